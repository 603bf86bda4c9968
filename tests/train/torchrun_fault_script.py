"""Launched by test_torchrun.py as `torchrun ... THIS sft ARGS`: `fused-stable sft` with a fault on its ranks.

FAULT_BATCHES=i,j,...: the logits become non-finite on those micro-batches (data positions), on every rank, as a
diverging layer would make them; the stability guard must then roll every rank back together.
KILL_RANK=r:s: rank r SIGKILLs itself at its logging step s (after writing the time of its death to DEATH_FILE),
as an out-of-memory kill or a lost node would end it; the other ranks must stop within a bounded time.
DEEPSPEED_IMPORT_TRACE=DIR: each rank writes DIR/rank-R.txt: the stack of every import of deepspeed ("deepspeed
imported by rank R:"), and at its exit whether deepspeed was loaded ("deepspeed loaded: BOOL"); a run that does not
use DeepSpeed must never import it (issue 52: the import came with ranks aborting at exit). A file per rank: the
ranks' lines interleave in torchrun's shared stdout.
GROUP_THREADS_AT_EXIT=DIR: each rank writes DIR/threads-rank-R.txt at its exit (atexit, before the interpreter
shuts down): the names of its threads that belong to a process group (helpers.group_threads). Empty once the trainer has
left and freed its group; a group held past destroy_process_group keeps them running into shutdown, where a
worker releasing a finished collective's tensors aborts the process (issue 52's SIGABRT at exit).
"""

import atexit
import builtins
import os
import signal
import sys
import time
import traceback

from fused_stable.train.run import parallel, sft

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers import group_threads  # noqa: E402


def trace_deepspeed_import(folder: str):
    """Report who imports deepspeed (absolute imports only: transformers' own `.deepspeed` modules are not it)
    into folder/rank-R.txt."""
    rank = os.environ.get("RANK", "0")
    report = os.path.join(folder, f"rank-{rank}.txt")
    plain_import = builtins.__import__

    def write(text: str) -> None:
        with open(report, "a") as f:
            f.write(text + "\n")

    def traced(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.split(".")[0] == "deepspeed" and "deepspeed" not in sys.modules:
            write(f"deepspeed imported by rank {rank}:\n{''.join(traceback.format_stack())}")
        return plain_import(name, globals, locals, fromlist, level)

    builtins.__import__ = traced
    atexit.register(lambda: write(f"deepspeed loaded: {'deepspeed' in sys.modules}"))


def report_group_threads_at_exit(folder: str) -> None:
    report = os.path.join(folder, f"threads-rank-{os.environ.get('RANK', '0')}.txt")

    def write() -> None:
        with open(report, "w") as f:
            f.write(repr(group_threads()))

    atexit.register(write)


def main(argv):
    if os.environ.get("DEEPSPEED_IMPORT_TRACE"):
        trace_deepspeed_import(os.environ["DEEPSPEED_IMPORT_TRACE"])
    if os.environ.get("GROUP_THREADS_AT_EXIT"):
        report_group_threads_at_exit(os.environ["GROUP_THREADS_AT_EXIT"])
    faults = {int(i) for i in os.environ.get("FAULT_BATCHES", "").split(",") if i}
    kill_rank, _, kill_step = os.environ.get("KILL_RANK", "").partition(":")
    build = sft.setup_run

    def setup_with_fault(args):
        setup = build(args)
        trainer = setup.trainer
        if faults:

            def hook(module, inputs, output):
                return output * float("inf") if trainer.state.micro_batches in faults else output

            parallel.unwrap(setup.model).get_output_embeddings().register_forward_hook(hook)
        if kill_rank and int(kill_rank) == parallel.rank():

            def die(step, optimizer, metrics):
                if step == int(kill_step):
                    with open(os.environ["DEATH_FILE"], "w") as f:
                        f.write(str(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)

            trainer.callbacks.append(die)
        return setup

    sft.setup_run = setup_with_fault
    return sft.main(argv[1:] if argv[:1] == ["sft"] else argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
