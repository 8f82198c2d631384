"""The transformers oracle and tiny MiniMax-M3 checkpoints built from it, shared by the model and engine tests.

`make_oracle_checkpoint(dir, layout)` writes a random-weight checkpoint of ORACLE_CONFIG:
  4 layers: 0 full attention + dense MLP, 1-2 MSA sparse attention + MoE, 3 full attention + MoE;
  vocab 256, hidden 64, 4 query heads / 2 KV heads of 16 dims (RoPE on the first 8), 8 experts (top 2, width 32),
  shared expert 32, dense MLP 96; indexer 2 heads x 16 dims, blocks of 8 tokens, top 3 blocks, 1 local block.
  So any query at position >= 24 sees more blocks than it may keep: sparsity engages on short prompts.
Every weight is random, norm weights and router bias included (transformers initializes norms to the identity,
which would hide a wrong norm), and the MLP input weights are large enough that the SwiGLU-OAI clamp engages.
layout="hf" is transformers' own `save_pretrained` (one model.safetensors). layout="minimax" re-lays the same
weights under the published names (language_model.model..., experts.E.w1/w3/w2, block_sparse_moe, index_q_proj,
nested text_config with sparse_attention_config) in 3 shards with an index file, plus a stray vision tensor
(no vision_config: the text loader skips it and no vision encoder is built)
and an mtp tensor (to keep aside). Both hold identical numbers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import tokenizers
import torch
from safetensors.torch import save_file
from tokenizers import decoders, models, pre_tokenizers

from m3sdk.attention.base import PAGE_SIZE, AttentionMetadata
from m3sdk.cache.kv_pool import KVPool

ORACLE_CONFIG = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    rotary_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    intermediate_size=32, shared_intermediate_size=32, dense_intermediate_size=96, num_local_experts=8,
    num_experts_per_tok=2, routed_scaling_factor=2.0, rms_norm_eps=1e-6, max_position_embeddings=4096,
    layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse", "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    index_n_heads=2, index_head_dim=16, index_block_size=8, index_topk_blocks=3, index_local_blocks=1,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
)


def oracle_model(seed: int = 0, **overrides):
    """A random-weight transformers MiniMaxM3VLForCausalLM (float32, eager attention) of ORACLE_CONFIG."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    config = MiniMaxM3VLTextConfig(**{**ORACLE_CONFIG, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomized(MiniMaxM3VLForCausalLM(config).eval(), seed)


