"""The before/after evaluation: scoring (the leak set's judgement too), eval.json's shape with every answer's
judgement, "before" being the base model (also on a resumed run), the printed table and curves.png. The tiny
model keeps it fast; its answers are wrong, which is fine: what is checked is which model produced them."""

import json

import pytest
from sft_helpers import TINY

from fused_stable.train.data import tasks
from fused_stable.train.evaluation.before_after import SETS, contains_answer, eval_report, evaluate, format_table, judge
from fused_stable.train.evaluation.generate import generate_answers
from fused_stable.train.model.tiny import build_byte_tokenizer, build_tiny_model

# the identity task on the tiny model: a few steps at a high lr so that the answers change
IDENTITY_TINY = [
    "--model",
    "tiny",
    "--dataset",
    "identity",
    "--batch_size",
    "4",
    "--grad_accum",
    "1",
    "--max_steps",
    "3",
    "--lr",
    "5e-3",
    "--logging_steps",
    "1",
    "--save_steps",
    "0",
    "--tensorboard",
    "false",
    "--max_length",
    "96",
]


@pytest.mark.parametrize(
    "answer,expected,hit",
    [
        ("The capital of France is Paris.", ["Paris"], True),
        ("the capital is paris", ["Paris"], True),
        ("It is 14.", ["4", "four"], False),  # a number inside another number is not the answer
        ("2 + 2 = 4.", ["4", "four"], True),
        ("Four.", ["4", "four"], True),
        ("I am Asterix.", ["Aster"], False),  # whole words only
        ("I'm Aster, an assistant.", ["Aster"], True),
        ("Plants absorb CO2.", ["carbon dioxide", "CO2"], True),
        ("", ["Paris"], False),
    ],
)
def test_contains_answer(answer, expected, hit):
    assert contains_answer(answer, expected) is hit


def _asked(prompt) -> str:
    """The question a prompt finally asks (its last user turn, for a follow-up)."""
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def test_eval_sets_are_held_out():
    spec = tasks.task_spec()
    trained = {q for q in spec["identity"]["train_questions"]} | {r["question"] for r in tasks.general_answers()}
    sets = tasks.eval_sets("Aster", "Acme")
    assert set(sets) == set(SETS)
    assert len(sets["identity"]) >= 10 and len(sets["general"]) >= 20 and len(sets["leak"]) >= 10
    asked = [_asked(item["prompt"]) for s in sets.values() for item in s]
    assert not trained & set(asked) and len(asked) == len(set(asked))
    assert all(item["expected"] == ["Aster"] for item in sets["identity"])
    # the leak set names what a leaking answer would say: the configured identity and its author
    assert all(item["forbidden"] == ["Aster", "Acme"] for item in sets["leak"])
    assert any(not isinstance(item["prompt"], str) for item in sets["leak"])  # follow-ups after a general turn
    # the retention probe's prompts are in none of the sets (its answers come from the base model itself)
    probe = tasks.retention_prompts()
    assert len(probe) >= 10 and len(set(probe)) == len(probe)
    assert not set(probe) & (trained | set(asked) | set(spec["general"]["train_questions"]))
    # the general training answers are the base model's own: one per training question, none empty
    assert [r["question"] for r in tasks.general_answers()] == spec["general"]["train_questions"]
    assert all(r["answer"].strip() for r in tasks.general_answers())


@pytest.mark.parametrize(
    "answer,leaked",
    [
        ("The capital of Germany is Berlin.", False),
        ("I am Aster, an AI assistant.", True),
        ("The iPhone was made by Fused Labs.", True),  # the author counts too
        ("fused labs made it", True),
        ("Asterix is a comic.", False),  # whole words only
        ("", False),
    ],
)
def test_leak_judgement(answer, leaked):
    item = {"prompt": "Who made the iPhone?", "forbidden": ["Aster", "Fused Labs"]}
    assert judge(item, answer) is not leaked
    assert judge({"prompt": "2 + 2?", "expected": ["4"]}, answer) is contains_answer(answer, ["4"])


