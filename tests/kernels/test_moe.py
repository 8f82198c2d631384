"""Fused MoE against its reference: every weight format, the sort-free decode path and both sorted paths,
ragged expert loads with idle experts, the shared expert riding along; `moe_align` against its reference."""

import pytest
import torch
import triton
import triton.language as tl
from kernel_marks import needs_gpu

from m3sdk_kernels import arch as kernel_arch
from m3sdk_kernels import experts as stack
from m3sdk_kernels import formats, moe, moe_align, mx_convert, reference
from m3sdk_kernels.arch import ARCHS, TILES

FP8 = ARCHS["sm90"].fp8_dtype
E, H, I, TOP_K = 9, 128, 128, 2  # 8 routed experts + the shared one (id 8)
ALPHA, LIMIT = 1.702, 7.0


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def weights(device):
    g = torch.Generator().manual_seed(0)
    w_gate_up = torch.randn(E, 2 * I, H, generator=g) * 0.08
    w_down = torch.randn(E, H, I, generator=g) * 0.08
    return w_gate_up.to(device), w_down.to(device)


def routing(t: int, seed: int, device: torch.device | str = "cpu"):
    """Ragged loads: experts 0..2 popular, 5 and 7 never picked; plus the shared column."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, E - 1, generator=g)
    bias = torch.tensor([2.0, 1.5, 1.0, 0.0, 0.0, -50.0, 0.0, -50.0])
    return reference.route_ref(logits.to(device), bias.to(device), TOP_K, routed_scale=2.0, shared=True)


def plain_moe(x, ids, w, w_gate_up, w_down):
    """The model's composition in fp32: sum_j w_j * expert_j(x), no quantization."""
    out = torch.zeros(x.shape[0], H, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j].item()
            gate, up = (x[t].float() @ w_gate_up[e].T).chunk(2)
            gate = gate.clamp(max=LIMIT)
            h = (up.clamp(-LIMIT, LIMIT) + 1) * gate * torch.sigmoid(ALPHA * gate)
            out[t] += w[t, j] * (h @ w_down[e].T)
    return out


@pytest.mark.parametrize("fmt", stack.FORMATS)
@pytest.mark.parametrize("t", [2, 24])  # sort-free decode path / sorted small-batch path
def test_fused_moe_matches_reference(weights, fmt, t, device):
    experts = stack.quantize_experts(*weights, fmt, FP8)
    w, ids = routing(t, seed=t, device=device)
    assert moe.moe_tiles(t, ARCHS["sm90"])[1] == (t > 2)
    assert not torch.isin(ids, torch.tensor([5, 7], device=device)).any()  # idle experts exist
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(7)).bfloat16().to(device)
    out = moe.fused_moe(x, ids, w, experts, ALPHA, LIMIT)
    ref = reference.fused_moe_ref(x, ids, w, experts, ALPHA, LIMIT, mx_fp8=moe.mx_fp8(fmt, t, ARCHS["sm90"]))
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert rel(out, ref) < 1.5e-2
    # the quantized formats against the unquantized composition: how much the format itself costs
    bound = {"bf16": 1.5e-2, "fp8": 6e-2, "mxfp8": 6e-2, "mxfp4": 0.25}[fmt]
    assert rel(ref, plain_moe(x, ids, w, *weights)) < bound


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_prefill_tiles(weights, fmt, monkeypatch, device):
    # the large-batch table (BLOCK_M 128) at a small token count
    monkeypatch.setitem(TILES["moe_small"]["sm90"], "MAX_TOKENS", 8)
    experts = stack.quantize_experts(*weights, fmt, FP8)
    w, ids = routing(40, seed=3, device=device)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(8)).bfloat16().to(device)
    assert moe.moe_tiles(40, ARCHS["sm90"])[0]["BLOCK_M"] == 128
    out = moe.fused_moe(x, ids, w, experts, ALPHA, LIMIT)
    ref = reference.fused_moe_ref(x, ids, w, experts, ALPHA, LIMIT, mx_fp8=moe.mx_fp8(fmt, 40, ARCHS["sm90"]),
                            h_row=moe.h_row(fmt, 40, ARCHS["sm90"]))
    assert rel(out, ref) < 1.5e-2


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_prefill_fused_gate_up_row_scaled_intermediate(weights, fmt, monkeypatch, device):
    # FUSED_GU (gate|up rows interleaved, one MMA), H_ROW (the fp8 intermediate quantized per row, bf16 before),
    # K tiles of 128 in the down GEMM; MXFP4 converted to fp8 experts once (MX_CONVERT) and inside the GEMMs
    monkeypatch.setitem(TILES["moe_small"]["sm90"], "MAX_TOKENS", 8)
    for key, value in dict(FUSED_GU=1, H_ROW=1, GU_BLOCK_K=128, DN_BLOCK_K=128).items():
        monkeypatch.setitem(TILES["moe_prefill:fp8"]["sm90"], key, value)
    experts = stack.quantize_experts(*weights, fmt, FP8)
    w, ids = routing(40, seed=4, device=device)
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(8)).bfloat16().to(device)
    arch = ARCHS["sm90"]
    assert moe.h_row(fmt, 40, arch) and not moe.h_row("bf16", 40, arch) and not moe.h_row(fmt, 2, arch)
    ref = reference.fused_moe_ref(x, ids, w, experts, ALPHA, LIMIT, mx_fp8=moe.mx_fp8(fmt, 40, arch), h_row=True)
    for convert in (0, 1) if fmt == "mxfp4" else (0,):
        monkeypatch.setitem(TILES["moe_prefill:fp8"]["sm90"], "MX_CONVERT", convert)
        assert rel(moe.fused_moe(x, ids, w, experts, ALPHA, LIMIT), ref) < 8e-3
    # per row vs per 64 columns: both within fp8 rounding of each other
    per64 = reference.fused_moe_ref(x, ids, w, experts, ALPHA, LIMIT, mx_fp8=moe.mx_fp8(fmt, 40, arch))
    assert rel(ref, per64) < 4e-2


