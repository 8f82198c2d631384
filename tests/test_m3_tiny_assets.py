"""The bundled m3-tiny checkpoint: complete, small, loadable by transformers, really sparse, and trained."""

import json
import lzma
from importlib.resources import files
from pathlib import Path

import jinja2
import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

ASSETS = Path(str(files("m3sdk") / "assets" / "m3-tiny"))
CORPUS = Path(__file__).resolve().parent.parent / "data" / "austen.txt.xz"
FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
         "generation_config.json", "README.md"]
SIZE_LIMIT = 8_000_000  # bytes for the whole folder: m3-tiny ships inside the wheel


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((ASSETS / "config.json").read_text())


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(ASSETS / "tokenizer.json"))


@pytest.fixture(scope="module")
def model():
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    return MiniMaxM3VLForCausalLM.from_pretrained(ASSETS, dtype=torch.float32).eval()


def test_folder_is_complete_and_small() -> None:
    missing = [name for name in FILES if not (ASSETS / name).is_file()]
    assert not missing, f"m3-tiny lacks {missing}"
    size = sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file())
    assert size <= SIZE_LIMIT, f"m3-tiny is {size:,} bytes, over {SIZE_LIMIT:,}"


def test_architecture_has_every_m3_part(config: dict) -> None:
    assert config["model_type"] == "minimax_m3_vl_text"
    assert config["architectures"] == ["MiniMaxM3VLForCausalLM"]
    assert "full_attention" in config["layer_types"] and "minimax_m3_sparse" in config["layer_types"]
    assert "dense" in config["mlp_layer_types"] and "sparse" in config["mlp_layer_types"]
    assert config["num_local_experts"] > config["num_experts_per_tok"] >= 2
    assert config["shared_intermediate_size"] > 0
    assert config["index_n_heads"] == config["num_key_value_heads"]
    assert config["rope_parameters"]["partial_rotary_factor"] * config["head_dim"] == config["rotary_dim"]


def test_weights_are_bf16_with_transformers_names(config: dict) -> None:
    with safe_open(ASSETS / "model.safetensors", "pt") as f:
        names = set(f.keys())
        dtypes = {name: f.get_slice(name).get_dtype() for name in names}
    sparse = config["layer_types"].index("minimax_m3_sparse")
    moe = config["mlp_layer_types"].index("sparse")
    for name in [f"model.layers.{sparse}.self_attn.indexer.q_proj.weight",
                 f"model.layers.{sparse}.self_attn.indexer.k_norm.weight",
                 f"model.layers.{moe}.mlp.experts.gate_up_proj", f"model.layers.{moe}.mlp.gate.weight",
                 f"model.layers.{moe}.mlp.shared_experts.down_proj.weight", "lm_head.weight"]:
        assert name in names
    for name, dtype in dtypes.items():  # as in MiniMax-M3, the router bias stays fp32
        assert dtype == ("F32" if name.endswith("e_score_correction_bias") else "BF16"), name


def test_msa_drops_blocks_within_the_context(config: dict, model) -> None:
    covered = config["index_topk_blocks"] * config["index_block_size"]
    assert covered < config["max_position_embeddings"]
    seq = covered + 4 * config["index_block_size"]  # past the point where selection must leave blocks out
    selections = []
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda m, a, out: selections.append(out[0]))
             for layer in model.model.layers if layer.self_attn.indexer is not None]
    with torch.no_grad():
        model(input_ids=torch.randint(3, config["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(0)))
    for hook in hooks:
        hook.remove()
    visible = torch.arange(seq) // config["index_block_size"] + 1
    for selection in selections:  # [index heads, queries, topk], -1 padded
        kept = (selection >= 0).sum(-1)
        assert torch.equal(kept, visible.clamp(max=config["index_topk_blocks"]).expand_as(kept))
        assert (kept < visible).any()


def test_tokenizer_round_trips_and_knows_the_special_tokens(config: dict, tokenizer: Tokenizer) -> None:
    text = 'It is a truth universally acknowledged -- "café", 42%, naïve\n\ttabs & émojis 🙂.'
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    assert 2000 <= tokenizer.get_vocab_size() == config["vocab_size"] <= 4096
    special = json.loads((ASSETS / "tokenizer_config.json").read_text())
    generation = json.loads((ASSETS / "generation_config.json").read_text())
    assert tokenizer.token_to_id(special["bos_token"]) == config["bos_token_id"] == generation["bos_token_id"]
    assert tokenizer.token_to_id(special["eos_token"]) == config["eos_token_id"] == generation["eos_token_id"]
    assert tokenizer.encode(special["eos_token"]).ids == [config["eos_token_id"]]


def test_chat_template_renders(tokenizer: Tokenizer) -> None:
    special = json.loads((ASSETS / "tokenizer_config.json").read_text())
    template = jinja2.Environment().from_string((ASSETS / "chat_template.jinja").read_text())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Good day."}, {"role": "user", "content": "Go on"}]
    prompt = template.render(messages=messages, bos_token=special["bos_token"], add_generation_prompt=True)
    assert prompt == ("]~!b[]~b]system\nBe brief.[e~[\n]~b]user\nHello[e~[\n]~b]ai\nGood day.[e~[\n"
                      "]~b]user\nGo on[e~[\n]~b]ai\n")
    ids = tokenizer.encode(prompt).ids
    assert ids[0] == tokenizer.token_to_id("]~!b[") and ids.count(tokenizer.token_to_id("[e~[")) == 4


def test_weights_are_trained(config: dict, tokenizer: Tokenizer, model) -> None:
    """Held-out Austen text scores far better than chance (log 2048 = 7.6 nats): the shipped weights are trained."""
    paragraphs = [p for book in lzma.decompress(CORPUS.read_bytes()).decode().strip().split("\n\n")
                  for i, p in enumerate(book.split("\n")) if i % 50 == 49]  # the trainer's validation split
    ids = torch.tensor([tokenizer.encode("\n".join(paragraphs)[:2000]).ids[:257]])
    with torch.no_grad():
        logits = model(input_ids=ids[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:]).item()
    assert loss < 4.5, loss