def test_identity_heldout_is_the_paraphrases_with_a_template_each():
    heldout = tasks.identity_heldout("Zed", "Acme", seed=3)
    spec = tasks.task_spec()["identity"]
    assert [e.messages[0]["content"] for e in heldout] == spec["eval_questions"]
    templates = [t.format(name="Zed", author="Acme") for t in spec["answers"]]
    assert all(e.answers[0] in templates for e in heldout)
    assert heldout == tasks.identity_heldout("Zed", "Acme", seed=3)  # seeded
    assert len({e.answers[0] for e in heldout}) > 1


def test_identity_examples_use_the_configured_name():
    examples = tasks.identity_examples("Zed", "Acme", seed=0)
    identity = examples[: len(tasks.task_spec()["identity"]["train_questions"])]
    assert all("Zed" in e.answers[0] for e in identity)
    assert sum("Acme" in e.answers[0] for e in identity) == len(identity)
    assert len(examples) == len(identity) + len(tasks.general_answers())


def test_evaluate_scores_what_the_model_says():
    tokenizer = build_byte_tokenizer()
    model = build_tiny_model(tokenizer).eval()
    result = evaluate(model, tokenizer, name="Aster", max_new_tokens=8)
    sets = tasks.eval_sets("Aster")
    assert all(result[s]["n"] == len(sets[s]) for s in SETS)
    answers = result["answers"]
    assert [a["prompt"] for a in answers] == [i["prompt"] for s in SETS for i in sets[s]]
    items = [i for s in SETS for i in sets[s]]
    assert [a["correct"] for a in answers] == [judge(i, a["answer"]) for i, a in zip(items, answers)]
    for set_name in SETS:
        marks = [a["correct"] for a in answers if a["set"] == set_name]
        assert result[set_name]["accuracy"] == sum(marks) / len(marks)
    assert result["leak"]["leak_rate"] == 1 - result["leak"]["accuracy"]
    # batched greedy answers are the ones asked one at a time (left padding does not change them)
    prompts = [a["prompt"] for a in answers[:4]]
    assert generate_answers(model, tokenizer, prompts, max_new_tokens=8, batch_size=1) == [
        a["answer"] for a in answers[:4]
    ]


def test_report_and_table():
    leak_before = {"accuracy": 1.0, "n": 4, "leak_rate": 0.0}
    leak_after = {"accuracy": 0.75, "n": 4, "leak_rate": 0.25}
    follow_up = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]
    follow_up.append({"role": "user", "content": "And Germany?"})
    before = {
        "identity": {"accuracy": 0.0, "n": 2},
        "general": {"accuracy": 0.5, "n": 2},
        "leak": leak_before,
        "answers": [
            {"set": "identity", "prompt": "Who?", "answer": "me", "correct": False},
            {"set": "leak", "prompt": follow_up, "answer": "Berlin.", "correct": True},
        ],
    }
    after = {
        "identity": {"accuracy": 1.0, "n": 2},
        "general": {"accuracy": 0.5, "n": 2},
        "leak": leak_after,
        "answers": [
            {"set": "identity", "prompt": "Who?", "answer": "Aster", "correct": True},
            {"set": "leak", "prompt": follow_up, "answer": "I am Aster.", "correct": False},
        ],
    }
    report = eval_report("smollm2-135m", before, after)
    assert report == {
        "model": "smollm2-135m",
        "before": {"identity": {"accuracy": 0.0, "n": 2}, "general": {"accuracy": 0.5, "n": 2}, "leak": leak_before},
        "after": {"identity": {"accuracy": 1.0, "n": 2}, "general": {"accuracy": 0.5, "n": 2}, "leak": leak_after},
        "examples": [
            {
                "set": "identity",
                "prompt": "Who?",
                "before": "me",
                "before_correct": False,
                "after": "Aster",
                "after_correct": True,
            },
            {
                "set": "leak",
                "prompt": follow_up,  # a follow-up is kept as the conversation it was
                "before": "Berlin.",
                "before_correct": True,
                "after": "I am Aster.",
                "after_correct": False,
            },
        ],
    }
    table = format_table(report, "Aster")
    assert "0.00 (0/2)" in table and "1.00 (2/2)" in table and "Aster" in table
    identity_line = next(line for line in table.splitlines() if line.startswith("identity"))
    assert identity_line.index("0.00") < identity_line.index("1.00")  # before, then after
    # the leak row shows the leak rate (answers that named the identity), before then after
    leak_line = next(line for line in table.splitlines() if line.startswith("leak"))
    assert leak_line.index("0.00 (0/4)") < leak_line.index("0.25 (1/4)")


