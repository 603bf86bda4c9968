"""`python -m fused_stable.bench ...` is the same as `fused-stable bench ...`."""

import sys

from fused_stable.bench import main

sys.exit(main(sys.argv[1:]))
