"""EAGLE3: a one-layer Llama draft head that reads three target layers' hidden states, in the checkpoint layout
the published EAGLE3 drafts use with vLLM and SGLang (e.g. Inferact/MiniMax-M3-EAGLE3).

Checkpoint (`config.json` + `model.safetensors` or `pytorch_model.bin`):
  config: `architectures: ["LlamaForCausalLMEagle3"]`, Llama fields (hidden_size, num_attention_heads,
    num_key_value_heads, head_dim, intermediate_size, rms_norm_eps, rope_theta, vocab_size), `draft_vocab_size`,
    optional `target_hidden_size`, `norm_before_residual`, and the aux layers in `eagle_aux_hidden_state_layer_ids`
    (top level, or inside `eagle_config`, which may also say `use_aux_hidden_state`). The speculators layout
    (`Eagle3Speculator`, Llama fields inside `transformer_layer_config`) is read too.
  tensors: `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
    `midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v take 2 * hidden inputs),
    `midlayer.mlp.{gate,up,down}_proj.weight`,
    `fc.weight` [hidden, 3 * target_hidden], `norm.weight`, `lm_head.weight` [draft_vocab, hidden],
    `d2t` int64 [draft_vocab] (target id = draft id + d2t[draft id]), `t2d` bool [vocab], and optionally
    `embed_tokens.weight` (absent: the target's embedding is shared). `layers.0.*` is accepted for `midlayer.*`.

Aux layer ids follow vLLM: id i is the hidden state *entering* target layer i (transformers' hidden_states[i]);
default (2, n // 2, n - 3). (SGLang shifts explicit ids by one: it reads id i as layer i's output.)

The draft step at position t reads the target's aux states at t and the embedding of token t + 1 and predicts
token t + 2; its later steps feed back its own pre-norm output instead of the target's states. It keeps its own
small KV cache per request (positions it has seen), so it needs nothing from the target's paged cache.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from m3sdk.attention.base import to_device
from m3sdk.errors import CheckpointError
from m3sdk.graphs import Replay, batch_buckets
from m3sdk.model.config import read_config_json
from m3sdk.speculative.base import DeviceDrafts, SpecConfig, TargetInfo, register
from m3sdk.speculative.chain import ChainDrafter, DraftSeq

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")
BUNDLED_HEAD_DIR = "m3-tiny-eagle3"  # next to the bundled target in m3sdk/assets
# the drafter keeps the draft vocabulary's normed embeddings as a table up to this size (m3-tiny's head: 0.5 MiB)
DRAFT_EMBED_TABLE_BYTES = 64 << 20


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    norm_before_residual: bool = False
    use_aux_hidden_state: bool = True
    aux_layer_ids: tuple[int, ...] | None = None  # None: the target's default

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> Eagle3Config:
        archs = raw.get("architectures") or []
        if archs and not any(a in ARCHITECTURES for a in archs):
            raise CheckpointError(f"{source}: architectures {archs} is not an EAGLE3 draft ({list(ARCHITECTURES)})")
        speculators = "transformer_layer_config" in raw
        layer = raw.get("transformer_layer_config") or raw
        eagle = raw.get("eagle_config") or {}
        try:
            hidden = int(layer["hidden_size"])
            heads = int(layer["num_attention_heads"])
            vocab = int(layer.get("vocab_size") or raw["vocab_size"])
            intermediate = int(layer["intermediate_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: missing or bad field {e}") from e
        if layer.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{source}: hidden_act {layer['hidden_act']!r} is not supported (only silu)")
        if layer.get("attention_bias") or layer.get("mlp_bias"):
            raise CheckpointError(f"{source}: biased draft projections are not supported")
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise CheckpointError(f"{source}: num_hidden_layers {layer['num_hidden_layers']} (only 1 is supported)")
        rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise CheckpointError(f"{source}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported")
        aux = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads),
            intermediate_size=intermediate,
            vocab_size=vocab,
            draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", layer.get("rope_theta", 10000.0))),
            max_position_embeddings=int(layer.get("max_position_embeddings", 8192)),
            norm_before_residual=bool(raw.get("norm_before_residual", speculators)),
            use_aux_hidden_state=bool(eagle.get("use_aux_hidden_state", True)),
            aux_layer_ids=tuple(int(i) for i in aux) if aux else None,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Eagle3Config:
        raw, file = read_config_json(path)
        return cls.from_dict(raw, str(file))

    def to_dict(self) -> dict[str, Any]:
        """The published LlamaForCausalLMEagle3 config.json."""
        d = asdict(self)
        out: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_act": "silu",
            "num_hidden_layers": 1,
            "hidden_size": d["hidden_size"],
            "num_attention_heads": d["num_heads"],
            "num_key_value_heads": d["num_kv_heads"],
            "head_dim": d["head_dim"],
            "intermediate_size": d["intermediate_size"],
            "vocab_size": d["vocab_size"],
            "draft_vocab_size": d["draft_vocab_size"],
            "target_hidden_size": d["target_hidden_size"],
            "rms_norm_eps": d["rms_norm_eps"],
            "rope_theta": d["rope_theta"],
            "max_position_embeddings": d["max_position_embeddings"],
            "norm_before_residual": d["norm_before_residual"],
            "tie_word_embeddings": False,
            "eagle_config": {"use_aux_hidden_state": d["use_aux_hidden_state"]},
        }
        if self.aux_layer_ids is not None:
            out["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
            out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        return out


class RMSNorm(nn.Module):
    """Llama RMSNorm (weight * x / rms; torch computes the rms in float32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one op (fused where torch has the kernel): a draft step is a few hundred small kernels, this was 9
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, 1, D / 2] of positions [N] (float32), for `rope`."""
    ang = positions.to(torch.float32)[:, None, None] * inv_freq
    return ang.cos(), ang.sin()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama (NeoX-style, rotate-half) RoPE over the whole head: x [N, H, D], angles from `rope_angles`."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Eagle3Head(nn.Module):
    """The draft head. Its state_dict names are the checkpoint's (`midlayer.*`, `fc`, `norm`, `lm_head`,
    `d2t`, `t2d`); `embed_tokens` exists only when the checkpoint carries its own."""

    def __init__(self, config: Eagle3Config, own_embedding: bool = False, own_lm_head: bool = True):
        super().__init__()
        c = self.config = config
        self.midlayer = _MidLayer(c)
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False) if c.use_aux_hidden_state else None
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False) if own_lm_head else None
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if own_embedding else None
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool)
                             if c.draft_vocab_size == c.vocab_size else torch.zeros(c.vocab_size, dtype=torch.bool))
        self.shared_embed: nn.Module | None = None  # the target's, when embed_tokens is None
        self.shared_lm_head: nn.Module | None = None  # the target's, when lm_head is None
        self.aux_layers: tuple[int, ...] = config.aux_layer_ids or ()  # the loader fills in the target's default
        self._rope_inv: torch.Tensor | None = None

    # -- the pieces of one draft step (also used by the training script with its own attention masks) --

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        emb = self.embed_tokens if self.embed_tokens is not None else self.shared_embed
        return emb(token_ids)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """Target aux states [N, 3 * target_hidden] -> the draft's hidden input [N, hidden]."""
        return self.fc(aux) if self.fc is not None else aux

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """-> q [N, Hq, D], k [N, Hkv, D] (both roped), v [N, Hkv, D], residual [N, hidden]."""
        c, layer = self.config, self.midlayer
        if c.norm_before_residual:
            h = residual = layer.hidden_norm(hidden)
        else:
            residual, h = hidden, layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(embeds), h], dim=-1)
        att = layer.self_attn
        # q and k roped together (one set of kernels for both)
        qk = torch.cat([att.q_proj(x), att.k_proj(x)], dim=-1).view(-1, c.num_heads + c.num_kv_heads, c.head_dim)
        q, k = rope(qk, *rope_angles(positions, self._inv_freq(x.device))).split([c.num_heads, c.num_kv_heads], 1)
        v = att.v_proj(x).view(-1, c.num_kv_heads, c.head_dim)
        return q, k, v, residual

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        """RoPE's inverse frequencies [D / 2], float32 (kept apart from the module's buffers, which `.to(dtype)`
        would round to the head's dtype), made once per device (outside a graph capture: its eager run is first)."""
        if self._rope_inv is None or self._rope_inv.device != device:
            d = self.config.head_dim
            self._rope_inv = 1.0 / self.config.rope_theta ** (
                torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
        return self._rope_inv

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attention output [N, Hq * D] -> (final-normed [N, hidden], pre-norm [N, hidden]: the next step's
        hidden input)."""
        layer = self.midlayer
        residual = layer.self_attn.o_proj(attn) + residual
        residual = layer.mlp(layer.post_attention_layernorm(residual)) + residual
        return self.norm(residual), residual

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [N, draft_vocab] (the target's full vocabulary when the head is shared)."""
        head = self.lm_head if self.lm_head is not None else self.shared_lm_head
        return head(normed).float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


class DraftKV:
    """One request's entries in the drafter's cache pool: row `slot`, positions first .. first + length - 1 at
    indices 0 .. length - 1."""

    def __init__(self, first: int, slot: int):
        self.first = first
        self.slot = slot
        self.length = 0

    @property
    def end(self) -> int:
        """The position after the last entry."""
        return self.first + self.length


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    bins = sorted(path.glob("pytorch_model*.bin"))
    if bins:
        out = {}
        for f in bins:
            out.update(torch.load(f, map_location="cpu", weights_only=True))
        return out
    raise CheckpointError(f"{path}: no *.safetensors or pytorch_model.bin")


def _canonical(name: str) -> str:
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def load_eagle3(path: str | Path, target: TargetInfo) -> Eagle3Head:
    """Read a draft head in the published layout and tie it to the target (shared embedding / lm_head when the
    checkpoint has none). Every tensor is checked by name and shape; a mismatch is a CheckpointError."""
    path = Path(path)
    config = Eagle3Config.from_pretrained(path)
    tc = target.config
    problems = []
    if config.vocab_size != tc.vocab_size:
        problems.append(f"vocab_size {config.vocab_size} != target's {tc.vocab_size}")
    if config.use_aux_hidden_state and config.target_hidden_size != tc.hidden_size:
        problems.append(f"target_hidden_size {config.target_hidden_size} != target's hidden_size {tc.hidden_size}")
    aux = config.aux_layer_ids or default_aux_layers(tc.num_layers)
    if len(aux) != 3 or any(not 0 <= i <= tc.num_layers for i in aux):
        problems.append(f"aux layer ids {aux} must be 3 ids in [0, {tc.num_layers}]")
    tensors = {_canonical(k): v for k, v in _read_tensors(path).items()}
    own_embed = "embed_tokens.weight" in tensors
    own_head = "lm_head.weight" in tensors
    if not own_embed and (target.embed_tokens is None or config.hidden_size != tc.hidden_size):
        problems.append("no embed_tokens.weight and the target's embedding cannot be shared")
    if not own_head and (target.lm_head is None or config.draft_vocab_size != tc.vocab_size
                         or config.hidden_size != tc.hidden_size):
        problems.append("no lm_head.weight and the target's lm_head cannot be shared")
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))

    head = Eagle3Head(config, own_embedding=own_embed, own_lm_head=own_head)
    expected = head.state_dict()
    if "d2t" not in tensors and config.draft_vocab_size == config.vocab_size:
        tensors["d2t"] = torch.zeros(config.vocab_size, dtype=torch.long)  # identity map
    if "d2t" in tensors and tensors["d2t"].shape == (config.draft_vocab_size,):
        t2d = _vocab_map(tensors["d2t"], config, path)
        if "t2d" not in tensors:  # only the target -> draft direction is missing: derive it
            tensors["t2d"] = t2d
        elif tensors["t2d"].shape == t2d.shape and not torch.equal(tensors["t2d"].bool(), t2d):
            raise CheckpointError(f"{path}: d2t and t2d name different target ids (d2t holds offsets: target id = "
                                  "draft id + d2t[draft id])")
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    bad = [f"{n} {tuple(tensors[n].shape)} != {tuple(t.shape)}" for n, t in expected.items()
           if n in tensors and tensors[n].shape != t.shape]
    if missing or unexpected or bad:
        raise CheckpointError(f"{path}: missing {missing}, unexpected {unexpected}, misshapen {bad}")
    head.load_state_dict({n: tensors[n].to(expected[n].dtype) for n in expected})
    head.shared_embed = None if own_embed else target.embed_tokens
    head.shared_lm_head = None if own_head else target.lm_head
    head.aux_layers = tuple(aux)
    return head.to(device=target.device, dtype=target.dtype).eval()


