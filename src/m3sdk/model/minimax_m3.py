"""The MiniMax-M3 text model as one batched, paged forward over flattened ragged tokens (Contract 2).

Per layer: Gemma norm -> attention (dense, or MSA on sparse layers: the lightning indexer picks key blocks per
query and KV group) -> residual -> Gemma norm -> MLP (dense, or sigmoid-routed MoE + shared expert) -> residual.
The attention math over the cache lives behind the AttentionBackend seam: this file projects, and the backend
norms, ropes and writes the new tokens' heads, then selects blocks and attends.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from m3sdk.attention.base import AttentionBackend, AttentionMetadata, AttentionShapes, get_backend
from m3sdk.cache.kv_pool import KVPool
from m3sdk.model.config import ModelConfig
from m3sdk.model.layers import (
    DenseMLP,
    Fp8Activation,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SparseMoE,
    residual_rms_norm,
)


class Attention(nn.Module):
    """GQA with per-head QK norm and partial RoPE; sparse layers add the lightning indexer (selection only).

    One packed projection [q | k | v | index_q | index_k] so a single GEMM serves the whole layer input.
    `tensor_parallel`: the config holds this rank's heads, and o_proj all-reduces the ranks' partial outputs.
    """

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, tensor_parallel: bool = False):
        super().__init__()
        c = config
        self.layer = layer
        self.sparse = c.is_sparse(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = c.head_dim**-0.5
        self.block_size = c.index_block_size
        sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        if self.sparse:
            self.index_n_heads, self.index_head_dim = c.index_n_heads, c.index_head_dim
            self.topk, self.local_blocks = c.index_topk_blocks, c.index_local_blocks
            sizes += [c.index_n_heads * c.index_head_dim, c.index_head_dim]
            self.index_q_norm = RMSNorm(c.index_head_dim, c.rms_norm_eps, dtype)
            self.index_k_norm = RMSNorm(c.index_head_dim, c.rms_norm_eps, dtype)
        self.split_sizes = sizes
        self.qkv_proj = nn.Linear(c.hidden_size, sum(sizes), bias=False, dtype=dtype)
        self.o_proj = RowParallelLinear(c.num_heads * c.head_dim, c.hidden_size, dtype, reduce=tensor_parallel)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor | Fp8Activation, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv: KVPool, backend: AttentionBackend) -> torch.Tensor:
        t = meta.positions.shape[0]
        parts = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = parts[0].view(t, self.num_heads, self.head_dim)
        k = parts[1].view(t, self.num_kv_heads, self.head_dim)
        v = parts[2].view(t, self.num_kv_heads, self.head_dim)
        block_sel = index_q = index_k = index_q_w = index_k_w = None
        if self.sparse:
            index_q = parts[3].view(t, self.index_n_heads, self.index_head_dim)
            index_k, index_q_w, index_k_w = parts[4], self.index_q_norm.weight, self.index_k_norm.weight
        # per-head norm + RoPE, then the cache writes (one launch on the triton backend); written first, so every
        # query then sees its own sequence's new tokens through the cache, causally
        q, index_q = backend.norm_rope_write(self.layer, q, k, v, self.q_norm.weight, self.k_norm.weight, cos, sin,
                                             self.q_norm.eps, meta, kv, index_q, index_k, index_q_w, index_k_w)
        if self.sparse:
            block_sel = backend.select_blocks(self.layer, index_q, meta, kv, self.block_size, self.topk,
                                              self.local_blocks)
        o = backend.attend(self.layer, q, meta, kv, block_sel, self.scale, self.block_size)
        return self.o_proj(o.reshape(t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, tensor_parallel: bool = False):
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = Attention(c, layer, dtype, tensor_parallel)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        if c.is_moe(layer):
            self.mlp = SparseMoE(c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_intermediate_size,
                                 c.num_experts_per_tok, c.routed_scaling_factor, c.swiglu_alpha, c.swiglu_limit,
                                 dtype, reduce=tensor_parallel)
        else:
            self.mlp = DenseMLP(c.hidden_size, c.dense_intermediate_size, c.swiglu_alpha, c.swiglu_limit, dtype,
                                reduce=tensor_parallel)
        # set by quantize_model where an FP8 projection reads the norm: it then hands over fp8 rows + scales
        self.attn_input_fp8: torch.dtype | None = None
        self.mlp_input_fp8: torch.dtype | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, kv: KVPool,
                backend: AttentionBackend, layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        y, _ = residual_rms_norm(x, self.input_layernorm, fp8_dtype=self.attn_input_fp8)
        attn = self.self_attn(y, cos, sin, meta, kv, backend)
        if layer_hook is not None:  # the layer's cache writes are queued: a prefill node sends its pages from here
            layer_hook(self.self_attn.layer)
        # the residual add fused into the post-attention norm; the MLP's add stays here because the layer's output
        # is the residual stream (EAGLE3's aux states and the MTP layer read it)
        y, x = residual_rms_norm(attn, self.post_attention_layernorm, residual=x, fp8_dtype=self.mlp_input_fp8)
        return x + self.mlp(y)


class MiniMaxM3ForCausalLM(nn.Module):
    """Build with `m3sdk.model.load_model(path)` (one rank) or `m3sdk.parallel.load_shard` (a tensor-parallel
    rank: `tensor_parallel`, and `config` is the rank's local one); constructing directly leaves the weights
    uninitialized."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, attn_backend: str = "torch",
                 tensor_parallel: bool = False):
        super().__init__()
        c = config
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(c, i, dtype, tensor_parallel) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, dtype=dtype)
        self.requires_grad_(False)
        self.rotary = RotaryEmbedding(c.rotary_dim, c.rope_theta)
        self.attn_backend: AttentionBackend = get_backend(attn_backend)
        self.attn_backend.bind(AttentionShapes(c.head_dim, c.rotary_dim, c.index_head_dim if c.sparse_layers else None,
                                               c.index_block_size if c.sparse_layers else None))
        # `mtp.*` tensors of the checkpoint, read on demand by the speculative decoder (not part of this forward)
        self.mtp_weights: Mapping[str, torch.Tensor] = {}

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVPool,
                logits_indices: torch.Tensor | None = None, aux_layers: Sequence[int] = (),
                layer_hook: Callable[[int], None] | None = None,
                embed_override: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple:
        """input_ids int64 [T] -> (final-normed hidden [T, hidden], float32 logits [N, vocab] at logits_indices).

        `embed_override` = (rows [K], embeddings [K, hidden]): the input embeddings of those rows instead of their
        tokens' (an image's tokens take the vision encoder's output, m3sdk.images).

        With `aux_layers` (EAGLE3 drafts read them), a third item: the hidden states entering those layers (id
        num_layers: the last layer's output, before the final norm), concatenated in the order given:
        [T, len(aux_layers) * hidden]. `layer_hook(i)` runs after layer i's attention (the engine's step observers)."""
        cos, sin = self.rotary(meta.positions)
        x = self.embed_tokens(input_ids)
        if embed_override is not None:
            x[embed_override[0]] = embed_override[1].to(x.dtype)
        aux = {}
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                aux[i] = x
            x = layer(x, cos, sin, meta, kv, self.attn_backend, layer_hook)
        aux[len(self.layers)] = x
        hidden, _ = residual_rms_norm(x, self.norm)  # one Triton launch on a GPU (the plain norm is eight)
        logits = None if logits_indices is None else self.lm_head(hidden[logits_indices]).float()
        if aux_layers:
            return hidden, logits, torch.cat([aux[i] for i in aux_layers], dim=-1)
        return hidden, logits
