"""ModelConfig: the numbers of a MiniMax-M3 text model, read from a checkpoint's config.json.

Two spellings exist in the wild: the published one (nested `text_config`, `sparse_attention_config.*`,
`moe_layer_freq`, `rope_theta`, `rotary_dim`) and transformers' (`index_*`, `layer_types`, `mlp_layer_types`,
`rope_parameters`). Both are read here. Anything we cannot compute faithfully is a CheckpointError that names
the field, so a checkpoint is never served with a silently different model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3sdk.errors import CheckpointError

# Architectures whose text part is this model (the VL wrappers carry a vision tower we skip).
ARCHITECTURES = (
    "MiniMaxM3SparseForConditionalGeneration",
    "MiniMaxM3VLForConditionalGeneration",
    "MiniMaxM3VLForCausalLM",
    "MiniMaxM3SparseForCausalLM",
    "MiniMaxM3ForCausalLM",
)
MODEL_TYPES = ("minimax_m3_vl", "minimax_m3_vl_text", "minimax_m3")

SPARSE_ATTENTION = "minimax_m3_sparse"
FULL_ATTENTION = "full_attention"

# Published sparse_attention_config key -> transformers' flat name.
_SPARSE_KEYS = {
    "sparse_num_index_heads": "index_n_heads",
    "sparse_index_dim": "index_head_dim",
    "sparse_block_size": "index_block_size",
    "sparse_topk_blocks": "index_topk_blocks",
    "sparse_local_block": "index_local_blocks",
}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    # MLP
    dense_intermediate_size: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    swiglu_alpha: float
    swiglu_limit: float
    # per-layer kinds
    sparse_layers: tuple[int, ...]
    moe_layers: tuple[int, ...]
    # lightning indexer (sparse layers)
    index_n_heads: int
    index_head_dim: int
    index_block_size: int
    index_topk_blocks: int
    index_local_blocks: int
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_mtp_modules: int = 0
    architecture: str = "MiniMaxM3VLForCausalLM"
    checkpoint_dtype: str = "bfloat16"
    # How the checkpoint stores its quantized linears (from quantization_config; the loader reads them as stored):
    # "none", "mxfp8" (MiniMaxAI/MiniMax-M3-MXFP8) or "mxfp4" (AMD Quark, amd/MiniMax-M3-MXFP4)
    quant_format: str = "none"
    # std of the normal init of the linears and embeddings (only load_format="dummy" reads it)
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        problems = []
        if self.num_heads % self.num_kv_heads:
            problems.append(f"num_attention_heads {self.num_heads} not a multiple of num_key_value_heads "
                            f"{self.num_kv_heads}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            problems.append(f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")
        if self.sparse_layers:
            # each index head selects blocks for one KV group
            if self.index_n_heads != self.num_kv_heads:
                problems.append(f"index_n_heads {self.index_n_heads} != num_key_value_heads {self.num_kv_heads}")
            if self.index_head_dim < self.rotary_dim:
                problems.append(f"index_head_dim {self.index_head_dim} < rotary_dim {self.rotary_dim}")
            if self.index_topk_blocks < max(1, self.index_local_blocks):
                problems.append(f"index_topk_blocks {self.index_topk_blocks} < index_local_blocks "
                                f"{self.index_local_blocks}")
        if self.moe_layers and not 0 < self.num_experts_per_tok <= self.num_experts:
            problems.append(f"num_experts_per_tok {self.num_experts_per_tok} not in [1, {self.num_experts}]")
        for name, layers in (("sparse", self.sparse_layers), ("moe", self.moe_layers)):
            if any(not 0 <= i < self.num_layers for i in layers):
                problems.append(f"{name} layer index outside [0, {self.num_layers})")
        if problems:
            raise CheckpointError("config.json: " + "; ".join(problems))

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """Layers with a dense MLP."""
        return tuple(i for i in range(self.num_layers) if i not in self.moe_layers)

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `path/config.json` (or `path` itself when it is the json file)."""
        raw, file = read_config_json(path)
        return cls.from_dict(raw, source=str(file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        architecture = _check_architecture(raw, source)
        text = raw.get("text_config") or raw
        if not isinstance(text, dict):
            raise CheckpointError(f"{source}: text_config is not an object")
        return _parse_text_config(text, raw, architecture, source)


def read_config_json(path: str | Path) -> tuple[dict[str, Any], Path]:
    """The parsed `config.json` of a checkpoint folder (or the json file itself), and its path."""
    path = Path(path)
    file = path if path.suffix == ".json" else path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"no config.json in {path}")
    try:
        return json.loads(file.read_text()), file
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: unreadable config ({e})") from e


def _check_architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type")
    known = [a for a in archs if a in ARCHITECTURES]
    if archs and not known:
        raise CheckpointError(f"{source}: unknown architecture {archs}; m3sdk serves {list(ARCHITECTURES)}")
    if not archs and model_type not in MODEL_TYPES:
        raise CheckpointError(f"{source}: unknown model_type {model_type!r} and no architectures; "
                              f"m3sdk serves model types {list(MODEL_TYPES)}")
    return known[0] if known else "MiniMaxM3VLForCausalLM"


class _Reader:
    """Reads fields from the text config, recording what is missing or unsupported, to report all at once."""

    def __init__(self, text: dict[str, Any], source: str):
        self.text = text
        self.source = source
        self.problems: list[str] = []

    def get(self, *names: str, default: Any = None, required: bool = False) -> Any:
        for name in names:
            if self.text.get(name) is not None:
                return self.text[name]
        if required:
            self.problems.append(f"missing {names[0]}")
        return default

    def expect(self, name: str, ok: bool, value: Any, why: str) -> None:
        if not ok:
            self.problems.append(f"{name}={value!r} is not supported ({why})")


def _parse_text_config(text: dict[str, Any], outer: dict[str, Any], architecture: str, source: str) -> ModelConfig:
    r = _Reader(text, source)
    num_layers = int(r.get("num_hidden_layers", required=True) or 0)
    hidden = int(r.get("hidden_size", required=True) or 0)
    num_heads = int(r.get("num_attention_heads", required=True) or 1)
    head_dim = int(r.get("head_dim", default=hidden // max(num_heads, 1)))

    _check_unsupported(r, num_layers)
    quant_format = _quant_format(r, text.get("quantization_config") or outer.get("quantization_config"))
    rope_theta, rotary_dim = _rope(r, head_dim)
    sparse_layers, index = _sparse_attention(r, num_layers)
    moe_layers = _moe_layers(r, num_layers)

    eos = r.get("eos_token_id", default=outer.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    tie = bool(text.get("tie_word_embeddings", outer.get("tie_word_embeddings", False)))
    dtype = r.get("dtype", "torch_dtype", default=outer.get("dtype", outer.get("torch_dtype", "bfloat16")))
    vocab_size = int(r.get("vocab_size", required=True) or 0)
    # sizes of the MLP kinds the layers use are required; scalar knobs default as in transformers
    moe, dense = bool(moe_layers), len(moe_layers) < num_layers
    mlp = {
        "dense_intermediate_size": int(r.get("dense_intermediate_size", required=dense) or 0),
        "moe_intermediate_size": int(r.get("intermediate_size", required=moe) or 0),
        "shared_intermediate_size": int(r.get("shared_intermediate_size", required=moe) or 0),
        "num_experts": int(r.get("num_local_experts", "num_experts", required=moe) or 0),
        "num_experts_per_tok": int(r.get("num_experts_per_tok", required=moe) or 0),
    }
    if r.problems:
        raise CheckpointError(f"{source}: " + "; ".join(r.problems))
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(r.get("num_key_value_heads", default=num_heads)),
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=rope_theta,
        max_position_embeddings=int(r.get("max_position_embeddings", default=524288)),
        rms_norm_eps=float(r.get("rms_norm_eps", default=1e-6)),
        routed_scaling_factor=float(r.get("routed_scaling_factor", default=2.0)),
        swiglu_alpha=float(r.get("swiglu_alpha", default=1.702)),
        swiglu_limit=float(r.get("swiglu_limit", default=7.0)),
        sparse_layers=sparse_layers,
        moe_layers=moe_layers,
        tie_word_embeddings=tie,
        bos_token_id=r.get("bos_token_id", default=outer.get("bos_token_id")),
        eos_token_ids=eos_ids,
        num_mtp_modules=int(r.get("num_mtp_modules", default=0)),
        architecture=architecture,
        checkpoint_dtype=str(dtype).removeprefix("torch."),
        quant_format=quant_format,
        initializer_range=float(r.get("initializer_range", default=0.02)),
        **mlp,
        **index,
    )


def _check_unsupported(r: _Reader, num_layers: int) -> None:
    """Fields whose non-default values would change the math in ways this model does not implement."""
    t = r.text
    for name, want in (("attention_output_gate", False), ("attention_bias", False), ("use_gemma_norm", True),
                       ("use_qk_norm", True), ("use_routing_bias", True)):
        if name in t and t[name] is not None:
            r.expect(name, bool(t[name]) == want, t[name], f"only {want} is implemented")
    if "qk_norm_type" in t:
        r.expect("qk_norm_type", t["qk_norm_type"] == "per_head", t["qk_norm_type"], "only per_head")
    if "scoring_func" in t:
        r.expect("scoring_func", t["scoring_func"] == "sigmoid", t["scoring_func"], "only the sigmoid router")
    if "hidden_act" in t:
        # transformers rewrites swigluoai to silu but always computes SwiGLU-OAI
        r.expect("hidden_act", t["hidden_act"] in ("swigluoai", "silu"), t["hidden_act"], "only SwiGLU-OAI")
    if t.get("swiglu_beta") is not None:
        r.expect("swiglu_beta", float(t["swiglu_beta"]) == 1.0, t["swiglu_beta"], "only (up + 1)")
    if t.get("n_shared_experts") is not None:
        r.expect("n_shared_experts", int(t["n_shared_experts"]) == 1, t["n_shared_experts"], "one shared expert")


def _quant_format(r: _Reader, qc: dict[str, Any] | None) -> str:
    """The MX format of a quantization_config we can load as stored, or a named problem (docs/kernels.md has the
    layouts: MiniMax's MXFP8 release and AMD Quark's MXFP4 experts, both E8M0 scales on 1x32 blocks)."""
    if not qc:
        return "none"
    served = "m3sdk loads quant_method 'mxfp8' (MiniMaxAI/MiniMax-M3-MXFP8) and 'quark' MXFP4 (amd/MiniMax-M3-MXFP4)"
    method = qc.get("quant_method")
    if method == "mxfp8":
        block = qc.get("weight_block_size", [1, 32])
        r.expect("quantization_config.weight_block_size", list(block) == [1, 32], block, "MXFP8 blocks are 1x32")
        return "mxfp8"
    if method == "quark":
        weight = (qc.get("global_quant_config") or {}).get("weight") or {}
        scheme = {k: weight.get(k) for k in ("dtype", "qscheme", "group_size", "scale_format")}
        mxfp4 = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0"}
        r.expect("quantization_config.global_quant_config.weight", scheme == mxfp4, scheme,
                 f"of Quark's schemes only MXFP4 weights {mxfp4}")
        r.expect("quantization_config.layer_quant_config", not qc.get("layer_quant_config"),
                 sorted(qc.get("layer_quant_config") or ()), "per-layer Quark schemes (e.g. FP8 attention)")
        return "mxfp4"
    r.expect("quantization_config.quant_method", False, method, served)
    return "none"


def _rope(r: _Reader, head_dim: int) -> tuple[float, int]:
    params = r.get("rope_parameters", default={}) or {}
    scaling = r.get("rope_scaling")
    if scaling:
        params = {**scaling, **params}
    rope_type = params.get("rope_type", params.get("type", "default"))
    r.expect("rope_parameters.rope_type", rope_type == "default", rope_type, "only plain RoPE is implemented")
    # absent: MiniMax-M3's theta, as transformers' MiniMaxM3VLTextConfig (default_theta) fills it in
    theta = float(params.get("rope_theta", r.get("rope_theta", default=5e6)))
    factor = params.get("partial_rotary_factor", r.get("partial_rotary_factor"))
    declared = r.get("rotary_dim")
    if factor is None and declared is None:
        return theta, head_dim
    from_factor = int(head_dim * float(factor)) if factor is not None else None
    if from_factor is not None and declared is not None and from_factor != int(declared):
        r.problems.append(f"rotary_dim {declared} disagrees with partial_rotary_factor {factor} "
                          f"(x head_dim {head_dim} = {from_factor})")
    return theta, int(from_factor if from_factor is not None else declared)


def _sparse_attention(r: _Reader, num_layers: int) -> tuple[tuple[int, ...], dict[str, int]]:
    sac = r.get("sparse_attention_config", default={}) or {}
    index = {
        "index_n_heads": 4, "index_head_dim": 128, "index_block_size": 128, "index_topk_blocks": 16,
        "index_local_blocks": 1,
    }
    for published, flat in _SPARSE_KEYS.items():
        a, b = sac.get(published), r.text.get(flat)
        if a is not None and b is not None and int(a) != int(b):
            r.problems.append(f"sparse_attention_config.{published}={a} disagrees with {flat}={b}")
        if a is not None or b is not None:
            index[flat] = int(a if a is not None else b)
    if sac.get("sparse_init_block") not in (None, 0):
        r.expect("sparse_attention_config.sparse_init_block", False, sac["sparse_init_block"], "only 0")
    if sac.get("sparse_score_type") not in (None, "max"):
        r.expect("sparse_attention_config.sparse_score_type", False, sac["sparse_score_type"], "only max")

    layer_types = r.get("layer_types")
    if layer_types is not None:
        bad = sorted({t for t in layer_types if t not in (SPARSE_ATTENTION, FULL_ATTENTION)})
        r.expect("layer_types", not bad, bad, f"only {FULL_ATTENTION!r} and {SPARSE_ATTENTION!r}")
        sparse = [t == SPARSE_ATTENTION for t in layer_types]
    elif sac.get("use_sparse_attention", True) and sac.get("sparse_attention_freq") is not None:
        sparse = [bool(f) for f in sac["sparse_attention_freq"]]
    else:
        sparse = [False] * num_layers
    if len(sparse) != num_layers:
        r.problems.append(f"layer_types/sparse_attention_freq has {len(sparse)} entries for {num_layers} layers")
    disable = sac.get("sparse_disable_index_value")
    if disable is not None:
        flags = disable if isinstance(disable, list) else [disable] * num_layers
        enabled = [i for i, (s, d) in enumerate(zip(sparse, flags, strict=False)) if s and not d]
        r.expect("sparse_attention_config.sparse_disable_index_value", not enabled, disable,
                 f"the index value path (enabled on layers {enabled}) is not implemented")
    return tuple(i for i, s in enumerate(sparse) if s), index


def _moe_layers(r: _Reader, num_layers: int) -> tuple[int, ...]:
    kinds = r.get("mlp_layer_types")
    if kinds is not None:
        bad = sorted({k for k in kinds if k not in ("dense", "sparse")})
        r.expect("mlp_layer_types", not bad, bad, "only 'dense' and 'sparse'")
        moe = [k == "sparse" for k in kinds]
    else:
        freq = r.get("moe_layer_freq")
        if freq is None:
            moe = [True] * num_layers  # transformers' default
        elif isinstance(freq, list):
            moe = [bool(f) for f in freq]
        else:
            r.expect("moe_layer_freq", False, freq, "only a per-layer list")
            moe = [True] * num_layers
    if len(moe) != num_layers:
        r.problems.append(f"mlp_layer_types/moe_layer_freq has {len(moe)} entries for {num_layers} layers")
    return tuple(i for i, m in enumerate(moe) if m)

