"""The page's run process made slow enough to be paused or stopped at a known point, and nothing else changed:
`python THIS SECONDS WORKSPACE RUN_DIR -- SFT_ARGS` is `python -m fused_stable.webui.runner WORKSPACE RUN_DIR --
SFT_ARGS` with a sleep of SECONDS after every logging step (the tests log every step)."""

import sys
import time

from fused_stable.train.run import sft
from fused_stable.webui import runner


def main(argv):
    pause = float(argv[0])
    build = sft.setup_run

    def slowed(args):
        setup = build(args)
        setup.trainer.callbacks.append(lambda step, optimizer, metrics: time.sleep(pause))
        return setup

    sft.setup_run = slowed
    return runner.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
