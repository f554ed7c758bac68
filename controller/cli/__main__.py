"""`python -m controller.cli`: the `tandem` command."""

import sys

from controller.cli import main

sys.exit(main())