def test_mx_to_fp8_matches_the_fp8_path(wide_weights, device):
    # the once-per-step conversion, from either layout, gives exactly the values the in-GEMM conversion multiplies
    experts = stack.quantize_experts(*wide_weights, "mxfp4")
    experts.gate_up_scale[0, :3, :4] -= 12  # groups under the flush threshold (11 octaves), some just above
    experts.gate_up_scale[1, :2, 2:5] -= 40
    want = stack.dequantize_experts(experts, mx_fp8=True)
    for source in (experts, stack.to_planes(experts)):
        fp8 = mx_convert.mx_to_fp8(source)
        assert fp8.fmt == "fp8" and fp8.gate_up.dtype == torch.float8_e4m3fn
        for a, b in zip(want, stack.dequantize_experts(fp8), strict=True):
            assert torch.equal(a, b)


@pytest.fixture(scope="module")
def wide_weights(device):
    # the planes layout tiles K by 256
    g = torch.Generator().manual_seed(5)
    return tuple((torch.randn(E, n, k, generator=g) * 0.08).to(device) for n, k in ((512, 256), (256, 256)))


def test_planes_layout_holds_the_same_values(wide_weights, device):
    experts = stack.quantize_experts(*wide_weights, "mxfp4")
    experts.gate_up_scale[1, :2, :3] -= 30  # groups past the 28-octave flush
    planes = stack.to_planes(experts)
    assert planes.planes and planes.gate_up.dtype == torch.int32 and planes.w_fmt == 4
    flush = formats.PLANE_FLUSH
    for w, s, got in ((experts.gate_up, experts.gate_up_scale, stack.dequantize_experts(planes)[0]),
                      (experts.down, experts.down_scale, stack.dequantize_experts(planes)[1])):
        want = formats.dequantize_mxfp4(w, s)
        s32 = s.to(torch.int32)
        gone = (s32 < s32.amax(-1, keepdim=True) - flush).repeat_interleave(32, -1)
        assert (got[gone] == 0).all() and (gone.any() or w is experts.down)
        # exact where the fp16 product is normal; else within fp16's subnormal step times the row scale
        assert torch.allclose(got[~gone], want[~gone], rtol=0, atol=float(want.abs().max()) * 2.0**-20)


@pytest.mark.parametrize("t, swap, xperm", [(2, 1, 0), (2, 0, 1), (24, 1, 1)])
def test_planes_fused_moe(wide_weights, t, swap, xperm, monkeypatch, device):
    # SWAP: weight rows as the MMA's M; XPERM: activations handed over in the planes column order
    for fam in ("moe_decode:planes", "moe_small:planes"):
        monkeypatch.setitem(TILES[fam]["sm90"], "PLANES_SWAP", swap)
        monkeypatch.setitem(TILES[fam]["sm90"], "PLANES_XPERM", xperm)
    experts = stack.to_planes(stack.quantize_experts(*wide_weights, "mxfp4"))
    w, ids = routing(t, seed=t + 2, device=device)
    x = torch.randn(t, 256, generator=torch.Generator().manual_seed(6)).bfloat16().to(device)
    out = moe.fused_moe(x, ids, w, experts, ALPHA, LIMIT)
    ref = reference.fused_moe_ref(x, ids, w, experts, ALPHA, LIMIT)
    assert rel(out, ref) < 8e-3
    checkpoint = reference.fused_moe_ref(x, ids, w, stack.quantize_experts(*wide_weights, "mxfp4"), ALPHA, LIMIT)
    assert rel(ref, checkpoint) < 8e-3  # fp16 activations instead of bf16: rounding only


