"""Versioned 8-bit states (fused_stable/state_format.py: CODES_KEY, code formats v1 and v2).

A saved state dict tags every param's 8-bit codes with their code format. An untagged 8-bit state (every one
saved before v2) is v1: it loads converted once, decoded exactly as v1 decodes it and encoded in v2, with one
warning line. Checked on the states main 977f179 saved (tests/core/fixtures/make_v1_state.py: FusedAdamW with
amsgrad, FusedLion), against the moments that code decoded them to:
- v1's decode is kept bit for bit (to_fp32 of the saved entry as v1 gives the fixture's decoded moments);
- after loading, each moment lies within half a v2 code of what v1 decoded (the bound of nearest rounding in the
  pseudo root's domain, test_state_codes.py), which a v1 state read as v2 without conversion breaks (up to 12%);
- training continues: the next steps move the params as an fp32-state optimizer loaded with v1's decoded moments
  does (as closely as v1 continuing its own state did), and the step counters go on;
- a v2 state saved now loads back bit for bit with no warning, a pickle likewise, an untagged pickle converts,
  and a code format newer than this version's is refused in one line before anything changes.
"""

from __future__ import annotations

import copy
import io
import pathlib
import warnings

import pytest
import torch
from test_state_codes import _pseudo_root_fp64

from fused_stable import FusedAdamW, FusedLion, state_format
from fused_stable.state_format import CODES_KEY, CODES_V1, CODES_VERSION, Q8, SIGNED

# the format, not a backend: the torch backend's exact reference (the compiled op's codes are the reference's bit for
# bit: test_state_codes.py, test_cpu_ops.py)
pytestmark = pytest.mark.torch_ops
FIXTURES = pathlib.Path(__file__).parent / "fixtures"
CASES = {
    "adamw": (FusedAdamW, "v1_adamw_8bit.pt", dict(lr=1e-2, weight_decay=0.01, amsgrad=True)),
    "lion": (FusedLion, "v1_lion_8bit.pt", dict(lr=1e-3, weight_decay=0.01)),
}


def fixture(name: str) -> dict:
    return torch.load(FIXTURES / CASES[name][1], weights_only=True)


def fresh(name: str, record: dict, precision: str = "8bit"):
    cls, _, kwargs = CASES[name]
    params = [torch.nn.Parameter(p.clone()) for p in record["params"]]
    return params, cls(params, state_precision=precision, backend="torch", **kwargs)


