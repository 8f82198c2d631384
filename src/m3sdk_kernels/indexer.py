"""The MSA lightning indexer: per-query, per-KV-group top-k selection of key blocks from the index-key cache."""

import torch
import triton
import triton.language as tl

from .arch import Arch, tiles
from .layout import PAGE, dim_tile
from .paged_attention import dims_ok, dot_dtype, q_tile, seq_of_block, tile_pages

# the narrowest top-k row (32K tokens at M3's blocks of 128): shorter contexts share its variant
TOPK_MIN_WIDTH = 256

# ---------------------------------------------------------------------------------------------- Triton kernels
#
# Two launches. The scan reads the index-key cache once per query tile (the bandwidth bill past ~16K tokens):
# a program owns BLOCK_Q query tokens x all index heads (the rows of its dots: the one shared key head is read
# once for every head) and a contiguous chunk of selection blocks, and writes each row's block maximum, with
# the local blocks forced to +inf. The top-k pass then ranks each (token, head) row of block scores by repeated
# arg-max: no softmax (ranking needs none) and no sort of the whole row. One warp per row keeps every arg-max
# inside the warp (shuffles, no shared-memory round trip and barrier per step, which dominated at 4 warps).


@triton.jit(do_not_specialize=["num_seqs", "num_tokens"])  # as _attn_kernel's
def _scan_kernel(iq_ptr, ik_cache, page_table, cu_q, ctx_lens, scores_ptr, num_seqs, num_tokens, num_blocks,
                 stride_qt, stride_qh, stride_ip, stride_pt,
                 NUM_HEADS: tl.constexpr, BLOCK_HI: tl.constexpr, INDEX_DIM: tl.constexpr, DI_PAD: tl.constexpr,
                 BLOCK_Q: tl.constexpr, SEL_BLOCK: tl.constexpr, KEY_TILE: tl.constexpr, LOCAL_BLOCKS: tl.constexpr,
                 DOT: tl.constexpr,
                 PAGE_AHEAD: tl.constexpr, ONE_EACH: tl.constexpr):
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    if ONE_EACH:  # one query token per sequence (decode): token = sequence, no search through cu_q
        seq, q_start, n_q, first = pid, pid, 1, 0
    else:
        seq, q_start, n_q, first = q_tile(cu_q, num_seqs, pid, BLOCK_Q)
    if first < n_q:
        BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_HI
        ctx = tl.load(ctx_lens + seq)
        r = tl.arange(0, BLOCK_M)
        d = tl.arange(0, DI_PAD)
        d_ok = dims_ok(d, INDEX_DIM, DI_PAD)
        qi = first + r // BLOCK_HI
        head = r % BLOCK_HI
        row_ok = (qi < n_q) & (head < NUM_HEADS)
        tok = (q_start + qi).to(tl.int64)
        pos = ctx - n_q + qi
        q = tl.load(iq_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT)
        kv_end = ctx - n_q + tl.minimum(first + BLOCK_Q, n_q)
        pages_ptr = page_table + seq.to(tl.int64) * stride_pt
        q_block = pos // SEL_BLOCK
        out_row = scores_ptr + (head.to(tl.int64) * num_tokens + tok) * num_blocks
        per = tl.cdiv(num_blocks, tl.num_programs(1))  # blocks per chunk
        # PAGE_AHEAD: the next block's page ids loaded one iteration early (as in paged_attention), so the key
        # copies do not wait on a page-id load of their own iteration and num_stages - 1 blocks can be in flight.
        # A block is SUBS tiles of KEY_TILE keys (one where it is a power of two up to 128; its tail masked where it
        # is not a multiple of the tile: blocks of 8 or 48 keys); page ids run one block ahead only at one tile.
        SUBS: tl.constexpr = (SEL_BLOCK + KEY_TILE - 1) // KEY_TILE
        AHEAD: tl.constexpr = PAGE_AHEAD and SUBS == 1
        page = tile_pages(pages_ptr, chunk * per * SEL_BLOCK, kv_end, KEY_TILE)
        for b in range(chunk * per, tl.minimum(chunk * per + per, tl.cdiv(kv_end, SEL_BLOCK))):
            if AHEAD:
                nxt = tile_pages(pages_ptr, (b + 1) * SEL_BLOCK, kv_end, KEY_TILE)
            else:
                nxt = page
            best = tl.full([BLOCK_M], float("-inf"), tl.float32)
            for sub in tl.static_range(SUBS):
                start = b * SEL_BLOCK + sub * KEY_TILE
                if not AHEAD:
                    page = tile_pages(pages_ptr, start, kv_end, KEY_TILE)
                n = start + tl.arange(0, KEY_TILE)
                if SEL_BLOCK % KEY_TILE == 0:
                    key_ok = n < kv_end
                else:
                    key_ok = (n < kv_end) & (n < (b + 1) * SEL_BLOCK)
                k = tl.load(ik_cache + page.to(tl.int64)[:, None] * stride_ip + (n % PAGE)[:, None] * INDEX_DIM
                            + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
                s = tl.dot(q, tl.trans(k.to(DOT)))
                s = tl.where(key_ok[None, :] & (n[None, :] <= pos[:, None]), s, float("-inf"))
                best = tl.maximum(best, tl.max(s, 1))
            # local blocks (pos // SEL_BLOCK - i, i < LOCAL_BLOCKS, clamped at 0) are always selected
            best = tl.where((b <= q_block) & (b > q_block - LOCAL_BLOCKS), float("inf"), best)
            tl.store(out_row + b, best, mask=row_ok)
            page = nxt


@triton.jit(do_not_specialize=["num_seqs", "num_tokens"])  # as _attn_kernel's (rows aligned by num_blocks)
def _topk_kernel(scores_ptr, cu_q, ctx_lens, out_ptr, num_seqs, num_tokens, num_blocks,
                 SEL_BLOCK: tl.constexpr, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr, BLOCKS_PAD: tl.constexpr,
                 ONE_EACH: tl.constexpr):
    t = tl.program_id(0)
    head = tl.program_id(1)
    if ONE_EACH:
        pos = tl.load(ctx_lens + t) - 1
    else:
        seq = seq_of_block(cu_q, num_seqs, t, 1)
        q_start = tl.load(cu_q + seq)
        n_q = tl.load(cu_q + seq + 1) - q_start
        pos = tl.load(ctx_lens + seq) - n_q + (t - q_start)
    b = tl.arange(0, BLOCKS_PAD)
    j = tl.arange(0, TOPK_PAD)
    row = head.to(tl.int64) * num_tokens + t
    s = tl.load(scores_ptr + row * num_blocks + b, mask=b <= pos // SEL_BLOCK, other=float("-inf"))
    picked = tl.full([TOPK_PAD], -1, tl.int32)
    for i in tl.static_range(TOPK):
        best, idx = tl.max(s, 0, return_indices=True)
        picked = tl.where(j == i, tl.where(best > float("-inf"), idx, -1), picked)
        s = tl.where(b == idx, float("-inf"), s)
    tl.store(out_ptr + row * TOPK + j, picked, mask=j < TOPK)


def topk_width(num_blocks: int) -> int:
    """The top-k pass's row width (a compile-time constant) for rows of `num_blocks` scores: a power of two, at
    least TOPK_MIN_WIDTH, so the short contexts share one compiled variant and a longer one adds one per doubling
    (`compile_topk_widths` compiles them all at the start)."""
    return max(TOPK_MIN_WIDTH, triton.next_power_of_2(num_blocks))


def key_tile(block_size: int) -> int:
    """Keys per scan tile for selection blocks of `block_size`: the block rounded up to a power of two, at least 16
    (tl.dot's smallest), at most 128 (a larger block is several tiles)."""
    return min(128, max(16, triton.next_power_of_2(block_size)))


def indexer_plan(num_tokens: int, num_seqs: int, num_heads: int, max_seqlen_q: int, num_blocks: int,
                 fp8: bool = False, arch: Arch | None = None) -> dict:
    """Tile shape and chunk count of the scan: a function of shapes, host ints and the key type only."""
    cfg = tiles("indexer_scan" if max_seqlen_q <= 1 else "indexer_prefill", arch, "fp8" if fp8 else None)
    block_q = 1 if max_seqlen_q <= 1 else min(cfg["BLOCK_Q"], triton.next_power_of_2(max_seqlen_q))
    block_hi = max(triton.next_power_of_2(num_heads), triton.next_power_of_2(triton.cdiv(16, block_q)))
    q_blocks = num_tokens if block_q == 1 else num_tokens // block_q + num_seqs
    want = max(1, cfg["SPLIT_PROGRAMS"] // max(1, q_blocks))
    # any count (a launch dimension, not a compile-time constant), so SPLIT_PROGRAMS can match the resident
    # slots; none left without a block
    chunks = triton.cdiv(num_blocks, triton.cdiv(num_blocks, min(want, num_blocks)))
    return {"BLOCK_Q": block_q, "BLOCK_HI": block_hi, "NUM_CHUNKS": chunks, "q_blocks": q_blocks,
            "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"], "PAGE_AHEAD": cfg.get("PAGE_AHEAD", 0),
            "ONE_EACH": _one_each(num_tokens, num_seqs, max_seqlen_q)}


def _one_each(num_tokens: int, num_seqs: int, max_seqlen_q: int) -> bool:
    """Every sequence has exactly one query token (a decode batch): token i is sequence i, so the kernels skip
    the search through cu_seqlens_q, a chain of dependent loads before a program's first real one."""
    return max_seqlen_q <= 1 and num_tokens == num_seqs


def indexer_block_scores(index_q: torch.Tensor, index_cache: torch.Tensor, page_table: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_size: int, local_blocks: int,
                         max_seqlen_q: int, max_context_len: int) -> torch.Tensor:
    """The scan: fp32 [Hidx, T, cdiv(max_context_len, block_size)] block maxima, +inf on each token's local blocks,
    -inf on blocks wholly past it; entries past the token's own block are unspecified (`block_topk` masks them)."""
    t_total, num_heads, index_dim = index_q.shape
    num_seqs = context_lens.shape[0]
    # rows a multiple of 16 wide: the kernels' row strides keep one integer specialization at every context
    num_blocks = triton.cdiv(max(1, triton.cdiv(max_context_len, block_size)), 16) * 16
    scores = torch.empty(num_heads, t_total, num_blocks, dtype=torch.float32, device=index_q.device)
    plan = indexer_plan(t_total, num_seqs, num_heads, max_seqlen_q, num_blocks, index_cache.element_size() == 1)
    _scan_kernel[(plan["q_blocks"], plan["NUM_CHUNKS"])](
        index_q, index_cache, page_table, cu_seqlens_q, context_lens, scores, num_seqs, t_total, num_blocks,
        index_q.stride(0), index_q.stride(1), index_cache.stride(0), page_table.stride(0),
        NUM_HEADS=num_heads, BLOCK_HI=plan["BLOCK_HI"], INDEX_DIM=index_dim, DI_PAD=dim_tile(index_dim),
        BLOCK_Q=plan["BLOCK_Q"], SEL_BLOCK=block_size, KEY_TILE=key_tile(block_size), LOCAL_BLOCKS=local_blocks,
        DOT=dot_dtype(index_cache.dtype), PAGE_AHEAD=plan["PAGE_AHEAD"], ONE_EACH=plan["ONE_EACH"],
        num_warps=plan["num_warps"], num_stages=plan["num_stages"])
    return scores


def block_topk(scores: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_size: int,
               topk: int, max_seqlen_q: int, out: torch.Tensor) -> torch.Tensor:
    """The top-`topk` blocks of each (head, token) row of `indexer_block_scores` into `out` [Hidx, T, topk]."""
    num_heads, t_total, num_blocks = scores.shape
    num_seqs = context_lens.shape[0]
    _topk_kernel[(t_total, num_heads)](
        scores, cu_seqlens_q, context_lens, out, num_seqs, t_total, num_blocks, SEL_BLOCK=block_size, TOPK=topk,
        TOPK_PAD=triton.next_power_of_2(topk), BLOCKS_PAD=topk_width(num_blocks),
        ONE_EACH=_one_each(t_total, num_seqs, max_seqlen_q), num_warps=tiles("indexer_topk")["num_warps"])
    return out


def compile_topk_widths(max_context_len: int, block_size: int, topk: int, device: torch.device) -> None:
    """Compile the top-k pass of a prefill (several query tokens per sequence) at every row width a context up to
    `max_context_len` needs, by one launch of each on a row of no valid block: a first prompt longer than any
    before would otherwise wait on the compile. Decode steps reach theirs through the graphs' warm steps."""
    widest = topk_width(triton.cdiv(max_context_len, block_size))
    cu = torch.tensor([0, 2], dtype=torch.int32, device=device)
    ctx = torch.tensor([2], dtype=torch.int32, device=device)
    out = torch.empty(1, 2, topk, dtype=torch.int32, device=device)
    width = TOPK_MIN_WIDTH
    while width <= widest:
        block_topk(torch.full((1, 2, width), float("-inf"), device=device), cu, ctx, block_size, topk, 2, out)
        width *= 2


def indexer_topk(index_q: torch.Tensor, index_cache: torch.Tensor, page_table: torch.Tensor,
                 cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_size: int, topk: int,
                 local_blocks: int, *, max_seqlen_q: int | None = None,
                 max_context_len: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton `indexer_topk_ref`: int32 [Hidx, T, topk], valid entries first (highest score first), -1 padded.
    The host ints only pick tile shapes and the block-score buffer's width; they must bound the real values.
    `out` receives the result when given."""
    t_total, num_heads, _ = index_q.shape
    if out is None:
        out = torch.empty(num_heads, t_total, topk, dtype=torch.int32, device=index_q.device)
    if t_total == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_context_len is None:
        max_context_len = int(context_lens.max())
    scores = indexer_block_scores(index_q, index_cache, page_table, cu_seqlens_q, context_lens, block_size,
                                  local_blocks, max_seqlen_q, max_context_len)
    return block_topk(scores, cu_seqlens_q, context_lens, block_size, topk, max_seqlen_q, out)


def aot_variants(arch: Arch) -> list:
    """The indexer kernels as launched on `arch` at M3's shapes (decode batch 64 at 128K; an 8K prefill chunk)."""
    from .aot import M3_SHAPES, AotVariant

    m = M3_SHAPES
    variants = []
    for decode, key in ((True, "fp8"), (True, "bf16"), (False, "fp8")):
        tokens, seqs = (64, 64) if decode else (8192, 1)
        num_blocks = 131072 // m["block_size"]
        plan = indexer_plan(tokens, seqs, m["index_heads"], 1 if decode else tokens, num_blocks, key == "fp8", arch)
        types = {"iq_ptr": "*bf16", "ik_cache": f"*{arch.fp8_triton if key == 'fp8' else 'bf16'}",
                 "page_table": "*i32", "cu_q": "*i32", "ctx_lens": "*i32", "scores_ptr": "*fp32"}
        types |= {name: "i32" for name in _scan_kernel.arg_names if name not in types}
        variants.append(AotVariant(
            name=f"indexer.scan_{'decode' if decode else 'prefill'}_{key}", kernel=_scan_kernel, types=types,
            constexprs={"NUM_HEADS": m["index_heads"], "BLOCK_HI": plan["BLOCK_HI"], "INDEX_DIM": m["index_dim"],
                        "DI_PAD": dim_tile(m["index_dim"]), "BLOCK_Q": plan["BLOCK_Q"], "SEL_BLOCK": m["block_size"],
                        "KEY_TILE": key_tile(m["block_size"]),
                        "LOCAL_BLOCKS": m["local_blocks"], "DOT": tl.float16 if key == "fp8" else tl.bfloat16,
                        "PAGE_AHEAD": plan["PAGE_AHEAD"], "ONE_EACH": plan["ONE_EACH"]},
            num_warps=plan["num_warps"], num_stages=plan["num_stages"],
            aligned=("stride_qt", "stride_qh", "stride_ip", "num_blocks")))
    variants.append(AotVariant(
        name="indexer.topk", kernel=_topk_kernel,
        types={"scores_ptr": "*fp32", "cu_q": "*i32", "ctx_lens": "*i32", "out_ptr": "*i32", "num_seqs": "i32",
               "num_tokens": "i32", "num_blocks": "i32"},
        constexprs={"SEL_BLOCK": m["block_size"], "TOPK": m["topk"], "TOPK_PAD": m["topk"],
                    "BLOCKS_PAD": topk_width(131072 // m["block_size"]),
                    "ONE_EACH": True},
        num_warps=tiles("indexer_topk", arch)["num_warps"], aligned=("num_blocks",)))
    return variants
