"""Which part of each weight a tensor-parallel rank holds, and loading just that part from a checkpoint.

A rank of N holds (docs/serving.md):
- attention: query heads [r*Hq/N, (r+1)*Hq/N) and KV heads [r*Hkv/N, ...) of the packed qkv projection (so GQA
  groups stay whole), the index-query heads of its KV groups (index head j selects for KV group j), the single
  index-key head whole; o_proj's input columns of its query heads (row parallel: partial sums). With more ranks
  than KV heads (N a multiple of Hkv), each rank holds the one KV head (and index head) its query heads attend
  with, replicated over N / Hkv ranks, and caches it;
- dense MLP and shared expert: gate rows and up rows of its 1/N of the intermediate, down_proj's matching columns;
- routed experts: whole experts [r*E/N, (r+1)*E/N) with `expert_parallel`, else 1/N of every expert's
  intermediate (like the dense MLP);
- lm_head: vocabulary rows [r*m, (r+1)*m), m = ceil(V/N) (VocabParallelHead: each rank computes its slice of
  the logits, an all-gather joins them), so no rank reads the whole head (2.46 GB at M3's width);
- everything else whole: embeddings, norms, the router and its bias.
So the rank's attention output after o_proj and its MLP/MoE output are partial sums: one all-reduce each.

The rank's model is the ordinary MiniMaxM3ForCausalLM built from `local_config` (fewer heads, narrower MLPs); with
expert parallelism each MoE layer is an ExpertParallelMoE (all E router rows, E/N experts).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from m3sdk.errors import CheckpointError
from m3sdk.model.config import ModelConfig
from m3sdk.model.dummy import materialize
from m3sdk.model.layers import SparseMoE, all_reduce, local_routes, moe_experts, route
from m3sdk.model.loader import check_tensors, detect_layout, expected_tensors, read_headers, tensor_files
from m3sdk.model.memory import check_split, local_heads
from m3sdk.model.minimax_m3 import MiniMaxM3ForCausalLM
from m3sdk.model.quantize import fp8_for, quantize_layer

_CHUNK_BYTES = 64 << 20
# one collective into one tensor: torch 2.13's name (the device's torch 2.11 has only all_gather_into_tensor)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# A piece of a sharded parameter: rows/columns [full_start, full_end) of the full parameter along the shard
# dimension land at [local_start, ...) of the rank's parameter.
Piece = tuple[int, int, int]


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int
    expert_parallel: bool = True

    def span(self, total: int) -> tuple[int, int]:
        """This rank's [start, end) of `total` items split evenly."""
        n = total // self.world
        return self.rank * n, (self.rank + 1) * n

    def span_ceil(self, total: int) -> tuple[int, int]:
        """This rank's [start, end) of `total` items in blocks of ceil(total / N) (the last one may run past
        `total`: padding)."""
        n = -(-total // self.world)
        return self.rank * n, (self.rank + 1) * n


def check_divisible(config: ModelConfig, shard: Shard) -> None:
    """Every sharded count must split evenly over the ranks; say all that do not, at once."""
    check_split(config, shard.world, shard.expert_parallel)


def local_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The config of one rank's model: 1/N of the heads and of the MLP widths (experts: see the module doc)."""
    check_divisible(config, shard)
    n = shard.world
    return dataclasses.replace(
        config, num_heads=config.num_heads // n, num_kv_heads=local_heads(config.num_kv_heads, n),
        index_n_heads=local_heads(config.index_n_heads, n) if config.sparse_layers else config.index_n_heads,
        dense_intermediate_size=config.dense_intermediate_size // n,
        shared_intermediate_size=config.shared_intermediate_size // n,
        moe_intermediate_size=config.moe_intermediate_size // (1 if shard.expert_parallel else n))


def _split(total: int, shard: Shard, full_offset: int, local_offset: int) -> Piece:
    start, end = shard.span(total)
    return full_offset + start, full_offset + end, local_offset


def _heads(count: int, width: int, shard: Shard, full_offset: int, local_offset: int) -> Piece:
    """This rank's heads of `count` heads `width` wide: 1/N of them, or where N exceeds them (a multiple of them)
    the one of its query heads' group, replicated over N / count ranks."""
    if count >= shard.world:
        return _split(count * width, shard, full_offset, local_offset)
    head = shard.rank * count // shard.world
    return full_offset + head * width, full_offset + (head + 1) * width, local_offset


def _gate_up(inter: int, shard: Shard) -> list[Piece]:
    """[gate | up] rows of width `inter` each -> the rank's gate rows then its up rows."""
    m = inter // shard.world
    return [_split(inter, shard, 0, 0), _split(inter, shard, inter, m)]


def param_pieces(name: str, config: ModelConfig, shard: Shard) -> tuple[int, list[Piece]] | None:
    """(dimension, pieces) of full-model parameter `name` that this rank holds, or None when held whole."""
    c = config
    if name == "lm_head.weight":
        start, end = shard.span_ceil(c.vocab_size)
        return 0, [(start, min(end, c.vocab_size), 0)]
    parts = name.split(".")
    if parts[0] != "layers":
        return None
    layer, rest = int(parts[1]), ".".join(parts[2:])
    if rest == "self_attn.qkv_proj.weight":
        d, n, w = c.head_dim, shard.world, c.index_head_dim
        q, kv = c.num_heads * d, c.num_kv_heads * d
        kv_local = local_heads(c.num_kv_heads, n) * d
        pieces = [_split(q, shard, 0, 0), _heads(c.num_kv_heads, d, shard, q, q // n),
                  _heads(c.num_kv_heads, d, shard, q + kv, q // n + kv_local)]
        if c.is_sparse(layer):
            iq = c.index_n_heads * w
            local = q // n + 2 * kv_local
            index_key = (q + 2 * kv + iq, q + 2 * kv + iq + w, local + local_heads(c.index_n_heads, n) * w)  # whole
            pieces += [_heads(c.index_n_heads, w, shard, q + 2 * kv, local), index_key]
        return 0, pieces
    if rest == "self_attn.o_proj.weight":
        return 1, [_split(c.num_heads * c.head_dim, shard, 0, 0)]
    for prefix, inter in (("mlp.shared_experts.", c.shared_intermediate_size), ("mlp.", c.dense_intermediate_size)):
        if rest == f"{prefix}gate_up_proj.weight":
            return 0, _gate_up(inter, shard)
        if rest == f"{prefix}down_proj.weight":
            return 1, [_split(inter, shard, 0, 0)]
    if rest in ("mlp.w_gate_up", "mlp.w_down"):
        if shard.expert_parallel:
            return 0, [_split(c.num_experts, shard, 0, 0)]
        inter = c.moe_intermediate_size
        return (1, _gate_up(inter, shard)) if rest == "mlp.w_gate_up" else (2, [_split(inter, shard, 0, 0)])
    return None


def copy_plan(index: tuple, full_shape: tuple[int, ...], pieces: tuple[int, list[Piece]] | None
              ) -> list[tuple[tuple[slice, ...], tuple]]:
    """For a checkpoint tensor that fills region `index` of a full parameter: [(source slices, local index)].

    `index` is the loader's Target.index: leading ints (a dimension dropped, e.g. one expert) or slices.
    The source's dimensions are the region's non-int ones."""
    entries = [index[k] if k < len(index) else slice(None) for k in range(len(full_shape))]
    ranges = []
    for k, e in enumerate(entries):
        if isinstance(e, int):
            ranges.append((e, e + 1, True))
        else:
            start, stop, _ = e.indices(full_shape[k])
            ranges.append((start, stop, False))
    if pieces is None:
        return [(tuple(slice(None) for _, _, is_int in ranges if not is_int), tuple(index))]
    dim, spans = pieces
    a, b, is_int = ranges[dim]
    out = []
    for full_start, full_end, local_start in spans:
        lo, hi = max(a, full_start), min(b, full_end)
        if lo >= hi:
            continue
        local = []
        src = []
        for k, (start, stop, k_int) in enumerate(ranges):
            if k == dim:
                at = local_start + lo - full_start
                local.append(at if k_int else slice(at, at + hi - lo))
                if not k_int:
                    src.append(slice(lo - a, hi - a))
            else:
                local.append(start if k_int else slice(start, stop))
                if not k_int:
                    src.append(slice(None))
        out.append((tuple(src), tuple(local)))
    return out


class ExpertParallelMoE(SparseMoE):
    """SparseMoE holding experts [first, first + E_local) of E: routing runs over all E (the router is whole),
    pairs routed elsewhere get weight 0 on local expert 0, so the expert kernels see fixed shapes (no host sync,
    CUDA-graph safe); their ranks' all-reduce adds them back."""

    def __init__(self, config: ModelConfig, shard: Shard, dtype: torch.dtype):
        c = config
        first, end = shard.span(c.num_experts)
        super().__init__(c.hidden_size, end - first, c.moe_intermediate_size,
                         c.shared_intermediate_size // shard.world, c.num_experts_per_tok, c.routed_scaling_factor,
                         c.swiglu_alpha, c.swiglu_limit, dtype, reduce=True, first_expert=first)
        self.router_weight = torch.nn.Parameter(torch.empty(c.num_experts, c.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = torch.nn.Parameter(torch.empty(c.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_experts(x)
        weights, ids = route(x, self.router_weight, self.e_score_correction_bias, self.top_k)
        ids, weights = local_routes(ids, weights, self.first_expert, self.w_gate_up.shape[0])
        routed = moe_experts(x, ids, weights, self.w_gate_up, self.w_down, self.alpha, self.limit)
        return all_reduce(routed * self.scaling + shared, self.reduce)


class VocabParallelHead(torch.nn.Module):
    """lm_head over this rank's vocabulary rows (rows past V on the last rank are zeros): the local logits
    of every rank are all-gathered, so every rank returns the full float32 [N, V] (each rank reads 1/N of the
    head; the gather moves N x V bf16 logits, 26 MB at batch 64 and M3's vocabulary)."""

    def __init__(self, hidden: int, vocab: int, shard: Shard, dtype: torch.dtype):
        super().__init__()
        self.vocab, self.world = vocab, shard.world
        self.weight = torch.nn.Parameter(torch.empty(-(-vocab // shard.world), hidden, dtype=dtype),
                                         requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = torch.nn.functional.linear(x, self.weight)
        n, m = local.shape
        gathered = local.new_empty(self.world, n, m)  # one collective into one buffer, rank-major
        _all_gather_single(gathered.view(self.world * n, m), local)
        # each rank's piece straight into its columns of float32 [N, V] (rows stay contiguous: coalesced copies;
        # the model's .float() is then a no-op), instead of a bf16 [N, V] transpose copy and then the float copy
        out = torch.empty((n, self.vocab), dtype=torch.float32, device=x.device)
        for r in range(self.world):
            width = min(m, self.vocab - r * m)
            out[:, r * m:r * m + width].copy_(gathered[r, :, :width])
        return out


def build_local_model(config: ModelConfig, shard: Shard, dtype: torch.dtype, attn_backend: str
                      ) -> MiniMaxM3ForCausalLM:
    """The rank's model on the meta device (weights unallocated)."""
    with torch.device("meta"):
        model = MiniMaxM3ForCausalLM(local_config(config, shard), dtype=dtype, attn_backend=attn_backend,
                                     tensor_parallel=shard.world > 1)
        if shard.expert_parallel:
            for i in config.moe_layers:
                model.layers[i].mlp = ExpertParallelMoE(config, shard, dtype)
        model.lm_head = VocabParallelHead(config.hidden_size, config.vocab_size, shard, dtype)
    model.requires_grad_(False)
    return model


def load_shard(path: str | Path, shard: Shard, device: torch.device | str, dtype: torch.dtype,
               attn_backend: str, quantization: str = "none") -> MiniMaxM3ForCausalLM:
    """Read this rank's part of the checkpoint at `path` into its model (no rank reads a whole sharded tensor),
    in the served format of `quantization` (model/quantize.py): shard first, then quantize on the rank, so each
    rank's scales cover its own slice. Allocated part by part (embeddings, head, norm, then layer by layer), each
    layer quantized before the next is read: the peak is the served shard plus one float layer."""
    path = Path(path)
    config = ModelConfig.from_pretrained(path)
    if config.quant_format != "none":
        raise CheckpointError(f"tensor parallel loading of {config.quant_format} checkpoints is not supported yet")
    files = tensor_files(path)
    shapes = read_headers(files)
    layout, prefix, lm_head = detect_layout(shapes)
    expected = expected_tensors(config, layout, prefix, lm_head, shapes)
    with torch.device("meta"):
        full = MiniMaxM3ForCausalLM(config, dtype=dtype, attn_backend=attn_backend)
    full_shapes = {name: tuple(p.shape) for name, p in full.named_parameters()}
    check_tensors(shapes, expected, dict(full.named_parameters()), path)  # the whole checkpoint, whole shapes
    by_part: dict[str, list[str]] = defaultdict(list)  # "layers.i" or "" (the rest) -> its checkpoint tensors
    for name, target in expected.items():
        parts = target.param.split(".")
        by_part[".".join(parts[:2]) if parts[0] == "layers" else ""].append(name)

    model = build_local_model(config, shard, dtype, attn_backend)
    handles: dict[Path, object] = {}

    def read(part: torch.nn.Module, prefix: str, names: list[str]) -> None:
        params = {f"{prefix}{n}": p for n, p in part.named_parameters()}
        for name in names:
            target = expected[name]
            plan = copy_plan(target.index, full_shapes[target.param],
                             param_pieces(target.param, config, shard))
            if not plan:
                continue
            if files[name] not in handles:
                handles[files[name]] = safe_open(files[name], framework="pt")
            source = handles[files[name]].get_slice(name)
            for src, local in plan:
                _copy(source, src, params[target.param][local])

    for name, part in model.named_children():
        if name != "layers":
            part.to_empty(device=device)
    model.lm_head.weight.zero_()  # the last rank's padding rows past the vocabulary
    read(model, "", by_part[""])
    if config.tie_word_embeddings:  # the head is this rank's rows of the embeddings
        start, end = shard.span_ceil(config.vocab_size)
        rows = model.embed_tokens.weight[start:min(end, config.vocab_size)]
        model.lm_head.weight[:rows.shape[0]].copy_(rows)
    fp8 = fp8_for(quantization, torch.device(device))
    for i, layer in enumerate(model.layers):
        layer.to_empty(device=device)
        read(layer, f"layers.{i}.", by_part[f"layers.{i}"])
        quantize_layer(layer, quantization, fp8)
    return model.eval()


def dummy_shard(config: ModelConfig, shard: Shard, device: torch.device | str, dtype: torch.dtype,
                attn_backend: str, seed: int, quantization: str = "none") -> MiniMaxM3ForCausalLM:
    """This rank's model with random weights (model/dummy.py), made on `device`: only its shard of each sharded
    parameter (salted with the rank: replicated KV heads differ between their ranks, which holds no meaning for
    random weights), the parameters held whole the same on every rank; each layer put into the
    served format of `quantization` as it is made (so the rank's scales are those of its own random slice)."""
    model = materialize(build_local_model(config, shard, dtype, attn_backend), device, quantization, seed,
                        salt=lambda name: 0 if param_pieces(name, config, shard) is None else shard.rank + 1)
    start, end = shard.span_ceil(config.vocab_size)
    with torch.no_grad():
        head = model.lm_head.weight
        if config.tie_word_embeddings:  # the head is this rank's rows of the embeddings
            rows = model.embed_tokens.weight[start:min(end, config.vocab_size)]
            head[:rows.shape[0]].copy_(rows)
        head[max(0, config.vocab_size - start):].zero_()  # the last rank's padding rows past the vocabulary
    return model


def load_rank(path: str | Path, shard: Shard, device: torch.device | str, dtype: torch.dtype, attn_backend: str,
              load_format: str = "auto", seed: int = 0, quantization: str = "none") -> MiniMaxM3ForCausalLM:
    """This rank's model in the served format of `quantization`: its shard of the checkpoint at `path`, or with
    load_format "dummy" random weights from `seed` for the config.json there."""
    if load_format == "dummy":
        config = ModelConfig.from_pretrained(path)
        return dummy_shard(config, shard, device, dtype, attn_backend, seed, quantization).eval()
    return load_shard(path, shard, device, dtype, attn_backend, quantization)


def _copy(source, src: tuple[slice, ...], dest: torch.Tensor) -> None:
    """dest <- source[src], in blocks of rows of at most _CHUNK_BYTES (an expert stack is GBs)."""
    if not src:  # a scalar
        dest.copy_(source[:])
        return
    start, stop, _ = src[0].indices(source.get_shape()[0])
    row_bytes = math.prod(dest.shape[1:]) * 4
    step = max(1, _CHUNK_BYTES // max(1, row_bytes))
    for s in range(start, stop, step):
        e = min(s + step, stop)
        dest[s - start:e - start].copy_(source[(slice(s, e), *src[1:])])
