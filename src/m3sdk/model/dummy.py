"""load_format="dummy": a MiniMax-M3 from its config alone, with seeded random weights made on the target device.

Nothing is read but config.json. The model is built on the meta device exactly as a checkpoint load builds it,
then allocated one part at a time on the device (embeddings, head, final norm, then layer by layer); each part is
filled there and a layer is put into its served format by the loader's own `quantize_layer` before the next
one is allocated, so the parameter names, shapes, dtypes and formats are a real load's and the peak is the served
model plus one layer before quantization.

Values, per parameter: linears, experts, the router and the embeddings ~ N(0, initializer_range); the Gemma norm
weights 0 (a scale of 1, as initialized in training) and the router's correction bias 0. RMS-normalized layer
inputs keep activations finite at any depth. Each parameter draws from its own generator seeded from (seed, its
name, salt), so a part's values do not depend on the order parts are made in; a tensor-parallel rank salts the
parameters it holds a shard of with its rank and not those it holds whole (parallel/sharding.py: `dummy_shard`),
so the whole ones (embeddings, norms, the router) are identical on every rank.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from torch import nn

from m3sdk.model.config import ModelConfig
from m3sdk.model.layers import RMSNorm
from m3sdk.model.minimax_m3 import MiniMaxM3ForCausalLM
from m3sdk.model.quantize import fp8_for, quantize_layer

_ZERO = ("e_score_correction_bias",)


def dummy_model(config: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16,
                attn_backend: str = "torch", quantization: str = "none", seed: int = 0) -> MiniMaxM3ForCausalLM:
    """`config`'s model on `device` with random weights from `seed`, in the served format of `quantization`."""
    with torch.device("meta"):
        model = MiniMaxM3ForCausalLM(config, dtype=dtype, attn_backend=attn_backend)
    model = materialize(model, device, quantization, seed)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


@torch.no_grad()
def materialize(model: MiniMaxM3ForCausalLM, device: torch.device | str, quantization: str, seed: int,
                salt: Callable[[str], int] = lambda name: 0) -> MiniMaxM3ForCausalLM:
    """`model`, built on the meta device, allocated on `device` part by part and filled with random values
    (`salt(name)` of each full parameter name joins the seed), its layers quantized as they are made."""
    device = torch.device(device)
    fp8 = fp8_for(quantization, device)
    std = model.config.initializer_range
    for name, part in model.named_children():
        if name == "layers":
            continue
        part.to_empty(device=device)
        fill_random_(part, seed, std, f"{name}.", salt)
    for i, layer in enumerate(model.layers):
        layer.to_empty(device=device)
        fill_random_(layer, seed, std, f"layers.{i}.", salt)
        quantize_layer(layer, quantization, fp8)
    return model.eval()


def fill_random_(module: nn.Module, seed: int, std: float, prefix: str = "",
                 salt: Callable[[str], int] = lambda name: 0) -> None:
    """Every parameter of `module` (named `prefix` + its name in the model) filled in place, on its device."""
    for module_name, owner in module.named_modules():
        for param_name, p in owner.named_parameters(recurse=False):
            name = f"{prefix}{module_name}.{param_name}" if module_name else f"{prefix}{param_name}"
            if isinstance(owner, RMSNorm) or param_name in _ZERO:
                p.zero_()
                continue
            generator = torch.Generator(device=p.device)
            generator.manual_seed(param_seed(seed, name, salt(name)))
            p.normal_(0.0, std, generator=generator)


def param_seed(seed: int, name: str, salt: int = 0) -> int:
    """A generator seed for parameter `name`: stable across processes and runs (no Python hash())."""
    return (seed * 1_000_003 + zlib.crc32(name.encode()) + salt * 2_654_435_761) % (1 << 63)
