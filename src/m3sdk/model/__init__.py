"""The MiniMax-M3 text model: config, layers, the paged forward, and the checkpoint loader."""

from m3sdk.model.config import ModelConfig
from m3sdk.model.loader import load_model
from m3sdk.model.minimax_m3 import MiniMaxM3ForCausalLM

__all__ = ["MiniMaxM3ForCausalLM", "ModelConfig", "load_model"]
