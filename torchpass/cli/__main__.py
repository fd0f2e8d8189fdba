"""`python -m torchpass.cli`: the same as the `torchpass` command."""

from torchpass.cli import entry

entry()
