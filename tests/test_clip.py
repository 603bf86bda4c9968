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


def test_interpreted_kernels_clip_bf16_grads_like_torch(monkeypatch):
    if not interpret_available():
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("FUSED_STABLE_BACKEND", "interpret")
    ours, theirs = pair([(33,), (1025,)], torch.bfloat16)
    total = fused_stable.clip_grad_norm_(ours, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert total.dtype == expected.dtype == torch.bfloat16
    assert_close(total, expected, 1e-2, 0, "total norm")
    for a, b in zip(ours, theirs):
        assert_close(a.grad, b.grad, 1e-2, 1e-3, "clipped bf16 grad")


def test_error_if_nonfinite(monkeypatch):
    monkeypatch.setenv("FUSED_STABLE_BACKEND", "interpret" if interpret_available() else "torch")
    ours, _ = pair([(5,)])
    ours[0].grad[2] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        fused_stable.clip_grad_norm_(ours, 1.0, error_if_nonfinite=True)
    assert fused_stable.clip_grad_norm_(ours, 1.0).isnan()
