"""Fixtures of the speculative-decoding tests: the oracle model (tests/oracle.py: MSA keeps 3 blocks of 8 tokens,
so contexts past 24 tokens drop blocks) with an `mtp.*` module and a byte tokenizer, and an EAGLE3 head for it
in the published layout."""

import json
import shutil

import pytest
import torch
from oracle import write_byte_tokenizer
from safetensors import safe_open
from safetensors.torch import save_file

from m3sdk.model import ModelConfig
from m3sdk.model.loader import expected_layer
from m3sdk.model.minimax_m3 import DecoderLayer
from m3sdk.speculative.eagle3 import Eagle3Config, Eagle3Head, save_eagle3


def add_mtp(path, model_config, seed=0):
    """Append a random `mtp.layers.0.*` module (published names) as a 4th shard of a minimax-layout checkpoint."""
    g = torch.Generator().manual_seed(seed)
    h = model_config.hidden_size
    last = model_config.num_layers - 1
    tensors = {f"mtp.layers.0.{n}.weight": torch.randn(h, generator=g) * 0.3
               for n in ("enorm", "hnorm", "final_layernorm")}
    tensors["mtp.layers.0.eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 0.1
    with torch.device("meta"):
        layer = DecoderLayer(model_config, last, torch.float32)
    params = dict(layer.named_parameters())
    for name, t in expected_layer(model_config, last, "minimax", prefix="").items():
        shape = params[t.param.removeprefix(f"layers.{last}.")][t.index].shape
        tensors["mtp.layers.0.transformer_layer." + name.removeprefix(f"layers.{last}.")] = \
            torch.randn(shape, generator=g) * (0.3 if name.endswith("norm.weight") else 0.1)
    save_file(tensors, str(path / "mtp.safetensors"))
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        index = json.loads(index_file.read_text())
        index["weight_map"].pop("mtp.layers.0.eh_proj.weight", None)
    else:  # one shard (a checkpoint transformers saved whole): an index over it and the new one
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            index = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), "model.safetensors")}
    index["weight_map"].update(dict.fromkeys(tensors, "mtp.safetensors"))
    index_file.write_text(json.dumps(index))
    return path


@pytest.fixture(scope="session")
def spec_checkpoint(oracle_checkpoint_minimax, tmp_path_factory):
    """The oracle checkpoint (published layout) with a random MTP module and a byte-level tokenizer."""
    path = tmp_path_factory.mktemp("spec") / "ckpt"
    shutil.copytree(oracle_checkpoint_minimax, path)
    add_mtp(path, ModelConfig.from_pretrained(path))
    write_byte_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def eagle3_head(tmp_path_factory):
    """A random EAGLE3 head for the oracle target (hidden 64, vocab 256, aux layers 1-3), reduced vocabulary of
    200 tokens, its own embedding."""
    torch.manual_seed(0)
    config = Eagle3Config(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                          vocab_size=256, draft_vocab_size=200, target_hidden_size=64, aux_layer_ids=(1, 2, 3))
    head = Eagle3Head(config, own_embedding=True)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.1)
        ids = torch.randperm(256)[:200].sort().values
        head.d2t.copy_(ids - torch.arange(200))
        head.t2d.zero_()
        head.t2d[ids] = True
    path = tmp_path_factory.mktemp("eagle3") / "head"
    save_eagle3(head, path)
    return path

