"""Launched by test_torchrun.py as `torchrun ... THIS sft ARGS` with FAULT_BATCHES=i,j,...: `fused-stable sft`
whose logits become non-finite on those micro-batches (data positions), on every rank, as a diverging layer
would make them; the stability guard must then roll every rank back together."""

import os
import sys

from fused_stable.train import cli, parallel


def main(argv):
    faults = {int(i) for i in os.environ["FAULT_BATCHES"].split(",")}
    build = cli.setup_run

    def setup_with_fault(args):
        setup = build(args)
        trainer = setup.trainer

        def hook(module, inputs, output):
            return output * float("inf") if trainer.state.micro_batches in faults else output

        parallel.unwrap(setup.model).get_output_embeddings().register_forward_hook(hook)
        return setup

    cli.setup_run = setup_with_fault
    return cli.main(argv[1:] if argv[:1] == ["sft"] else argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
