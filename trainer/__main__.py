"""``python -m horovod_airflow.trainer {train,export,doctor}`` — see
``horovod_airflow.trainer.cli``."""

from horovod_airflow.core.startup_savings import exit_without_teardown
from horovod_airflow.trainer.cli import main

# An exception or SystemExit (argparse's --help and usage errors) does not get here and exits
# the usual way.
exit_without_teardown(main())
