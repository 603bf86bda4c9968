"""The losses measured during training (`HeldOutLosses`): the mean per-token loss, as in training, of `eval_loss`
(held-out conversations: `--val_size` of the user's data, or the identity task's own held-out set,
`held_out_split`) and `retention_loss` (the base model's own greedy answers to general prompts shipped with the
package, generated once before training: `retention_items`). Forward only, summed on the device, one read per
evaluation; the trainer schedules it (`fused_stable.train.run.loop`) and the guard compares the values with
their best so far (`fused_stable.guard`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fused_stable.errors import UserError
from fused_stable.train.data import instructions, mixing, tasks
from fused_stable.train.evaluation.generate import generate_answer_ids

RETENTION_MAX_NEW_TOKENS = 32  # the probe's answers: short, so that an evaluation stays cheap (docs/trainer.md)
EVAL_BATCH = 16  # held-out sequences per forward


# ---------------------------------------------------------------------------------------------- held-out data
def split_examples(examples: list, val_size: float, seed: int) -> tuple[list, list]:
    """(training examples, held-out examples): `val_size` < 1 is a fraction of the examples (rounded up, as
    LLaMA-Factory's and datasets' `train_test_split`), >= 1 a count; a seeded choice, the order of the rest
    kept."""
    n = len(examples)
    count = math.ceil(val_size * n) if val_size < 1 else int(val_size)
    if count >= n:
        raise UserError(
            f"val_size={val_size:g} holds out {count} of the data set's {n} examples: nothing is left to train on"
        )
    held = set(random.Random(seed).sample(range(n), count))
    return [e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held]


def held_out_split(cfg, examples: list, eval_examples: list = ()) -> tuple[list, list]:
    """The training examples and the held-out ones `eval_loss` is measured on: eval_dataset's (`eval_examples`,
    loaded and mixed as the training data), the identity task's own held-out set (its evaluation paraphrases),
    or `val_size` of any other data set (none when it is 0)."""
    if cfg.eval_dataset is not None:
        return examples, list(eval_examples)
    if mixing.is_identity_only(cfg.dataset):
        return examples, tasks.identity_heldout(cfg.identity_name, cfg.identity_author, cfg.seed)
    if not cfg.val_size:
        return examples, []
    return split_examples(examples, cfg.val_size, cfg.seed)


def retention_items(
    model, tokenizer, prompts: list, *, max_length: int, max_new_tokens: int = RETENTION_MAX_NEW_TOKENS, autocast=None
) -> list[instructions.TokenizedExample]:
    """The retention probe: `model` (the base, before training) answers each prompt greedily; the answer's own
    tokens (its end-of-sequence token too, when it ended) become the labels, after the prompt formatted as in
    training. Their loss under the model being trained is `retention_loss`: how far it moved from what the
    base model said."""
    answers = generate_answer_ids(model, tokenizer, prompts, max_new_tokens=max_new_tokens, autocast=autocast)
    items = []
    for prompt, (ids, finished) in zip(prompts, answers):
        answer = ids + ([tokenizer.eos_token_id] if finished else [])
        context = instructions.prompt_ids(
            tokenizer, [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        )
        if answer:
            labels = [instructions.IGNORE_INDEX] * len(context) + answer
            items.append(instructions.TokenizedExample((context + answer)[:max_length], labels[:max_length]))
    return items


# ---------------------------------------------------------------------------------------------- held-out losses
@dataclass
class _LossBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    keep: torch.Tensor  # the positions whose logits predict a label (one range for the whole batch)
    targets: torch.Tensor  # the labels those positions predict (IGNORE_INDEX where a row has none)


def accepts_logits_to_keep(model) -> bool:
    """Whether the causal LM inside `model` (under DDP's `module`, peft's base model) computes logits only at the
    positions it is given (`logits_to_keep`): the vocabulary projection of the prompt tokens is then skipped."""
    inner = getattr(model, "module", model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    try:
        return "logits_to_keep" in inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return False


class HeldOutLosses:
    """`eval_loss` and `retention_loss` of the model being trained: each the mean per-token cross-entropy over
    its set's label tokens, as the training loss is defined. Built once (batches collated, sorted by length
    and put on the device); `measure` runs forward only, in eval mode, sums each set's loss on the device and
    reads both means with one transfer. Every rank of a torchrun job measures the whole sets (the same
    number of forwards on every rank, as FSDP2 needs; the same values, so every rank's guard decides alike)."""

    def __init__(
        self,
        sets: dict[str, list[instructions.TokenizedExample]],
        *,
        pad_id: int,
        device,
        keep_logits: bool = False,
        batch_size: int = EVAL_BATCH,
    ):
        self.device = torch.device(device)
        self.keep_logits = keep_logits
        self.batches: dict[str, list[_LossBatch]] = {}
        self.tokens: dict[str, int] = {}
        self.examples: dict[str, int] = {}
        for name, items in sets.items():
            items = [it for it in items if any(label != instructions.IGNORE_INDEX for label in it.labels[1:])]
            if not items:
                continue
            items = sorted(items, key=lambda it: len(it.input_ids))  # similar lengths together: less padding
            batches = [self._batch(items[i : i + batch_size], pad_id) for i in range(0, len(items), batch_size)]
            self.batches[name] = batches
            self.tokens[name] = sum(int((b.targets != instructions.IGNORE_INDEX).sum()) for b in batches)
            self.examples[name] = len(items)
        self.names = list(self.batches)

    def _batch(self, items: list, pad_id: int) -> _LossBatch:
        b = instructions.collate(items, pad_id)
        shifted = b.labels[:, 1:]  # the logit at position t predicts token t + 1
        columns = (shifted != instructions.IGNORE_INDEX).any(dim=0).nonzero().flatten()  # set-up, not the loop
        keep = torch.arange(int(columns[0]), int(columns[-1]) + 1)
        return _LossBatch(
            b.input_ids.to(self.device),
            b.attention_mask.to(self.device),
            keep.to(self.device),
            shifted[:, keep].contiguous().to(self.device),
        )

    def describe(self) -> str:
        what = {"eval_loss": "held-out examples", "retention_loss": "retention-probe answers"}
        return ", ".join(
            f"{n} on {self.examples[n]} {what.get(n, 'examples')} ({self.tokens[n]} tokens)" for n in self.names
        )

    @torch.no_grad()
    def measure(self, model, autocast: Callable[[], contextlib.AbstractContextManager] | None = None) -> dict:
        """{name: mean per-token loss} of `model` on every set; one device read."""
        was_training = model.training
        model.eval()
        try:
            means = []
            for name in self.names:
                total = torch.zeros((), device=self.device)
                for b in self.batches[name]:
                    extra = {"logits_to_keep": b.keep} if self.keep_logits else {}
                    with autocast() if autocast is not None else contextlib.nullcontext():
                        logits = model(
                            input_ids=b.input_ids, attention_mask=b.attention_mask, use_cache=False, **extra
                        ).logits
                    logits = logits if self.keep_logits else logits[:, b.keep]
                    total += F.cross_entropy(
                        logits.float().reshape(-1, logits.size(-1)),
                        b.targets.reshape(-1),
                        ignore_index=instructions.IGNORE_INDEX,
                        reduction="sum",
                    )
                means.append(total / self.tokens[name])
            values = torch.stack(means).tolist()  # the one device read of this evaluation
        finally:
            model.train(was_training)
        return dict(zip(self.names, values))
