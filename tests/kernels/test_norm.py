"""Fused residual add + Gemma RMSNorm (+ FP8 output) against its reference and against the model's norm."""

import pytest
import torch

from m3sdk_kernels import norm, reference
from m3sdk_kernels.arch import ARCHS

FP8 = ARCHS["sm90"].fp8_dtype


def gemma_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' MiniMaxM3VLRMSNorm, written out."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(x.dtype)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_add_rms_norm(residual, fp8, device):
    torch.manual_seed(0)
    t, h, eps = 5, 600, 1e-6  # a width that is not a power of two
    x = torch.randn(t, h).bfloat16().to(device) * 3
    r = torch.randn(t, h).bfloat16().to(device) if residual else None
    w = (torch.randn(h) * 0.2).bfloat16().to(device)
    y, s, new_r = norm.add_rms_norm(x, w, eps, r, FP8 if fp8 else None)
    yr, sr, new_rr = reference.add_rms_norm_ref(x, w, eps, r, FP8 if fp8 else None)
    summed = x if r is None else (x.float() + r.float()).to(x.dtype)
    # the interpreter rounds bf16 by truncation: one bf16 ulp apart at most
    torch.testing.assert_close(new_r, summed, rtol=2**-7, atol=0)
    torch.testing.assert_close(new_rr, summed, rtol=0, atol=0)
    if fp8:
        assert s.shape == (t,) and y.dtype == FP8
        torch.testing.assert_close(s, sr, rtol=1e-2, atol=0)
        deq, deq_ref = y.float() * s[:, None], yr.float() * sr[:, None]
        assert ((deq - deq_ref).norm() / deq_ref.norm()) < 2e-2
        torch.testing.assert_close(deq_ref, gemma_norm(summed, w, eps).float(), rtol=0.07, atol=0.02)
    else:
        assert s is None
        torch.testing.assert_close(y, yr, rtol=2**-6, atol=1e-2)
        torch.testing.assert_close(yr, gemma_norm(summed, w, eps), rtol=0, atol=0)
