"""`fused-stable chat`: talk to a base model or a fine-tuned one, with the model's chat template (the format it
was trained in), greedy decoding by default, answers streamed as they are generated.

    fused-stable chat                                  # the embedded smollm2-135m, interactive
    fused-stable chat --adapter runs/sft               # a run folder (or its adapter/ or model/ folder)
    fused-stable chat --adapter runs/sft --prompt "Who are you?"   # one answer on stdout, then exit

One-shot mode prints only the answer on stdout (loading messages go to stderr), so it can be piped.
"""

from __future__ import annotations

import sys

from fused_stable.argcheck import parse_command
from fused_stable.cli import offline_environment
from fused_stable.errors import UserError

DEFAULT_MAX_NEW_TOKENS = 256


def build_parser():
    from fused_stable.argcheck import OneLineParser, number

    p = OneLineParser(
        prog="fused-stable chat",
        description=__doc__.split("\n\n")[0],
        aliases={
            "--max-tokens": "--max-new-tokens",
            "--max-length": "--max-new-tokens",
            "--message": "--prompt",
            "--system-prompt": "--system",
            "--output-dir": "--adapter",
        },
    )
    p.add_argument(
        "--model", default=None, help="base model, as in sft: smollm2-135m (default) | tiny | HF dir | .gguf"
    )
    p.add_argument("--adapter", default=None, help="an adapter folder, a saved full model, or a run folder holding one")
    p.add_argument("--prompt", default=None, help="ask once, print only the answer on stdout, exit")
    p.add_argument(
        "--system",
        default=None,
        help="a system message (default: the one the run was trained with, --system of sft, else the chat "
        "template's own; '' = the template's own)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=number(1, 100_000, integer=True),
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"longest answer in tokens (default: {DEFAULT_MAX_NEW_TOKENS})",
    )
    p.add_argument("--temperature", type=number(0, 100), default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--seed", type=number(0, 2**32 - 1, integer=True), default=0, help="seed for sampling (default: 0)")
    p.add_argument(
        "--threads",
        type=number(0, 4096, integer=True),
        default=0,
        help="torch CPU threads; 0 = one per physical core (default: 0)",
    )
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    return p


def check_args(args) -> None:
    """Everything that can be checked before a model is loaded (UserError, one line)."""
    from fused_stable.argcheck import check_device
    from fused_stable.train.model.sources import DEFAULT_MODEL, resolve_model
    from fused_stable.train.saved.final_model import inspect_saved

    if args.model is not None and args.adapter is not None:
        raise UserError("give --model or --adapter, not both (an adapter names its own base model)")
    if args.prompt is not None and not args.prompt.strip():
        raise UserError("--prompt is empty: give a question, or leave --prompt out for an interactive chat")
    check_device(args.device, "--device")
    if args.adapter is not None:
        if not args.adapter.strip():
            raise UserError("--adapter is empty: give an adapter folder or a run folder")
        args.saved = inspect_saved(args.adapter)
    else:
        if args.model is not None and not args.model.strip():
            raise UserError("--model is empty: give smollm2-135m, tiny, a Hugging Face folder or a .gguf file")
        args.source = resolve_model(args.model or DEFAULT_MODEL)


def load_chat_model(args, device, log):
    """(model, tokenizer, description) for the checked `--model` or `--adapter` (see `check_args`)."""
    from fused_stable.train.model.load import load_pretrained
    from fused_stable.train.saved.final_model import load_trained

    if args.adapter is not None:
        trained = load_trained(args.adapter, device=device, log=log, saved=args.saved)
        where = trained.adapter_dir or args.adapter
        quant = f", {trained.quant_bits}-bit base" if trained.quant_bits else ""
        return trained.model, trained.tokenizer, f"{where} on {trained.base.reference}{quant}"
    net, tokenizer = load_pretrained(args.source, device=device, log=log)
    return net, tokenizer, args.source.reference


def chat_system(args) -> str | None:
    """The system message chat sends: its own `--system` ('' for none: the template's own), else the one the
    run was trained with (stored with it, `Saved.system`), else none."""
    if args.system is not None:
        return args.system or None
    saved = getattr(args, "saved", None)
    return saved.system if saved is not None else None


def chat_messages(system: str | None, history: list[dict], text: str) -> list[dict]:
    """The conversation chat answers: the system message (`chat_system`) first, as in training, then the turns
    so far and the user's new one."""
    from fused_stable.train.data.rows import with_system

    return with_system([*history, {"role": "user", "content": text}], system)


def answer(
    model, tokenizer, messages: list[dict], *, max_new_tokens: int, temperature: float = 0.0, stream: bool = True
) -> str:
    """Generate the next assistant turn; with `stream`, print it to stdout as it is generated."""
    import torch
    from transformers import TextStreamer

    from fused_stable.train.data.instructions import prompt_ids

    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids(tokenizer, messages)], device=device)
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
        if temperature > 0
        else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    )
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            streamer=streamer,
            use_cache=True,
            **sampling,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def _interactive(model, tokenizer, system: str | None, args) -> None:
    print(
        "type a message; /reset starts a new conversation, /exit (or Ctrl-D) quits, Ctrl-C stops an answer",
        file=sys.stderr,
    )
    history: list[dict] = []
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print(file=sys.stderr)
            return
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            history = []
            continue
        messages = chat_messages(system, history, text)
        print("assistant> ", end="", flush=True)
        try:
            reply = answer(model, tokenizer, messages, max_new_tokens=args.max_new_tokens, temperature=args.temperature)
        except KeyboardInterrupt:  # Ctrl-C during an answer stops that answer; at the prompt it quits
            print("\n(answer stopped: that turn is left out of the conversation)", file=sys.stderr, flush=True)
            continue
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]


def main(argv: list[str]) -> int:
    """`fused-stable chat`; a bad option, model or adapter is one line on stderr and exit code 2, before any
    model is loaded."""
    offline_environment()
    args, code = parse_command(build_parser(), argv, "chat")
    if args is None:
        return code
    try:
        check_args(args)
        from fused_stable.train.run.runtime import quiet_third_party_noise

        quiet_third_party_noise()
        import torch

        from fused_stable.train.run.runtime import resolve_runtime, set_threads

        set_threads(args.threads)
        torch.manual_seed(args.seed)
        device = resolve_runtime(args.device, "fp32").device
        model, tokenizer, description = load_chat_model(
            args, device, log=lambda text: print(text, file=sys.stderr, flush=True)
        )
        system = chat_system(args)
        told = "" if system is None else f"; system {system!r}" + ("" if args.system else " (the run's)")
        print(
            f"fused-stable chat: {description} ({'greedy' if args.temperature == 0 else 'sampling'}{told})",
            file=sys.stderr,
            flush=True,
        )
        if args.prompt is not None:
            messages = chat_messages(system, [], args.prompt)
            answer(model, tokenizer, messages, max_new_tokens=args.max_new_tokens, temperature=args.temperature)
            return 0
        _interactive(model, tokenizer, system, args)
        return 0
    except UserError as exc:
        print(f"fused-stable chat: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
