"""Write an M3 slice: MiniMax-M3 at its real width with a few layers and random weights, as a checkpoint folder.

The shapes are the released model's (transformers' MiniMaxM3VLTextConfig defaults: hidden 6144, 64 query / 4 KV
heads of 128, partial RoPE 64, 128 experts top-4 of width 3072 + a shared expert of 3072, dense MLP 12288,
indexer 4 x 128 with blocks of 128 and top-16, vocab 200064); only the layer count is cut: `--dense` full-attention
+ dense-MLP layers first, then `--sparse` MSA + MoE layers, as in the real stack (layers 0-2 dense, 3-59 sparse).
So one slice layer costs what one real layer costs, and per-layer timings scale to the full model.

Weights are random (each linear ~ N(0, 1/fan_in), so activations keep their scale through the layers); norm weights
and the router bias are random too, so a wrong norm or a bias-blind router shows. Tensors use transformers' names
(what `MiniMaxM3VLForCausalLM.save_pretrained` writes), so HF transformers loads the same folder; one shard per
layer plus an index file. The tokenizer is a byte-level BPE of the full vocabulary: the 256 byte tokens, filler
tokens of three bytes each up to 200064, and MiniMax's bos/eos at their real ids (200034, 200020). It encodes
text byte by byte and decodes every id; benchmarks feed random token ids anyway.

Tensors are drawn on --device (a GPU makes the ~20 GB of a 1 + 1 slice quick) and streamed to disk one at a
time per shard, a few shards at once on a GPU, so host memory peaks at a few of the largest tensor (an expert
stack: 9.7 GB at full width).

`--vision` adds MiniMax-M3's vision tower at its real width (~0.6 B parameters, random) and its config, with a
preprocessor_config.json whose pixel range reaches the tower's image_size (2016 x 2016).

    python scripts/make_m3_slice.py /tmp/m3-slice --dense 1 --sparse 3 [--device cuda] [--vision] [--set ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from m3sdk.model.config import ModelConfig  # noqa: E402
from m3sdk.model.loader import expected_tensors  # noqa: E402
from m3sdk.model.minimax_m3 import MiniMaxM3ForCausalLM  # noqa: E402
from m3sdk.model.vision import VisionEncoder  # noqa: E402
from m3sdk.model.vision_loader import checkpoint_tensors, vision_config  # noqa: E402

BOS, EOS = "]~!b[", "[e~["
CHAT_TEMPLATE = ("{{- bos_token -}}{%- for m in messages -%}{{- ']~b]' + m['role'] + '\\n' + m['content'] + "
                 "'[e~[\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- ']~b]ai\\n' -}}{%- endif -%}")
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32"}


def slice_config(dense: int, sparse: int, max_position_embeddings: int, overrides: dict):
    """transformers' MiniMaxM3VLTextConfig of the slice (its defaults are the released model's numbers)."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLTextConfig

    kinds = ["dense"] * dense + ["sparse"] * sparse
    defaults = MiniMaxM3VLTextConfig()
    head_dim = overrides.get("head_dim", defaults.head_dim)
    rotary_dim = overrides.get("rotary_dim", defaults.rotary_dim)
    # transformers rotates by rope_parameters' partial_rotary_factor (default 1.0) and ignores rotary_dim: say both
    overrides = {"rope_parameters": {"rope_type": "default", "rope_theta": 5e6,
                                     "partial_rotary_factor": rotary_dim / head_dim}, **overrides}
    config = MiniMaxM3VLTextConfig(
        num_hidden_layers=len(kinds), max_position_embeddings=max_position_embeddings,
        layer_types=["full_attention" if k == "dense" else "minimax_m3_sparse" for k in kinds],
        mlp_layer_types=kinds, hidden_act="swigluoai", **overrides)
    config.architectures = ["MiniMaxM3VLForCausalLM"]
    config.dtype = "bfloat16"
    return config


