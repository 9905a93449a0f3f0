"""`python -m retrieval ...` is the `twotower` command (handy under torchrun)."""

import sys

from retrieval.cli import main

sys.exit(main())
