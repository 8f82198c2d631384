"""The loader: both name layouts, dtypes, mtp/vision handling, and one clear error per bad checkpoint."""

import json
import shutil

import pytest
import torch
from oracle import PagedSequences, load_oracle, make_oracle_checkpoint
from safetensors.torch import load_file, save_file

from m3sdk.cache.kv_pool import KVCacheSpec, KVPool
from m3sdk.errors import CheckpointError
from m3sdk.model import load_model


def logits(model, ids):
    kv = KVPool(KVCacheSpec.for_model(model.config, 8, kv_dtype="fp32", index_dtype="fp32",
                                      model_dtype=model.dtype))
    return PagedSequences(kv).step(model, {"s": ids})["s"]


def test_minimax_layout_gives_the_same_logits(oracle_checkpoint, oracle_checkpoint_minimax):
    ids = torch.randint(3, 256, (90,), generator=torch.Generator().manual_seed(5)).tolist()
    hf = load_model(oracle_checkpoint, dtype=torch.float32)
    mm = load_model(oracle_checkpoint_minimax, dtype=torch.float32)
    assert (oracle_checkpoint_minimax / "model.safetensors.index.json").is_file()
    for (name, a), (_, b) in zip(hf.state_dict().items(), mm.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(logits(hf, ids), logits(mm, ids))
    # vision tensors skipped, mtp tensors kept aside (read on access)
    assert list(mm.mtp_weights) == ["mtp.layers.0.eh_proj.weight"]
    assert mm.mtp_weights["mtp.layers.0.eh_proj.weight"].shape == (64, 128)
    assert len(hf.mtp_weights) == 0


def test_vl_wrapper_names_and_nested_config(oracle_checkpoint, tmp_path):
    """What transformers' VL class saves: model.language_model.*, lm_head, a vision tower, nested text_config."""
    tensors = {("lm_head.weight" if k == "lm_head.weight" else k.replace("model.", "model.language_model.", 1)): v
               for k, v in load_file(oracle_checkpoint / "model.safetensors").items()}
    tensors["model.vision_tower.layers.0.mlp.fc1.weight"] = torch.zeros(4, 4)
    tmp_path.mkdir(exist_ok=True)
    save_file(tensors, tmp_path / "model.safetensors")
    text = json.loads((oracle_checkpoint / "config.json").read_text())
    config = {"architectures": ["MiniMaxM3VLForConditionalGeneration"], "model_type": "minimax_m3_vl",
              "text_config": text, "vision_config": {}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ids = list(range(3, 80))
    assert torch.equal(logits(load_model(tmp_path, dtype=torch.float32), ids),
                       logits(load_model(oracle_checkpoint, dtype=torch.float32), ids))


def test_tied_embeddings(tmp_path):
    path = make_oracle_checkpoint(tmp_path, layout="hf", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model = load_model(path, dtype=torch.float32)
    assert model.lm_head.weight is model.embed_tokens.weight
    ids = list(range(3, 60))
    with torch.no_grad():
        ref = load_oracle(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits(model, ids), ref, rtol=0, atol=1e-4 * ref.abs().max().item())


def test_bf16_load_keeps_router_in_fp32(oracle_checkpoint):
    m = load_model(oracle_checkpoint, dtype=torch.bfloat16)
    ref = load_file(oracle_checkpoint / "model.safetensors")
    moe = m.layers[1].mlp
    assert moe.router_weight.dtype == moe.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(moe.router_weight, ref["model.layers.1.mlp.gate.weight"])
    assert torch.equal(moe.e_score_correction_bias, ref["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert moe.w_gate_up.dtype == m.layers[1].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert torch.equal(moe.w_down, ref["model.layers.1.mlp.experts.down_proj"].bfloat16())


def broken(src, tmp_path, edit):
    """A copy of the hf-layout oracle checkpoint with its tensors edited."""
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_missing_tensor(oracle_checkpoint, tmp_path):
    path = broken(oracle_checkpoint, tmp_path, lambda t: t.pop("model.layers.2.self_attn.indexer.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"1 missing tensors:\n\s+model.layers.2.self_attn.indexer.k_proj"):
        load_model(path)


def test_wrong_shape(oracle_checkpoint, tmp_path):
    def edit(t):
        t["model.layers.1.mlp.experts.down_proj"] = torch.zeros(8, 64, 31)

    path = broken(oracle_checkpoint, tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.experts.down_proj: \[8, 64, 31\], expected "
                                              r"\[8, 64, 32\]"):
        load_model(path)


def test_every_problem_in_one_error(oracle_checkpoint, tmp_path):
    def edit(t):
        t.pop("model.norm.weight")
        t.pop("model.layers.0.mlp.down_proj.weight")
        t["model.layers.3.self_attn.q_norm.weight"] = torch.zeros(17)
        t["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(1)
        t["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"].to(
            torch.float8_e4m3fn)

    with pytest.raises(CheckpointError) as e:
        load_model(broken(oracle_checkpoint, tmp_path, edit))
    msg = str(e.value)
    assert "2 missing tensors" in msg and "model.norm.weight" in msg and "layers.0.mlp.down_proj" in msg
    assert "1 wrong shapes" in msg and "q_norm.weight: [17], expected [16]" in msg
    assert "1 unexpected tensors" in msg and "layers.0.mlp.experts.gate_up_proj" in msg
    assert "1 wrong dtypes" in msg and "o_proj.weight: F8_E4M3, expected BF16 or F16 or F32" in msg


def test_unknown_architecture(oracle_checkpoint, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(oracle_checkpoint, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unknown architecture.*Qwen3ForCausalLM"):
        load_model(dst)


def test_missing_config_or_weights(oracle_checkpoint, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(oracle_checkpoint, dst)
    (dst / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(dst)
    shutil.copy(oracle_checkpoint / "config.json", dst / "config.json")
    (dst / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json or model.safetensors"):
        load_model(dst)


def test_index_naming_a_missing_shard(oracle_checkpoint_minimax, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(oracle_checkpoint_minimax, dst)
    (dst / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shards that do not exist.*model-00002-of-00003"):
        load_model(dst)


def test_progress_bar_only_when_asked(oracle_checkpoint, capfd):
    load_model(oracle_checkpoint, "cpu", torch.float32)
    assert capfd.readouterr().err == ""  # an embedded engine prints nothing
    load_model(oracle_checkpoint, "cpu", torch.float32, progress=True)
    err = capfd.readouterr().err
    assert f"loading {oracle_checkpoint.name}" in err
