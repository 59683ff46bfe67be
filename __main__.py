"""`python -m kernelmux` runs the command-line interface."""

import sys

from kernelmux.cli import main

sys.exit(main())
