"""fused_stable.clip_grad_norm_ is a drop-in for torch.nn.utils.clip_grad_norm_."""
from __future__ import annotations

import pytest
import torch

import fused_stable
from helpers import assert_close, interpret_available


def pair(shapes, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    theirs = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    for a, b in zip(ours, theirs):
        g = (torch.randn(s := a.shape, generator=gen) * 3).to(dtype) if a.numel() else torch.zeros(a.shape, dtype=dtype)
        a.grad, b.grad = g.clone(), g.clone()
    return ours, theirs


@pytest.mark.parametrize("backend", ["torch", "interpret"])
@pytest.mark.parametrize("max_norm, norm_type", [(1.0, 2.0), (1e9, 2.0), (1.0, float("inf")), (0.5, 1.0)])
def test_same_total_and_clipped_grads_as_torch(monkeypatch, backend, max_norm, norm_type):
    if backend == "interpret" and not interpret_available():
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("FUSED_STABLE_BACKEND", backend)
    shapes = [(7,), (1025,), (3, 4), ()] + ([(0,)] if norm_type != float("inf") else [])  # torch: no inf norm of empty
    ours, theirs = pair(shapes)
    total = fused_stable.clip_grad_norm_(ours, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert_close(total, expected, 1e-6, 1e-6, "total norm")
    for a, b in zip(ours, theirs):
        assert_close(a.grad, b.grad, 1e-6, 1e-7, "clipped grad")


def mixed_pair(dtypes, scale=3.0):
    """Grads of odd sizes (one over a chunk of 65536), the dtypes taking turns; ours and torch's copies."""
    gen = torch.Generator().manual_seed(0)
    ours, theirs = [], []
    for index, shape in enumerate([(7,), (1025,), (3, 4), (), (0,), (70001,)]):
        dtype = dtypes[index % len(dtypes)]
        g = (torch.randn(shape, generator=gen) * scale).to(dtype)
        for side in (ours, theirs):
            side.append(torch.nn.Parameter(torch.zeros(shape, dtype=dtype)))
            side[-1].grad = g.clone()
    return ours, theirs


def interpreted(monkeypatch):
    if not interpret_available():
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("FUSED_STABLE_BACKEND", "interpret")


B16 = {"bf16": [torch.bfloat16], "fp16": [torch.float16]}


@pytest.mark.parametrize("name", B16)
def test_interpreted_kernels_clip_16_bit_grads_exactly_as_torch(monkeypatch, name):
    """Per-tensor norms in the grads' dtype, the total and the coefficient in it, one rounding per grad: torch's
    steps, so norm and clipped grads are equal bit for bit."""
    interpreted(monkeypatch)
    ours, theirs = mixed_pair(B16[name])
    total = fused_stable.clip_grad_norm_(ours, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert total.dtype == expected.dtype == B16[name][0] and torch.equal(total, expected)
    for a, b in zip(ours, theirs):
        assert torch.equal(a.grad, b.grad)


def test_interpreted_kernels_fp32_norm_is_closer_to_fp64_than_torchs(monkeypatch):
    """fp32: the kernels sum each chunk in fp32 in another order than torch's CPU norm (more accurately here), so
    the norm is compared with an fp64 reference, and the grads with torch's to the norm's difference."""
    interpreted(monkeypatch)
    ours, theirs = mixed_pair([torch.float32])
    exact = torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in theirs]))
    total = fused_stable.clip_grad_norm_(ours, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert total.dtype == torch.float32
    assert abs(total.double() - exact) <= abs(expected.double() - exact) and abs(total.double() - exact) < 1e-6 * exact
    for a, b in zip(ours, theirs):
        assert_close(a.grad, b.grad, 1e-6, 1e-9, "clipped fp32 grad")


@pytest.mark.parametrize("dtypes", [[torch.bfloat16, torch.float32], [torch.float16, torch.float32]], ids=["bf16+fp32", "fp16+fp32"])
def test_interpreted_kernels_mixed_dtypes_return_torchs_dtype(monkeypatch, dtypes):
    interpreted(monkeypatch)
    ours, theirs = mixed_pair(dtypes)
    total = fused_stable.clip_grad_norm_(ours, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert total.dtype == expected.dtype == torch.float32
    assert_close(total, expected, 1e-6, 0, "total norm")
    for a, b in zip(ours, theirs):  # one rounding of g * coef, with coefficients equal to within 1e-6
        rtol = {torch.float32: 1e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11}[a.dtype]
        assert_close(a.grad, b.grad, rtol, 0, f"clipped {a.dtype} grad")


def test_interpreted_kernels_fp16_norm_that_overflows_is_torchs(monkeypatch):
    """torch's per-tensor fp16 norm overflows to inf: the total is inf and the grads are zeroed, not scaled."""
    interpreted(monkeypatch)
    ours, theirs = mixed_pair([torch.float16], scale=3000.0)
    total = fused_stable.clip_grad_norm_(ours, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert total.dtype == torch.float16 and total.isinf() and expected.isinf()
    for a, b in zip(ours, theirs):
        assert torch.equal(a.grad, b.grad) and not a.grad.any()


@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_error_if_nonfinite_raises_before_any_grad_changes(monkeypatch, backend):
    if backend == "interpret":
        interpreted(monkeypatch)
    else:
        monkeypatch.setenv("FUSED_STABLE_BACKEND", "torch")
    ours, _ = pair([(5,), (1025,)])
    ours[0].grad[2] = float("nan")
    before = [p.grad.clone() for p in ours]
    with pytest.raises(RuntimeError, match="non-finite"):
        fused_stable.clip_grad_norm_(ours, 1.0, error_if_nonfinite=True)
    for a, b in zip(ours, before):
        assert torch.allclose(a.grad, b, rtol=0, atol=0, equal_nan=True)
    assert fused_stable.clip_grad_norm_(ours, 1.0).isnan()


def test_non_dense_grads_are_clipped_by_torch_on_any_backend(monkeypatch):
    interpreted(monkeypatch)
    ours, theirs = pair([(6, 8)])
    ours[0].grad = ours[0].grad.t().contiguous().t()  # dense, transposed: the kernels take it
    strided = torch.nn.Parameter(torch.zeros(6, 4))
    strided.grad = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))[:, ::2]  # not dense
    twin = torch.nn.Parameter(torch.zeros(6, 4))
    twin.grad = strided.grad.clone()
    total = fused_stable.clip_grad_norm_(ours + [strided], 1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs + [twin], 1.0)
    assert_close(total, expected, 1e-6, 0, "total norm")
    for a, b in zip(ours + [strided], theirs + [twin]):
        assert_close(a.grad, b.grad, 1e-6, 1e-9, "clipped grad")
