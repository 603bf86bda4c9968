"""`fused-stable` command line: a thin dispatcher; each subcommand owns its own argument parsing, and its
`main()` first calls `offline_environment()`."""

from __future__ import annotations

import importlib
import os
import sys

# the Hugging Face libraries read these when they are first imported: nothing a command does may try a model hub
OFFLINE_ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

# subcommand -> (module, one-line help). Each module exposes `main(argv: list[str]) -> int`.
SUBCOMMANDS = {
    "sft": (
        "fused_stable.train.run.sft",
        "fine-tuning (LoRA / QLoRA / DoRA / full), any optimizer of fused_stable.OPTIMIZERS",
    ),
    "chat": (
        "fused_stable.train.saved.chat",
        "talk to a base model or a fine-tuned adapter (streamed, greedy by default)",
    ),
    "export": ("fused_stable.train.saved.export", "merge an adapter into its base: a plain Hugging Face model folder"),
    "bench": ("fused_stable.bench", "benchmark fused_stable against torch's clip + AdamW step"),
    "stress": ("fused_stable.stress.cli", "failure scenarios: the usual recipe vs fused_stable's guarded recipe"),
    "webui": ("fused_stable.webui.cli", "a live page to set up, watch, stop, pause and resume runs (gradio)"),
}


def offline_environment() -> None:
    """Every command runs offline by construction (models are read from local folders only). Called at the
    start of each command's main(), before transformers is imported, never at import time: importing the package
    changes no environment variable. A value the user set is kept."""
    for name, value in OFFLINE_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def _usage() -> str:
    lines = ["usage: fused-stable {" + ",".join(SUBCOMMANDS) + "} [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run `fused-stable COMMAND --help` for a command's options."]
    return "\n".join(lines)


def launcher_arguments_removed(argv: list[str]) -> list[str]:
    """argv without the `--local_rank=N` the `deepspeed` launcher passes every process (unless --no_local_rank; the rank
    is also in LOCAL_RANK, which is what is read)."""
    out, skip = [], False
    for i, token in enumerate(argv):
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in ("--local_rank", "--local-rank"):
            skip = "=" not in token and i + 1 < len(argv) and argv[i + 1].lstrip("-").isdigit()
            continue
        out.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = launcher_arguments_removed(list(sys.argv[1:] if argv is None else argv))
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        from fused_stable.argcheck import suggestion

        close = suggestion(name, SUBCOMMANDS, cutoff=0.6)
        hint = f"did you mean {close!r}? " if close else ""
        print(
            f"fused-stable: error: unknown command {name!r}; {hint}commands: {', '.join(SUBCOMMANDS)}", file=sys.stderr
        )
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
