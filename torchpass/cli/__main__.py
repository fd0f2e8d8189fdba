"""`python -m torchpass.cli`: the same as the `torchpass` command."""

import sys

from torchpass.cli import main

sys.exit(main())
