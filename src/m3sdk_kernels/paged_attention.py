"""Causal attention of ragged query chunks over the paged KV cache: dense, or MSA-sparse with `block_sel`."""

import torch

from .layout import gather_kv_ref


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
