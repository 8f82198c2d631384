"""Load a MiniMax-M3 checkpoint (safetensors) into MiniMaxM3ForCausalLM, layer by layer, memory-mapped.

Two name layouts are accepted, detected from the keys:
  minimax (as published):  language_model.model.layers.N.block_sparse_moe.experts.E.w1 / w3 / w2 ...,
                           self_attn.index_q_proj, mlp.gate_proj / up_proj, language_model.lm_head
  hf (transformers' save): model[.language_model].layers.N.mlp.experts.gate_up_proj [E, 2I, H] ...,
                           self_attn.indexer.q_proj, mlp.gate_up_proj (packed), lm_head
Vision tower and projector tensors are skipped; `mtp.*` tensors are kept aside, unread, in `model.mtp_weights`.
Every expected tensor is checked for presence, shape and dtype before anything is read, and all problems are
reported in one CheckpointError.

Quantized checkpoints (config.quant_format, docs/kernels.md): a linear is stored in the MX format when its E8M0
scale tensor is there (`<name>.weight_scale_inv` for MiniMax's MXFP8, `<name>.weight_scale` for Quark's MXFP4).
A MoE layer whose experts are stored so becomes a QuantizedMoE whose stack the bytes are read into as stored (no
requantization, no float copy); any other MX linear (attention, dense MLP) is dequantized into the model's dtype
as it is read.

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
from tqdm import tqdm

from m3sdk.errors import CheckpointError
from m3sdk.model.config import ModelConfig
from m3sdk.model.minimax_m3 import MiniMaxM3ForCausalLM
from m3sdk.model.quantize import QuantizedMoE, quantize_model
from m3sdk_kernels.experts import empty_experts
from m3sdk_kernels.formats import MX_BLOCK, dequantize_mxfp4, dequantize_mxfp8

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SKIPPED = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector|patch_merge_mlp)\.|\.rotary_emb\.inv_freq$")
_MTP = re.compile(r"(^|\.)(mtp\..*)$")
_FLOAT_DTYPES = {"F32", "BF16", "F16"}
_CHUNK_BYTES = 64 << 20
_REMAP_BYTES = 256 << 20
_MAX_LISTED = 40
# MX checkpoints: the E8M0 scale tensor beside each quantized `weight`, and the weight's stored dtype
_MX_SCALE = {"mxfp8": "weight_scale_inv", "mxfp4": "weight_scale"}
_MX_WEIGHT_DTYPE = {"mxfp8": "F8_E4M3", "mxfp4": "U8"}
_E8M0_DTYPES = {"U8", "F8_E8M0"}
_MX_DEQUANTIZE = {"mxfp8": dequantize_mxfp8, "mxfp4": dequantize_mxfp4}
# expert parameters of a float MoE layer -> (tensor of the QuantizedMoE stack, is it the shared expert: row E)
_STACKED = {"mlp.w_gate_up": ("gate_up", False), "mlp.w_down": ("down", False),
            "mlp.shared_experts.gate_up_proj.weight": ("gate_up", True),
            "mlp.shared_experts.down_proj.weight": ("down", True)}


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: parameter or buffer `param`, region `index` (() = the whole of it).
    MX tensors are either dequantized with their E8M0 `scale` tensor as they are read, or copied as `raw` bytes
    into an MX expert stack."""

    param: str
    index: tuple = ()
    scale: str | None = None
    raw: bool = False


def load_model(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
               attn_backend: str = "torch", quantization: str = "none", progress: bool = False) -> MiniMaxM3ForCausalLM:
    """Read config.json and the safetensors weights of `path` into a ready model on `device` in `dtype`;
    `quantization` ("none" | "fp8" | "fp8_experts" | "mxfp4", see m3sdk.model.quantize) is applied once the
    weights are in.
    `progress` draws a bar on stderr (the CLI's choice: an embedded engine stays silent)."""
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    files = tensor_files(path)
    shapes = read_headers(files)
    layout, prefix, lm_head = detect_layout(shapes)
    expected = expected_tensors(config, layout, prefix, lm_head, shapes)
    mx = mx_weights(shapes, expected, config.quant_format)

    with torch.device("meta"):
        model = MiniMaxM3ForCausalLM(config, dtype=dtype, attn_backend=attn_backend)
        check_tensors(shapes, expected, dict(model.named_parameters()), path, mx, config.quant_format)
        plan = _mx_plan(model, expected, mx)

    model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in plan:  # in model order within each shard
        by_file[files[name]].append(name)
    destinations = {name: tensors[target.param][target.index] for name, target in plan.items()}
    bar = tqdm(total=sum(d.numel() * d.element_size() for d in destinations.values()), unit="B", unit_scale=True,
               desc=f"loading {path.name}", disable=not progress, leave=False)
    for file, names in by_file.items():
        shard = _MappedShard(file)
        for name in names:
            target = plan[name]
            dest = destinations[name]
            if target.raw:
                shard.copy_to(name, dest, lambda rows, _, d=dest: rows.view(d.dtype))
            elif target.scale is not None:
                shard.copy_to(name, dest, _dequantizer(files[target.scale], target.scale, config.quant_format,
                                                       dest.dtype))
            else:
                shard.copy_to(name, dest)
            bar.update(dest.numel() * dest.element_size())
    bar.close()
    model.mtp_weights = LazyTensors({m.group(2): (files[k], k) for k in shapes if (m := _MTP.search(k))})
    return quantize_model(model, quantization).eval()