@pytest.mark.parametrize("convert", [0, 1])
def test_planes_prefill(wide_weights, convert, monkeypatch, device):
    # planes at prefill: their own fp16 GEMMs, or (MX_CONVERT) converted to fp8 experts once
    monkeypatch.setitem(TILES["moe_small"]["sm90"], "MAX_TOKENS", 8)
    monkeypatch.setitem(TILES["moe_prefill:fp8"]["sm90"], "MX_CONVERT", convert)
    arch = ARCHS["sm90"]
    assert moe.mx_fp8("mxfp4", 40, arch, planes=True) == bool(convert) and moe.mx_fp8("mxfp4", 40, arch)
    experts = stack.to_planes(stack.quantize_experts(*wide_weights, "mxfp4"))
    w, ids = routing(40, seed=5, device=device)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(6)).bfloat16().to(device)
    ref = reference.fused_moe_ref(x, ids, w, experts, ALPHA, LIMIT, mx_fp8=bool(convert),
                            h_row=moe.h_row("mxfp4", 40, arch, planes=True))
    assert rel(moe.fused_moe(x, ids, w, experts, ALPHA, LIMIT), ref) < 8e-3


@pytest.mark.parametrize("t", [2, 24])
def test_mxfp4_both_paths(weights, t, monkeypatch, device):
    # MX_FP8 on: MXFP4 through the fp8 tensor cores (sm90's prefill table); off: tl.dot_scaled (bf16 activations).
    # Each path against its own reference, and the two references within fp8 activation rounding of each other.
    experts = stack.quantize_experts(*weights, "mxfp4", FP8)
    w, ids = routing(t, seed=t + 1, device=device)
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(9)).bfloat16().to(device)
    assert moe.mx_fp8("mxfp4", 4096, ARCHS["sm90"]) and not moe.mx_fp8("mxfp4", 4096, ARCHS["gfx950"])
    for fam in ("moe_decode", "moe_small"):
        monkeypatch.setitem(TILES[fam]["sm90"], "MX_FP8", 1)
    ref8 = reference.fused_moe_ref(x, ids, w, experts, ALPHA, LIMIT, mx_fp8=True)
    assert rel(moe.fused_moe(x, ids, w, experts, ALPHA, LIMIT), ref8) < 8e-3
    for fam in ("moe_decode", "moe_small"):
        monkeypatch.setitem(TILES[fam]["sm90"], "MX_FP8", 0)
    ref16 = reference.fused_moe_ref(x, ids, w, experts, ALPHA, LIMIT)
    assert rel(moe.fused_moe(x, ids, w, experts, ALPHA, LIMIT), ref16) < 8e-3
    assert rel(ref8, ref16) < 6e-2


