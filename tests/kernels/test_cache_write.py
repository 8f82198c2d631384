"""Triton cache writes against the references: K/V (FP8 per-token-head scales, both layouts), index keys, and
the fused norm + RoPE + write of the attention block against the composition of its plain parts."""

import pytest
import torch
from attn_cases import DTYPES, poisoned
from kernel_marks import kv_dtypes

from m3sdk_kernels import cache_write as cw
from m3sdk_kernels import reference
from m3sdk_kernels.layout import cache_shape
from m3sdk_kernels.reference import gather_kv_ref

PAGES, HKV, D = 5, 2, 32
# ragged token slots over scattered pages, page edges, and one padding token (slot -1) that must not be written
SLOTS = torch.tensor([3, 15, 16, -1, 47, 48, 79, 33])


def caches(kv_dtype: str, layout: str, index_dtype: str = "bf16", device: torch.device | str = "cpu", d: int = D,
           index_dim: int = D):
    dtype = DTYPES[kv_dtype]
    fp8 = dtype.itemsize == 1
    return {"k_cache": poisoned(cache_shape("k", layout, PAGES, HKV, d, dtype), dtype, device),
            "v_cache": poisoned(cache_shape("v", layout, PAGES, HKV, d, dtype), dtype, device),
            "k_scale": poisoned((PAGES, HKV, 16), torch.float32, device) if fp8 else None,
            "v_scale": poisoned((PAGES, HKV, 16), torch.float32, device) if fp8 else None,
            "index_cache": poisoned((PAGES, 16, index_dim), DTYPES[index_dtype], device)}


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None:
        return b is None
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("layout", ["plain", "shuffle"])
@pytest.mark.parametrize("kv_dtype", kv_dtypes("bf16", "fp8", "fp8nuz", "fp32"))
def test_write_kv_is_bit_exact(kv_dtype, layout, device):
    """fp32 inputs (a float32 model): every cache type rounds them like torch's cast, bf16 included."""
    k = torch.randn(len(SLOTS), HKV, D, device=device) * 3
    v = torch.randn(len(SLOTS), HKV, D, device=device)
    k[2, 1] = 0  # an all-zero row: finite scale, zero values
    got, ref = caches(kv_dtype, layout, device=device), caches(kv_dtype, layout, device=device)
    slots = SLOTS.to(device)
    cw.write_kv(k, v, got["k_cache"], got["v_cache"], slots, got["k_scale"], got["v_scale"], layout)
    reference.write_kv_ref(k, v, ref["k_cache"], ref["v_cache"], slots, ref["k_scale"], ref["v_scale"], layout)
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        assert same_bits(got[name], ref[name]), name


@pytest.mark.parametrize("index_dtype", kv_dtypes("bf16", "fp8", "fp8nuz"))
def test_write_index_key_rounds_like_torch(index_dtype, device):
    """Magnitudes from fp8 subnormals to near the max: the kernel's own fp8 / bf16 rounding equals torch's cast.
    Index keys are RMS-normalized, so the cast never sees values past the type's max (e4m3fnuz: 240): kept so."""
    ik = (torch.randn(len(SLOTS), D) * torch.logspace(-4, 2, D)).clamp(-230, 230).to(device)
    got, ref = (caches("bf16", "plain", index_dtype, device)["index_cache"] for _ in range(2))
    cw.write_index_key(ik, got, SLOTS.to(device))
    reference.write_index_key_ref(ik, ref, SLOTS.to(device))
    assert same_bits(got, ref)


