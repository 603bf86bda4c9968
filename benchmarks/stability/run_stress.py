"""The stability stress scenarios as a plain script: the same runs as `fused-stable stress`.

    python benchmarks/stability/run_stress.py                      # all scenarios -> benchmarks/stability/results/
    python benchmarks/stability/run_stress.py --scenarios nan_injection,lr_too_high --steps 200

Every option of `fused-stable stress --help` is accepted. By default the results (stress.json, stress.png) go to
benchmarks/stability/results/, next to this script, so they can be committed with the machine they ran on.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # run from a checkout without installing

from fused_stable import stress  # noqa: E402


def main(argv: list[str]) -> int:
    if not any(a == "--output-dir" or a.startswith("--output-dir=") for a in argv):
        argv = [*argv, "--output-dir", os.path.join(HERE, "results")]
    return stress.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