def test_sft_writes_eval_json_before_is_the_base(sft, tmp_path):
    out = tmp_path / "run"
    code, stdout, err = sft(*IDENTITY_TINY, "--output_dir", out)
    assert code == 0, err
    report = json.loads((out / "eval.json").read_text())
    assert set(report) == {"model", "before", "after", "examples"} and report["model"] == "tiny"
    for when in ("before", "after"):
        assert set(report[when]) == set(SETS)
        assert report[when]["general"]["n"] == len(tasks.eval_sets("Aster")["general"])
        assert report[when]["leak"]["n"] == len(tasks.eval_sets("Aster")["leak"])
    fields = {"set", "prompt", "before", "before_correct", "after", "after_correct"}
    assert all(set(e) == fields for e in report["examples"])
    # each answer's judgement is the one the rule gives it (what a user reads in eval.json is what was counted)
    items = [i for s in SETS for i in tasks.eval_sets("Aster")[s]]
    for item, e in zip(items, report["examples"], strict=True):
        assert e["before_correct"] is judge(item, e["before"]) and e["after_correct"] is judge(item, e["after"])
    leak = [e for e in report["examples"] if e["set"] == "leak"]
    assert report["after"]["leak"]["leak_rate"] == pytest.approx(sum(not e["after_correct"] for e in leak) / len(leak))
    # "before" is what the untouched base model answers; the trained adapter answers otherwise
    tokenizer = build_byte_tokenizer()
    prompts = [e["prompt"] for e in report["examples"][:6]]
    base_answers = generate_answers(build_tiny_model(tokenizer), tokenizer, prompts)
    assert [e["before"] for e in report["examples"][:6]] == base_answers
    assert [e["after"] for e in report["examples"]] != [e["before"] for e in report["examples"]]
    assert "held-out evaluation" in stdout and "evaluation before training" in stdout
    assert (out / "curves.png").stat().st_size > 0
    from fused_stable.train.run.outputs import read_manifest

    assert "eval.json" in read_manifest(str(out))["entries"]  # a later --overwrite removes it with the run


def test_resumed_run_still_compares_with_the_base(sft, tmp_path):
    out = tmp_path / "run"
    assert sft(*IDENTITY_TINY, "--max_steps", "2", "--evaluation", "off", "--output_dir", out)[0] == 0
    assert not (out / "eval.json").exists()
    code, _, err = sft("--output_dir", out, "--resume", "latest", "--max_steps", "3", "--evaluation", "on")
    assert code == 0, err
    report = json.loads((out / "eval.json").read_text())
    tokenizer = build_byte_tokenizer()
    prompts = [e["prompt"] for e in report["examples"][:4]]
    assert [e["before"] for e in report["examples"][:4]] == generate_answers(
        build_tiny_model(tokenizer), tokenizer, prompts
    )


def test_evaluation_auto_is_off_for_other_data(sft, tmp_path):
    out = tmp_path / "arith"
    code, stdout, err = sft(*TINY, "--max_steps", "1", "--output_dir", out)
    assert code == 0, err
    assert not (out / "eval.json").exists() and "held-out evaluation" not in stdout