@pytest.mark.parametrize("layout", ["plain", "shuffle"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_fused_norm_rope_write_matches_composition(sparse, kv_dtype, layout, device):
    norm_rope_write_matches(sparse, kv_dtype, layout, device, D, D, 16)


@pytest.mark.parametrize(("d", "index_dim", "rot", "kv_dtype", "layout"), [
    (40, 24, 20, "fp8", "plain"), (72, 24, 20, "bf16", "shuffle"), (96, 48, 36, "fp8", "plain"),
    (40, 40, 40, "bf16", "plain")], ids=["d40-i24-r20", "d72-i24-r20-shuffle", "d96-i48-r36", "d40-full-rotary"])
def test_fused_norm_rope_write_odd_widths(d, index_dim, rot, kv_dtype, layout, device):
    """Head, index and rotary widths that are not powers of two (index_head_dim 24 stopped an engine at its first
    request): padded lanes masked, the cache slots past a head's width untouched."""
    norm_rope_write_matches(True, kv_dtype, layout, device, d, index_dim, rot)


def norm_rope_write_matches(sparse: bool, kv_dtype: str, layout: str, device, d: int, index_dim: int, rot: int):
    t, hq, hidx = len(SLOTS), 8, 2
    slots = SLOTS.to(device)
    sizes = [hq * d, HKV * d, HKV * d] + ([hidx * index_dim, index_dim] if sparse else [])
    packed = (torch.randn(t, sum(sizes)) * 2).to(device, torch.bfloat16)  # one projection's output: strided views
    parts = packed.split(sizes, -1)
    q, k, v = parts[0].view(t, hq, d), parts[1].view(t, HKV, d), parts[2].view(t, HKV, d)
    iq, ik = (parts[3].view(t, hidx, index_dim), parts[4]) if sparse else (None, None)
    w = [(torch.randn(n) * 0.1).to(device, torch.bfloat16) for n in (d, d, index_dim, index_dim)]
    pos = torch.tensor([0, 7, 100, 5000, 17, 3, 65000, 9])
    freqs = pos.float()[:, None] / (5e6 ** (torch.arange(0, rot, 2).float() / rot))
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)
    out = {}
    for name, fn in (("got", cw.norm_rope_write), ("ref", reference.norm_rope_write_ref)):
        c = caches(kv_dtype, layout, "fp8", device, d, index_dim)
        qo, iqo = fn(q, k, v, w[0], w[1], cos, sin, 1e-6, c["k_cache"], c["v_cache"], slots, c["k_scale"],
                     c["v_scale"], layout, iq, ik, w[2], w[3], c["index_cache"] if sparse else None)
        out[name] = (qo, iqo, c)
    (qg, iqg, cg), (qr, iqr, cr) = out["got"], out["ref"]
    # one bf16 rounding step apart at most (rsqrt vs 1/sqrt)
    torch.testing.assert_close(qg.float(), qr.float(), atol=0.06, rtol=1e-2)
    if sparse:
        torch.testing.assert_close(iqg.float(), iqr.float(), atol=0.06, rtol=1e-2)
        ok = cr["index_cache"].float()
        torch.testing.assert_close(cg["index_cache"].float(), ok, atol=0.01, rtol=0.13, equal_nan=True)  # fp8 step
    else:
        assert cg["index_cache"].float().isnan().all()
    pages = torch.arange(PAGES, device=device)
    kg, vg = gather_kv_ref(cg["k_cache"], cg["v_cache"], pages, PAGES * 16, layout, cg["k_scale"], cg["v_scale"])
    kr, vr = gather_kv_ref(cr["k_cache"], cr["v_cache"], pages, PAGES * 16, layout, cr["k_scale"], cr["v_scale"])
    written = torch.zeros(PAGES * 16, dtype=torch.bool, device=device)
    written[slots[slots >= 0]] = True
    assert kg[:, ~written].isnan().all() and vg[:, ~written].isnan().all()  # nothing else touched
    # K: the fp8 grid step (1/8 relative) of one tiny upstream difference at most; V: exact
    torch.testing.assert_close(kg[:, written], kr[:, written], atol=0.06, rtol=0.13)
    torch.testing.assert_close(vg[:, written], vr[:, written], atol=0, rtol=0)


@pytest.mark.parametrize("d", [40, 72])
def test_write_kv_and_index_key_odd_widths(d, device):
    """write_kv / write_index_key at head width d and index width 24: bit-exact, nothing past a head written."""
    k, v = (torch.randn(len(SLOTS), HKV, d, device=device) for _ in range(2))
    ik = torch.randn(len(SLOTS), 24, device=device)
    slots = SLOTS.to(device)
    got, ref = (caches("fp8", "plain", "fp8", device, d, 24) for _ in range(2))
    cw.write_kv(k, v, got["k_cache"], got["v_cache"], slots, got["k_scale"], got["v_scale"])
    reference.write_kv_ref(k, v, ref["k_cache"], ref["v_cache"], slots, ref["k_scale"], ref["v_scale"])
    cw.write_index_key(ik, got["index_cache"], slots)
    reference.write_index_key_ref(ik, ref["index_cache"], slots)
    for name in ("k_cache", "v_cache", "k_scale", "v_scale", "index_cache"):
        assert same_bits(got[name], ref[name]), name


def test_gather_kv_matches_reference(device):
    from m3sdk_kernels.layout import gather_kv

    c = caches("fp8", "shuffle", device=device)
    k = torch.randn(len(SLOTS), HKV, D).to(device, torch.bfloat16)
    cw.write_kv(k, k, c["k_cache"], c["v_cache"], SLOTS.to(device), c["k_scale"], c["v_scale"], "shuffle")
    pages = torch.tensor([0, 2, 1], dtype=torch.int32, device=device)
    got = gather_kv(c["k_cache"], c["v_cache"], pages, 40, "shuffle", c["k_scale"], c["v_scale"])
    ref = gather_kv_ref(c["k_cache"], c["v_cache"], pages, 40, "shuffle", c["k_scale"], c["v_scale"])
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, equal_nan=True, atol=0, rtol=0)
