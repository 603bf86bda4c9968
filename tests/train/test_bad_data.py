"""Bad data, row by row: every malformed record of a JSON / JSONL dataset is one line naming the file and the
line (exit code 2, nothing written, no traceback); what the documented rules skip instead (an empty answer, an
answer that max_length cuts off entirely) is counted in one note naming where; blank lines are ignored."""

import json

import pytest
from sft_helpers import TINY, setup_run

from fused_stable.errors import UserError
from fused_stable.train.data import instructions, rows

GOOD = {"instruction": "Add.", "input": "1 + 2", "output": "3"}
GOOD_LINE = json.dumps(GOOD).encode()


def _jsonl(path, *lines: bytes):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


# (name, file name, content, the line named, what the message says)
BAD_FILES = [
    ("not-json", "d.jsonl", GOOD_LINE + b'\n{"instruction": "x", "output": \n', 2, "invalid JSON"),
    ("missing-key", "d.jsonl", GOOD_LINE + b'\n\n{"instruction": "Say hi."}\n', 3, "has no 'output'"),
    ("wrong-type", "d.jsonl", GOOD_LINE + b'\n{"instruction": "Add.", "output": 3}\n', 2, "'output' must be a string"),
    ("input-not-a-string", "d.jsonl", b'{"instruction": "a", "input": [1], "output": "b"}\n', 1, "'input' must be"),
    ("not-an-object", "d.json", b"[\n" + GOOD_LINE + b",\n 7\n]\n", 3, "expected a JSON object, got a number"),
    ("unknown-format", "d.jsonl", b'{"question": "c", "answer": "d"}\n', 1, "unknown record format"),
    ("turns-not-a-list", "d.jsonl", b'{"conversations": "hello"}\n', 1, "must be a non-empty array"),
    ("speaker-a-list", "d.jsonl", b'{"conversations": [{"from": ["gpt"], "value": "x"}]}\n', 1, "turn 1 needs"),
    ("no-assistant-turn", "d.jsonl", b'{"conversations": [{"from": "human", "value": "x"}]}\n', 1, "no 'gpt'"),
    ("invalid-utf8-jsonl", "d.jsonl", GOOD_LINE + b'\n{"instruction": "caf\xe9", "output": "x"}\n', 2, "not UTF-8"),
    ("invalid-utf8-json", "d.json", b"[\n" + GOOD_LINE + b',\n{"instruction": "\xff", "output": "x"}]', 3, "not UTF-8"),
    ("nested-too-deeply", "d.jsonl", GOOD_LINE + b"\n" + b"[" * 100_000 + b"]" * 100_000 + b"\n", 2, "nested"),
    ("unterminated-array", "d.json", b"[\n" + GOOD_LINE + b",\n", 3, "unterminated"),
    ("not-an-array", "d.json", GOOD_LINE, 1, "must be a JSON array"),
]


@pytest.mark.parametrize("name, file_name, content, line, needle", BAD_FILES, ids=[case[0] for case in BAD_FILES])
def test_a_malformed_record_is_one_line_naming_file_and_line(sft, tmp_path, name, file_name, content, line, needle):
    path = tmp_path / file_name
    path.write_bytes(content)
    out = tmp_path / "out"
    code, stdout, err = sft(*TINY, "--dataset", path, "--output_dir", out)
    assert code == 2 and "Traceback" not in stdout + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"fused-stable sft: error: {path}:{line}: "), lines[0]
    assert needle in lines[0], lines[0]
    assert not out.exists()


@pytest.mark.parametrize(
    "file_name, content, needle",
    [
        ("empty.jsonl", b"", "the file is empty"),
        ("blank.jsonl", b"\n \n\t\n", "the file is empty"),
        ("empty.json", b"", "the file is empty"),
        ("no-records.json", b"[ ]\n", "the dataset has no records"),
        ("all-empty.jsonl", b'{"instruction": "a", "output": ""}\n{"instruction": "b", "output": " "}\n', "every"),
    ],
)
def test_a_dataset_with_nothing_to_learn_is_one_line_naming_the_file(sft, tmp_path, file_name, content, needle):
    path = tmp_path / file_name
    path.write_bytes(content)
    code, _, err = sft(*TINY, "--dataset", path, "--output_dir", tmp_path / "out")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"fused-stable sft: error: {path}: ") and needle in err, err


def test_an_empty_answer_is_skipped_and_counted(tmp_path, capsys):
    path = _jsonl(
        tmp_path / "d.jsonl",
        GOOD_LINE,
        b'{"instruction": "Say nothing.", "output": ""}',
        b"",
        json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "  "}]}).encode(),
        GOOD_LINE,
    )
    setup = setup_run(*TINY, "--dataset", path, "--output_dir", tmp_path / "out")
    assert setup.n_examples == 2
    notes = [line for line in capsys.readouterr().out.splitlines() if "empty answer" in line]
    assert notes == [f"note: {path}: skipped 2 record(s) with an empty answer (lines 2, 4)"]


def test_examples_longer_than_max_length_are_truncated_or_skipped_and_counted(tmp_path, capsys):
    long_prompt = {"instruction": "Repeat." + " x" * 200, "output": "x"}  # the answer lies beyond 96 tokens
    long_answer = {"instruction": "Count.", "output": "1 2 3 " * 40}  # cut, but part of the answer stays
    path = tmp_path / "d.json"
    path.write_text(json.dumps([GOOD, long_prompt, long_answer, GOOD], indent=1))
    setup = setup_run(*TINY, "--dataset", path, "--output_dir", tmp_path / "out")
    assert setup.n_examples == 3
    assert all(len(item.input_ids) <= 96 and item.has_answer() for item in setup.trainer.batches.items)
    out = capsys.readouterr().out
    assert f"cuts off the whole answer of 1 example(s), which are skipped (the first: {path}:7)" in out, out
    assert f"1 example(s) longer than max_length=96 are truncated (the first: {path}:11)" in out, out


def test_every_answer_cut_off_is_one_line(sft, tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", json.dumps({"instruction": "x" * 300, "output": "y"}).encode())
    code, _, err = sft(*TINY, "--dataset", path, "--output_dir", tmp_path / "out")
    assert code == 2 and err.count("\n") == 1 and "max_length=96 cuts off every answer" in err, err


def test_what_well_formed_files_may_hold(tmp_path):
    # a byte-order mark, CRLF line ends, a line separator inside a string (valid JSON: not a line break of
    # the .jsonl file), blank lines, a null input (as in many alpaca exports)
    record = {"instruction": "Join\u2028these.", "input": None, "output": "ok"}
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(record, ensure_ascii=False).encode() + b"\r\n\r\n" + GOOD_LINE)
    examples = instructions.load_examples(str(path))
    assert [e.source for e in examples] == [f"{path}:1", f"{path}:3"]
    assert examples[0].messages[0]["content"] == "Join\u2028these." and examples[0].answers == ["ok"]


def test_every_row_goes_through_parse_row():
    # the one place a row is checked: a new format is one more entry of ROW_FORMATS
    assert [fmt.name for fmt in rows.ROW_FORMATS] == ["sharegpt", "messages", "alpaca"]
    assert rows.parse_row(GOOD, "f:1").messages[-1] == {"role": "assistant", "content": "3"}
    with pytest.raises(UserError, match=r"^f:9: expected a JSON object, got an array$"):
        rows.parse_row([GOOD], "f:9")