def _vocab_map(d2t: torch.Tensor, config: Eagle3Config, path: Path) -> torch.Tensor:
    """The t2d mask that d2t implies; d2t must map the draft ids one to one into the target vocabulary."""
    targets = torch.arange(config.draft_vocab_size) + d2t.long()
    if targets.min() < 0 or targets.max() >= config.vocab_size or targets.unique().numel() != targets.numel():
        raise CheckpointError(f"{path}: d2t maps draft ids outside [0, {config.vocab_size}) or two onto one target "
                              "(d2t holds offsets: target id = draft id + d2t[draft id])")
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[targets] = True
    return t2d


def save_eagle3(head: Eagle3Head, path: str | Path) -> None:
    """Write config.json + model.safetensors in the published layout."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(head.config.to_dict(), indent=2) + "\n")
    state = {n: t.detach().contiguous().cpu() for n, t in head.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


class Eagle3Drafter(ChainDrafter):
    """Drafts a chain of k tokens per request, greedily (the verifier treats each as a point mass). The first
    entry of each observed position reads fc(aux states); chain entries read the head's pre-norm output.

    The draft KV cache is one pool [slots + 1, Hkv, capacity, D] (a row per request, the last row scratch for
    padding), so a draft step attends for every request in one batched op, and the read of a verify step's
    entries with the k - 1 chain steps after it is one fixed-shape function that `capture_graphs` records as a
    CUDA graph per batch bucket.

    On a GPU each op of a draft step is a kernel of a few microseconds whatever its size, so the step is written
    for few ops: the head's weights are fused once for inference (`_fuse`), a read computes its outputs only at
    each context's last entry (the other entries only need their keys and values in the cache), and the chain
    attends over float32 working copies of the contexts' keys and values, into which its own entries go (they
    are dropped after proposing anyway, so they never touch the pool)."""

    method = "eagle3"

    def __init__(self, head: Eagle3Head, num_speculative_tokens: int, max_num_seqs: int = 1,
                 capacity: int | None = None):
        super().__init__(num_speculative_tokens)
        self.head = head
        c = head.config
        self.aux_layers = head.aux_layers if c.use_aux_hidden_state else ()
        self.dtype = head.midlayer.self_attn.q_proj.weight.dtype
        self.device = head.midlayer.self_attn.q_proj.weight.device
        self.capacity = capacity or c.max_position_embeddings
        self._free: list[int] = []
        # fixed-shape steps by batch bucket (capture_graphs): the chain's, and read's
        self._graphs: dict[int, Replay] = {}
        self._read_graphs: dict[int, Replay] = {}
        self._fuse()
        self._grow(max(max_num_seqs, 1))

    def _fuse(self) -> None:
        """Inference-only forms of the head's weights (the head keeps the checkpoint's tensors, which the training
        script trains): q | k | v and gate | up as one GEMM each, q's rows scaled by 1 / sqrt(D) (the attention
        then has no scale op), o_proj and down_proj transposed for `addmm` (the residual add inside the GEMM),
        RoPE's cos / sin of every position the pool can hold as one table (a step looks its rows up: one op),
        draft -> target ids as one lookup."""
        c, att, mlp = self.head.config, self.head.midlayer.self_attn, self.head.midlayer.mlp
        d = c.head_dim
        with torch.no_grad():
            self._w_qkv = torch.cat([att.q_proj.weight * (1.0 / math.sqrt(d)), att.k_proj.weight, att.v_proj.weight])
            self._w_gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            self._w_o, self._w_down = att.o_proj.weight.t(), mlp.down_proj.weight.t()
            self._ids = torch.arange(c.draft_vocab_size, device=self.device) + self.head.d2t
            # rows: positions 0 .. capacity - 1 (`has_room` keeps every entry, chain entries included, below it)
            inv = 1.0 / c.rope_theta ** (torch.arange(0, d, 2, device=self.device, dtype=torch.float32) / d)
            ang = torch.arange(self.capacity, device=self.device, dtype=torch.float32)[:, None] * inv
            cos, sin = ang.cos(), ang.sin()
            # x * [cos | cos] + roll(x, D / 2) * [-sin | sin]: rotate-half RoPE in two ops
            self._rope = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], 1)[:, :, None]
            self._span = torch.arange(self.capacity, device=self.device)
            # the chain's tokens are draft ids: their normed embeddings as one table where it is small (one lookup a
            # step instead of three ops)
            size = c.draft_vocab_size * c.hidden_size * self.dtype.itemsize
            self._draft_embeds = self._embed(self._ids) if size <= DRAFT_EMBED_TABLE_BYTES else None

    def _grow(self, slots: int) -> None:
        """(Re)size the pool [slots + 1, Hkv, 2 (key, value), capacity, D] to `slots` request rows + the scratch
        row, keeping the rows in use (keys and values side by side: one write and one gather each for both, and a
        context's keys are still one stride per (context, head) for the attention's batched GEMMs). Zero-filled: a
        masked key's weight is exactly 0, but 0 * NaN is not."""
        c = self.head.config
        kv = torch.zeros(slots + 1, c.num_kv_heads, 2, self.capacity, c.head_dim, dtype=self.dtype,
                         device=self.device)
        used = 0
        if hasattr(self, "kv_cache"):
            used = self.kv_cache.shape[0] - 1
            kv[:used] = self.kv_cache[:used]
            self._graphs, self._read_graphs = {}, {}  # they captured the old pool's addresses
        self.kv_cache = kv
        self._rows = torch.arange(slots + 1, device=self.device)  # context rows of the chain's working copies
        self._free += range(used, slots)
        self.scratch = slots

    def new_context(self, first: int, device: torch.device) -> DraftKV:
        if not self._free:
            self._grow(2 * (self.kv_cache.shape[0] - 1))
        return DraftKV(first, self._free.pop())

    def drop_context(self, ctx: DraftKV) -> None:
        self._free.append(ctx.slot)

    def has_room(self, ctx: DraftKV, n: int) -> bool:
        # positions bound the entries too (the RoPE table's rows): a context starting past 0 ends before capacity
        return ctx.end + n <= self.capacity

    # -- one draft step, at fixed shapes (no host sync): the eager paths and the graphs run these --

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Normed embeddings [N, H] of target token ids [N] (the first half of q/k/v's input)."""
        return self.head.midlayer.input_layernorm(self.head.embed(tokens))

    def _embed_draft(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """`_embed` of draft-vocabulary ids."""
        if self._draft_embeds is not None:
            return self._draft_embeds[draft_ids]
        return self._embed(self._ids[draft_ids])

    def _enter(self, embedded: torch.Tensor, hidden: torch.Tensor, rope: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Entries from their tokens' normed embeddings [N, H], hidden inputs [N, H] (fc of the target's features,
        or the draft's own pre-norm output) and RoPE rows [N, 2, 1, D] -> q [N, Hq, D] (scaled) and k [N, Hkv, D],
        both roped, in float32, v [N, Hkv, D] in the head's dtype, residual [N, H]."""
        c, layer = self.head.config, self.head.midlayer
        if c.norm_before_residual:
            h = residual = layer.hidden_norm(hidden)
        else:
            residual, h = hidden, layer.hidden_norm(hidden)
        qkv = F.linear(torch.cat([embedded, h], dim=-1), self._w_qkv).view(
            -1, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        qk = qkv[:, :c.num_heads + c.num_kv_heads]
        cos, sin = rope.unbind(1)
        # (the head's dtype times float32 promotes: the rotation is computed in float32, as the head was trained)
        qk = torch.addcmul(qk * cos, qk.roll(c.head_dim // 2, -1), sin)
        return qk[:, :c.num_heads], qk[:, c.num_heads:], qkv[:, c.num_heads + c.num_kv_heads:], residual

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, hide: torch.Tensor) -> torch.Tensor:
        """One query per context: q [B, Hq, D] over its context's keys and values kv [B, Hkv, 2, S, D] (float32)
        but those where hide [B, S] -> [B, Hq * D] in the head's dtype. (Written out: SDPA with a mask, float32
        and grouped heads falls back to its many-kernel math path on a GPU.)"""
        b, hq, d = q.shape
        s = torch.matmul(q.reshape(b, kv.shape[1], -1, d), kv[:, :, 0].transpose(-1, -2))
        s.masked_fill_(hide[:, None, None], float("-inf"))
        return torch.matmul(s.softmax(-1), kv[:, :, 1]).view(b, hq * d).to(self.dtype)

    def _exit(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention output [B, Hq * D] -> (pre-norm output [B, H]: the next entry's hidden input, its draft
        token [B] as a draft-vocabulary id)."""
        layer, head = self.head.midlayer, self.head
        residual = torch.addmm(residual, attn, self._w_o)
        gate, up = F.linear(layer.post_attention_layernorm(residual), self._w_gate_up).chunk(2, dim=-1)
        residual = torch.addmm(residual, F.silu(gate) * up, self._w_down)
        lm = head.lm_head if head.lm_head is not None else head.shared_lm_head
        # (argmax over the logits in the head's dtype: their float32 copy holds the same values)
        return residual, lm(head.norm(residual)).argmax(-1)

    def _read(self, tokens: torch.Tensor, features: torch.Tensor, rope: torch.Tensor, slot: torch.Tensor,
              idx: torch.Tensor, last: torch.Tensor, ctx_slot: torch.Tensor, hide: torch.Tensor, span: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Committed entries [N] (target token ids, target features [N, F], RoPE rows) written to the pool at
        (slot, idx) [N]; the output at each context's last entry `last` [B] (context pool rows `ctx_slot` [B], keys
        past its entry hidden by `hide` [B, span]) -> its draft ids [B] (draft vocabulary), its pre-norm output
        [B, H], and the contexts' keys and values as a float32 working copy [B, Hkv, 2, span, D] (the chain's)."""
        q, k, v, residual = self._enter(self._embed(tokens), self.head.combine(features), rope)
        self.kv_cache[slot, :, :, idx] = torch.stack([k, v], dim=2).to(self.dtype)
        kv = self.kv_cache[ctx_slot, :, :, :span].float()
        residual, first = self._exit(self._attend(q[last], kv, hide), residual[last])
        return first, residual, kv

    def _chain(self, embedded: torch.Tensor, residual: torch.Tensor, rope: torch.Tensor, kv: torch.Tensor,
               idx: torch.Tensor, hide: torch.Tensor) -> list[torch.Tensor]:
        """Chain entries from each context's last entry (its draft's normed embedding [B, H], pre-norm output
        residual [B, H]): entry s at RoPE rows rope[s] [B, 2, 1, D] goes into the working copy kv at idx[s] [B]
        and sees what hide[s] [B, span] does not hide -> the draft ids (draft vocabulary) of each entry, [B] each."""
        rows, drafted = self._rows[:embedded.shape[0]], []
        for s in range(idx.shape[0]):
            q, k, v, residual = self._enter(embedded, residual, rope[s])
            kv[rows, :, :, idx[s]] = torch.stack([k, v], dim=2)
            residual, ids = self._exit(self._attend(q, kv, hide[s]), residual)
            drafted.append(ids)
            if s + 1 < idx.shape[0]:
                embedded = self._embed_draft(ids)
        return drafted

    def _targets(self, draft_ids: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """Draft-vocabulary ids, [B] each -> target ids [B, len(draft_ids)] (into `out` if given)."""
        ids = torch.stack(draft_ids, dim=1)
        return torch.index_select(self._ids, 0, ids.view(-1), out=None if out is None else out.view(-1)).view(
            ids.shape)

    # -- the ChainDrafter steps --

    @torch.inference_mode()
    def read(self, ctxs: list[DraftKV], counts: list[int], token_ids: list[int], features: torch.Tensor,
             positions: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Eager (a prefill's entries, or no graphs): one upload of the entries' and contexts' ints, `_read`."""
        slot, idx, last, at = [], [], [], 0
        for ctx, n in zip(ctxs, counts, strict=True):
            slot += [ctx.slot] * n
            idx += range(ctx.length, ctx.length + n)
            ctx.length += n
            at += n
            last.append(at - 1)
        n, b = len(token_ids), len(ctxs)
        ints = to_device(token_ids + positions + slot + idx + last + [c.slot for c in ctxs]
                         + [idx[r] for r in last], torch.long, self.device)
        tok, pos, slot_t, idx_t = ints[:4 * n].view(4, n)
        last_t, ctx_slot, q_idx = ints[4 * n:].view(3, b)
        span = max(c.length for c in ctxs)
        first, residual, _ = self._read(tok, features.to(self.dtype), self._rope[pos], slot_t, idx_t, last_t,
                                        ctx_slot, self._span[:span] > q_idx[:, None], span)
        return residual, self._ids[first].tolist()

    @torch.inference_mode()
    def chain(self, seqs: list[DraftSeq], steps: int) -> list[list[int]]:
        b = len(seqs)
        # the graphs run k - 1 steps: fewer (requests near their end) read the first `steps` columns
        bucket = next((g for g in self._graphs if g >= b), None)
        if bucket is None:
            ints = to_device(self._chain_ints(seqs, b, steps), torch.long, self.device)
            span = max(s.ctx.length for s in seqs) + steps
            return self._chain_from(ints, torch.stack([s.hidden for s in seqs]), b, steps, span).tolist()
        static = self._static[bucket]
        self._stage(static)[:] = self._chain_ints(seqs, bucket, self.num_speculative_tokens - 1)
        self._send(static)
        torch.stack([s.hidden for s in seqs], out=self._chain_hidden[:b])
        return self._graphs[bucket]()[:b, :steps].tolist()

    def _chain_ints(self, seqs: list[DraftSeq], bucket: int, steps: int) -> list[int]:
        """The chain's packed ints: first drafts [bucket], pool rows [bucket], then per step the entries' positions
        and working-copy indices [steps, bucket] each; padding contexts: token 0 at position 0 on the scratch
        row."""
        pad = [0] * (bucket - len(seqs))
        out = [s.next_token for s in seqs] + pad + [s.ctx.slot for s in seqs] + [self.scratch] * len(pad)
        for s in range(steps):
            out += [q.ctx.end + s for q in seqs] + pad
        for s in range(steps):
            out += [q.ctx.length + s for q in seqs] + pad
        return out

    def _chain_from(self, ints: torch.Tensor, hidden: torch.Tensor, bucket: int, steps: int, span: int
                    ) -> torch.Tensor:
        """The chain alone (after an eager read), from `_chain_ints` (the first drafts as target ids) and the last
        entries' pre-norm outputs -> target ids [bucket, steps]."""
        tok, ctx_slot = ints[:2 * bucket].view(2, bucket)
        pos, idx = ints[2 * bucket:].view(2, steps, bucket)
        kv = self.kv_cache[ctx_slot, :, :, :span].float()
        return self._targets(self._chain(self._embed(tok), hidden, self._rope[pos], kv, idx,
                                         self._span[:span] > idx[..., None]))

    @torch.inference_mode()
    def read_ahead(self, ctxs: list[DraftKV], counts: list[int], token_ids: list[int],
                   features: tuple[torch.Tensor, list[int]], positions: list[int]) -> DeviceDrafts | None:
        """The read graph over entries the host has settled (each context's n entries all committed), whose chain
        runs on the device from the read's outputs: one upload, one copy of the features, one replay (nothing
        waits here)."""
        b, width = len(ctxs), self.num_speculative_tokens + 1
        bucket = next((g for g in self._read_graphs if g >= b), None)
        if bucket is None or max(counts) > width:  # a prefill, or no graphs: `read` runs eagerly
            return None
        feats, rows = features
        if feats.shape[0] > bucket * width:  # (the step also held a prefill chunk: its rows, compacted)
            feats = torch.cat([feats[r:r + n] for r, n in zip(rows, counts, strict=True)])
            rows = [sum(counts[:i]) for i in range(b)]
        static = self._read_static[bucket]
        ints, at = _ReadInts(self._stage(static), bucket, self.num_speculative_tokens), 0
        for i, (ctx, n, row) in enumerate(zip(ctxs, counts, rows, strict=True)):
            # all n entries committed: the device counts no accepted draft, `lim` says n - 1
            self._read_context(ints, i, ctx, n, row, positions[at], lim=n - 1)
            ints.verdict[row:row + n] = token_ids[at:at + n]
            ctx.length += n
            at += n
        self._send(static)
        self._features[:feats.shape[0]].copy_(feats)
        return DeviceDrafts(self._read_graphs[bucket]()[:b])

    @torch.inference_mode()
    def launch_unverified(self, ctxs: list[DraftKV], items: Sequence[tuple[str, int, int, int, int]],
                          logits: torch.Tensor, features: torch.Tensor, drafts: torch.Tensor) -> DeviceDrafts | None:
        """The read graph launched right behind a greedy verify step's forward: the verdict (how many drafts each
        request accepted) is worked out on the device from the step's argmax and the drafts it verified (the
        last read's, still in `_drafts_out`), so the host launches it before reading anything."""
        b, k = len(ctxs), self.num_speculative_tokens
        bucket = next((g for g in self._read_graphs if g >= b), None)
        if bucket is None:
            return None
        static = self._read_static[bucket]
        ints = _ReadInts(self._stage(static), bucket, k)
        for i, (ctx, (_, start, n, row, first)) in enumerate(zip(ctxs, items, strict=True)):
            self._read_context(ints, i, ctx, n, row, start, lim=0)
            ints.drafts[i * k:i * k + n - 1] = range(first, first + n - 1)
            ints.valid[i * k:i * k + n - 1] = 1
        self._send(static)
        t = logits.shape[0]
        verdict = self._verdicts[bucket][:t]
        torch.argmax(logits, dim=1, out=verdict)  # into the verdict region, after the upload (stream order)
        self._verdict.send(torch.cat([verdict, drafts]))  # before the read overwrites those drafts
        self._features[:t].copy_(features)
        return DeviceDrafts(self._read_graphs[bucket]()[:b])

    def _read_context(self, ints: _ReadInts, i: int, ctx: DraftKV, n: int, row: int, start: int, lim: int) -> None:
        """Context i's part of the read graph's ints: its n entries, whose features and tokens sit at the step's
        rows row .. row + n - 1, at positions start .., padded to k + 1 on the scratch row; `lim` is added to the
        accepted drafts the device counts."""
        r = i * (self.num_speculative_tokens + 1)
        ints.src[r:r + n] = range(row, row + n)
        ints.slot[r:r + n] = ctx.slot
        ints.idx[r:r + n] = range(ctx.length, ctx.length + n)
        ints.pos[r:r + n] = range(start, start + n)
        ints.ctx_slot[i], ints.lim[i] = ctx.slot, lim
        ints.base[:, i] = r, ctx.length, start  # its first entry's row, working-copy index, position

    def _draft_ahead(self, ints: torch.Tensor, bucket: int) -> torch.Tensor:
        """The read graph's body (`_ReadInts` layout): the verdict (accepted drafts a per context: the leading
        valid drafts that equal the argmax before them, plus `lim`), then `_read` over `bucket` contexts of k + 1
        entries whose output is read at entry a, then the chain from there, all on the device -> drafts
        [bucket, k]. Each entry's token is the verdict region's value at its row: for a verify step the argmax
        there, which is the token after the entry's position for every entry up to a (an accepted draft equals
        it, and the one at a is the step's bonus token); entries past a are written where the next read
        overwrites them, and no query here sees them. One upload and one copy of the features (and of a verify
        step's argmax) feed the whole step."""
        k, w = self.num_speculative_tokens, self.num_speculative_tokens + 1
        p = _ReadInts(ints, bucket, k)
        src = p.src.view(bucket, w)
        accepted = (p.verdict[src[:, :k]] == self._drafts_out.view(-1)[p.drafts.view(bucket, k)]) * p.valid.view(
            bucket, k)
        a = accepted.cumprod(1).sum(1) + p.lim
        last, q_idx, pos = (p.base + a).unbind(0)
        q_idx = q_idx + self._steps  # [k, bucket]: the read's last entry's working-copy index, then the chain's
        hide = self._span > q_idx[..., None]
        first, residual, kv = self._read(p.verdict[p.src], self._features[p.src], self._rope[p.pos], p.slot, p.idx,
                                         last, p.ctx_slot, hide[0], self.capacity)
        out = [first]
        if k > 1:
            out += self._chain(self._embed_draft(first), residual, self._rope[pos + 1 + self._steps[:-1]], kv,
                               q_idx[1:], hide[1:])
        # into a buffer made outside every capture: the drafts stay on the device while the chain graph may replay
        # (after an eager read), and memory a graph allocated in the shared pool can be another graph's scratch
        return self._targets(out, out=self._drafts_out[:bucket])

    def _stage(self, static: torch.Tensor) -> np.ndarray:
        """The host staging buffer of a graph's packed static ints, holding their defaults (padding), to fill and
        `_send`; reused once its last copy has run."""
        stage, done, defaults = self._staging[static.data_ptr()]
        if done is not None:
            done.synchronize()  # its copy of the step before (long done: the host has read a verify since)
        host = stage.numpy()
        host[:] = defaults
        return host

    def _send(self, static: torch.Tensor) -> None:
        """One non-blocking copy of the staging buffer into the static ints (pinned: a pageable upload would wait
        for the whole stream)."""
        stage, done, _ = self._staging[static.data_ptr()]
        static.copy_(stage, non_blocking=True)
        if done is not None:
            done.record()

    def capture_graphs(self, max_num_seqs: int) -> None:
        """CUDA graphs per batch bucket, captured now (serving never stalls on a capture): `read` of up to k + 1
        committed entries per request (what a verify step commits) followed by the chain on its outputs
        (`_draft_ahead`), and the chain alone (k - 1 draft steps, after a read that ran eagerly). Each bucket reads
        one packed static int buffer, filled by one upload. Off CUDA, the same fixed-shape steps run eagerly on
        the same static buffers."""
        if self.kv_cache.shape[0] - 1 < max_num_seqs:
            self._grow(max_num_seqs)
        c, n, k = self.head.config, max_num_seqs, self.num_speculative_tokens
        i64 = dict(dtype=torch.long, device=self.device)
        features = 3 * c.target_hidden_size if c.use_aux_hidden_state else c.hidden_size
        self._features = torch.zeros(n * (k + 1), features, dtype=self.dtype, device=self.device)
        self._chain_hidden = torch.zeros(n, c.hidden_size, dtype=self.dtype, device=self.device)
        self._drafts_out = torch.zeros(n, k, **i64)  # the read graphs' drafts (`_draft_ahead`)
        self._steps = torch.arange(k, **i64)[:, None]  # a chain's entries after the read's last one
        self._read_static, self._static, self._staging, self._verdicts = {}, {}, {}, {}
        cuda = self.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if cuda else None
        with torch.inference_mode():
            for b in batch_buckets(n):
                # padding: token 0 at position 0 on the scratch row (its values never reach a real request)
                defaults = np.zeros(_ReadInts.size(b, k), dtype=np.int64)
                pad = _ReadInts(defaults, b, k)
                pad.slot[:] = pad.ctx_slot[:] = self.scratch
                ints = self._read_static[b] = torch.from_numpy(defaults).to(self.device)
                self._staging[ints.data_ptr()] = self._stage_for(ints, cuda)
                self._verdicts[b] = ints[-b * (k + 1):]  # `_ReadInts.verdict`, which a verify step's argmax fills
                self._read_graphs[b] = Replay(lambda b=b, ints=ints: self._draft_ahead(ints, b), pool, self.device)
                if k > 1:
                    ints = self._static[b] = torch.zeros(2 * b + 2 * (k - 1) * b, **i64)
                    ints[b:2 * b] = self.scratch
                    self._staging[ints.data_ptr()] = self._stage_for(ints, cuda)
                    self._graphs[b] = Replay(lambda b=b, ints=ints: self._chain_fixed(ints, b), pool, self.device)

    @staticmethod
    def _stage_for(static: torch.Tensor, cuda: bool) -> tuple[torch.Tensor, torch.cuda.Event | None, np.ndarray]:
        """A host staging buffer for `static` (pinned on CUDA), the event of its last copy, and the static ints'
        defaults (their values now)."""
        stage = torch.empty(static.shape, dtype=static.dtype, pin_memory=cuda)
        return stage, torch.cuda.Event() if cuda else None, static.cpu().numpy().copy()

    def _chain_fixed(self, ints: torch.Tensor, bucket: int) -> torch.Tensor:
        """The chain graph's body: `ints` in `_chain_ints`' layout, the last entries' pre-norm outputs in
        `_chain_hidden`."""
        steps = self.num_speculative_tokens - 1
        return self._chain_from(ints, self._chain_hidden[:bucket], bucket, steps, self.capacity)


class _ReadInts:
    """The read graph's packed int64 inputs for one batch bucket, as named views of one buffer (host: numpy, device:
    torch). Per entry row (bucket x (k + 1), context i's at i (k + 1) ..): the step row of its features and token
    (`src`), its pool row and index, its position. Per context: the flat indices (in `_drafts_out`) of the drafts
    a verify step verified and which of them count (`valid`, [bucket, k] each), its pool row, `lim`, and its first
    entry's row, working-copy index and position (`base`, [3, bucket]). Then the verdict region: a token per step
    row (the entries' next tokens, or a verify step's argmax)."""

    def __init__(self, buf: np.ndarray | torch.Tensor, bucket: int, k: int):
        rows = bucket * (k + 1)
        self.src, self.slot, self.idx, self.pos, self.drafts, self.valid, self.ctx_slot, self.lim, base, \
            self.verdict = (buf[a:b] for a, b in _runs(rows, bucket, k))
        self.base = base.reshape(3, bucket)

    @staticmethod
    def size(bucket: int, k: int) -> int:
        return _runs(bucket * (k + 1), bucket, k)[-1][1]


def _runs(rows: int, bucket: int, k: int) -> list[tuple[int, int]]:
    """`_ReadInts`' fields as (start, end) runs, in order."""
    out, at = [], 0
    for n in (rows, rows, rows, rows, bucket * k, bucket * k, bucket, bucket, 3 * bucket, rows):
        out.append((at, at + n))
        at += n
    return out


def bundled_head_path(target_checkpoint: str | None) -> Path | None:
    """The head shipped beside the bundled target (m3sdk/assets/m3-tiny-eagle3), if the target is it."""
    if target_checkpoint is None:
        return None
    here = Path(target_checkpoint).resolve()
    candidate = here.parent / BUNDLED_HEAD_DIR
    if here.name == "m3-tiny" and (candidate / "config.json").is_file():
        return candidate
    return None


@register("eagle3")
def _build(config: SpecConfig, target: TargetInfo) -> Eagle3Drafter:
    path = config.model or bundled_head_path(target.checkpoint)
    if path is None:
        raise CheckpointError("speculative eagle3 needs a draft head: pass {'model': path} (only the bundled "
                              "m3-tiny ships one)")
    return Eagle3Drafter(load_eagle3(path, target), config.num_speculative_tokens, target.max_num_seqs,
                         target.max_model_len or None)