def tensor_files(path: Path) -> dict[str, Path]:
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


def read_headers(files: dict[str, Path]) -> dict[str, tuple[tuple[int, ...], str]]:
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


def detect_layout(names: Mapping[str, object]) -> tuple[str, str, str]:
    """(layout, prefix of the text model's tensors, lm_head name) from the checkpoint's keys."""
    if any(n.startswith("language_model.") for n in names):
        return "minimax", "language_model.model.", "language_model.lm_head.weight"
    if any(n.startswith("model.language_model.") for n in names):
        return "hf", "model.language_model.", "lm_head.weight"
    return "hf", "model.", "lm_head.weight"


def expected_tensors(config: ModelConfig, layout: str, prefix: str, lm_head: str,
                     present: Mapping[str, object] = ()) -> dict[str, Target]:
    """Every tensor the checkpoint must hold, by its name in `layout`, and where it goes in the model. A dense
    layer's MLP of the published layout may be named `mlp.*` or `block_sparse_moe.*` (transformers reads both into
    `mlp`, and some releases save the second): a name missing from `present` takes its alias where that exists."""
    out = {f"{prefix}embed_tokens.weight": Target("embed_tokens.weight"),
           f"{prefix}norm.weight": Target("norm.weight")}
    if not config.tie_word_embeddings:
        out[lm_head] = Target("lm_head.weight")
    for i in range(config.num_layers):
        out.update(expected_layer(config, i, layout, prefix))
    if layout == "minimax" and present:
        aliases = {n: n.replace(".mlp.", ".block_sparse_moe.", 1) for n in out if ".mlp." in n and n not in present}
        out = {aliases[n] if n in aliases and aliases[n] in present else n: t for n, t in out.items()}
    return out


def expected_layer(c: ModelConfig, i: int, layout: str, prefix: str) -> dict[str, Target]:
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


