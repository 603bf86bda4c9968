"""Several datasets in one run, as LLaMA-Factory and ms-swift take them: `dataset: a,b,c` (LLaMA-Factory's comma
list; ms-swift's `--dataset a.json b.json` arrives here as the same list), each a built-in task, a local file or
(resolved before, by `config`) a `dataset_info.json` entry; `name#N` on any of them with ms-swift's meaning
(`sample_count`); `max_samples` (LLaMA-Factory's: the first N examples of each dataset, before the held-out
split); then mixed as LLaMA-Factory mixes them (`mix`: concat, interleave_under, interleave_over with
interleave_probs and the run's seed). One code path for both trainers; the run's header line lists what each
dataset contributed (`summary`). `eval_dataset` (LLaMA-Factory's held-out datasets, used instead of val_size) is
loaded and mixed by the same path.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
from dataclasses import dataclass

from fused_stable.errors import UserError

MIX_STRATEGIES = ("concat", "interleave_under", "interleave_over")
# ms-swift's name of its identity dataset: this project's built-in identity task
SELF_COGNITION = ("swift/self-cognition", "self-cognition")


@dataclass(frozen=True)
class Spec:
    name: str  # a built-in task or a file path
    count: int | None = None  # `#N`: ms-swift's sample count

    @property
    def label(self) -> str:
        """What the header calls it: a file by its name without folder or extension."""
        if self.name in ("identity", "arithmetic"):
            return self.name
        return os.path.splitext(os.path.basename(self.name))[0] or self.name

    @property
    def text(self) -> str:
        """The item as written: `name`, or `name#N`."""
        return self.name if self.count is None else f"{self.name}#{self.count}"


def split_list(text) -> list[str]:
    """`a,b,c` (or a YAML list) as its items, stripped; empty items dropped."""
    items = text if isinstance(text, (list, tuple)) else str(text).split(",")
    return [str(item).strip() for item in items if str(item).strip()]


def parse(text) -> list[Spec]:
    """`a,b#500,c` as Specs; `#N` must be a whole count of at least 1."""
    specs = []
    for item in split_list(text):
        name, hashed, count = item.rpartition("#") if "#" in item else (item, "", "")
        if hashed and not count.isdigit() or hashed and int(count) < 1:
            raise UserError(f"dataset {item!r}: #N must be a whole count of at least 1 (ms-swift's sample count)")
        specs.append(Spec(name.strip(), int(count) if hashed else None))
    if not specs:
        raise UserError("dataset cannot be empty")
    return specs


def rename(text, new_name) -> str:
    """The comma list (or YAML list) with each dataset's name replaced by `new_name(name)`, its `#N` kept: where
    names are rewritten (dataset_info.json entries, the webui's workspace paths, ms-swift's self-cognition), `parse`
    stays the one reader of `name#N`."""
    return ",".join(dataclasses.replace(spec, name=new_name(spec.name)).text for spec in parse(text))


def is_identity_only(text) -> bool:
    """The run trains the built-in identity task alone (which holds out its own set for eval_loss)."""
    specs = parse(text)
    return len(specs) == 1 and specs[0].name == "identity"


def sample_count(examples: list, n: int, rng: random.Random) -> list:
    """ms-swift's `dataset#N`: N below the size samples N without replacement; above it, the dataset repeated
    N // size times plus N % size sampled without replacement."""
    size = len(examples)
    whole, rest = divmod(n, size)
    return examples * whole + rng.sample(examples, rest)


def parse_probs(text, k: int) -> list[float] | None:
    """interleave_probs (`0.3,0.7` or a YAML list) as k weights summing to 1, or None (round-robin)."""
    if text is None or text == "":
        return None
    try:
        probs = [float(p) for p in split_list(text)]
    except ValueError:
        raise UserError(f"interleave_probs must be numbers, one per dataset (as 0.5,0.5), got {text!r}") from None
    if len(probs) != k:
        raise UserError(f"interleave_probs gives {len(probs)} probabilities for {k} datasets: give one per dataset")
    if not all(math.isfinite(p) and p >= 0 for p in probs) or abs(sum(probs) - 1) > 1e-6:
        raise UserError(f"interleave_probs must be non-negative and sum to 1, got {text!r}")
    return probs


def mix(parts: list[list], strategy: str, probs, seed: int) -> list:
    """LLaMA-Factory's mix_strategy. concat: one after another (the batch order shuffles them later).
    interleave_under / interleave_over: one example at a time from a dataset drawn with `probs` (the run's seed;
    round-robin without them), stopping when the first dataset has given its last example (under), or when every
    one has, the exhausted ones starting over (over), as `datasets.interleave_datasets`' first_exhausted /
    all_exhausted."""
    if strategy not in MIX_STRATEGIES:
        raise UserError(f"mix_strategy must be one of {' | '.join(MIX_STRATEGIES)}, got {strategy!r}")
    if strategy == "concat" or len(parts) == 1:  # one dataset: nothing to mix (LLaMA-Factory's merge_dataset)
        return [e for part in parts for e in part]
    weights = parse_probs(probs, len(parts))
    rng = random.Random(seed)
    positions, exhausted, out = [0] * len(parts), [False] * len(parts), []
    turn = -1
    while True:
        turn = rng.choices(range(len(parts)), weights)[0] if weights else (turn + 1) % len(parts)
        out.append(parts[turn][positions[turn]])
        positions[turn] += 1
        if positions[turn] == len(parts[turn]):
            exhausted[turn], positions[turn] = True, 0
            if strategy == "interleave_under" or all(exhausted):
                return out


def load_mixed(cfg, load_one, *, held_out: bool = False) -> tuple[list, str]:
    """Every dataset of cfg.dataset (or, `held_out`, of cfg.eval_dataset: LLaMA-Factory loads and mixes both
    alike) loaded (`load_one(name) -> examples`), cut to max_samples, sampled by #N, and mixed; returns (examples, the
    header's line). A dataset that fails to load names itself."""
    text = cfg.eval_dataset if held_out else cfg.dataset
    specs = parse(text)
    parts = []
    for number, spec in enumerate(specs, start=1):
        try:
            examples = load_one(spec.name)
        except UserError as exc:
            if len(specs) == 1:
                raise
            raise UserError(f"dataset {spec.name!r} (item {number} of {text!r}): {exc}") from None
        if cfg.max_samples is not None:
            examples = examples[: cfg.max_samples]
        if spec.count is not None:
            examples = sample_count(examples, spec.count, random.Random(cfg.seed + number))
        parts.append(examples)
    mixed = mix(parts, cfg.mix_strategy, cfg.interleave_probs, cfg.seed)
    line = summary(specs, parts, len(mixed), cfg)
    return mixed, f"eval_{line}" if held_out else line


def summary(specs: list[Spec], parts: list[list], total: int, cfg) -> str:
    """`datasets: identity 91 + alpaca_en_demo 999 = 1090 examples (...)`."""
    each = " + ".join(
        f"{spec.label}{'#' + str(spec.count) if spec.count is not None else ''} {len(part)}"
        for spec, part in zip(specs, parts)
    )
    notes = []
    if cfg.max_samples is not None:
        notes.append(f"max_samples {cfg.max_samples}: at most the first {cfg.max_samples} of each")
    if len(specs) > 1 and cfg.mix_strategy != "concat":
        notes.append(f"mixed by {cfg.mix_strategy}" + (f" {cfg.interleave_probs}" if cfg.interleave_probs else ""))
    tail = f" ({'; '.join(notes)})" if notes else ""
    return f"datasets: {each} = {total} examples{tail}" if len(specs) > 1 else f"dataset: {each} examples{tail}"
