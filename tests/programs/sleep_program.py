"""A rank program that says its pids and then sleeps: something for a timeout to stop.

    horovodrun -np 2 -H localhost:2 python -m tests.programs.sleep_program [SECONDS] [--helper]

Each rank prints one line ``{"event": "sleeping", "pids": [...]}`` and sleeps ``SECONDS``
(default 600). With ``--helper`` it first starts a helper process that sleeps as long (as a
data-loader worker or a compiler would be), whose pid is listed too: horovodrun's own
clean-up signals only the rank, so a helper outlives a rank that dies of SIGTERM unless the
launcher kills the whole tree. Imports neither torch nor horovod, so it starts fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    helper = "--helper" in args
    args = [a for a in args if a != "--helper"]
    seconds = float(args[0]) if args else 600.0
    pids = [os.getpid()]
    if helper:
        sleeper = f"import time; time.sleep({seconds!r})"
        pids.append(subprocess.Popen([sys.executable, "-c", sleeper]).pid)
    print(json.dumps({"event": "sleeping", "pids": pids}), flush=True)
    time.sleep(seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