def check_tensors(shapes: Mapping[str, tuple[tuple[int, ...], str]], expected: Mapping[str, Target],
           params: Mapping[str, torch.Tensor], path: Path, mx: Mapping[str, str] | None = None,
           fmt: str = "none") -> None:
    """Presence, shape and dtype of every expected tensor (`mx`: weight -> scale names of the MX-stored linears,
    in `fmt`), and no unexpected ones; all problems in one CheckpointError."""
    mx = mx or {}
    missing = [n for n in expected if n not in shapes]
    bad_shape, bad_dtype = [], []
    for name, target in expected.items():
        if name not in shapes:
            continue
        want = tuple(params[target.param][target.index].shape)
        wants = {name: (want, _FLOAT_DTYPES)}
        if name in mx:  # [out, in] stored as MX rows + one E8M0 scale per 32 inputs
            out, k = want
            if k % MX_BLOCK:
                bad_shape.append(f"{name}: {k} inputs is not a multiple of the MX block {MX_BLOCK}")
            wants = {name: ((out, k // 2 if fmt == "mxfp4" else k), {_MX_WEIGHT_DTYPE[fmt]}),
                     mx[name]: ((out, k // MX_BLOCK), _E8M0_DTYPES)}
        for tensor, (want_shape, dtypes) in wants.items():
            shape, dtype = shapes[tensor]
            if shape != want_shape:
                bad_shape.append(f"{tensor}: {list(shape)}, expected {list(want_shape)}")
            if dtype not in dtypes:
                bad_dtype.append(f"{tensor}: {dtype}, expected {' or '.join(sorted(dtypes))}")
    scales = set(mx.values())
    unexpected = [n for n in shapes if n not in expected and n not in scales and not _SKIPPED.search(n)
                  and not _MTP.search(n)]
    problems = []
    for what, items in (("missing tensors", missing), ("wrong shapes", bad_shape), ("wrong dtypes", bad_dtype),
                        ("unexpected tensors", unexpected)):
        if items:
            listed = "\n    ".join(items[:_MAX_LISTED])
            more = f"\n    ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
            problems.append(f"  {len(items)} {what}:\n    {listed}{more}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match its config.json:\n" + "\n".join(problems))


def mx_weights(shapes: Mapping[str, object], expected: Mapping[str, Target], fmt: str) -> dict[str, str]:
    """weight name -> its E8M0 scale tensor's name, for the linears the checkpoint stores in the MX format `fmt`:
    those whose scale tensor is present (the rest, e.g. the router and lm_head, are stored as floats)."""
    if fmt == "none":
        return {}
    suffix = _MX_SCALE[fmt]
    return {n: scale for n in expected if n.endswith(".weight") and (scale := n[: -len("weight")] + suffix) in shapes}


def _mx_plan(model: MiniMaxM3ForCausalLM, expected: Mapping[str, Target], mx: Mapping[str, str]
             ) -> dict[str, Target]:
    """The copy plan: `expected`, where each MoE layer whose experts (routed and shared) are all MX-stored becomes a
    QuantizedMoE (built where the model is, e.g. on the meta device) that their bytes and scales are read into, and
    every other MX linear is dequantized as it is read."""
    fmt = model.config.quant_format
    plan: dict[str, Target] = {}
    experts: dict[int, list[tuple[str, str]]] = defaultdict(list)  # MoE layer -> (tensor name, float param)
    for name, target in expected.items():
        layer, _, param = target.param.removeprefix("layers.").partition(".")
        if param in _STACKED:
            experts[int(layer)].append((name, param))
        else:
            plan[name] = Target(target.param, target.index, scale=mx.get(name))
    problems = []
    for layer, names in experts.items():
        stored = sum(name in mx for name, _ in names)
        if stored == 0:
            plan.update({name: expected[name] for name, _ in names})
            continue
        # the MoE kernels serve the routed experts and the shared expert as one stack in one format
        moe = model.layers[layer].mlp
        num_experts, hidden, inter = moe.w_down.shape
        if stored < len(names):
            problems.append(f"layer {layer}: {stored} of its {len(names)} expert tensors (routed + shared) are "
                            f"stored as {fmt}: one {fmt} stack needs them all")
            continue
        if moe.shared_experts.down_proj.weight.shape[1] != inter:
            problems.append(f"layer {layer}: the shared expert's width differs from the routed experts' {inter}")
            continue
        model.layers[layer].mlp = QuantizedMoE(moe, empty_experts(fmt, num_experts + 1, hidden, inter))
        for name, param in names:
            stack, shared = _STACKED[param]
            index = (num_experts, *expected[name].index) if shared else expected[name].index
            plan[name] = Target(f"layers.{layer}.mlp.{stack}", index, raw=True)
            plan[mx[name]] = Target(f"layers.{layer}.mlp.{stack}_scale", index, raw=True)
    if problems:
        raise CheckpointError(f"{fmt} experts:\n  " + "\n  ".join(problems))
    return plan


def _dequantizer(file: Path, scale_name: str, fmt: str, dtype: torch.dtype):
    """rows of an MX weight (and their first row number) -> the dequantized rows in `dtype`."""
    with safe_open(file, framework="pt") as f:
        scale = f.get_tensor(scale_name).view(torch.uint8)  # E8M0 may come typed float8_e8m0fnu: its bytes
    return lambda rows, start: _MX_DEQUANTIZE[fmt](rows, scale[start : start + rows.shape[0]], dtype)


class _MappedShard:
    """Reads a shard through a memory map that is dropped and re-opened after every _REMAP_BYTES read: pages
    already copied stop counting against the process (a real MoE layer alone is ~15 GB)."""

    def __init__(self, file: Path):
        self.file = file
        self.handle = None
        self.mapped = 0

    def copy_to(self, name: str, dest: torch.Tensor, convert=None) -> None:
        """Copy tensor `name` into `dest` in row blocks of at most _CHUNK_BYTES (an expert stack can be GBs),
        through `convert(rows, first_row)` when given."""
        shape = self._open().get_slice(name).get_shape()
        if not shape:
            dest.copy_(self._open().get_tensor(name))
            return
        step = max(1, _CHUNK_BYTES // (4 * math.prod(shape[1:])))
        for start in range(0, shape[0], step):
            chunk = self._open().get_slice(name)[start : start + step]
            dest[start : start + chunk.shape[0]].copy_(chunk if convert is None else convert(chunk, start))
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