def load_quietly(opt, state: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no conversion warning (nor any other)
        opt.load_state_dict(state)


def through_disk(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def quantised_moments(entry: dict):
    for key in state_format.state_keys():
        if key in entry and state_format.moment_format(entry[key]) == Q8:
            yield key


def assert_within_half_a_code(entry: dict, key: str, expected: torch.Tensor) -> None:
    """`expected` (v1's decoded moment) lies within half a v2 code of the code it was given: nearest rounding in
    the pseudo root's domain, from the fp64 definition, plus the fp32 arithmetic's rounding (1e-4 of a code)."""
    kind = state_format.codec_of(key)
    levels, times = (127, 1) if kind == SIGNED else (255, 2)
    codes = state_format.flat(entry[key]).double()
    values = torch.cat([state_format.flat(expected).double(), torch.zeros((-codes.numel()) % 128)]).view(-1, 128)
    ratio = values.abs() / entry[key + state_format.SCALE_SUFFIX].double()[:, None]
    position = (levels * _pseudo_root_fp64(ratio, times)).view(-1)[: codes.numel()]
    worst = float((position - codes.abs()).abs().max())
    assert worst <= 0.5 + 1e-4, f"{key}: a v1 value lies {worst:.3f} codes from its v2 code"


@pytest.mark.parametrize("name", CASES)
def test_the_fixture_is_a_v1_state_and_v1_decodes_it_as_it_did(name):
    record = fixture(name)
    assert record["commit"].startswith("977f179")
    for param_id, entry in record["state_dict"]["state"].items():
        assert CODES_KEY not in entry
        for key in quantised_moments(entry):
            decoded = state_format.to_fp32(entry, key, state_format.saved_codes_version(entry))
            assert torch.equal(decoded, record["decoded"][param_id][key]), (param_id, key)


@pytest.mark.parametrize("name", CASES)
def test_a_v1_state_loads_converted_once_within_half_a_v2_code_of_what_v1_decoded(name):
    record = fixture(name)
    params, opt = fresh(name, record)
    with pytest.warns(UserWarning, match="code format v1") as caught:
        opt.load_state_dict(record["state_dict"])
    assert len([w for w in caught if "code format" in str(w.message)]) == 1
    saved = opt.state_dict()
    converted = 0
    for param_id, entry in saved["state"].items():
        expected = record["decoded"][param_id]
        for key in quantised_moments(entry):
            assert int(entry[CODES_KEY]) == CODES_VERSION
            assert_within_half_a_code(entry, key, expected[key])
            converted += 1
        for key in state_format.state_keys():  # fp32 moments (the small-tensor rule) as they were
            if key in entry and entry[key].dtype == torch.float32:
                assert torch.equal(entry[key], expected[key])
    assert converted == (6 if name == "adamw" else 2)
    decoded = opt.torch_state_dict()["state"]  # and torch's form decodes the v2 codes
    for param_id, entry in saved["state"].items():
        for key in quantised_moments(entry):
            assert torch.equal(decoded[param_id][key], state_format.to_fp32(entry, key))
    # the conversion is what quantising v1's decoded fp32 moments gives, bit for bit
    quantised_params, quantised = fresh(name, record)
    load_quietly(quantised, fp32_form(record))
    for p, q in zip(params, quantised_params):
        assert opt.state[p].keys() == quantised.state[q].keys()
        for key, value in opt.state[p].items():
            assert torch.equal(quantised.state[q][key], value), key
    # loading the converted state again converts nothing
    again_params, again = fresh(name, record)
    load_quietly(again, through_disk(saved))


def fp32_form(record: dict) -> dict:
    """The fixture's state with v1's decoded fp32 moments in place of the codes and scales."""
    state = copy.deepcopy(record["state_dict"])
    for param_id, entry in state["state"].items():
        for key in list(entry):
            if key in state_format.state_keys():
                entry[key] = record["decoded"][param_id][key]
            elif key.endswith(state_format.SCALE_SUFFIX):
                del entry[key]
    return state


def _updates(opt, params, steps=3):
    before = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(params, before)])


@pytest.mark.parametrize("name", CASES)
def test_training_continues_after_the_conversion(name):
    """The converted 8-bit optimizer's next 3 updates against an fp32-state one loaded with v1's decoded moments
    (the same step counts). Measured, cosine of the two updates: AdamW 0.999968, Lion (a sign: a few elements flip)
    0.99922; v1 itself continuing its own state (main 977f179): 0.999986 and 0.99934. AdamW's median relative
    difference per element 0.0060 (v1's 0.0046). Allowed: cosine >= 0.999, AdamW's median <= 0.01."""
    record = fixture(name)
    params, opt = fresh(name, record)
    with pytest.warns(UserWarning, match="code format v1"):
        opt.load_state_dict(record["state_dict"])
    reference_params, reference = fresh(name, record, precision="fp32")
    reference.load_state_dict(fp32_form(record))
    got, expected = _updates(opt, params), _updates(reference, reference_params)
    assert bool(got.ne(0).any())
    cosine = float(torch.nn.functional.cosine_similarity(got.double(), expected.double(), dim=0))
    assert cosine >= 0.999, cosine
    if name == "adamw":
        median = float(((got - expected).abs() / expected.abs()).median())
        assert median <= 0.01, median
    saved_steps = [float(entry["step"]) for entry in record["state_dict"]["state"].values()]
    assert [float(opt.state[p]["step"]) for p in params] == [s + 3 for s in saved_steps]


