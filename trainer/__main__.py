"""``python -m trainer {train,export,doctor}`` — see ``trainer.cli``."""

import sys

from trainer.cli import main

sys.exit(main())
