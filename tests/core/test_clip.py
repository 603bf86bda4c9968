"""fused_stable.clip_grad_norm_ is a drop-in for torch.nn.utils.clip_grad_norm_.

The L2 norm over grads of the supported dtypes runs the package's own multi-tensor kernels (on CUDA, and on
CPU under the `interpret` backend), with torch's arithmetic for the norms and the coefficient (per-tensor norms
in the grads' dtype, total and coefficient in their promoted dtype): 16-bit grads are checked against torch's
function bit for bit, mixed dtypes to one rounding, and fp32 against a float64 reference written here (the
kernels' fp32 sums are closer to it than torch's CPU ones); a spy proves torch's clip_grad_norm_ was not what
ran. Everything else (other norm types, the `torch` backend,
unsupported grads) is documented to defer to torch: checked by the same spy, so a broken switch shows."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close, describe_dtype, interpret_available

import fused_stable

needs_interpreter = pytest.mark.skipif(not interpret_available(), reason="needs TRITON_INTERPRET=1")


def make_grads(shapes, dtypes, scale=3.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = []
    for i, shape in enumerate(shapes):
        dtype = dtypes[i % len(dtypes)]
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (torch.randn(shape, generator=gen) * scale).to(dtype)
        params.append(p)
    return params


def reference_clip(grads, max_norm):
    """float64: total L2 norm of the grads as given, clip coefficient min(1, max_norm / (norm + 1e-6))."""
    total = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    coef = min(1.0, max_norm / (total + 1e-6))
    return total, [g.double() * coef for g in grads]


@pytest.fixture
def torch_clip_calls(monkeypatch):
    """Spy on torch.nn.utils.clip_grad_norm_ (the real one runs): the list of its calls."""
    calls = []
    real = torch.nn.utils.clip_grad_norm_

    def spy(*args, **kwargs):
        calls.append(args[2] if len(args) > 2 else kwargs.get("norm_type", 2.0))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    return calls


SHAPES = [(7,), (1025,), (3, 4), (), (0,), (4097,)]
LARGE_SHAPES = SHAPES + [(70001,)]  # one grad over a chunk of 65536 elements
DTYPE_SETS = {
    "fp32": (torch.float32,),
    "bf16": (torch.bfloat16,),
    "fp16": (torch.float16,),
    "mixed": (torch.float32, torch.bfloat16, torch.float16),
}


@needs_interpreter
@pytest.mark.parametrize("max_norm", [1.0, 1e9], ids=["clipping", "not-clipping"])
def test_kernels_clip_fp32_like_the_float64_reference(monkeypatch, torch_clip_calls, max_norm):
    monkeypatch.setenv("FUSED_STABLE_BACKEND", "interpret")
    dtypes = (torch.float32,)
    params = make_grads(SHAPES, dtypes)
    given = [p.grad.clone() for p in params]
    total = fused_stable.clip_grad_norm_(params, max_norm)
    assert torch_clip_calls == []  # the kernels ran, not torch
    ref_total, ref_grads = reference_clip(given, max_norm)
    assert ref_total > 100  # the grads' norm: far above 1, so "clipping" clips by ~100x
    assert total.dtype == torch.float32
    assert_close(total, torch.tensor(ref_total), 2 * torch.finfo(total.dtype).eps, 0, "total norm")
    for p, ref in zip(params, ref_grads):
        # one rounding of g x coef to the grad's dtype (fp32: coef's own rounding adds an ulp); below the
        # smallest normal (fp16: 6e-5) the spacing is absolute, one subnormal step
        info = torch.finfo(p.grad.dtype)
        assert_close(
            p.grad,
            ref,
            2 * info.eps,
            info.tiny * info.eps,
            f"clipped {describe_dtype(p.grad.dtype)} grad {tuple(p.shape)}",
        )
    if max_norm == 1e9:
        for p, g in zip(params, given):
            assert torch.equal(p.grad, g)  # coefficient 1: untouched, bit for bit


@needs_interpreter
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_kernels_clip_16_bit_grads_exactly_as_torch(monkeypatch, torch_clip_calls, name):
    """Per-tensor norms in the grads' dtype, the total and the coefficient in it, one rounding per grad: torch's
    steps, so norm, its dtype and the clipped grads are torch's bit for bit."""
    monkeypatch.setenv("FUSED_STABLE_BACKEND", "interpret")
    ours, theirs = make_grads(LARGE_SHAPES, DTYPE_SETS[name]), make_grads(LARGE_SHAPES, DTYPE_SETS[name])
    total = fused_stable.clip_grad_norm_(ours, 1.0)
    assert torch_clip_calls == []
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert total.dtype == expected.dtype == DTYPE_SETS[name][0] and torch.equal(total, expected)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.grad, b.grad), tuple(a.shape)


