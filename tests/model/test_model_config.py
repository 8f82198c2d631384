"""ModelConfig from config.json: both spellings give the same model; what we cannot honour is a named error."""

import json
from dataclasses import replace

import pytest

from m3sdk.errors import CheckpointError
from m3sdk.model import ModelConfig


def test_transformers_config(oracle_checkpoint):
    c = ModelConfig.from_pretrained(oracle_checkpoint)
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (4, 64, 4, 2, 16)
    assert c.rotary_dim == 8 and c.rope_theta == 10000.0
    assert c.sparse_layers == (1, 2) and c.moe_layers == (1, 2, 3) and c.dense_layers == (0,)
    assert (c.index_n_heads, c.index_head_dim, c.index_block_size, c.index_topk_blocks, c.index_local_blocks) == (
        2, 16, 8, 3, 1)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 32)
    assert (c.shared_intermediate_size, c.dense_intermediate_size, c.routed_scaling_factor) == (32, 96, 2.0)
    assert c.architecture == "MiniMaxM3VLForCausalLM" and c.eos_token_ids == (2,)


def test_published_config_reads_the_same(oracle_checkpoint, oracle_checkpoint_minimax):
    hf = ModelConfig.from_pretrained(oracle_checkpoint)
    pub = ModelConfig.from_pretrained(oracle_checkpoint_minimax)
    assert pub.architecture == "MiniMaxM3SparseForConditionalGeneration" and pub.num_mtp_modules == 1
    assert replace(pub, architecture=hf.architecture, num_mtp_modules=0) == hf


def published(oracle_checkpoint_minimax) -> dict:
    return json.loads((oracle_checkpoint_minimax / "config.json").read_text())


@pytest.mark.parametrize("edit,field", [
    (lambda t: t.update(attention_output_gate=True), "attention_output_gate"),
    (lambda t: t.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type"),
    (lambda t: t["sparse_attention_config"].update(sparse_score_type="sum"), "sparse_score_type"),
    (lambda t: t["sparse_attention_config"].update(sparse_init_block=1), "sparse_init_block"),
    (lambda t: t["sparse_attention_config"].update(sparse_disable_index_value=[0, 0, 1, 0]),
     "sparse_disable_index_value"),
    (lambda t: t.update(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
     "quant_method='fp8' is not supported .*mxfp8"),
    (lambda t: t.update(quantization_config={"quant_method": "mxfp8", "weight_block_size": [128, 128]}),
     "weight_block_size"),
    (lambda t: t.update(quantization_config={"quant_method": "quark", "global_quant_config": {"weight": {
        "dtype": "fp8_e4m3", "qscheme": "per_channel"}}}), "global_quant_config.weight"),
    (lambda t: t.update(quantization_config={"quant_method": "quark", "global_quant_config": {"weight": {
        "dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0"}},
        "layer_quant_config": {"*self_attn*": {}}}), "layer_quant_config"),
    (lambda t: t.update(rotary_dim=16), "rotary_dim"),
    (lambda t: t.update(scoring_func="softmax"), "scoring_func"),
    (lambda t: t.update(moe_layer_freq=[0, 1]), "moe_layer_freq"),
    (lambda t: t.update(index_topk_blocks=5), "sparse_topk_blocks"),
])
def test_unsupported_fields_are_named(oracle_checkpoint_minimax, edit, field):
    raw = published(oracle_checkpoint_minimax)
    edit(raw["text_config"])
    with pytest.raises(CheckpointError, match=field):
        ModelConfig.from_dict(raw)


def test_all_problems_in_one_error(oracle_checkpoint_minimax):
    raw = published(oracle_checkpoint_minimax)
    raw["text_config"].update(attention_output_gate=True, scoring_func="softmax")
    del raw["text_config"]["vocab_size"]
    with pytest.raises(CheckpointError) as e:
        ModelConfig.from_dict(raw)
    assert all(s in str(e.value) for s in ("attention_output_gate", "scoring_func", "missing vocab_size"))


def test_unknown_architecture(oracle_checkpoint_minimax):
    raw = published(oracle_checkpoint_minimax)
    raw["architectures"] = ["LlamaForCausalLM"]
    with pytest.raises(CheckpointError, match="unknown architecture.*LlamaForCausalLM"):
        ModelConfig.from_dict(raw)
    with pytest.raises(CheckpointError, match="unknown model_type 'llama'"):
        ModelConfig.from_dict({"model_type": "llama", "hidden_size": 8})


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable config"):
        ModelConfig.from_pretrained(tmp_path)


def test_absent_rope_theta_defaults_like_transformers(oracle_checkpoint):
    # a config without any rope_theta is served by transformers with MiniMax-M3's theta (5e6), not Llama's 1e4
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

    raw = json.loads((oracle_checkpoint / "config.json").read_text())
    text = raw.get("text_config", raw)
    text.pop("rope_theta", None)
    text["rope_parameters"].pop("rope_theta")
    want = MiniMaxM3VLTextConfig(num_hidden_layers=1).rope_parameters["rope_theta"]
    assert ModelConfig.from_dict(raw).rope_theta == want == 5e6
