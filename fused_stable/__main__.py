import sys

from fused_stable.cli import main

sys.exit(main())
