"""The MTP drafter: the checkpoint's `mtp.layers.0.*` module, loaded by name and shape, drafting through its
own paged one-layer pool, against a full recompute of the same module over a fresh pool."""

import pytest
import torch

from m3sdk.attention.base import AttentionMetadata
from m3sdk.cache.kv_pool import KVCacheSpec, KVPool
from m3sdk.errors import CheckpointError
from m3sdk.model import load_model
from m3sdk.speculative.base import DraftRequest, TargetInfo, TargetStates
from m3sdk.speculative.mtp import MtpDrafter, load_mtp


@pytest.fixture(scope="module")
def mtp_model(spec_checkpoint):
    return load_model(spec_checkpoint, dtype=torch.float32), spec_checkpoint


def target_info(model, path, pages=64):
    spec = KVCacheSpec.for_model(model.config, pages, kv_dtype="fp32", index_dtype="fp32", model_dtype=torch.float32)
    return TargetInfo(config=model.config, embed_tokens=model.embed_tokens, lm_head=model.lm_head,
                      checkpoint=str(path), model=model, kv_spec=spec, num_cache_pages=pages)


def reference(model, module, hidden, next_tokens, start, k):
    """Recompute every entry (committed ones from the target's hidden, chain ones from the module's output) in
    one forward over a fresh pool, k times."""
    hs, toks, drafts = hidden.clone(), list(next_tokens), []
    spec = KVCacheSpec(8, 1, model.config.num_kv_heads, model.config.head_dim, (), model.config.index_head_dim,
                       kv_dtype="fp32", index_dtype="fp32", model_dtype=torch.float32)
    for _ in range(k):
        n = len(toks)
        pos = torch.arange(start, start + n)
        x = module.eh_proj(torch.cat([module.enorm(model.embed_tokens(torch.tensor(toks))), module.hnorm(hs)], -1))
        cos, sin = model.rotary(pos)
        meta = AttentionMetadata.build([n], [n], [list(range(8))])
        out = module.final_layernorm(module.transformer_layer(x, cos, sin, meta, KVPool(spec), model.attn_backend))
        drafts.append(int(model.lm_head(out[-1]).argmax()))
        hs = torch.cat([hs, out[-1:]])
        toks.append(drafts[-1])
    return drafts


def test_mtp_loads_and_drafts_like_a_full_recompute(mtp_model):
    model, path = mtp_model
    target = target_info(model, path)
    module = load_mtp(target)
    assert torch.equal(module.eh_proj.weight, model.mtp_weights["mtp.layers.0.eh_proj.weight"])
    drafter = MtpDrafter(module, target, 3, num_pages=8)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(3, 256, (30,), generator=g).tolist()
    hidden = torch.randn(29, 64, generator=g)
    # observed at positions 5..33 (a prefix-cache hit skipped 0..4), in two chunks
    drafter.observe([("r", TargetStates(5, tokens[1:20], hidden[:19]))])
    drafter.observe([("r", TargetStates(24, tokens[20:30], hidden[19:]))])
    request = DraftRequest("r", [0] * 34 + [tokens[-1]], 3)
    assert drafter.propose([request])[0].tokens == reference(model, module, hidden, tokens[1:30], 5, 3)
    # a gap (the next observed position is not the context's end) restarts the context there
    drafter.observe([("r", TargetStates(40, tokens[:3], hidden[:3]))])
    assert drafter._seqs["r"].ctx.first == 40 and drafter.pool.num_free == 7
    drafter.release("r")
    assert drafter.pool.num_free == 8  # its pages are back


def test_mtp_needs_the_modules(oracle_checkpoint):
    model = load_model(oracle_checkpoint, dtype=torch.float32)
    with pytest.raises(CheckpointError, match="mtp"):
        load_mtp(target_info(model, oracle_checkpoint))