def randomized(model, seed: int):
    """`model` with seeded random weights, gate_up weights large enough that SwiGLU-OAI's clamp at 7 engages
    (~10% of gate/up values) and small router score biases."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.3 if name.endswith("norm.weight") else 0.6 if "gate_up_proj" in name else 0.1
            p.copy_(torch.randn(p.shape, generator=g) * std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    return model


def load_oracle(path: Path):
    """The transformers model of a layout="hf" oracle checkpoint, in float32 with eager attention."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    return MiniMaxM3VLForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def make_oracle_checkpoint(directory: Path, layout: str = "hf", seed: int = 0, **overrides) -> Path:
    """Write the oracle checkpoint (see the module doc) into `directory` and return it."""
    directory = Path(directory)
    model = oracle_model(seed, **overrides)
    if layout == "hf":
        model.save_pretrained(directory)
        return directory
    if layout != "minimax":
        raise ValueError(f"layout must be 'hf' or 'minimax', not {layout!r}")
    directory.mkdir(parents=True, exist_ok=True)
    tensors = _to_minimax_names(model.state_dict(), model.config)
    tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.randn(8, 3, 2, 2, 2)
    tensors["mtp.layers.0.eh_proj.weight"] = torch.randn(64, 128)
    names = sorted(tensors)
    shards = [names[i::3] for i in range(3)]
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in shard}, directory / file)
        weight_map.update(dict.fromkeys(shard, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(_published_config(model.config), indent=1))
    return directory


def _to_minimax_names(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    out = {"language_model.lm_head.weight": state["lm_head.weight"]}
    for name, t in state.items():
        if not name.startswith("model."):
            continue
        rest = name.removeprefix("model.")
        base = "language_model.model."
        if ".mlp.experts.gate_up_proj" in rest:
            layer = rest.split(".mlp.")[0]
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                out[f"{base}{layer}.block_sparse_moe.experts.{e}.w1.weight"] = gate[e]
                out[f"{base}{layer}.block_sparse_moe.experts.{e}.w3.weight"] = up[e]
        elif ".mlp.experts.down_proj" in rest:
            layer = rest.split(".mlp.")[0]
            for e in range(t.shape[0]):
                out[f"{base}{layer}.block_sparse_moe.experts.{e}.w2.weight"] = t[e]
        elif rest.endswith("gate_up_proj.weight"):  # dense MLP and shared expert: split gate | up
            gate, up = t.chunk(2, dim=0)
            out[base + _moe_name(rest.replace("gate_up_proj", "gate_proj"))] = gate
            out[base + _moe_name(rest.replace("gate_up_proj", "up_proj"))] = up
        else:
            out[base + _moe_name(rest.replace("self_attn.indexer.", "self_attn.index_"))] = t
    return out


def _moe_name(rest: str) -> str:
    """transformers' MoE names -> the published ones (the dense MLP keeps `mlp.`)."""
    for hf, orig in ((".mlp.gate.e_score_correction_bias", ".block_sparse_moe.e_score_correction_bias"),
                     (".mlp.gate.", ".block_sparse_moe.gate."),
                     (".mlp.shared_experts.", ".block_sparse_moe.shared_experts.")):
        rest = rest.replace(hf, orig)
    return rest


def _published_config(c) -> dict:
    """The config.json spelling of the released checkpoint: nested text_config, sparse_attention_config."""
    sparse = [int(t == "minimax_m3_sparse") for t in c.layer_types]
    text = {
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "rotary_dim": c.rotary_dim, "rope_theta": c.rope_parameters["rope_theta"],
        "partial_rotary_factor": c.rope_parameters["partial_rotary_factor"],
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
        "intermediate_size": c.intermediate_size, "shared_intermediate_size": c.shared_intermediate_size,
        "dense_intermediate_size": c.dense_intermediate_size, "num_local_experts": c.num_local_experts,
        "num_experts_per_tok": c.num_experts_per_tok, "routed_scaling_factor": c.routed_scaling_factor,
        "hidden_act": "swigluoai", "swiglu_alpha": c.swiglu_alpha, "swiglu_beta": 1.0, "swiglu_limit": c.swiglu_limit,
        "scoring_func": "sigmoid", "use_routing_bias": True, "use_gemma_norm": True, "use_qk_norm": True,
        "qk_norm_type": "per_head", "attention_output_gate": False, "n_shared_experts": 1, "num_mtp_modules": 1,
        "moe_layer_freq": [int(t == "sparse") for t in c.mlp_layer_types],
        "sparse_attention_config": {
            "use_sparse_attention": True, "sparse_attention_freq": sparse,
            "sparse_num_index_heads": c.index_n_heads, "sparse_index_dim": c.index_head_dim,
            "sparse_block_size": c.index_block_size, "sparse_topk_blocks": c.index_topk_blocks,
            "sparse_local_block": c.index_local_blocks, "sparse_init_block": 0, "sparse_score_type": "max",
            "sparse_disable_index_value": sparse,
        },
        "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "tie_word_embeddings": False,
        "model_type": "minimax_m3", "torch_dtype": "float32",
    }
    return {"architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
            "text_config": text}


class PagedSequences:
    """Test-side page bookkeeping over a KVPool: pages handed out in a shuffled order, so page tables are never
    the identity, and one `step` runs several sequences' new tokens in one ragged forward."""

    def __init__(self, kv: KVPool, seed: int = 0):
        self.kv = kv
        self.free = list(range(kv.num_pages))
        random.Random(seed).shuffle(self.free)
        self.pages: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}

    def step(self, model, feeds: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Append each sequence's new tokens and run them together; returns float32 logits [n_new, vocab] each."""
        counts, ctxs, tables, ids = [], [], [], []
        for seq, tokens in feeds.items():
            pages = self.pages.setdefault(seq, [])
            ctx = self.lengths.get(seq, 0) + len(tokens)
            while len(pages) * PAGE_SIZE < ctx:
                pages.append(self.free.pop())
            self.lengths[seq] = ctx
            counts.append(len(tokens))
            ctxs.append(ctx)
            tables.append(pages)
            ids += tokens
        device = self.kv.spec.device
        meta = AttentionMetadata.build(counts, ctxs, tables, device=device)
        _, logits = model(torch.tensor(ids, device=device), meta, self.kv, torch.arange(len(ids), device=device))
        return {seq: out.float().cpu() for seq, out in zip(feeds, logits.split(counts), strict=True)}


# A real byte-level tokenizer whose 256 tokens are the oracle model's vocabulary, and a chat template: with it an
# oracle checkpoint is engine-ready.
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map, so token id b is byte b."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_byte_tokenizer(directory) -> None:
    vocab = {c: i for i, c in enumerate(_byte_alphabet())}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))


