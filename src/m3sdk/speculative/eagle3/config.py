"""Eagle3Config: an EAGLE3 draft head's config.json (the published LlamaForCausalLMEagle3 layout, or the
speculators one), read and written."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from m3sdk.errors import CheckpointError
from m3sdk.model.config import read_config_json

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")


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
