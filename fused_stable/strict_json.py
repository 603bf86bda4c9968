"""The one JSON encoding of every output file (metrics.jsonl, alerts.jsonl, trainer_state.json, eval.json,
stress.json, the benchmark results): strict JSON (RFC 8259), with a non-finite float written as one of the
strings "NaN", "Infinity", "-Infinity".

Strict JSON has no NaN or Infinity; Python's `json` writes them as bare tokens that JavaScript's `JSON.parse`,
jq and most other parsers refuse. The three strings parse everywhere and read back as the number with
`float()` in Python and `Number()` in JavaScript. `dumps` refuses anything else that is not JSON
(`allow_nan=False` after the conversion), `loads` gives the floats back.

Readers also take the encodings of files written by earlier versions (a run resumed after an upgrade):
bare NaN / Infinity tokens (stress.json, benchmark results), the strings "nan", "inf", "-inf" (alerts.jsonl,
stress.json), and metrics.jsonl's null with a `nonfinite` object naming the value (`{"loss": null,
"nonfinite": {"loss": "nan"}}`).

Decoding turns every string that spells a non-finite number into a float, so it is meant for the files above,
whose strings are names and labels: a free-text field that is exactly "NaN" would come back as a float.
"""

from __future__ import annotations

import json
import math
from typing import Any

NAN, INFINITY, NEG_INFINITY = "NaN", "Infinity", "-Infinity"
# what each spelling reads back as: ours, and the str(float) spellings earlier versions wrote
_NONFINITE = {
    NAN: math.nan,
    INFINITY: math.inf,
    NEG_INFINITY: -math.inf,
    "nan": math.nan,
    "inf": math.inf,
    "-inf": -math.inf,
}
_LEGACY_NONFINITE_KEY = "nonfinite"  # metrics.jsonl before this encoding: {"loss": null, "nonfinite": {...}}


def encode(value: Any) -> Any:
    """`value` with every non-finite float (in dicts, lists and tuples too) replaced by its string."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return NAN if math.isnan(value) else INFINITY if value > 0 else NEG_INFINITY
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    return value


def decode(value: Any) -> Any:
    """The inverse of `encode`, also for the older encodings (see the module docstring)."""
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        legacy = value.get(_LEGACY_NONFINITE_KEY)
        if isinstance(legacy, dict) and all(isinstance(v, str) and v in _NONFINITE for v in legacy.values()):
            value = {k: v for k, v in value.items() if k != _LEGACY_NONFINITE_KEY}
            value.update({k: _NONFINITE[v] for k, v in legacy.items()})
        return {k: decode(v) for k, v in value.items()}
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """`json.dumps` in this encoding (keyword arguments as for json.dumps, e.g. indent)."""
    return json.dumps(encode(value), allow_nan=False, **kwargs)


def loads(text: str | bytes) -> Any:
    """`json.loads` of a file in this encoding or an older one, with the non-finite floats back."""
    return decode(json.loads(text))  # json.loads also takes the bare NaN / Infinity tokens of older files
