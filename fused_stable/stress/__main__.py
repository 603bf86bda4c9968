"""`python -m fused_stable.stress ...` is the same as `fused-stable stress ...`."""

import sys

from fused_stable.stress.cli import main

sys.exit(main(sys.argv[1:]))
