"""The vision tower's q/k/v split + RoPE (`vision_rope.vision_qkv_rope`) against its reference, the reference
against the rotation written out, and the kernel's compiled builds for every target."""

import json
import os
import subprocess
import sys

import pytest
import torch

from m3sdk_kernels.reference import vision_qkv_rope_ref
from m3sdk_kernels.vision_rope import vision_qkv_rope


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' vision RoPE of x [P, H, D] with cos, sin [P, R]: rotate-half over the first R dims, fp32."""
    rot = cos.shape[-1]
    head, tail = x[..., :rot].float(), x[..., rot:].float()
    x1, x2 = head.chunk(2, dim=-1)
    c, s = cos.float()[:, None], sin.float()[:, None]
    return torch.cat([head * c + torch.cat([-x2, x1], dim=-1) * s, tail], dim=-1)


def inputs(p: int, heads: int, head_dim: int, rot: int, dtype: torch.dtype, device, padded: bool = False):
    g = torch.Generator().manual_seed(p * 31 + head_dim)
    width = 3 * heads * head_dim
    qkv = (torch.randn(p, width + (8 if padded else 0), generator=g) * 3).to(dtype).to(device)[:, :width]
    angles = torch.rand(p, rot // 2, generator=g) * 40  # cos / sin of real angles, both halves alike as the tower's
    angles = torch.cat([angles, angles], dim=-1)
    return qkv, angles.cos().to(device), angles.sin().to(device)


# (patches, heads, head_dim, rotated width): M3's 80 / 78, a power-of-two head rotated whole, one that leaves a tail;
# odd patch counts (1, 17, ~1000: tiles end mid-row-block)
SHAPES = [(1, 16, 80, 78), (17, 2, 80, 78), (1001, 3, 80, 78), (17, 4, 16, 16), (1000, 2, 16, 12), (5, 2, 20, 18)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p, heads, head_dim, rot", SHAPES)
def test_kernel_matches_reference(p, heads, head_dim, rot, dtype, device):
    qkv, cos, sin = inputs(p, heads, head_dim, rot, dtype, device, padded=p == 17)
    out = vision_qkv_rope(qkv, cos, sin, heads, head_dim)
    ref = vision_qkv_rope_ref(qkv, cos, sin, heads, head_dim)
    assert out.shape == ref.shape == (3, p, heads, head_dim) and out.dtype == ref.dtype == dtype
    assert out.is_contiguous()
    parts = qkv.reshape(p, 3, heads, head_dim)
    assert torch.equal(out[2], parts[:, 2]) and torch.equal(ref[2], parts[:, 2])  # v as it is
    assert torch.equal(out[:2, ..., rot:], parts[:, :2, :, rot:].transpose(0, 1))  # the unrotated tail too
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-5)
    else:  # the interpreter rounds fp32 -> bf16 by truncation: one bf16 ulp apart at most
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-6)
    for i in range(2):  # the reference is the rotation, rounded once
        torch.testing.assert_close(ref[i], rotate_half(parts[:, i], cos, sin).to(dtype), rtol=0, atol=0)


def test_rotation_is_not_the_identity(device):
    """The check above could not pass with q and k copied: rotated channels move by about their size."""
    qkv, cos, sin = inputs(33, 2, 80, 78, torch.float32, device)
    out = vision_qkv_rope(qkv, cos, sin, 2, 80)
    moved = (out[:2, ..., :78] - qkv.reshape(33, 3, 2, 80)[:, :2, :, :78].transpose(0, 1)).abs().mean()
    assert moved > 1.0


def test_zero_patches_and_bad_shapes(device):
    qkv, cos, sin = inputs(4, 2, 16, 16, torch.float32, device)
    assert vision_qkv_rope(qkv[:0], cos[:0], sin[:0], 2, 16).shape == (3, 0, 2, 16)
    with pytest.raises(ValueError, match="do not fit"):
        vision_qkv_rope(qkv, cos, sin, 3, 16)
    with pytest.raises(ValueError, match="do not fit"):
        vision_qkv_rope(qkv, cos[:, :15], sin[:, :15], 2, 16)  # an odd rotated width
    with pytest.raises(ValueError, match="unit last stride"):
        vision_qkv_rope(qkv, cos.t().contiguous().t(), sin, 2, 16)


def test_builds_compile_for_every_target():
    """The kernel's AOT variants (bf16, fp32 at M3's shapes) compile for sm90, gfx942 and gfx950 without spills,
    as `python -m m3sdk_kernels.aot` builds them."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for real, not interpret
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    code = ("import json; from m3sdk_kernels import aot; "
            "print(json.dumps([r for t in ('sm90', 'gfx942', 'gfx950') "
            "for r in aot.run(t, ['m3sdk_kernels.vision_rope'])]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.splitlines()[-1])
    targets = ("sm90", "gfx942", "gfx950")
    assert {(r["target"], r["name"]) for r in rows} == {(t, f"vision_rope.qkv_{d}") for t in targets
                                                       for d in ("bf16", "fp32")}
    for r in rows:
        assert r["ok"] and r["spill_bytes"] == 0 and r["registers"] > 0, r


@pytest.mark.gpu
def test_m3_shape_on_the_gpu_feeds_sdpa_without_copies():
    """One 1344 x 1344 image at M3's widths (9,216 patches, 16 heads of 80, 78 rotated), bf16, compiled: the
    reference's values, and the SDPA output of an image's q, k, v views is [P, H, D] in memory, so out_proj's
    [P, H * D] input is a view of it."""
    p, heads, head_dim, rot = 9216, 16, 80, 78
    qkv, cos, sin = inputs(p, heads, head_dim, rot, torch.bfloat16, "cuda")
    out = vision_qkv_rope(qkv, cos, sin, heads, head_dim)
    torch.testing.assert_close(out.float(), vision_qkv_rope_ref(qkv, cos, sin, heads, head_dim).float(),
                               rtol=2**-7, atol=1e-6)
    q, k, v = (t.transpose(0, 1)[None] for t in out)
    attn = torch.nn.functional.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1)
    assert attn.is_contiguous()
