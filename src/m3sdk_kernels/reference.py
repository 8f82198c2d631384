"""Plain-torch references of every kernel in this package, in one module: the numeric truth the kernels are tested
against and the path the engine takes where no kernel serves (a CPU, a shape `supports` turns down).

Each function is named after its kernel with a `_ref` suffix and takes the same arguments; they compute in
float32 and round where the kernels round. Torch only: no Triton here.
"""

from __future__ import annotations

import torch

from .experts import FP8_ACT_GROUP, Experts, dequantize_experts
from .formats import quantize_fp8_rows
from .layout import PAGE_SIZE, shuffle_width


def quantize_fp8_ref(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) symmetric FP8, the FP8 caches' and activations' rule: (fp8, float32 scale per row)."""
    return quantize_fp8_rows(x, fp8_dtype)


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, layout: str = "plain") -> None:
    """Store k, v [T, kv_heads, head_dim] at `slot_mapping` [T]. FP8 caches need both scale tensors.
    Tokens with a negative slot are padding and are not stored."""
    keep = slot_mapping >= 0
    k, v, slots = k[keep], v[keep], slot_mapping[keep].long()
    for x, cache, scale, kind in ((k, k_cache, k_scale, "k"), (v, v_cache, v_scale, "v")):
        if scale is not None:
            x, s = quantize_fp8_ref(x, cache.dtype)
            scale[slots // PAGE_SIZE, :, slots % PAGE_SIZE] = s
        store_tokens_ref(cache, x.to(cache.dtype), slots, kind, layout)


def write_index_key_ref(index_k: torch.Tensor, index_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store index keys [T, index_dim]; FP8 is a direct cast (unit scale: the key is RMS-normalized).
    Tokens with a negative slot are padding and are not stored."""
    keep = slot_mapping >= 0
    index_k, slots = index_k[keep], slot_mapping[keep].long()
    index_cache[slots // PAGE_SIZE, slots % PAGE_SIZE] = index_k.to(index_cache.dtype)


def gemma_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head Gemma RMSNorm over the last dim: normalize in fp32, scale by (1 + w), back to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial NeoX RoPE of x [T, H, D] with cos/sin [T, R/2]: the first R dims rotate (rotate-half pairs)."""
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half: 2 * half].float()
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    return torch.cat((rotated, x[..., 2 * half:]), dim=-1)


def vision_qkv_rope_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                        head_dim: int) -> torch.Tensor:
    """The vision tower's packed projection qkv [P, 3 * heads * head_dim] (q | k | v, head-major within each) ->
    [3, P, heads, head_dim], q and k rotated: rotate-half RoPE over the first R dims of each head with cos, sin
    [P, R] (R even, R <= head_dim), the last head_dim - R dims and v as they are. Math in fp32, one rounding."""
    p, rot = qkv.shape[0], cos.shape[-1]
    x = qkv.reshape(p, 3, heads, head_dim).transpose(0, 1)
    out = torch.empty((3, p, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    out.copy_(x)
    head = x[:2, ..., :rot].float()
    x1, x2 = head.chunk(2, dim=-1)
    c, s = cos.float()[None, :, None, :], sin.float()[None, :, None, :]
    out[:2, ..., :rot] = head * c + torch.cat((-x2, x1), dim=-1) * s
    return out


def norm_rope_write_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_w: torch.Tensor,
                        k_norm_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                        layout: str = "plain", index_q: torch.Tensor | None = None,
                        index_k: torch.Tensor | None = None, index_q_norm_w: torch.Tensor | None = None,
                        index_k_norm_w: torch.Tensor | None = None, index_cache: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention block's pre-attention step: per-head norm + partial RoPE of q, k (and of the index query
    and key on sparse layers), then the cache writes. Returns (q, index_q) ready for attention and selection.

    q [T, Hq, D], k/v [T, Hkv, D], index_q [T, Hidx, Di], index_k [T, Di]; cos/sin [T, R/2] float32."""
    q = rope_ref(gemma_rms_norm_ref(q, q_norm_w, eps), cos, sin)
    k = rope_ref(gemma_rms_norm_ref(k, k_norm_w, eps), cos, sin)
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, layout)
    if index_q is None:
        return q, None
    index_q = rope_ref(gemma_rms_norm_ref(index_q, index_q_norm_w, eps), cos, sin)
    index_k = rope_ref(gemma_rms_norm_ref(index_k[:, None], index_k_norm_w, eps), cos, sin)[:, 0]
    write_index_key_ref(index_k, index_cache, slot_mapping)
    return q, index_q


