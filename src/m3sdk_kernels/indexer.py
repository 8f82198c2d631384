"""The MSA lightning indexer: per-query, per-KV-group top-k selection of key blocks from the index-key cache."""

import torch

from .layout import gather_index_keys_ref


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
