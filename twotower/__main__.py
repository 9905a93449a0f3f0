"""`python -m twotower ...` is the `twotower` command (handy under torchrun)."""

import sys

from twotower.cli import main

sys.exit(main())
