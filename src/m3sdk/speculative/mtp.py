"""MTP: the checkpoint's own multi-token-prediction module (`mtp.layers.0.*`), DeepSeek-V3 style.

Layout (MiniMax-M3 keeps it beside the text model; our loader sets it aside in `model.mtp_weights`):
  `mtp.layers.0.enorm.weight`, `.hnorm.weight` (Gemma norms of the next token's embedding and of the target's
  hidden state), `.eh_proj.weight` [hidden, 2 * hidden] over their concatenation [enorm(emb) | hnorm(h)],
  `.transformer_layer.*` (one full M3 decoder layer, built like the model's last layer: on M3 that is MSA +
  MoE, under the same tensor names as the model's layers), `.final_layernorm.weight`. The embedding and the
  lm_head are the target's.
Entry t reads the target's final hidden state at t and token t + 1 and predicts token t + 2; a chain feeds the
module's own normed output back (the one module serves every depth, as engines do when k exceeds the number of
MTP modules). Its decoder layer runs over a private one-layer paged KV pool (K, V and, on an MSA layer, index
keys) with the target's attention backend, so draft tokens get their own MSA selection too.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from m3sdk.attention.base import AttentionMetadata
from m3sdk.cache.kv_pool import KVPool
from m3sdk.cache.page_pool import PagePool, pages_for
from m3sdk.errors import CheckpointError
from m3sdk.model.config import ModelConfig
from m3sdk.model.layers import RMSNorm
from m3sdk.model.loader import expected_layer
from m3sdk.model.minimax_m3 import DecoderLayer
from m3sdk.speculative.base import SpecConfig, TargetInfo, register
from m3sdk.speculative.chain import ChainDrafter

PREFIX = "mtp.layers.0."


class MtpModule(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(h, eps, dtype)
        self.hnorm = RMSNorm(h, eps, dtype)
        self.eh_proj = nn.Linear(2 * h, h, bias=False, dtype=dtype)
        self.transformer_layer = DecoderLayer(config, config.num_layers - 1, dtype)
        self.transformer_layer.self_attn.layer = 0  # layer 0 of the drafter's own one-layer pool
        self.final_layernorm = RMSNorm(h, eps, dtype)
        self.requires_grad_(False)


def load_mtp(target: TargetInfo) -> MtpModule:
    """Module 0 of the target's `mtp.*` tensors, every tensor checked by name and shape."""
    weights = getattr(target.model, "mtp_weights", {}) or {}
    if not any(n.startswith(PREFIX) for n in weights):
        raise CheckpointError(f"speculative mtp: the checkpoint {target.checkpoint} has no {PREFIX}* tensors")
    c: ModelConfig = target.config
    last = c.num_layers - 1
    layout = "hf" if any(n.endswith("gate_up_proj.weight") or ".indexer." in n for n in weights) else "minimax"
    expected: dict[str, tuple[str, tuple]] = {
        f"{PREFIX}{n}.weight": (f"{n}.weight", ()) for n in ("enorm", "hnorm", "eh_proj", "final_layernorm")}
    for name, t in expected_layer(c, last, layout, prefix="").items():
        inner = name.removeprefix(f"layers.{last}.")
        expected[f"{PREFIX}transformer_layer.{inner}"] = (
            "transformer_layer." + t.param.removeprefix(f"layers.{last}."), t.index)
    with torch.device("meta"):
        module = MtpModule(c, target.dtype)
    module.to_empty(device=target.device)
    params = dict(module.named_parameters())
    missing = sorted(n for n in expected if n not in weights)
    if missing:
        raise CheckpointError(f"speculative mtp: missing tensors {missing[:20]}")
    bad = []
    for name, (param, index) in expected.items():
        tensor = weights[name]
        dest = params[param][index]
        if tuple(tensor.shape) != tuple(dest.shape):
            bad.append(f"{name} {list(tensor.shape)} != {list(dest.shape)}")
            continue
        dest.copy_(tensor)
    if bad:
        raise CheckpointError(f"speculative mtp: misshapen tensors {bad}")
    return module.eval()


@dataclasses.dataclass
class PagedContext:
    """A request's entries in the drafter's pool: positions first .. first + length - 1 at slots 0 .. length - 1
    of its own pages (relative slots: the pool holds only what the draft has seen)."""

    first: int
    pages: list[int]
    length: int = 0

    @property
    def end(self) -> int:
        return self.first + self.length


class MtpDrafter(ChainDrafter):
    method = "mtp"

    def __init__(self, module: MtpModule, target: TargetInfo, num_speculative_tokens: int, num_pages: int):
        super().__init__(num_speculative_tokens)
        self.module = module
        self.model = target.model
        c = target.config
        sparse = (0,) if c.is_sparse(c.num_layers - 1) else ()
        self.kv = KVPool(dataclasses.replace(target.kv_spec, num_pages=num_pages, num_layers=1, sparse_layers=sparse))
        self.pool = PagePool(num_pages)

    def new_context(self, first: int, device: torch.device) -> PagedContext:
        return PagedContext(first, [])

    def drop_context(self, ctx: PagedContext) -> None:
        self.pool.release_all(self.pool.decref_all(ctx.pages))
        ctx.pages.clear()

    def run(self, ctxs: list[PagedContext], counts: list[int], token_ids: torch.Tensor, hidden: torch.Tensor,
            positions: torch.Tensor, from_target: bool) -> torch.Tensor:
        m = self.module
        for ctx, n in zip(ctxs, counts, strict=True):
            for _ in range(pages_for(ctx.length + n) - len(ctx.pages)):
                if self.pool.num_free == 0:
                    raise RuntimeError("the MTP drafter's KV pool is full")  # sized to never happen
                ctx.pages.append(self.pool.take())
        meta = AttentionMetadata.build(counts, [ctx.length + n for ctx, n in zip(ctxs, counts, strict=True)],
                                       [ctx.pages for ctx in ctxs], device=hidden.device)
        for ctx, n in zip(ctxs, counts, strict=True):
            ctx.length += n
        emb = self.model.embed_tokens(token_ids)
        x = m.eh_proj(torch.cat([m.enorm(emb), m.hnorm(hidden.to(emb.dtype))], dim=-1))
        cos, sin = self.model.rotary(positions)  # absolute positions; the pool's slots are relative
        x = m.transformer_layer(x, cos, sin, meta, self.kv, self.model.attn_backend)
        return m.final_layernorm(x)

    def tokens(self, out: torch.Tensor) -> list[int]:
        return self.model.lm_head(out).argmax(-1).tolist()


@register("mtp")
def _build(config: SpecConfig, target: TargetInfo) -> MtpDrafter:
    if config.model is not None:
        raise CheckpointError("speculative mtp reads the target checkpoint's own mtp.* modules: pass no model")
    # live draft contexts hold at most the target's computed slots plus one partial page each for the chain
    pages = 2 * target.num_cache_pages
    return MtpDrafter(load_mtp(target), target, config.num_speculative_tokens, pages)