def store_tokens_ref(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor, kind: str,
                     layout: str) -> None:
    """Write `values` [T, kv_heads, head_dim] (already in the cache dtype) into their slots."""
    page, off = slot_mapping // PAGE_SIZE, slot_mapping % PAGE_SIZE
    if layout == "plain":
        cache[page, :, off] = values
        return
    x = shuffle_width(cache.dtype)
    t, h, d = values.shape
    if kind == "k":
        cache[page, :, :, off] = values.view(t, h, d // x, x)
    else:
        cache[page, :, off // x, :, off % x] = values


def gather_tokens_ref(cache: torch.Tensor, pages: torch.Tensor, length: int, kind: str,
                      layout: str) -> torch.Tensor:
    """The first `length` tokens of a sequence whose logical pages are `pages`: [kv_heads, length, head_dim]."""
    block = cache[pages.long()]
    if layout == "plain":  # [n, H, 16, D]
        out = block.permute(1, 0, 2, 3)
    elif kind == "k":  # [n, H, D/x, 16, x]
        out = block.permute(1, 0, 3, 2, 4)
    else:  # [n, H, 16/x, D, x]
        out = block.permute(1, 0, 2, 4, 3)
    return _flatten(out, out.shape[0])[:, :length]


def _flatten(tokens: torch.Tensor, heads: int) -> torch.Tensor:
    """[H, n, 16, D] or [H, n, 16, D/x, x] or [H, n, 16/x, x, D] -> [H, n*16, D]."""
    if tokens.dim() == 4:
        return tokens.reshape(heads, -1, tokens.shape[-1])
    if tokens.shape[2] == PAGE_SIZE:  # K shuffle: [H, n, 16, D/x, x]
        return tokens.reshape(heads, -1, tokens.shape[-2] * tokens.shape[-1])
    return tokens.reshape(heads, -1, tokens.shape[-1])  # V shuffle: [H, n, 16/x, x, D]


def gather_scales_ref(scale: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """Per-token, per-head scales of a sequence: [kv_heads, length]."""
    s = scale[pages.long()]  # [n, H, 16]
    return s.permute(1, 0, 2).reshape(s.shape[1], -1)[:, :length]


def gather_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor, length: int,
                  layout: str = "plain", k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's K and V, dequantized to float32: two [kv_heads, length, head_dim] tensors."""
    k = gather_tokens_ref(k_cache, pages, length, "k", layout).float()
    v = gather_tokens_ref(v_cache, pages, length, "v", layout).float()
    if k_scale is not None:
        k = k * gather_scales_ref(k_scale, pages, length)[..., None]
    if v_scale is not None:
        v = v * gather_scales_ref(v_scale, pages, length)[..., None]
    return k, v


def gather_index_keys_ref(index_cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """A sequence's index keys as float32 [length, index_dim] (fp8 index keys have unit scale)."""
    return index_cache[pages.long()].reshape(-1, index_cache.shape[-1])[:length].float()


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                        layout: str = "plain", block_sel: torch.Tensor | None = None,
                        block_size: int = 128) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D] in q's dtype.

    Sequence i owns q rows cu_seqlens_q[i]:cu_seqlens_q[i+1]; its cache holds context_lens[i] tokens, the last of
    which are these queries, so query j of n sits at position context_lens[i] - n + j and sees keys <= it.
    block_sel [Hkv, T, topk] (int, -1 padded) restricts each query of KV group g to the keys of its selected
    blocks of `block_size` tokens (MiniMax sparse attention).
    """
    t_total, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        lo, hi = cu[i], cu[i + 1]
        n = hi - lo
        if n == 0:
            continue
        pages = page_table[i, : -(-ctx // 16)]
        k, v = gather_kv_ref(k_cache, v_cache, pages, ctx, layout, k_scale, v_scale)  # [Hkv, L, D]
        qi = q[lo:hi].float().view(n, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
        scores = torch.einsum("hgnd,hld->hgnl", qi, k) * scale
        q_pos = torch.arange(ctx - n, ctx, device=q.device)
        allowed = (torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]).expand(hkv, n, ctx)
        if block_sel is not None:
            allowed = allowed & selected_keys_mask(block_sel[:, lo:hi], ctx, block_size)
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hgnl,hld->nhgd", probs, v)
        out[lo:hi] = o.reshape(n, hq, d).to(q.dtype)
    return out


def selected_keys_mask(block_sel: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """block_sel [H, n, topk] (-1 padded) -> bool [H, n, length]: key t is inside a selected block."""
    num_blocks = -(-length // block_size)
    h, n, _ = block_sel.shape
    chosen = torch.zeros(h, n, num_blocks + 1, dtype=torch.bool, device=block_sel.device)
    # -1 entries land in a spare column that is dropped.
    chosen.scatter_(-1, block_sel.long().masked_fill(block_sel < 0, num_blocks), True)
    key_block = torch.arange(length, device=block_sel.device) // block_size
    return chosen[..., :num_blocks][..., key_block]


def indexer_topk_ref(index_q: torch.Tensor, index_cache: torch.Tensor, page_table: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_size: int, topk: int,
                     local_blocks: int) -> torch.Tensor:
    """index_q [T, Hidx, Di] -> int32 [Hidx, T, topk] selected block ids, valid first, -1 padded.

    score[j, t, b] = max over cached keys s <= pos(t) in block b of index_q[t, j] . index_key[s] (fp32, raw dot
    products: ranking needs no softmax). The query's own block and the `local_blocks - 1` before it are forced in.
    """
    t_total, hidx, _ = index_q.shape
    out = torch.full((hidx, t_total, topk), -1, dtype=torch.int32, device=index_q.device)
    cu = cu_seqlens_q.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        lo, hi = cu[i], cu[i + 1]
        n = hi - lo
        if n == 0:
            continue
        keys = gather_index_keys_ref(index_cache, page_table[i, : -(-ctx // 16)], ctx)  # [L, Di]
        scores = torch.einsum("nhd,ld->hnl", index_q[lo:hi].float(), keys)
        q_pos = torch.arange(ctx - n, ctx, device=index_q.device)
        future = torch.arange(ctx, device=index_q.device)[None, None, :] > q_pos[None, :, None]
        scores = scores.masked_fill(future, float("-inf"))
        num_blocks = -(-ctx // block_size)
        scores = torch.nn.functional.pad(scores, (0, num_blocks * block_size - ctx), value=float("-inf"))
        block_scores = scores.view(hidx, n, num_blocks, block_size).amax(dim=-1)
        q_block = q_pos // block_size
        for back in range(local_blocks):
            local = (q_block - back).clamp(min=0)
            block_scores.scatter_(-1, local.view(1, n, 1).expand(hidx, n, 1), float("inf"))
        k = min(topk, num_blocks)
        vals, idx = block_scores.topk(k, dim=-1)
        out[:, lo:hi, :k] = idx.masked_fill(vals == float("-inf"), -1).to(torch.int32)
    return out


def add_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                     fp8_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """x [T, H] (+ residual [T, H]) -> (y [T, H], y_scale float32 [T] | None, h [T, H] the new residual)."""
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    if fp8_dtype is None:
        return y.to(x.dtype), None, h
    q, scale = quantize_fp8_ref(y, fp8_dtype)
    return q, scale, h


def route_ref(logits: torch.Tensor, bias: torch.Tensor, top_k: int, routed_scale: float = 1.0,
              shared: bool | int = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights float32 [T, k + n], expert ids int32 [T, k + n]), routed ids by descending
    choice score, then n = int(shared) shared columns (ids E .. E + n - 1, weight 1)."""
    p = torch.sigmoid(logits.float())
    _, ids = torch.topk(p + bias.float(), top_k, dim=-1, sorted=True)
    w = p.gather(1, ids)
    w = w / w.sum(dim=-1, keepdim=True) * routed_scale
    ids = ids.to(torch.int32)
    n, e = int(shared), logits.shape[1]
    w = torch.cat((w, torch.ones_like(w[:, :1]).expand(-1, n)), dim=1)
    ids = torch.cat((ids, torch.arange(e, e + n, dtype=ids.dtype, device=ids.device).expand(ids.shape[0], n)), 1)
    return w, ids


def swiglu_oai_ref(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[.., 2I] (gate | up, not interleaved) -> [.., I]: (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, L)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1.0) * (gate * torch.sigmoid(alpha * gate))


def _quantize_groups_ref(h: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Quantize-dequantize [P, I] per (row, 64-column group), as the fp8 gate_up epilogue stores it."""
    groups = h.reshape(h.shape[0], -1, FP8_ACT_GROUP)
    q, s = quantize_fp8_per_token_ref(groups, fp8_dtype)
    return (q.float() * s[..., None]).reshape(h.shape)


def fused_moe_ref(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: Experts,
                  alpha: float, limit: float, mx_fp8: bool = False, h_row: bool = False) -> torch.Tensor:
    """hidden [T, H], topk_ids / topk_weights [T, k] -> [T, H] in hidden's dtype (fp32 math, the kernels'
    quantization of activations mirrored; `mx_fp8`: MXFP4 experts as `fused_moe` runs them through the fp8 tensor
    cores, activations fp8 like the fp8 experts'; planes: activations and the intermediate fp16; `h_row`: an fp8
    intermediate rounded to hidden's dtype, then quantized per row instead of per 64 columns)."""
    t, k = topk_ids.shape
    act_fp8 = experts.fmt == "fp8" or (mx_fp8 and experts.fmt == "mxfp4")
    fp8 = experts.gate_up.dtype if experts.fmt == "fp8" else torch.float8_e4m3fn
    w_gate_up, w_down = dequantize_experts(experts, mx_fp8)
    act_dtype = torch.float16 if experts.planes else hidden.dtype
    if act_fp8:
        xq, xs = quantize_fp8_per_token_ref(hidden, fp8)
        x = xq.float() * xs[:, None]
    else:
        x = hidden.to(act_dtype).float()
    flat = topk_ids.reshape(-1).long()
    out = torch.zeros((t, experts.hidden), dtype=torch.float32, device=hidden.device)
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        tokens = pairs // k
        h = swiglu_oai_ref(x[tokens] @ w_gate_up[e].T, alpha, limit)
        if act_fp8 and h_row:
            hq, hs = quantize_fp8_per_token_ref(h.to(hidden.dtype).float(), fp8)
            h = hq.float() * hs[:, None]
        else:
            h = _quantize_groups_ref(h, fp8) if act_fp8 else h.to(act_dtype).float()
        y = (h @ w_down[e].T) * topk_weights.reshape(-1)[pairs, None].float()
        out.index_add_(0, tokens, y)
    return out.to(hidden.dtype)


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Pairs (flattened index t * k + j) sorted by expert, each expert's run padded to a multiple of block_m with
    the sentinel P = number of pairs -> (sorted pairs int32 [padded], expert of each block int32, padded)."""
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    order = torch.argsort(flat, stable=True)
    pairs, owners, start = [], [], 0
    for e, c in enumerate(counts.tolist()):
        run = order[start : start + c]
        start += c
        pad = -c % block_m
        pairs.append(torch.cat((run, torch.full((pad,), n, dtype=run.dtype, device=run.device))))
        owners += [e] * ((c + pad) // block_m)
    sorted_pairs = torch.cat(pairs).to(torch.int32)
    return sorted_pairs, torch.tensor(owners, dtype=torch.int32, device=flat.device), sorted_pairs.numel()


def quantize_fp8_per_token_ref(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scale [M])."""
    return quantize_fp8_ref(x, fp8_dtype)


def fp8_gemm_ref(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                 out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(x_q [M, K] fp8, x_scale [M]) x (w_q [N, K] fp8, w_scale [N]) (+ bias [N]) -> [M, N] out_dtype, fp32
    accumulation, one rounding at the end."""
    acc = (x_q.float() @ w_q.float().T) * x_scale.float()[:, None] * w_scale.float()[None, :]
    return (acc if bias is None else acc + bias.float()).to(out_dtype)


def fp8_linear_ref(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, x_scale: torch.Tensor | None = None,
                   out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(w).T (+ bias). x is bf16 (quantized here per token) or already fp8 with its `x_scale`."""
    if x_scale is None:
        x, x_scale = quantize_fp8_per_token_ref(x, w_q.dtype)
    return fp8_gemm_ref(x, x_scale, w_q, w_scale, out_dtype, bias)


def gelu_quantize_fp8_ref(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> its exact (erf) GELU, in x's dtype, quantized per token: (fp8, float32 scale [M])."""
    return quantize_fp8_per_token_ref(torch.nn.functional.gelu(x), fp8_dtype)


def swiglu_quantize_fp8_ref(gate_up: torch.Tensor, alpha: float, limit: float,
                            fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2I] (gate | up) -> the SwiGLU-OAI output [M, I] quantized per token: (fp8, float32 scale [M])."""
    return quantize_fp8_per_token_ref(swiglu_oai_ref(gate_up, alpha, limit), fp8_dtype)
