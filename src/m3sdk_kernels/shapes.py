"""Which model shapes the kernels serve: asked once when a model is built, never at a request.

The kernels take any head, index and rotary width (tiles padded to a power of two, lanes past the width masked),
any MSA block size (tiles padded to tl.dot's 16 keys, or several tiles per block), page counts ending anywhere,
any expert count and top-k. What remains is listed here, per op, with the reason: the engine serves those ops
with the plain-torch references (`reference.py`) and logs the reason once. The MoE GEMMs' limits are
`moe.moe_unsupported`; the shuffle KV layout's is `layout.cache_shape`'s error.
"""

from __future__ import annotations

# The widest head / index vector a program holds in registers (D_PAD = the next power of two of the width): a
# decode tile of 16 query rows x 512 fp32 accumulators is 128 registers a thread at 4 warps before anything else.
MAX_DIM = 256

ATTENTION_OPS = ("norm_rope_write", "write_kv", "attend", "select_blocks")


def attention_unsupported(head_dim: int, rotary_dim: int, index_dim: int | None = None,
                          block_size: int | None = None) -> dict[str, str]:
    """op name (`ATTENTION_OPS`) -> why the Triton kernels cannot serve it for these shapes; {} when they serve
    every op. `index_dim` / `block_size`: the MSA indexer's, None for a model without sparse layers."""
    why: dict[str, str] = {}
    if head_dim > MAX_DIM:
        reason = f"head_dim {head_dim} > {MAX_DIM}: a tile of it does not fit a program's registers"
        why |= dict.fromkeys(("norm_rope_write", "write_kv", "attend"), reason)
    if rotary_dim % 2 or rotary_dim > head_dim or (index_dim is not None and rotary_dim > index_dim):
        why["norm_rope_write"] = (f"rotary_dim {rotary_dim} is odd or wider than head_dim {head_dim} / index_head_dim "
                                  f"{index_dim} (rotate-half pairs)")
    if index_dim is not None and index_dim > MAX_DIM:
        reason = f"index_head_dim {index_dim} > {MAX_DIM}: a tile of it does not fit a program's registers"
        why |= dict.fromkeys(("norm_rope_write", "select_blocks"), reason)
    if block_size is not None and block_size < 1:
        why["select_blocks"] = why["attend"] = f"index_block_size {block_size} < 1"
    return why
