"""Cache writes: store each new token's K, V (optionally FP8 with per-token, per-head scales) and index key."""

import torch
import triton
import triton.language as tl

from .arch import Arch, tiles
from .layout import PAGE, dim_tile, shuffle_width, slot_offsets

# ---------------------------------------------------------------------------------------------- Triton kernels


@triton.jit
def _exact_cast(x, ty: tl.constexpr):
    """x (fp32) cast to `ty`, rounded to nearest even in fp32 first (on the e4m3 grid of that type for FP8, on
    bf16's for bf16), so the cast itself is exact: Triton's interpreter rounds fp32 -> fp8 wrongly and truncates
    fp32 -> bf16, and the same integer trick costs nothing next to the store on a GPU."""
    if ty.is_fp8():
        min_exp: tl.constexpr = -7 if ty == tl.float8e4b8 else -6  # smallest normal exponent: fnuz vs fn
        e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        step = tl.maximum(e, min_exp) - 3  # 3 mantissa bits; below the normals the spacing stays 2^(min-3)
        magic = (((step + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2^(step + 23)
        rounded = ((tl.abs(x) + magic) - magic).to(ty)
        # the sign as a bit of the sign-magnitude byte: tiny negatives round to -0 as in torch (a negated float 0
        # lost its sign in the compiled cast); fnuz has no -0 (0x80 is its NaN), so its zeros stay positive
        if ty == tl.float8e4b8:
            neg = (x < 0) & (rounded.to(tl.uint8, bitcast=True) != 0)
        else:
            neg = x < 0
        out = (rounded.to(tl.uint8, bitcast=True) | tl.where(neg, 0x80, 0).to(tl.uint8)).to(ty, bitcast=True)
    elif ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16  # ties to the even upper half
        out = bits.to(tl.float32, bitcast=True).to(ty)
    else:
        out = x.to(ty)
    return out


@triton.jit
def _quantize_store(x, cache_ptr, scale_ptr, page, off, d, head, stride_cp, stride_ch, stride_sp, stride_sh,
                    HEAD_DIM: tl.constexpr, X: tl.constexpr, SHUFFLE: tl.constexpr, IS_V: tl.constexpr,
                    FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """Store one token's head vector x (fp32 [D_PAD], zero past HEAD_DIM); FP8 with its per-token, per-head
    scale."""
    if FP8:
        scale = tl.maximum(tl.max(tl.abs(x)), 1e-12) / FP8_MAX
        x = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(scale_ptr + page * stride_sp + head * stride_sh + off, scale)
    dst = cache_ptr + page * stride_cp + head * stride_ch + slot_offsets(off, d, HEAD_DIM, X, SHUFFLE, IS_V)
    tl.store(dst, _exact_cast(x, cache_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache, v_cache, k_scale, v_scale, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cp, stride_ch, stride_sp, stride_sh,
                     HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, X: tl.constexpr, SHUFFLE: tl.constexpr,
                     FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # t x a token row stride passes 2**31 in a step of ~218K tokens
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:  # negative slots are padding rows (e.g. a CUDA graph's spare tokens)
        page, off = (slot // PAGE).to(tl.int64), slot % PAGE
        d = tl.arange(0, D_PAD)
        k = tl.load(k_ptr + t * stride_kt + head * stride_kh + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + head * stride_vh + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        _quantize_store(k, k_cache, k_scale, page, off, d, head, stride_cp, stride_ch, stride_sp, stride_sh,
                        HEAD_DIM, X, SHUFFLE, False, FP8, FP8_MAX)
        _quantize_store(v, v_cache, v_scale, page, off, d, head, stride_cp, stride_ch, stride_sp, stride_sh,
                        HEAD_DIM, X, SHUFFLE, True, FP8, FP8_MAX)


@triton.jit
def _write_index_key_kernel(ik_ptr, cache_ptr, slot_ptr, stride_t, stride_cp, INDEX_DIM: tl.constexpr,
                            DI_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        d = tl.arange(0, DI_PAD)
        x = tl.load(ik_ptr + t * stride_t + d, mask=d < INDEX_DIM, other=0.0).to(tl.float32)
        dst = cache_ptr + (slot // PAGE).to(tl.int64) * stride_cp + (slot % PAGE) * INDEX_DIM + d
        tl.store(dst, _exact_cast(x, cache_ptr.dtype.element_ty), mask=d < INDEX_DIM)


def _kv_args(k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> tuple:
    """Cache strides + scale strides; FP8 iff scales are given (the scale pointers are unread otherwise)."""
    fp8 = k_scale is not None
    s = k_scale if fp8 else k_cache
    return (k_cache.stride(0), k_cache.stride(1), s.stride(0), s.stride(1)), fp8


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None, layout: str = "plain") -> None:
    """Triton `write_kv_ref`: quantize (FP8 caches) and store k, v [T, kv_heads, head_dim]; slots < 0 skip."""
    t, heads, head_dim = k.shape
    if t == 0:
        return
    strides, fp8 = _kv_args(k_cache, k_scale)
    _write_kv_kernel[(t, heads)](
        k, v, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *strides,
        HEAD_DIM=head_dim, D_PAD=dim_tile(head_dim), X=shuffle_width(k_cache.dtype), SHUFFLE=layout == "shuffle",
        FP8=fp8, FP8_MAX=torch.finfo(k_cache.dtype).max if fp8 else 1.0, **_launch())


def write_index_key(index_k: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton `write_index_key_ref`: store index keys [T, index_dim] (fp8 caches: a direct cast)."""
    if index_k.shape[0] == 0:
        return
    _write_index_key_kernel[(index_k.shape[0],)](
        index_k, index_cache, slot_mapping, index_k.stride(0), index_cache.stride(0),
        INDEX_DIM=index_k.shape[-1], DI_PAD=dim_tile(index_k.shape[-1]), **_launch())


@triton.jit
def _norm_rope(ptr, w_ptr, cos_ptr, sin_ptr, eps, DIM: tl.constexpr, PAD: tl.constexpr, HALF: tl.constexpr):
    """Gemma RMSNorm + partial NeoX RoPE of the DIM-vector at `ptr`, as fp32 values rounded the way the
    composition of the two ops rounds (to the input dtype after the norm); PAD (a power of two) lanes, 0 past DIM."""
    d = tl.arange(0, PAD)
    ok = d < DIM
    # rotate-half partner of each rotated dim; loading x twice is cheaper than shuffling registers
    rotated = d < 2 * HALF
    partner = tl.where(d < HALF, d + HALF, tl.where(rotated, d - HALF, d))
    x = tl.load(ptr + d, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf) / DIM + eps)
    y = _exact_cast(xf * inv_rms * (1.0 + tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)), x.dtype)
    y = y.to(tl.float32)
    xp = tl.load(ptr + partner, mask=ok, other=0.0).to(tl.float32)
    yp = _exact_cast(xp * inv_rms * (1.0 + tl.load(w_ptr + partner, mask=ok, other=0.0).to(tl.float32)), x.dtype)
    yp = yp.to(tl.float32)
    c = tl.load(cos_ptr + d % HALF, mask=rotated, other=1.0)
    s = tl.load(sin_ptr + d % HALF, mask=rotated, other=0.0)
    s = tl.where(d < HALF, -s, s)
    return _exact_cast(tl.where(rotated, y * c + yp * s, y), x.dtype).to(tl.float32)


@triton.jit
def _norm_rope_write_kernel(
        q_ptr, k_ptr, v_ptr, iq_ptr, ik_ptr, q_w, k_w, iq_w, ik_w, cos_ptr, sin_ptr, slot_ptr,
        q_out, iq_out, k_cache, v_cache, k_scale, v_scale, index_cache, eps,
        stride_qt, stride_kt, stride_vt, stride_iqt, stride_ikt, stride_ct,
        stride_cp, stride_ch, stride_sp, stride_sh, stride_ip,
        NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, NUM_IQ: tl.constexpr, HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr, INDEX_DIM: tl.constexpr, DI_PAD: tl.constexpr, HALF: tl.constexpr, X: tl.constexpr,
        SHUFFLE: tl.constexpr,
        FP8: tl.constexpr, FP8_MAX: tl.constexpr, HAS_INDEX: tl.constexpr):
    """One program per (token, head row); rows are the q heads, then the kv heads (k and v together: they share
    the slot), then the index-query heads, then the index key."""
    t = tl.program_id(0).to(tl.int64)  # t x a token row stride passes 2**31 in a step of ~218K tokens
    row = tl.program_id(1)
    cos_t = cos_ptr + t * stride_ct
    sin_t = sin_ptr + t * stride_ct
    if row < NUM_Q:
        y = _norm_rope(q_ptr + t * stride_qt + row * HEAD_DIM, q_w, cos_t, sin_t, eps, HEAD_DIM, D_PAD, HALF)
        d = tl.arange(0, D_PAD)
        tl.store(q_out + (t * NUM_Q + row) * HEAD_DIM + d, y.to(q_out.dtype.element_ty), mask=d < HEAD_DIM)
    elif row < NUM_Q + NUM_KV:
        head = row - NUM_Q
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            page, off = (slot // PAGE).to(tl.int64), slot % PAGE
            d = tl.arange(0, D_PAD)
            k = _norm_rope(k_ptr + t * stride_kt + head * HEAD_DIM, k_w, cos_t, sin_t, eps, HEAD_DIM, D_PAD, HALF)
            v = tl.load(v_ptr + t * stride_vt + head * HEAD_DIM + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
            _quantize_store(k, k_cache, k_scale, page, off, d, head, stride_cp, stride_ch, stride_sp,
                            stride_sh, HEAD_DIM, X, SHUFFLE, False, FP8, FP8_MAX)
            _quantize_store(v, v_cache, v_scale, page, off, d, head, stride_cp, stride_ch, stride_sp,
                            stride_sh, HEAD_DIM, X, SHUFFLE, True, FP8, FP8_MAX)
    elif HAS_INDEX:
        d = tl.arange(0, DI_PAD)
        if row < NUM_Q + NUM_KV + NUM_IQ:
            head = row - NUM_Q - NUM_KV
            y = _norm_rope(iq_ptr + t * stride_iqt + head * INDEX_DIM, iq_w, cos_t, sin_t, eps, INDEX_DIM, DI_PAD,
                           HALF)
            tl.store(iq_out + (t * NUM_IQ + head) * INDEX_DIM + d, y.to(iq_out.dtype.element_ty), mask=d < INDEX_DIM)
        else:
            slot = tl.load(slot_ptr + t)
            if slot >= 0:
                y = _norm_rope(ik_ptr + t * stride_ikt, ik_w, cos_t, sin_t, eps, INDEX_DIM, DI_PAD, HALF)
                dst = index_cache + (slot // PAGE).to(tl.int64) * stride_ip + (slot % PAGE) * INDEX_DIM + d
                tl.store(dst, _exact_cast(y, index_cache.dtype.element_ty), mask=d < INDEX_DIM)


def norm_rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_w: torch.Tensor,
                    k_norm_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    layout: str = "plain", index_q: torch.Tensor | None = None,
                    index_k: torch.Tensor | None = None, index_q_norm_w: torch.Tensor | None = None,
                    index_k_norm_w: torch.Tensor | None = None, index_cache: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton `norm_rope_write_ref` in one launch. q/k/v/index_q/index_k may be strided token rows (views of
    one packed projection); heads inside a row must be contiguous."""
    t, num_q, head_dim = q.shape
    q_out = torch.empty(t, num_q, head_dim, dtype=q.dtype, device=q.device)
    has_index = index_q is not None
    iq_out = torch.empty_like(index_q, memory_format=torch.contiguous_format) if has_index else None
    if t == 0:
        return q_out, iq_out
    for x in (q, k, v) + ((index_q, index_k) if has_index else ()):
        assert x.stride(-1) == 1 and (x.dim() == 2 or x.stride(-2) == x.shape[-1]), "heads must be contiguous"
    strides, fp8 = _kv_args(k_cache, k_scale)
    num_kv = k.shape[1]
    num_iq, index_dim = (index_q.shape[1], index_q.shape[2]) if has_index else (0, 16)
    rows = num_q + num_kv + (num_iq + 1 if has_index else 0)
    iq, ik = (index_q, index_k) if has_index else (q, q)  # unread placeholders on dense layers
    _norm_rope_write_kernel[(t, rows)](
        q, k, v, iq, ik, q_norm_w, k_norm_w, index_q_norm_w if has_index else q_norm_w,
        index_k_norm_w if has_index else q_norm_w, cos, sin, slot_mapping,
        q_out, iq_out if has_index else q_out, k_cache, v_cache,
        k_scale if fp8 else k_cache, v_scale if fp8 else v_cache, index_cache if has_index else k_cache, eps,
        q.stride(0), k.stride(0), v.stride(0), iq.stride(0), ik.stride(0), cos.stride(0), *strides,
        index_cache.stride(0) if has_index else 0,
        NUM_Q=num_q, NUM_KV=num_kv, NUM_IQ=num_iq, HEAD_DIM=head_dim, D_PAD=dim_tile(head_dim),
        INDEX_DIM=index_dim, DI_PAD=dim_tile(index_dim),
        HALF=cos.shape[-1], X=shuffle_width(k_cache.dtype), SHUFFLE=layout == "shuffle", FP8=fp8,
        FP8_MAX=torch.finfo(k_cache.dtype).max if fp8 else 1.0, HAS_INDEX=has_index, **_launch())
    return q_out, iq_out


def _launch() -> dict:
    return _launch_for(None)


def aot_variants(arch: Arch) -> list:
    """The cache-write kernels as launched on `arch` at M3's shapes (see m3sdk_kernels.aot)."""
    from .aot import M3_SHAPES, AotVariant

    m = M3_SHAPES
    fp8, fp8_max = arch.fp8_triton, arch.fp8_max
    other = "plain" if arch.kv_layout == "shuffle" else "shuffle"
    strides = ("stride_cp", "stride_ch", "stride_sp", "stride_sh")
    variants = []
    for kv, layout in (("fp8", arch.kv_layout), ("fp8", other), ("bf16", arch.kv_layout)):
        kv_type = fp8 if kv == "fp8" else "bf16"
        types = {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache": f"*{kv_type}", "v_cache": f"*{kv_type}",
                 "k_scale": "*fp32", "v_scale": "*fp32", "slot_ptr": "*i64"}
        types |= {name: "i32" for name in _write_kv_kernel.arg_names if name not in types}
        variants.append(AotVariant(
            name=f"cache_write.write_kv_{kv}_{layout}", kernel=_write_kv_kernel, types=types,
            constexprs={"HEAD_DIM": m["head_dim"], "D_PAD": dim_tile(m["head_dim"]), "X": 16 if kv == "fp8" else 8,
                        "SHUFFLE": layout == "shuffle",
                        "FP8": kv == "fp8", "FP8_MAX": fp8_max},
            aligned=("stride_kt", "stride_kh", "stride_vt", "stride_vh") + strides, **_launch_for(arch)))
    variants.append(AotVariant(
        name="cache_write.write_index_key_fp8", kernel=_write_index_key_kernel,
        types={"ik_ptr": "*bf16", "cache_ptr": f"*{fp8}", "slot_ptr": "*i64", "stride_t": "i32", "stride_cp": "i32"},
        constexprs={"INDEX_DIM": m["index_dim"], "DI_PAD": dim_tile(m["index_dim"])}, aligned=("stride_t", "stride_cp"),
        **_launch_for(arch)))
    # the sparse-layer fused step, FP8 KV and FP8 index keys in the platform's layout
    types = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "iq_ptr", "ik_ptr", "q_w", "k_w", "iq_w", "ik_w",
                                         "q_out", "iq_out")}
    types |= {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64", "k_cache": f"*{fp8}",
              "v_cache": f"*{fp8}", "k_scale": "*fp32", "v_scale": "*fp32", "index_cache": f"*{fp8}", "eps": "fp32"}
    types |= {name: "i32" for name in _norm_rope_write_kernel.arg_names if name not in types}
    variants.append(AotVariant(
        name=f"cache_write.norm_rope_write_fp8_{arch.kv_layout}", kernel=_norm_rope_write_kernel, types=types,
        constexprs={"NUM_Q": m["num_heads"], "NUM_KV": m["num_kv_heads"], "NUM_IQ": m["index_heads"],
                    "HEAD_DIM": m["head_dim"], "D_PAD": dim_tile(m["head_dim"]), "INDEX_DIM": m["index_dim"],
                    "DI_PAD": dim_tile(m["index_dim"]), "HALF": m["rotary_half"], "X": 16,
                    "SHUFFLE": arch.kv_layout == "shuffle", "FP8": True, "FP8_MAX": fp8_max, "HAS_INDEX": True},
        aligned=("stride_qt", "stride_kt", "stride_vt", "stride_iqt", "stride_ikt", "stride_ip") + strides,
        **_launch_for(arch)))
    return variants


def _launch_for(arch: Arch | None) -> dict:
    cfg = tiles("cache_write", arch)
    return {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
