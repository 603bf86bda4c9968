"""The one JSON encoding of the output files (fused_stable.strict_json): strict JSON that other languages'
parsers accept, the three strings "NaN" / "Infinity" / "-Infinity" for non-finite floats, and the encodings
earlier versions wrote still read back."""

from __future__ import annotations

import json
import math

import pytest

from fused_stable import strict_json


def refuse_constant(constant):
    raise ValueError(f"non-standard JSON constant {constant}")


def strict_loads(text):
    """A parser as strict as JavaScript's JSON.parse: no NaN, Infinity or -Infinity tokens."""
    return json.loads(text, parse_constant=refuse_constant)


ROW = {
    "step": 3,
    "loss": math.nan,
    "grad_norm": math.inf,
    "lr": 1e-4,
    "skipped": True,
    "nested": {"low": -math.inf, "values": [1.5, math.nan, (math.inf, 2)]},
    "name": "q_proj",
}


def test_nonfinite_floats_are_written_as_the_three_strings():
    text = strict_json.dumps(ROW)
    parsed = strict_loads(text)
    assert parsed["loss"] == "NaN" and parsed["grad_norm"] == "Infinity"
    assert parsed["nested"] == {"low": "-Infinity", "values": [1.5, "NaN", ["Infinity", 2]]}
    assert parsed["step"] == 3 and parsed["lr"] == 1e-4 and parsed["skipped"] is True and parsed["name"] == "q_proj"
    # what Python's float() (and JavaScript's Number()) read back from them
    assert math.isnan(float(parsed["loss"])) and float(parsed["grad_norm"]) == math.inf
    assert float(parsed["nested"]["low"]) == -math.inf


def test_loads_gives_every_float_back():
    back = strict_json.loads(strict_json.dumps(ROW, indent=1))
    assert math.isnan(back["loss"]) and back["grad_norm"] == math.inf and back["nested"]["low"] == -math.inf
    assert math.isnan(back["nested"]["values"][1]) and back["nested"]["values"][2] == [math.inf, 2]
    assert back["lr"] == 1e-4 and back["name"] == "q_proj" and back["skipped"] is True


@pytest.mark.parametrize("text", ["nanny", "NaN!", "Inf", "infinity", "", "null"])
def test_other_strings_stay_strings(text):
    assert strict_json.loads(strict_json.dumps({"label": text})) == {"label": text}


@pytest.mark.parametrize(
    "line, expected",
    [
        ('{"loss": NaN, "grad_norm": Infinity, "low": -Infinity}', {"loss": math.nan, "grad_norm": math.inf}),
        ('{"loss": "nan", "grad_norm": "inf", "low": "-inf"}', {"loss": math.nan, "grad_norm": math.inf}),
        (
            '{"loss": null, "grad_norm": null, "low": null, "nonfinite": {"loss": "nan", "grad_norm": "inf", '
            '"low": "-inf"}}',
            {"loss": math.nan, "grad_norm": math.inf},
        ),
    ],
    ids=["bare-tokens", "str-spellings", "metrics-null-and-nonfinite"],
)
def test_the_encodings_of_earlier_versions_are_read(line, expected):
    back = strict_json.loads(line)
    assert set(back) == {"loss", "grad_norm", "low"}  # the metrics' `nonfinite` object is folded back in
    assert math.isnan(back["loss"]) and back["grad_norm"] == expected["grad_norm"] and back["low"] == -math.inf
    assert strict_loads(strict_json.dumps(back))["loss"] == "NaN"  # and written again in the current encoding


def test_dumps_refuses_what_is_not_json():
    with pytest.raises(TypeError):
        strict_json.dumps({"value": object()})
    assert strict_json.dumps({"value": object()}, default=lambda o: "object") == '{"value": "object"}'