@needs_interpreter
@pytest.mark.parametrize("name", ["bf16+fp32", "fp16+fp32", "mixed"])
def test_kernels_clip_mixed_dtypes_as_torch_in_torchs_dtype(monkeypatch, torch_clip_calls, name):
    monkeypatch.setenv("FUSED_STABLE_BACKEND", "interpret")
    dtypes = DTYPE_SETS.get(name) or (getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[name[:4]]), torch.float32)
    ours, theirs = make_grads(LARGE_SHAPES, dtypes), make_grads(LARGE_SHAPES, dtypes)
    total = fused_stable.clip_grad_norm_(ours, 1.0)
    assert torch_clip_calls == []
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert total.dtype == expected.dtype == torch.float32  # the promoted dtype, not the first grad's
    assert_close(total, expected, 1e-6, 0, "total norm")
    for a, b in zip(ours, theirs):  # one rounding of g x coef, with coefficients equal to within 1e-6
        rtol = max(torch.finfo(a.dtype).eps, 1e-6)
        assert_close(a.grad, b.grad, rtol, 0, f"clipped {describe_dtype(a.dtype)} grad")


@needs_interpreter
def test_kernels_fp16_norm_that_overflows_is_torchs(monkeypatch, torch_clip_calls):
    """torch's per-tensor fp16 norm overflows to inf: the total is inf and the grads are zeroed, not scaled."""
    monkeypatch.setenv("FUSED_STABLE_BACKEND", "interpret")
    ours = make_grads(LARGE_SHAPES, (torch.float16,), scale=3000.0)
    theirs = make_grads(LARGE_SHAPES, (torch.float16,), scale=3000.0)
    total = fused_stable.clip_grad_norm_(ours, 1.0)
    assert torch_clip_calls == []
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert total.dtype == torch.float16 and total.isinf() and expected.isinf()
    for a, b in zip(ours, theirs):
        assert torch.equal(a.grad, b.grad) and not a.grad.any()


@needs_interpreter
def test_non_dense_grads_are_clipped_by_torch(monkeypatch, torch_clip_calls):
    monkeypatch.setenv("FUSED_STABLE_BACKEND", "interpret")
    ours, theirs = make_grads([(6, 8), (6, 4)], (torch.float32,)), make_grads([(6, 8), (6, 4)], (torch.float32,))
    for params in (ours, theirs):
        params[1].grad = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))[:, ::2]  # not dense
    total = fused_stable.clip_grad_norm_(ours, 1.0)
    assert torch_clip_calls == [2.0]  # the kernels walk memory linearly: torch's clip takes any layout
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert torch.equal(total, expected)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.grad, b.grad)


@needs_interpreter
def test_kernels_agree_with_torch_clip_grad_norm(monkeypatch):
    """The drop-in promise itself: the same total and grads as torch's function, on the same input."""
    monkeypatch.setenv("FUSED_STABLE_BACKEND", "interpret")
    ours, theirs = make_grads(SHAPES, (torch.float32,)), make_grads(SHAPES, (torch.float32,))
    total = fused_stable.clip_grad_norm_(ours, 0.5)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    assert_close(total, expected, 2e-7, 0, "total norm")
    for a, b in zip(ours, theirs):
        assert_close(a.grad, b.grad, 2.4e-7, 0, "clipped grad")


@pytest.mark.parametrize(
    "backend, norm_type",
    [("torch", 2.0), ("interpret", float("inf")), ("interpret", 1.0)],
    ids=["torch-backend", "inf-norm", "l1-norm"],
)
def test_other_cases_defer_to_torch(monkeypatch, torch_clip_calls, backend, norm_type):
    if backend == "interpret" and not interpret_available():
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("FUSED_STABLE_BACKEND", backend)
    shapes = [(7,), (1025,), (3, 4)]
    ours, theirs = make_grads(shapes, (torch.float32,)), make_grads(shapes, (torch.float32,))
    total = fused_stable.clip_grad_norm_(ours, 1.0, norm_type)
    assert torch_clip_calls == [norm_type]
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    assert torch.equal(total, expected)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_error_if_nonfinite_raises_before_any_grad_changes(monkeypatch, backend):
    if backend == "interpret" and not interpret_available():
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("FUSED_STABLE_BACKEND", backend)
    ours = make_grads([(5,), (1025,)], (torch.float32,))
    ours[0].grad[2] = float("nan")
    before = [p.grad.clone() for p in ours]
    with pytest.raises(RuntimeError, match="non-finite"):
        fused_stable.clip_grad_norm_(ours, 1.0, error_if_nonfinite=True)
    for p, g in zip(ours, before):
        assert torch.allclose(p.grad, g, rtol=0, atol=0, equal_nan=True)  # untouched, as torch leaves them
    assert fused_stable.clip_grad_norm_(ours, 1.0).isnan()


def test_no_grads_returns_zero():
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert fused_stable.clip_grad_norm_(params, 1.0).item() == 0.0