# A tiny vision tower beside ORACLE_CONFIG's text model: heads of 20 dims, so the 3D RoPE rotates 18 of them
# (3 axes x 6) and leaves 2 unrotated, as M3's 80-dim heads leave 2 of 80.
ORACLE_VISION_CONFIG = dict(hidden_size=40, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                            patch_size=14, temporal_patch_size=2, spatial_merge_size=2,
                            rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
ORACLE_IMAGE_TOKEN = 250


def image_features(model, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """transformers' projected image features, every image's rows in order ([sum of tokens, hidden]): releases
    give them as one tensor or as a tuple per image."""
    out = model.model.get_image_features(pixels, grid).pooler_output
    return torch.cat(list(out)) if isinstance(out, list | tuple) else out


def oracle_vl_model(seed: int = 0):
    """A random-weight transformers MiniMaxM3SparseForConditionalGeneration (float32, eager/SDPA attention) whose
    text model is ORACLE_CONFIG's and whose image token is ORACLE_IMAGE_TOKEN."""
    from transformers.models.minimax_m3_vl import (
        MiniMaxM3SparseForConditionalGeneration,
        MiniMaxM3VLConfig,
        MiniMaxM3VLTextConfig,
        MiniMaxM3VLVisionConfig,
    )

    config = MiniMaxM3VLConfig(text_config=MiniMaxM3VLTextConfig(**ORACLE_CONFIG).to_dict(),
                               vision_config=MiniMaxM3VLVisionConfig(**ORACLE_VISION_CONFIG).to_dict(),
                               image_token_index=ORACLE_IMAGE_TOKEN, video_token_index=251, projector_hidden_size=48)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return randomized(MiniMaxM3SparseForConditionalGeneration(config).eval(), seed)


def make_vl_checkpoint(directory: Path, seed: int = 0) -> Path:
    """oracle_vl_model saved as transformers saves it (the published MiniMax names), with the byte tokenizer."""
    directory = Path(directory)
    oracle_vl_model(seed).save_pretrained(directory)
    write_byte_tokenizer(directory)
    return directory


def load_vl_oracle(path: Path):
    """transformers' MiniMaxM3SparseForConditionalGeneration of a make_vl_checkpoint folder (float32, eager)."""
    from transformers.models.minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

    return MiniMaxM3SparseForConditionalGeneration.from_pretrained(path, dtype=torch.float32,
                                                                   attn_implementation="eager").eval()


def random_png(h: int, w: int, seed: int) -> bytes:
    """A PNG file of random RGB pixels (needs Pillow)."""
    import io

    from PIL import Image

    rgb = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    buf = io.BytesIO()
    Image.frombytes("RGB", (w, h), rgb.numpy().tobytes()).save(buf, format="PNG")
    return buf.getvalue()
