"""The plain-PyTorch attention backend: the m3sdk_kernels references over the paged cache. Runs anywhere."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from m3sdk.attention.base import AttentionMetadata, AttentionShapes, register_backend
from m3sdk_kernels.reference import (
    indexer_topk_ref,
    norm_rope_write_ref,
    paged_attention_ref,
    write_index_key_ref,
    write_kv_ref,
)

if TYPE_CHECKING:
    from m3sdk.cache.kv_pool import KVPool


@register_backend("torch")
class TorchAttentionBackend:
    def bind(self, shapes: AttentionShapes) -> None:
        """The references serve every shape."""

    def compile_ahead(self, max_context_len: int, topk: int, device: torch.device) -> None:
        """Nothing compiles."""

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, index_k: torch.Tensor | None,
                 meta: AttentionMetadata, kv: KVPool) -> None:
        write_kv_ref(k, v, kv.k[layer], kv.v[layer], meta.slot_mapping, kv.k_scale[layer], kv.v_scale[layer],
                     layout=kv.spec.layout)
        if index_k is not None:
            write_index_key_ref(index_k, kv.index_k[layer], meta.slot_mapping)

    def norm_rope_write(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        eps: float, meta: AttentionMetadata, kv: KVPool, index_q: torch.Tensor | None = None,
                        index_k: torch.Tensor | None = None, index_q_norm_w: torch.Tensor | None = None,
                        index_k_norm_w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return norm_rope_write_ref(q, k, v, q_norm_w, k_norm_w, cos, sin, eps, kv.k[layer], kv.v[layer],
                                   meta.slot_mapping, kv.k_scale[layer], kv.v_scale[layer], kv.spec.layout, index_q,
                                   index_k, index_q_norm_w, index_k_norm_w, kv.index_k[layer])

    def attend(self, layer: int, q: torch.Tensor, meta: AttentionMetadata, kv: KVPool,
               block_sel: torch.Tensor | None, scale: float, block_size: int) -> torch.Tensor:
        return paged_attention_ref(q, kv.k[layer], kv.v[layer], meta.page_table, meta.cu_seqlens_q, meta.context_lens,
                                   scale, kv.k_scale[layer], kv.v_scale[layer], layout=kv.spec.layout,
                                   block_sel=block_sel, block_size=block_size)

    def select_blocks(self, layer: int, index_q: torch.Tensor, meta: AttentionMetadata, kv: KVPool,
                      block_size: int, topk: int, local_blocks: int) -> torch.Tensor:
        return indexer_topk_ref(index_q, kv.index_k[layer], meta.page_table, meta.cu_seqlens_q, meta.context_lens,
                                block_size, topk, local_blocks)
