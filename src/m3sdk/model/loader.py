"""Load a MiniMax-M3 checkpoint (safetensors) into MiniMaxM3ForCausalLM, layer by layer, memory-mapped.

Two name layouts are accepted, detected from the keys:
  minimax (as published):  language_model.model.layers.N.block_sparse_moe.experts.E.w1 / w3 / w2 ...,
                           self_attn.index_q_proj, mlp.gate_proj / up_proj, language_model.lm_head
  hf (transformers' save): model[.language_model].layers.N.mlp.experts.gate_up_proj [E, 2I, H] ...,
                           self_attn.indexer.q_proj, mlp.gate_up_proj (packed), lm_head
Vision tower and projector tensors are skipped; `mtp.*` tensors are kept aside, unread, in `model.mtp_weights`.
Every expected tensor is checked for presence, shape and dtype before anything is read, and all problems are
reported in one CheckpointError.

Memory: the model is built on the meta device, then allocated on the target device; tensors, in model order, are
read through a memory map (re-opened every `_REMAP_BYTES`, so mapped pages do not pile up in the process) in
slices of at most `_CHUNK_BYTES`, straight into the destination parameter: no second full host copy.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from m3sdk.errors import CheckpointError
from m3sdk.model.config import ModelConfig
from m3sdk.model.minimax_m3 import MiniMaxM3ForCausalLM
from m3sdk.model.quantize import quantize_model

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SKIPPED = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector|patch_merge_mlp)\.|\.rotary_emb\.inv_freq$")
_MTP = re.compile(r"(^|\.)(mtp\..*)$")
_FLOAT_DTYPES = {"F32", "BF16", "F16"}
_CHUNK_BYTES = 64 << 20
_REMAP_BYTES = 256 << 20
_MAX_LISTED = 40


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: parameter `param`, region `index` (() = the whole parameter)."""

    param: str
    index: tuple = ()


def load_model(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
               attn_backend: str = "torch", quantization: str = "none") -> MiniMaxM3ForCausalLM:
    """Read config.json and the safetensors weights of `path` into a ready model on `device` in `dtype`;
    `quantization` ("none" | "fp8" | "mxfp4", see m3sdk.model.quantize) is applied once the weights are in."""
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    files = _tensor_files(path)
    shapes = _read_headers(files)
    layout, prefix, lm_head = _detect_layout(shapes)
    expected = expected_tensors(config, layout, prefix, lm_head)

    with torch.device("meta"):
        model = MiniMaxM3ForCausalLM(config, dtype=dtype, attn_backend=attn_backend)
    params = dict(model.named_parameters())
    _check(shapes, expected, params, path)

    model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters())
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in expected:  # in model order within each shard
        by_file[files[name]].append(name)
    for file, names in by_file.items():
        shard = _MappedShard(file)
        for name in names:
            target = expected[name]
            shard.copy_to(name, params[target.param][target.index])
    model.mtp_weights = LazyTensors({m.group(2): (files[k], k) for k in shapes if (m := _MTP.search(k))})
    return quantize_model(model, quantization).eval()


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> shard file, from the index file or the single-file checkpoint."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e})") from e
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise CheckpointError(f"{index} names shards that do not exist: {missing}")
        return {name: path / f for name, f in weight_map.items()}
    single = path / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise CheckpointError(f"no {INDEX_FILE} or {SINGLE_FILE} in {path}")


