"""``python -m horovod_airflow.trainer {train,export,doctor}`` — see
``horovod_airflow.trainer.cli``."""

import atexit
import os
import sys

from horovod_airflow.trainer.cli import main

code = main()
# The command has finished and written all it writes (files closed, uploads complete). Run
# the exit handlers (Horovod's shutdown, logging, temporary files), flush, and leave without
# the interpreter's teardown of torch's modules and libraries, which only frees memory the
# process is about to lose anyway: ~0.9 s after `import torch`, ~1.8 s after an ONNX export
# on 2 cores, paid by every rank and by each export task. An exception or SystemExit
# (argparse's --help and usage errors) does not get here and exits the usual way.
atexit._run_exitfuncs()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
