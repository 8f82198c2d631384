"""Eagle3Head: the one-layer Llama draft head as its checkpoint stores it, with the pieces of one draft step
(the drafter serves fused forms of its weights; the training script runs these pieces with its own masks).

Its norm is Llama's (weight * x / rms), not the target's Gemma norm (1 + w); its RoPE is the target's
(model/layers.py RotaryEmbedding, the kernels' rope_ref) over the whole head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from m3sdk.model.layers import RotaryEmbedding
from m3sdk.speculative.eagle3.config import Eagle3Config
from m3sdk_kernels.reference import rope_ref


class RMSNorm(nn.Module):
    """Llama RMSNorm (weight * x / rms; torch computes the rms in float32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one op (fused where torch has the kernel): a draft step is a few hundred small kernels
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Eagle3Head(nn.Module):
    """The draft head. Its state_dict names are the checkpoint's (`midlayer.*`, `fc`, `norm`, `lm_head`,
    `d2t`, `t2d`); `embed_tokens` exists only when the checkpoint carries its own."""

    def __init__(self, config: Eagle3Config, own_embedding: bool = False, own_lm_head: bool = True):
        super().__init__()
        c = self.config = config
        self.midlayer = _MidLayer(c)
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False) if c.use_aux_hidden_state else None
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False) if own_lm_head else None
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if own_embedding else None
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool)
                             if c.draft_vocab_size == c.vocab_size else torch.zeros(c.vocab_size, dtype=torch.bool))
        self.shared_embed: nn.Module | None = None  # the target's, when embed_tokens is None
        self.shared_lm_head: nn.Module | None = None  # the target's, when lm_head is None
        self.aux_layers: tuple[int, ...] = config.aux_layer_ids or ()  # the loader fills in the target's default
        # Llama RoPE over the whole head: the target's rotate-half RoPE with rotary_dim = head_dim. Not a module
        # buffer, which `.to(dtype)` would round to the head's dtype
        self.rotary = RotaryEmbedding(c.head_dim, c.rope_theta)

    # -- the pieces of one draft step (also used by the training script with its own attention masks) --

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        emb = self.embed_tokens if self.embed_tokens is not None else self.shared_embed
        return emb(token_ids)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """Target aux states [N, 3 * target_hidden] -> the draft's hidden input [N, hidden]."""
        return self.fc(aux) if self.fc is not None else aux

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """-> q [N, Hq, D], k [N, Hkv, D] (both roped), v [N, Hkv, D], residual [N, hidden]."""
        c, layer = self.config, self.midlayer
        if c.norm_before_residual:
            h = residual = layer.hidden_norm(hidden)
        else:
            residual, h = hidden, layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(embeds), h], dim=-1)
        att = layer.self_attn
        # q and k roped together (one set of kernels for both)
        qk = torch.cat([att.q_proj(x), att.k_proj(x)], dim=-1).view(-1, c.num_heads + c.num_kv_heads, c.head_dim)
        q, k = rope_ref(qk, *self.rotary(positions)).split([c.num_heads, c.num_kv_heads], 1)
        v = att.v_proj(x).view(-1, c.num_kv_heads, c.head_dim)
        return q, k, v, residual

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attention output [N, Hq * D] -> (final-normed [N, hidden], pre-norm [N, hidden]: the next step's
        hidden input)."""
        layer = self.midlayer
        residual = layer.self_attn.o_proj(attn) + residual
        residual = layer.mlp(layer.post_attention_layernorm(residual)) + residual
        return self.norm(residual), residual

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [N, draft_vocab] (the target's full vocabulary when the head is shared)."""
        head = self.lm_head if self.lm_head is not None else self.shared_lm_head
        return head(normed).float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
