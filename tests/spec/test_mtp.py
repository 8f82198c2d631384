"""The MTP drafter: the checkpoint's `mtp.layers.0.*` module, loaded by name and shape, drafting through its
own paged one-layer pool, against a full recompute of the same module over a fresh pool."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from m3sdk.attention.base import AttentionMetadata
from m3sdk.cache.kv_pool import KVCacheSpec, KVPool
from m3sdk.errors import CheckpointError
from m3sdk.model import ModelConfig, load_model
from m3sdk.model.loader import _expected_layer
from m3sdk.spec.base import DraftRequest, TargetInfo, TargetStates
from m3sdk.spec.mtp import MtpDrafter, load_mtp


def add_mtp(path, model_config, seed=0):
    """Append a random `mtp.layers.0.*` module (published names) as a 4th shard of a minimax-layout checkpoint."""
    g = torch.Generator().manual_seed(seed)
    h = model_config.hidden_size
    last = model_config.num_layers - 1
    tensors = {f"mtp.layers.0.{n}.weight": torch.randn(h, generator=g) * 0.3
               for n in ("enorm", "hnorm", "final_layernorm")}
    tensors["mtp.layers.0.eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 0.1
    with torch.device("meta"):
        from m3sdk.model.minimax_m3 import DecoderLayer
        layer = DecoderLayer(model_config, last, torch.float32)
    params = dict(layer.named_parameters())
    for name, t in _expected_layer(model_config, last, "minimax", prefix="").items():
        shape = params[t.param.removeprefix(f"layers.{last}.")][t.index].shape
        tensors["mtp.layers.0.transformer_layer." + name.removeprefix(f"layers.{last}.")] = \
            torch.randn(shape, generator=g) * (0.3 if name.endswith("norm.weight") else 0.1)
    save_file(tensors, str(path / "mtp.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].pop("mtp.layers.0.eh_proj.weight")
    index["weight_map"].update(dict.fromkeys(tensors, "mtp.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


@pytest.fixture(scope="module")
def mtp_model(oracle_checkpoint_minimax, tmp_path_factory):
    path = tmp_path_factory.mktemp("oracle_mtp") / "ckpt"
    shutil.copytree(oracle_checkpoint_minimax, path)
    add_mtp(path, ModelConfig.from_pretrained(path))
    return load_model(path, dtype=torch.float32), path


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
