"""The Triton attention backend: the m3sdk_kernels kernels over the paged cache (the default on a GPU).

Same contract as the torch backend (Contract 2); the step's host ints (`max_seqlen_q`, `max_context_len`) go to
the kernels so that picking tiles and split counts never syncs the device. An op whose shapes the kernels do not
serve (`m3sdk_kernels.shapes.attention_unsupported`, asked in `bind` when the model is built) runs the torch
backend's reference instead, with one log line saying why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from m3sdk.attention.base import AttentionMetadata, AttentionShapes, register_backend
from m3sdk.attention.torch_backend import TorchAttentionBackend
from m3sdk.observability import get_logger
from m3sdk_kernels.cache_write import norm_rope_write, write_index_key, write_kv
from m3sdk_kernels.indexer import compile_topk_widths, indexer_topk
from m3sdk_kernels.paged_attention import paged_attention
from m3sdk_kernels.shapes import attention_unsupported

if TYPE_CHECKING:
    from m3sdk.cache.kv_pool import KVPool

log = get_logger("m3sdk.attention")


@register_backend("triton")
class TritonAttentionBackend:
    def __init__(self) -> None:
        self._torch = TorchAttentionBackend()
        self._ref_ops: frozenset[str] = frozenset()  # ops the references serve (set once, by `bind`)
        self._block_size: int | None = None  # the indexer's selection block (set by `bind`; None: no sparse layers)

    def bind(self, shapes: AttentionShapes) -> None:
        unsupported = attention_unsupported(shapes.head_dim, shapes.rotary_dim, shapes.index_dim, shapes.block_size)
        for op, why in unsupported.items():
            log.info("attention op on the torch path: the Triton kernels do not serve these shapes", op=op, reason=why)
        self._ref_ops = frozenset(unsupported)
        self._block_size = shapes.block_size

    def compile_ahead(self, max_context_len: int, topk: int, device: torch.device) -> None:
        """The indexer's top-k pass of a prefill at every row width up to `max_context_len` (its width grows with
        the context); the other kernels' prefill variants do not depend on the context. On a GPU only: the
        interpreter compiles nothing."""
        if device.type != "cpu" and self._block_size is not None and "select_blocks" not in self._ref_ops:
            compile_topk_widths(max_context_len, self._block_size, topk, device)

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, index_k: torch.Tensor | None,
                 meta: AttentionMetadata, kv: KVPool) -> None:
        if "write_kv" in self._ref_ops:
            return self._torch.write_kv(layer, k, v, index_k, meta, kv)
        write_kv(k, v, kv.k[layer], kv.v[layer], meta.slot_mapping, kv.k_scale[layer], kv.v_scale[layer],
                 layout=kv.spec.layout)
        if index_k is not None:
            write_index_key(index_k, kv.index_k[layer], meta.slot_mapping)

    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, kv: KVPool,
               block_sel: torch.Tensor | None, scale: float, block_size: int) -> torch.Tensor:
        if "attend" in self._ref_ops:
            return self._torch.attend(layer, q, meta, kv, block_sel, scale, block_size)
        return paged_attention(q, kv.k[layer], kv.v[layer], meta.page_table, meta.cu_seqlens_q, meta.context_lens,
                               scale, kv.k_scale[layer], kv.v_scale[layer], layout=kv.spec.layout,
                               block_sel=block_sel, block_size=block_size, max_seqlen_q=meta.max_seqlen_q,
                               max_context_len=meta.max_context_len)

    def select_blocks(self, layer: int, index_q: torch.Tensor, meta: AttentionMetadata, kv: KVPool,
                      block_size: int, topk: int, local_blocks: int) -> torch.Tensor:
        if "select_blocks" in self._ref_ops:
            return self._torch.select_blocks(layer, index_q, meta, kv, block_size, topk, local_blocks)
        return indexer_topk(index_q, kv.index_k[layer], meta.page_table, meta.cu_seqlens_q, meta.context_lens,
                            block_size, topk, local_blocks, max_seqlen_q=meta.max_seqlen_q,
                            max_context_len=meta.max_context_len)

    def norm_rope_write(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        eps: float, meta: AttentionMetadata, kv: KVPool, index_q: torch.Tensor | None = None,
                        index_k: torch.Tensor | None = None, index_q_norm_w: torch.Tensor | None = None,
                        index_k_norm_w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-head norm + partial RoPE of q, k (and the index query and key) and the K/V and index-key writes
        in one launch."""
        if "norm_rope_write" in self._ref_ops:
            return self._torch.norm_rope_write(layer, q, k, v, q_norm_w, k_norm_w, cos, sin, eps, meta, kv, index_q,
                                               index_k, index_q_norm_w, index_k_norm_w)
        return norm_rope_write(q, k, v, q_norm_w, k_norm_w, cos, sin, eps, kv.k[layer], kv.v[layer],
                               meta.slot_mapping, kv.k_scale[layer], kv.v_scale[layer], kv.spec.layout, index_q,
                               index_k, index_q_norm_w, index_k_norm_w, kv.index_k[layer])