@pytest.mark.parametrize("name", CASES)
def test_a_v2_state_round_trips_bit_for_bit_with_no_warning(name):
    record = fixture(name)
    params, opt = fresh(name, record)
    _updates(opt, params, steps=2)
    saved = through_disk(opt.state_dict())
    for entry in saved["state"].values():
        if state_format.holds_codes(entry):
            tag = entry[CODES_KEY]
            assert tag.dtype == torch.int64 and tag.dim() == 0 and int(tag) == CODES_VERSION
        else:
            assert CODES_KEY not in entry
    again_params, again = fresh(name, record)
    load_quietly(again, saved)
    for p, q in zip(params, again_params):
        for key, value in opt.state[p].items():
            assert torch.equal(again.state[q][key], value), key
    assert CODES_KEY not in again.state[again_params[0]]  # the live state holds no tag: its codes are current


def test_a_pickled_optimizer_keeps_its_codes_and_an_untagged_pickle_converts():
    record = fixture("adamw")
    params, opt = fresh("adamw", record)
    _updates(opt, params, steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copied = copy.deepcopy(opt)
    for p, q in zip(opt.param_groups[0]["params"], copied.param_groups[0]["params"]):
        assert torch.equal(copied.state[q]["exp_avg"], opt.state[p]["exp_avg"])
    # a pickle made before v2: v1 codes in the live state, no tag
    old = opt.__getstate__()
    old.pop("_codes_version")
    for param_id, p in enumerate(opt.param_groups[0]["params"]):
        old["state"][p] = {k: v.clone() for k, v in record["state_dict"]["state"][param_id].items()}
    unpickled = FusedAdamW.__new__(FusedAdamW)
    with pytest.warns(UserWarning, match="code format v1"):
        unpickled.__setstate__(old)
    entry = unpickled.state[opt.param_groups[0]["params"][0]]
    assert_within_half_a_code(entry, "exp_avg_sq", record["decoded"][0]["exp_avg_sq"])


def test_a_loader_that_merges_over_a_live_template_converts_once_the_v1_state_is_tagged():
    """torch.distributed.checkpoint's set_optimizer_state_dict (full state) merges the saved state over the live
    optimizer's own state_dict(), keeping template keys the saved state lacks: a v1 state would get the live v2
    tag. tag_untagged_codes (what the trainer's FSDP2 resume calls first) marks it v1, so it converts."""
    record = fixture("adamw")
    params, opt = fresh("adamw", record)
    _updates(opt, params, steps=1)  # live v2 codes: the template is tagged v2
    template = opt.state_dict()
    for tagged in (False, True):
        saved = copy.deepcopy(record["state_dict"])
        if tagged:
            assert state_format.tag_untagged_codes(saved) is saved
        merged = {**saved, "state": {i: {**template["state"][i], **e} for i, e in saved["state"].items()}}
        if not tagged:  # the template's tag stands: the v1 codes would be read as v2
            assert all(int(e[CODES_KEY]) == CODES_VERSION for e in merged["state"].values() if CODES_KEY in e)
            continue
        with pytest.warns(UserWarning, match="code format v1"):
            opt.load_state_dict(merged)
        entry = opt.state_dict()["state"][0]
        for key in quantised_moments(entry):
            assert_within_half_a_code(entry, key, record["decoded"][0][key])


def test_a_newer_code_format_is_refused_before_anything_changes():
    record = fixture("adamw")
    params, opt = fresh("adamw", record)
    _updates(opt, params, steps=1)
    before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    state = opt.state_dict()
    state["state"][0][CODES_KEY] = state_format.codes_tag(CODES_VERSION + 1)
    with pytest.raises(ValueError, match=f"format v{CODES_VERSION + 1}.*upgrade fused_stable"):
        opt.load_state_dict(state)
    assert all(torch.equal(opt.state[params[0]][k], v) for k, v in before.items())
    assert state_format.saved_codes_version({}) == CODES_V1
