"""The run's system message (issue 40 item 2): ms-swift's `--system`, LLaMA-Factory's `default_system`. It is
the system message of every training and held-out example without one (an example's own wins), rendered by the
chat template as an example's own would be, shown in the run header, stored with the run (fused_stable.json,
adapter and full model alike) and used by `fused-stable chat` unless chat is given its own `--system`."""

import json
from types import SimpleNamespace

import pytest
from sft_helpers import TINY, setup_run

from fused_stable.errors import UserError
from fused_stable.train.config.resolve import resolve_config
from fused_stable.train.data import instructions, rows
from fused_stable.train.saved import chat
from fused_stable.train.saved.final_model import inspect_saved

SYSTEM = "You are a helpful assistant."
OWN = "Answer in one word."


def data(tmp_path, n=8):
    """Alpaca records, the even ones with their own system message."""
    records = [
        {"instruction": f"{'own' if i % 2 == 0 else 'none'} question {i}", "output": f"answer {i}"}
        | ({"system": OWN} if i % 2 == 0 else {})
        for i in range(n)
    ]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records))
    return path


def plain_texts(tokenizer, items):
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in items]


def test_the_system_reaches_training_and_held_out_examples_without_one_and_theirs_wins(tmp_path):
    setup = setup_run(
        *TINY, "--dataset", data(tmp_path), "--val_size", "0.5", "--system", SYSTEM, "--output_dir", tmp_path / "o"
    )
    tok = setup.tokenizer
    trained = plain_texts(tok, [item.input_ids for item in setup.trainer.batches.items])
    held = plain_texts(tok, [row for b in setup.trainer.evaluator.batches["eval_loss"] for row in b.input_ids.tolist()])
    assert len(trained) == 4 and len(held) == 4 and setup.given_system == 4
    for text in trained + held:
        question = text[text.index("### Instruction:") :]
        expected = OWN if "own question" in question else SYSTEM
        assert text.startswith(f"### System:\n{expected}\n\n### Instruction:\n"), text
        assert text.count("### System:") == 1
    assert any("none question" in text for text in held), "the seeded split holds out an example without a system"


def test_the_identity_tasks_own_held_out_set_gets_the_system_too(tmp_path):
    setup = setup_run(
        "--model", "tiny", "--max_steps", "1", "--system", SYSTEM, "--general_examples", "0",
        "--output_dir", tmp_path / "o",
    )  # fmt: skip
    held = setup.trainer.evaluator.batches["eval_loss"]
    texts = plain_texts(setup.tokenizer, [row for b in held for row in b.input_ids.tolist()])
    assert texts and all(text.startswith(f"### System:\n{SYSTEM}\n\n") for text in texts)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from fused_stable.train.model.load import load_tokenizer
    from fused_stable.train.model.sources import resolve_model

    return load_tokenizer(resolve_model("smollm2-135m"))


def test_the_chat_template_renders_the_system_in_place_of_its_own_default(smollm2_tokenizer):
    tok = smollm2_tokenizer
    without = rows.conversation("Hi", "Hello")
    own = rows.Example([{"role": "system", "content": OWN}, *without.messages])
    (given, kept), count = rows.give_system([without, own], SYSTEM)
    assert count == 1
    turn = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    for example, system in ((given, SYSTEM), (kept, OWN)):
        text = "".join(t for t, _ in instructions.render(example, tok))
        assert text == f"<|im_start|>system\n{system}<|im_end|>\n" + turn
    # chat asks with exactly the prompt training put before the answer
    prompt = instructions.prompt_ids(tok, chat.chat_messages(SYSTEM, [], "Hi"))
    (item,) = instructions.tokenize_examples([given], tok, 512)
    assert item.input_ids[: len(prompt)] == prompt


