"""The start-up savings this project keeps, in one module, each measured against the plain way
in one run (``python -m bench.startup_savings``; figures in ``bench/results/startup_savings.md``)
and kept because it saves a task more than half a second:

- :func:`exit_without_teardown` — ``python -m horovod_airflow.trainer`` (every rank, each
  export task, the preflight doctor) runs the exit handlers, flushes, and leaves without the
  interpreter's teardown of torch's modules and libraries, which only frees memory the process
  is about to lose anyway.
- :data:`HOROVODRUN_WITHOUT_GLOO_PROBE` — ``horovodrun --gloo`` first asks, in a forked process
  that imports ``horovod.torch`` and so torch, whether Horovod was built with Gloo. When the
  preflight doctor has just answered that in the very interpreter horovodrun runs in, the local
  launcher starts horovodrun's own entry point with the answer given.
- :data:`INTERPRETER_FINGERPRINT` — what the doctor's interpreter would import (its real path,
  torch's and horovod's versions and package files), read without importing torch: the local
  launcher remembers a doctor's pass under it and skips the doctor while nothing changed.

The Gloo one reaches into Horovod's launcher (``horovod.runner.launch.gloo_built`` and
``run_commandline``), so it is applied only to the Horovod it was checked against
(:data:`VERIFIED_HOROVOD`); under any other version the script is plain horovodrun, probe and
all, and ``tests/test_startup_savings.py`` fails until the new version is checked. Torch-free,
Airflow-free: the trainer and the launcher both import it.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

#: The Horovod whose ``horovod.runner.launch`` :data:`HOROVODRUN_WITHOUT_GLOO_PROBE` was
#: checked against (the pinned build, scripts/build_horovod.sh).
VERIFIED_HOROVOD = "0.28.1"

#: ``python -c`` program run as ``[python, "-c", HOROVODRUN_WITHOUT_GLOO_PROBE, <horovodrun
#: arguments>]``: horovodrun, with its Gloo probe answered "built" on :data:`VERIFIED_HOROVOD`.
HOROVODRUN_WITHOUT_GLOO_PROBE = f"""\
import sys
import horovod
import horovod.runner.launch as launch
if horovod.__version__ == {VERIFIED_HOROVOD!r}:
    launch.gloo_built = lambda verbose=False: True  # verified by the preflight doctor
sys.argv[0] = "horovodrun"
sys.exit(launch.run_commandline())
"""

#: ``python -c`` program printing one JSON line that changes when what the doctor would find
#: could have changed (another interpreter, a rebuilt or reinstalled torch or horovod).
INTERPRETER_FINGERPRINT = """
import importlib.metadata as m, importlib.util as u, json, os, sys
out = {"python": os.path.realpath(sys.executable), "version": sys.version}
for name in ("torch", "horovod"):
    try:
        spec = u.find_spec(name)
        st = os.stat(spec.origin)
        out[name] = [m.version(name), spec.origin, st.st_size, st.st_mtime_ns]
    except Exception as e:
        out[name] = repr(e)
print(json.dumps(out, sort_keys=True))
"""


def exit_without_teardown(code: int) -> NoReturn:
    """Run the exit handlers (Horovod's shutdown, logging, temporary files), flush, and end
    the process with ``code`` without the interpreter's teardown. Only for a command that has
    finished and written all it writes (files closed, uploads complete)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
