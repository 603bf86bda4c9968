"""The evaluations a run of `fused-stable sft` makes: eval.json's before/after (the identity task's answers, of
the base and of the trained model) and the held-out losses the loop measures during training (eval_loss,
retention_loss)."""

from __future__ import annotations

import contextlib
import time


def base_model_context(cfg, model, base: bool = True):
    """A context in which `model` (unwrapped) answers as its base: adapters switched off; a full fine-tune is
    the base as long as `start` has not restored a checkpoint (also on a resumed run; a QLoRA base stays
    quantised as in training)."""
    return model.disable_adapter() if base and cfg.tuner != "full" else contextlib.nullcontext()


def evaluate_run(setup, base: bool) -> dict:
    """The held-out evaluation of the model being trained, or (base=True) of its base, evaluated before `start`
    restores a checkpoint (see `base_model_context`)."""
    from fused_stable.train.evaluation.before_after import evaluate
    from fused_stable.train.run import parallel

    cfg, model = setup.cfg, parallel.unwrap(setup.model)
    with base_model_context(cfg, model, base):
        return evaluate(
            model,
            setup.tokenizer,
            name=cfg.identity_name,
            author=cfg.identity_author,
            autocast=setup.runtime.autocast(),
            system=cfg.system,
        )


def held_out_losses(cfg, model, tokenizer, heldout, runtime, log=print):
    """What the loop measures at its evaluations (None when eval_steps is 0 or there is nothing to measure):
    eval_loss on the held-out examples, and retention_loss on the base model's own answers to the retention
    probe's prompts, generated here, before training."""
    from fused_stable.train.config.resolve import eval_steps, retention_probe
    from fused_stable.train.data import instructions, tasks
    from fused_stable.train.data.rows import with_system
    from fused_stable.train.evaluation.generate import as_messages
    from fused_stable.train.evaluation.held_out import HeldOutLosses, accepts_logits_to_keep, retention_items
    from fused_stable.train.run import parallel

    if eval_steps(cfg) == 0:
        return None
    sets = {}
    if heldout:
        sets["eval_loss"] = instructions.tokenize_examples(heldout, tokenizer, cfg.max_length)
    if retention_probe(cfg):
        started = time.perf_counter()
        base = parallel.unwrap(model)
        # asked as chat asks them: with the run's system message (--system), when it has one
        prompts = [with_system(as_messages(p), cfg.system) for p in tasks.retention_prompts()]
        with base_model_context(cfg, base):
            sets["retention_loss"] = retention_items(
                base, tokenizer, prompts, max_length=cfg.max_length, autocast=runtime.autocast()
            )
        log(f"retention probe: the base model answered {len(prompts)} prompts ({time.perf_counter() - started:.1f}s)")
    losses = HeldOutLosses(
        sets, pad_id=tokenizer.pad_token_id, device=runtime.device, keep_logits=accepts_logits_to_keep(model)
    )
    return losses if losses.names else None
