"""`python -m polo ...` (and `torchrun ... -m polo train RECIPE`) runs the `polo` command."""

import sys

from polo.cli import main

sys.exit(main())