@triton.jit
def _convert_kernel(w_ptr, s_ptr, out_ptr, K: tl.constexpr, N: tl.constexpr):
    # moe's MXFP4 -> e4m3 conversion times the row factor, as float32: what the fp8 path's dots multiply
    rows = tl.arange(0, N)
    ref = mx_convert.mx_row_ref(s_ptr, rows, K, K // 32, N)
    w = mx_convert.mxfp4_e4m3_tile(w_ptr, s_ptr, rows, ref, 0, K // 2, K // 32, K).to(tl.float32)
    tl.store(out_ptr + rows[None, :] * K + tl.arange(0, K)[:, None], w * mx_convert.mx_row_scale(ref)[None, :])


def test_mxfp4_to_e4m3_is_exact_within_range(device):
    # every E2M1 code under group scales spread 0..14 octaves below the row's largest: values within 11 octaves
    # convert exactly, those further below flush to zero (`mx_fp8_flush`), nothing else changes
    n, k = 16, 32 * 16
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    codes[:, :16] = torch.arange(16, dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    top = torch.randint(100, 140, (n, 1), generator=g)
    scales = (top - torch.arange(16)[None, :] % 15).to(torch.uint8)  # 0..14 octaves below the row's top
    packed, scales = packed.to(device), scales.to(device)
    out = torch.empty(n, k, device=device)
    _convert_kernel[(1,)](packed, scales, out, K=k, N=n)
    want = formats.dequantize_mxfp4(packed, scales)
    flush = stack.mx_fp8_flush(scales).repeat_interleave(32, -1)
    assert flush.any() and (~flush).any()
    assert torch.equal(out[~flush], want[~flush])
    assert (out[flush] == 0).all()


@pytest.mark.parametrize("block_m", [4, 16])
def test_moe_align(block_m, device):
    torch.manual_seed(block_m)
    ids = torch.randint(0, 6, (37, 3), dtype=torch.int32)  # experts 6..9 of 10 get nothing
    ids[:, 0] = 2  # one expert with a long run
    ids = ids.to(device)
    n = ids.numel()
    pairs, block_expert, num_padded = moe_align.moe_align(ids, 10, block_m)
    ref_pairs, ref_blocks, ref_padded = reference.moe_align_ref(ids, 10, block_m)
    assert num_padded.item() == ref_padded and ref_padded % block_m == 0
    used = pairs[:ref_padded]
    nblocks = ref_padded // block_m
    assert torch.equal(block_expert[:nblocks], ref_blocks)
    # each block: its valid pairs all routed to its expert; every pair exactly once; the rest is the sentinel
    flat = ids.reshape(-1)
    for b in range(nblocks):
        rows = used[b * block_m : (b + 1) * block_m]
        valid = rows[rows < n].long()
        assert (flat[valid] == block_expert[b]).all()
    assert torch.equal(used[used < n].sort().values, torch.arange(n, dtype=torch.int32, device=device))
    assert (pairs[ref_padded:] == n).all()
    # each expert's run holds the reference's pairs (their order inside the run follows the atomics)
    for e in range(10):
        run, ref_run = used.view(-1, block_m)[block_expert[:nblocks] == e], ref_pairs.view(-1, block_m)[ref_blocks == e]
        assert torch.equal(run.flatten().sort().values, ref_run.flatten().sort().values), e


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_empty_experts_filled_from_checkpoint_tensors(weights, fmt, device):
    # per-expert gate (w1), up (w3), down (w2) as an MX checkpoint stores them, copied into the storage as the
    # loader does (bytes, no requantization): the same stack as quantizing the whole stack at once (torch, CPU)
    w_gate_up, w_down = (w.cpu() for w in weights)
    quantize = formats.quantize_mxfp4 if fmt == "mxfp4" else formats.quantize_mxfp8
    got = stack.empty_experts(fmt, E, H, I)
    for e in range(E):
        for rows, m in ((slice(0, I), w_gate_up[e, :I]), (slice(I, 2 * I), w_gate_up[e, I:])):
            got.gate_up[e, rows], got.gate_up_scale[e, rows] = quantize(m)
        got.down[e], got.down_scale[e] = quantize(w_down[e])
    want = stack.quantize_experts(w_gate_up, w_down, fmt)
    for a, b in zip((got.gate_up, got.gate_up_scale, got.down, got.down_scale),
                    (want.gate_up, want.gate_up_scale, want.down, want.down_scale), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.gpu
@needs_gpu
def test_gpu_quantized_moe_serves_the_planes_layout():
    # the engine's path on an sm90 GPU: MXFP4 experts rearranged once after loading (quantize_model ->
    # QuantizedMoE.serve_layout), then decode (sort-free, sorted) and prefill through them, against the reference on
    # the checkpoint layout
    from m3sdk.model.layers import SparseMoE
    from m3sdk.model.quantize import QuantizedMoE

    torch.manual_seed(0)
    sparse = SparseMoE(512, 16, 256, 256, 4, 2.0, ALPHA, LIMIT, torch.bfloat16).cuda()
    for p in sparse.parameters():
        torch.nn.init.normal_(p, std=0.05)
    layer = QuantizedMoE.quantize(sparse, "mxfp4")
    stored = layer.experts
    layer.serve_layout()
    assert layer.experts.planes == (kernel_arch.current_arch().name == "sm90")
    for t in (1, 24, 300):
        x = torch.randn(t, 512, device="cuda", dtype=torch.bfloat16)
        logits = torch.nn.functional.linear(x.float(), layer.router_weight)
        w, ids = reference.route_ref(logits, layer.e_score_correction_bias, 4, 2.0, shared=True)
        arch, planes = kernel_arch.current_arch(), layer.experts.planes
        ref = reference.fused_moe_ref(x, ids, w, stored, ALPHA, LIMIT, mx_fp8=moe.mx_fp8("mxfp4", t, arch, planes),
                                h_row=moe.h_row("mxfp4", t, arch, planes))
        assert rel(layer(x), ref) < 1e-2, t  # the planes' fp16 activations against bf16 ones at decode
