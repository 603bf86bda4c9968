"""Launched by test_interrupt.py (directly, or by torchrun) as `python THIS [sft] ARGS`: `fused-stable sft` made
slow enough to be interrupted at a known point, and nothing else changed.

STEP_SLEEP=s: sleep s seconds after each logged step (logging_steps 1), so a signal lands mid-run.
PID_DIR=d: write this process's pid to d/rank-<RANK> (so a test can signal one rank of a torchrun job).
SLOW_SAVE_FLAG=f: once an interrupt is pending, the checkpoint save creates file f and then takes 60 s, so a
second signal lands inside the save.
"""

import os
import signal
import sys
import time

from fused_stable.train.run import checkpoint, sft


def _interrupt_pending() -> bool:
    handler = signal.getsignal(signal.SIGINT)  # the bound method of the run's loop.Interrupts
    return bool(getattr(getattr(handler, "__self__", None), "signum", 0))


def main(argv):
    pause = float(os.environ.get("STEP_SLEEP", "0"))
    build = sft.setup_run

    def slowed(args):
        setup = build(args)
        setup.trainer.callbacks.append(lambda step, optimizer, metrics: time.sleep(pause))
        return setup

    sft.setup_run = slowed
    if os.environ.get("PID_DIR"):
        with open(os.path.join(os.environ["PID_DIR"], f"rank-{os.environ.get('RANK', '0')}"), "w") as f:
            f.write(str(os.getpid()))
    flag = os.environ.get("SLOW_SAVE_FLAG")
    if flag:
        real_save = checkpoint._torch_save

        def slow_save(obj, path):
            if _interrupt_pending():
                open(flag, "w").close()
                for _ in range(600):  # 60 s, in short sleeps: a signal handler that raises ends it at once
                    time.sleep(0.1)
            real_save(obj, path)

        checkpoint._torch_save = slow_save
    return sft.main(argv[1:] if argv[:1] == ["sft"] else argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