def tensor_plan(model_config: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Checkpoint name -> (shape, dtype) in transformers' layout, from the loader's own expectations."""
    with torch.device("meta"):
        model = MiniMaxM3ForCausalLM(model_config, dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    plan = {}
    for name, target in expected_tensors(model_config, "hf", "model.", "lm_head.weight").items():
        region = params[target.param][target.index]
        plan[name] = (tuple(region.shape), region.dtype)
    return plan


def random_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: str) -> torch.Tensor:
    """A deterministic random tensor per (name, seed), scaled for its role."""
    digest = int.from_bytes(hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest(), "little")
    gen = torch.Generator(device=device).manual_seed(digest & (2**63 - 1))
    if name.endswith("e_score_correction_bias"):
        std = 0.05  # moves some choices, as a trained bias does
    elif name.endswith("norm.weight"):
        std = 0.1  # Gemma norm: (1 + w), so w ~ 0.1 is a visible, well-conditioned scale
    elif name.endswith("embed_tokens.weight"):
        std = 1.0
    else:
        std = shape[-1] ** -0.5  # fan_in: outputs keep unit scale
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(std)
    return t.to(dtype)


def write_shard(path: Path, names: list[str], plan: dict, seed: int, device: str) -> None:
    """A safetensors file written tensor by tensor (the header first, from the shapes), never all in memory."""
    header, offset = {}, 0
    for name in names:
        shape, dtype = plan[name]
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in names:
            shape, dtype = plan[name]
            t = random_tensor(name, shape, dtype, seed, device).cpu().contiguous()
            f.write(t.view(torch.uint8).numpy().data)


def write_tokenizer(out: Path, vocab_size: int, bos_id: int, eos_id: int) -> None:
    """Byte-level BPE with the full vocabulary: bytes, 3-byte fillers, and bos/eos at their ids."""
    import tokenizers
    from tokenizers import AddedToken, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # GPT-2's byte -> character order, so token b is byte b
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    assert set(chars) == set(alphabet)
    vocab = {c: i for i, c in enumerate(chars)}
    filler = 0
    for i in range(256, vocab_size):
        if i == bos_id:
            vocab[BOS] = i
        elif i == eos_id:
            vocab[EOS] = i
        else:
            vocab[chars[filler >> 16 & 255] + chars[filler >> 8 & 255] + chars[filler & 255]] = i
            filler += 1
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOS, special=True)])
    assert tok.get_vocab_size() == vocab_size and tok.token_to_id(EOS) == eos_id
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS,
                                                           "chat_template": CHAT_TEMPLATE}, indent=1))


def vision_plan(out: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Give the slice MiniMax-M3's vision tower: its vision_config (from the bundled minimax-m3 config) in config.json,
    a preprocessor_config.json whose pixel range reaches the tower's image_size, and the tower's tensors to write
    (transformers' names, bf16)."""
    real = json.loads((ROOT / "src" / "m3sdk" / "assets" / "minimax-m3" / "config.json").read_text())
    raw = json.loads((out / "config.json").read_text())
    raw.update({k: real[k] for k in ("vision_config", "image_token_index", "video_token_index",
                                     "projector_hidden_size")})
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    side = real["vision_config"]["image_size"]
    (out / "preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": 4 * 28 * 28, "max_pixels": side * side, "patch_size": 14, "temporal_patch_size": 2,
         "merge_size": 2}))
    with torch.device("meta"):
        encoder = VisionEncoder(vision_config(out))
    params = dict(encoder.named_parameters())
    return {name: (tuple(params[param][index].shape), torch.bfloat16)
            for name, (param, index) in checkpoint_tensors(encoder, "hf").items()}


def make_slice(out: Path, dense: int = 1, sparse: int = 3, seed: int = 0, device: str = "cpu",
               max_position_embeddings: int = 524288, overrides: dict | None = None, workers: int = 3,
               vision: bool = False) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    config = slice_config(dense, sparse, max_position_embeddings, overrides or {})
    config.save_pretrained(out)
    model_config = ModelConfig.from_pretrained(out)
    plan = tensor_plan(model_config)
    if vision:
        plan.update(vision_plan(out))
    # one shard per layer, the embeddings and head in a shard of their own, the vision tower in one
    groups: dict[str, list[str]] = {}
    for name in plan:
        key = name.split(".")[2] if name.startswith("model.layers.") else "io"
        key = "vision" if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")) else key
        groups.setdefault(key, []).append(name)
    weight_map = {}
    files = {key: f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i, key in enumerate(groups)}

    def write(key: str) -> None:
        write_shard(out / files[key], groups[key], plan, seed, device)
        what = {"io": "embeddings + lm_head", "vision": "vision tower"}.get(key, f"layer {key}")
        print(f"  {files[key]}: {what} "
              f"({len(groups[key])} tensors)", flush=True)

    # Shards are independent: on a GPU several are drawn, copied to the host and written at once (the copies and
    # file writes release the GIL; a 1 + 3 slice is ~49 GB, so one at a time is bound by a single writer).
    # Host memory then peaks at `workers` expert stacks.
    with ThreadPoolExecutor(workers if device != "cpu" else 1) as pool:
        list(pool.map(write, groups))
    for key, names in groups.items():
        weight_map.update(dict.fromkeys(names, files[key]))
    total = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for s, d in plan.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    write_tokenizer(out, model_config.vocab_size, model_config.bos_token_id, model_config.eos_token_ids[0])
    return out


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--dense", type=int, default=1, help="full-attention + dense-MLP layers (first)")
    p.add_argument("--sparse", type=int, default=3, help="MSA + MoE layers (after the dense ones)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--max-position-embeddings", type=int, default=524288)
    p.add_argument("--vision", action="store_true", help="add MiniMax-M3's vision tower (real width, random)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a config field (e.g. hidden_size=256 for a small test slice)")
    args = p.parse_args()
    overrides = {k: _value(v) for k, _, v in (s.partition("=") for s in args.set)}
    make_slice(args.out, args.dense, args.sparse, args.seed, args.device, args.max_position_embeddings, overrides,
               vision=args.vision)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