def _read_headers(files: dict[str, Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, safetensors dtype), reading only the shard headers."""
    out = {}
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, file in files.items():
        by_file[file].append(name)
    for file, names in by_file.items():
        try:
            with safe_open(file, framework="pt") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(f"{file.name} does not hold {name} although the index says so")
                    s = f.get_slice(name)
                    out[name] = (tuple(s.get_shape()), s.get_dtype())
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from e
    return out


def _detect_layout(names: Mapping[str, object]) -> tuple[str, str, str]:
    """(layout, prefix of the text model's tensors, lm_head name) from the checkpoint's keys."""
    if any(n.startswith("language_model.") for n in names):
        return "minimax", "language_model.model.", "language_model.lm_head.weight"
    if any(n.startswith("model.language_model.") for n in names):
        return "hf", "model.language_model.", "lm_head.weight"
    return "hf", "model.", "lm_head.weight"


def expected_tensors(config: ModelConfig, layout: str, prefix: str, lm_head: str) -> dict[str, Target]:
    """Every tensor the checkpoint must hold, by its name in `layout`, and where it goes in the model."""
    out = {f"{prefix}embed_tokens.weight": Target("embed_tokens.weight"),
           f"{prefix}norm.weight": Target("norm.weight")}
    if not config.tie_word_embeddings:
        out[lm_head] = Target("lm_head.weight")
    for i in range(config.num_layers):
        out.update(_expected_layer(config, i, layout, prefix))
    return out


def _expected_layer(c: ModelConfig, i: int, layout: str, prefix: str) -> dict[str, Target]:
    out: dict[str, Target] = {}

    def add(name: str, param: str, index: tuple = ()) -> None:
        out[f"{prefix}layers.{i}.{name}"] = Target(f"layers.{i}.{param}", index)

    for norm in ("input_layernorm", "post_attention_layernorm"):
        add(f"{norm}.weight", f"{norm}.weight")
    # rows of the packed [q | k | v | index_q | index_k] projection
    widths = [("q_proj", c.num_heads * c.head_dim), ("k_proj", c.num_kv_heads * c.head_dim),
              ("v_proj", c.num_kv_heads * c.head_dim)]
    if c.is_sparse(i):
        indexer = "self_attn.index_" if layout == "minimax" else "self_attn.indexer."
        widths += [(f"{indexer}q_proj", c.index_n_heads * c.index_head_dim), (f"{indexer}k_proj", c.index_head_dim)]
        for part in ("q_norm", "k_norm"):
            add(f"{indexer}{part}.weight", f"self_attn.index_{part}.weight")
    start = 0
    for name, width in widths:
        full = name if name.startswith("self_attn.") else f"self_attn.{name}"
        add(f"{full}.weight", "self_attn.qkv_proj.weight", (slice(start, start + width),))
        start += width
    for name in ("o_proj", "q_norm", "k_norm"):
        add(f"self_attn.{name}.weight", f"self_attn.{name}.weight")
    if c.is_moe(i):
        _expected_moe(c, layout, add)
    else:
        _expected_mlp("mlp", "mlp", c.dense_intermediate_size, layout, add)
    return out


def _expected_mlp(src: str, dst: str, inter: int, layout: str, add) -> None:
    if layout == "minimax":
        add(f"{src}.gate_proj.weight", f"{dst}.gate_up_proj.weight", (slice(0, inter),))
        add(f"{src}.up_proj.weight", f"{dst}.gate_up_proj.weight", (slice(inter, 2 * inter),))
    else:
        add(f"{src}.gate_up_proj.weight", f"{dst}.gate_up_proj.weight")
    add(f"{src}.down_proj.weight", f"{dst}.down_proj.weight")


def _expected_moe(c: ModelConfig, layout: str, add) -> None:
    inter = c.moe_intermediate_size
    if layout == "minimax":
        add("block_sparse_moe.gate.weight", "mlp.router_weight")
        add("block_sparse_moe.e_score_correction_bias", "mlp.e_score_correction_bias")
        for e in range(c.num_experts):
            add(f"block_sparse_moe.experts.{e}.w1.weight", "mlp.w_gate_up", (e, slice(0, inter)))
            add(f"block_sparse_moe.experts.{e}.w3.weight", "mlp.w_gate_up", (e, slice(inter, 2 * inter)))
            add(f"block_sparse_moe.experts.{e}.w2.weight", "mlp.w_down", (e,))
        _expected_mlp("block_sparse_moe.shared_experts", "mlp.shared_experts", c.shared_intermediate_size, layout, add)
    else:
        add("mlp.gate.weight", "mlp.router_weight")
        add("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias")
        add("mlp.experts.gate_up_proj", "mlp.w_gate_up")
        add("mlp.experts.down_proj", "mlp.w_down")
        _expected_mlp("mlp.shared_experts", "mlp.shared_experts", c.shared_intermediate_size, layout, add)


def _check(shapes: Mapping[str, tuple[tuple[int, ...], str]], expected: Mapping[str, Target],
           params: Mapping[str, torch.Tensor], path: Path) -> None:
    missing = [n for n in expected if n not in shapes]
    bad_shape, bad_dtype = [], []
    for name, target in expected.items():
        if name not in shapes:
            continue
        shape, dtype = shapes[name]
        want = tuple(params[target.param][target.index].shape)
        if shape != want:
            bad_shape.append(f"{name}: {list(shape)}, expected {list(want)}")
        if dtype not in _FLOAT_DTYPES:
            bad_dtype.append(f"{name}: {dtype}")
    unexpected = [n for n in shapes if n not in expected and not _SKIPPED.search(n) and not _MTP.search(n)]
    problems = []
    for what, items in (("missing tensors", missing), ("wrong shapes", bad_shape),
                        ("unsupported dtypes (quantized weights are not loadable yet)", bad_dtype),
                        ("unexpected tensors", unexpected)):
        if items:
            listed = "\n    ".join(items[:_MAX_LISTED])
            more = f"\n    ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
            problems.append(f"  {len(items)} {what}:\n    {listed}{more}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match its config.json:\n" + "\n".join(problems))


class _MappedShard:
    """Reads a shard through a memory map that is dropped and re-opened after every _REMAP_BYTES read: pages
    already copied stop counting against the process (a real MoE layer alone is ~15 GB)."""

    def __init__(self, file: Path):
        self.file = file
        self.handle = None
        self.mapped = 0

    def copy_to(self, name: str, dest: torch.Tensor) -> None:
        """Copy tensor `name` into `dest` in row blocks of at most _CHUNK_BYTES (an expert stack can be GBs)."""
        shape = self._open().get_slice(name).get_shape()
        if not shape:
            dest.copy_(self._open().get_tensor(name))
            return
        step = max(1, _CHUNK_BYTES // (4 * math.prod(shape[1:])))
        for start in range(0, shape[0], step):
            chunk = self._open().get_slice(name)[start : start + step]
            dest[start : start + chunk.shape[0]].copy_(chunk)
            self.mapped += chunk.numel() * chunk.element_size()
            del chunk  # its view keeps the map alive: release it before a possible re-open

    def _open(self):
        if self.handle is None or self.mapped >= _REMAP_BYTES:
            self.handle = None  # drop the old map first
            self.handle = safe_open(self.file, framework="pt")
            self.mapped = 0
        return self.handle


class LazyTensors(Mapping):
    """name -> tensor, read from its shard on access (for `mtp.*`: only the speculative decoder needs them)."""

    def __init__(self, sources: Mapping[str, tuple[Path, str]]):
        self._sources = dict(sources)  # name -> (shard file, key in the file)

    def __getitem__(self, name: str) -> torch.Tensor:
        file, key = self._sources[name]
        with safe_open(file, framework="pt") as f:
            return f.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)
