"""QLoRA on any shape: bitsandbytes' CPU 4-bit inference path (0.50's `_convert_weight_packed_for_cpu`, taken on
CPUs with AVX512-BF16) asserts on layers whose output size is not a multiple of 32 or whose input size is not a
multiple of the quantisation block (64). The trainer sends such layers through bitsandbytes' generic 4-bit path
(one line names them), and a model that trains never takes the packed, inference-only path.

This machine may have no AVX512-BF16, so the packed path is switched on the way bitsandbytes decides it
(`has_avx512bf16()` when a layer is built) and its conversion is replaced by a checker that runs the real
conversion on a copy, so a shape it cannot take fails here as it fails for a user, and then leaves the layer on
the generic path (the packed kernel itself needs the CPU feature).
"""

import copy

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
bnb_functional = pytest.importorskip("bitsandbytes.functional")
bnb_modules = pytest.importorskip("bitsandbytes.nn.modules")

from sft_helpers import TINY, setup_run  # noqa: E402

from fused_stable.train.model.load import PACKED_CPU_PATH, packed_cpu_path_takes  # noqa: E402
from fused_stable.train.saved import chat  # noqa: E402

needs_packed_path = pytest.mark.skipif(
    not hasattr(bnb_functional, "_convert_weight_packed_for_cpu"),
    reason="this bitsandbytes has no packed CPU 4-bit path",
)


@pytest.fixture
def packed_cpu_path(monkeypatch):
    """bitsandbytes as on a CPU with AVX512-BF16; returns the shapes (out, in) its packed path was handed."""
    real = bnb_functional._convert_weight_packed_for_cpu
    handed = []

    def checked(qweight, quant_state, block_n=32):
        real(qweight.clone(), copy.deepcopy(quant_state), block_n)  # AssertionError where a user gets one
        handed.append(tuple(quant_state.shape))
        return qweight, quant_state  # stays unpacked: the packed kernel needs the CPU feature

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)
    monkeypatch.setattr(bnb_modules, "_convert_weight_packed_for_cpu", checked)
    return handed


def _odd_model(folder):
    """A local Hugging Face folder: attention 128 -> 128 (the packed path takes it), MLP 128 -> 200 -> 128
    (200 is no multiple of 32 or 64: it cannot)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fused_stable.train.model.tiny import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=200,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@needs_packed_path
@pytest.mark.parametrize(
    "out_features, in_features", [(32, 64), (64, 128), (128, 320), (320, 128), (40, 64), (128, 200), (200, 128)]
)
def test_the_shape_rule_is_the_rule_of_the_installed_bitsandbytes(out_features, in_features):
    weight, state = bnb_functional.quantize_4bit(torch.randn(out_features, in_features), quant_type="nf4")
    try:
        bnb_functional._convert_weight_packed_for_cpu(weight, state)
        taken = True
    except (AssertionError, RuntimeError):
        taken = False
    assert taken == packed_cpu_path_takes(out_features, in_features, state.blocksize)


@needs_packed_path
def test_the_installed_bitsandbytes_still_decides_per_layer_as_assumed():
    # the switch the trainer turns off; a release that renames it must fail here, not in a user's first answer
    layer = bnb.nn.Linear4bit(64, 64, quant_type="nf4")
    assert hasattr(layer, PACKED_CPU_PATH)


@needs_packed_path
def test_every_4bit_layer_of_the_tiny_model_fits_the_packed_path(tmp_path, packed_cpu_path):
    setup = setup_run(*TINY, "--quant_bits", "4", "--target_modules", "all-linear", "--output_dir", tmp_path / "r")
    layers = [m for m in setup.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 4 * 7
    for m in layers:
        assert packed_cpu_path_takes(m.out_features, m.in_features, m.weight.quant_state.blocksize)


@needs_packed_path
def test_odd_sized_model_trains_chats_and_exports_in_4bit(tmp_path, sft, capsys, packed_cpu_path):
    model = _odd_model(tmp_path / "odd")
    out = tmp_path / "run"
    args = [*TINY, "--model", model, "--quant_bits", "4", "--target_modules", "all-linear", "--max_steps", "2"]

    # the training model never takes the packed path, also when it is evaluated (eval mode, no gradients)
    setup = setup_run(*args, "--output_dir", tmp_path / "inspect")
    layers = {n: m for n, m in setup.model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(layers) == 2 * 7 and not any(getattr(m, PACKED_CPU_PATH) for m in layers.values())
    from fused_stable.train.evaluation.generate import generate_answers

    generate_answers(setup.model, setup.tokenizer, ["Add.\n\n1 + 2"], max_new_tokens=2, batch_size=1)
    assert packed_cpu_path == []

    code, _, err = sft(*args, "--output_dir", out)
    assert code == 0, err
    assert packed_cpu_path == []

    # inference: the packed path gets the layers it can take; the others stay 4-bit on the generic path
    assert chat.main(["--adapter", str(out), "--prompt", "Add.\n\n1 + 2", "--max_new_tokens", "3"]) == 0
    _, err = capsys.readouterr()
    notes = [line for line in err.splitlines() if "generic 4-bit path" in line]
    assert len(notes) == 1, err
    assert "6 layer(s)" in notes[0] and "model.layers.*.mlp.down_proj (200 -> 128)" in notes[0], notes[0]
    assert "model.layers.*.mlp.gate_proj (128 -> 200)" in notes[0] and "self_attn" not in notes[0]
    assert packed_cpu_path and set(packed_cpu_path) == {(128, 128)}  # q, k, v, o of both blocks

    from fused_stable.train.saved import export

    assert export.main(["--adapter", str(out), "--output_dir", str(tmp_path / "merged")]) == 0