@pytest.mark.parametrize("tuner", ["lora", "full"])
def test_the_system_is_in_the_header_stored_with_the_run_and_chat_uses_it(sft, tmp_path, tuner):
    out = tmp_path / tuner
    code, stdout, err = sft(
        *TINY, "--tuner", tuner, "--max_steps", "1", "--val_size", "2", "--system", SYSTEM, "--output_dir", out
    )
    assert code == 0, err
    assert f"system: {SYSTEM!r} (given to the 64 training and held-out examples without their own" in stdout
    folder = out / ("model" if tuner == "full" else "adapter")
    assert json.loads((folder / "fused_stable.json").read_text())["system"] == SYSTEM
    saved = inspect_saved(str(out))
    assert saved.system == SYSTEM
    # chat: the run's system, unless chat is given its own ('' = none: the template's own)
    for given, used in ((None, SYSTEM), ("Be brief.", "Be brief."), ("", None)):
        args = SimpleNamespace(system=given, saved=saved)
        assert chat.chat_system(args) == used
    from fused_stable.train.saved.final_model import load_saved_tokenizer

    tok = load_saved_tokenizer(str(folder))
    asked = tok.decode(instructions.prompt_ids(tok, chat.chat_messages(chat.chat_system(args_of(saved)), [], "Hi")))
    assert f"### System:\n{SYSTEM}\n\n### Instruction:\nHi" in asked


def args_of(saved):
    return SimpleNamespace(system=None, saved=saved)


def test_chat_one_shot_says_and_sends_the_runs_system(sft, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = sft(*TINY, "--max_steps", "1", "--system", SYSTEM, "--output_dir", out)
    assert code == 0, err
    assert chat.main(["--adapter", str(out), "--prompt", "Hi", "--max-new-tokens", "2"]) == 0
    assert f"system {SYSTEM!r} (the run's)" in capsys.readouterr().err
    assert chat.main(["--adapter", str(out), "--prompt", "Hi", "--max-new-tokens", "2", "--system", "Mine."]) == 0
    err = capsys.readouterr().err
    assert "system 'Mine.'" in err and "(the run's)" not in err


def test_a_run_without_system_stores_none_and_chat_sends_none(tmp_path, sft):
    out = tmp_path / "run"
    code, stdout, err = sft(*TINY, "--max_steps", "1", "--output_dir", out)
    assert code == 0, err
    assert "system:" not in stdout
    saved = inspect_saved(str(out))
    assert saved.system is None and chat.chat_system(args_of(saved)) is None
    assert chat.chat_messages(None, [], "Hi") == [{"role": "user", "content": "Hi"}]


def test_llamafactory_default_system_and_swift_system_map(tmp_path):
    path = tmp_path / "lf.yaml"
    path.write_text(f"stage: sft\nfinetuning_type: lora\ndataset: identity\ndefault_system: {SYSTEM}\n")
    lines = []
    cfg, _ = resolve_config(["--config", str(path)], log=lines.append)
    assert cfg.system == SYSTEM
    assert f"  default_system: {SYSTEM} -> system: {SYSTEM}" in lines[0].splitlines()
    cfg, _ = resolve_config(["--tuner_type", "lora", "--system", SYSTEM])
    assert cfg.system == SYSTEM
    for value in ("", "   "):
        with pytest.raises(UserError, match="system"):
            resolve_config(["--system", value])
        path.write_text(f"stage: sft\ndefault_system: '{value}'\n")
        with pytest.raises(UserError, match="system"):
            resolve_config(["--config", str(path)])


def test_the_evaluations_ask_with_the_system_as_chat_does(tmp_path):
    """eval.json's before/after answers and the retention probe's prompts carry the run's system, as chat sends
    it (the identity task on the tiny model, whose greedy answers depend on the prompt)."""
    from fused_stable.train.data.rows import with_system
    from fused_stable.train.evaluation.generate import EVAL_MAX_NEW_TOKENS, as_messages, generate_answers
    from fused_stable.train.evaluation.run_evaluations import evaluate_run

    setup = setup_run(
        "--model", "tiny", "--max_steps", "1", "--system", SYSTEM, "--general_examples", "0",
        "--retention_probe", "on", "--output_dir", tmp_path / "o",
    )  # fmt: skip
    retention = setup.trainer.evaluator.batches["retention_loss"]
    texts = plain_texts(setup.tokenizer, [row for b in retention for row in b.input_ids.tolist()])
    assert texts and all(f"### System:\n{SYSTEM}\n\n### Instruction:\n" in text for text in texts)
    answers = evaluate_run(setup, base=True)["answers"]
    prompts = [as_messages(a["prompt"]) for a in answers]

    def asked(system):
        return generate_answers(
            setup.model, setup.tokenizer, [with_system(p, system) for p in prompts], max_new_tokens=EVAL_MAX_NEW_TOKENS
        )

    with_run_system = asked(SYSTEM)
    assert with_run_system != asked(None), "the tiny model answers alike with and without the system"
    assert [a["answer"] for a in answers] == with_run_system
