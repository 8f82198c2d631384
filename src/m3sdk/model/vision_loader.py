"""Load the vision encoder (m3sdk.model.vision) of a MiniMax-M3 VL checkpoint, from either name layout:

  hf (transformers' save):  model.vision_tower.{embeddings.proj, pre_layrnorm, layers.N.*},
                            model.multi_modal_projector.{linear_1, linear_2, merge_linear_1, merge_linear_2}
  minimax (as published):   vision_tower.vision_model.{embeddings.patch_embedding, pre_layrnorm, encoder.layers.N.*},
                            multi_modal_projector.{linear_1, linear_2}, patch_merge_mlp.{linear_1, linear_2}

Each layer's packed attention projection `self_attn.qkv_proj` (weight and bias) is filled from the checkpoint's
`self_attn.{q,k,v}_proj` tensors, one third of its rows each (m3sdk.model.vision.VisionAttention).

The encoder is small next to the text model (M3: ~0.9B parameters), so its tensors are read whole; under a
`quantization` other than "none" (the engine passes "fp8" for `vision_quantization="fp8"`) its linears then go to
FP8 (m3sdk.model.quantize.quantize_vision_encoder).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from m3sdk.errors import CheckpointError
from m3sdk.model.loader import _MAX_LISTED, INDEX_FILE, SINGLE_FILE, read_headers, tensor_files
from m3sdk.model.quantize import quantize_vision_encoder
from m3sdk.model.vision import VisionConfig, VisionEncoder

_HF = (("projector.", "model.multi_modal_projector."), ("", "model.vision_tower."))
_MINIMAX = (("projector.merge_linear_", "patch_merge_mlp.linear_"), ("projector.", "multi_modal_projector."),
            ("embeddings.proj.", "vision_tower.vision_model.embeddings.patch_embedding."),
            ("layers.", "vision_tower.vision_model.encoder.layers."), ("", "vision_tower.vision_model."))
_PACKED, _QKV = "self_attn.qkv_proj.", ("self_attn.q_proj.", "self_attn.k_proj.", "self_attn.v_proj.")


def vision_config(path: str | Path) -> VisionConfig | None:
    """The checkpoint's vision config, or None for a text-only checkpoint."""
    source = Path(path) / "config.json"
    try:
        raw = json.loads(source.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{source}: unreadable ({e})") from e
    return VisionConfig.from_dict(raw, str(source))


def checkpoint_name(param: str, layout: str) -> str:
    """The name of our parameter `param` (one of the checkpoint's own module names: q_proj, not qkv_proj) in a
    checkpoint of `layout` ("hf" | "minimax")."""
    for ours, theirs in _HF if layout == "hf" else _MINIMAX:
        if param.startswith(ours):
            return theirs + param[len(ours):]
    raise AssertionError(param)  # the last rule's empty prefix matches everything


def _sources(param: str, rows: int) -> list[tuple[str, tuple]]:
    """Where our parameter `param` of `rows` rows comes from: (the checkpoint module's parameter name, the index
    of `param` it fills), one per source tensor."""
    if _PACKED not in param:
        return [(param, ())]
    third = rows // len(_QKV)
    return [(param.replace(_PACKED, part), (slice(i * third, (i + 1) * third),)) for i, part in enumerate(_QKV)]


def checkpoint_tensors(encoder: VisionEncoder, layout: str,
                       present: Mapping[str, object] = ()) -> dict[str, tuple[str, tuple]]:
    """Every tensor a checkpoint of `layout` holds for `encoder`: its name -> (our parameter, the index it fills).
    `present` (the checkpoint's names) picks the `block_sparse_moe` alias of an MLP tensor where only that is
    there."""
    out = {}
    for param, tensor in encoder.named_parameters():
        for source, index in _sources(param, tensor.shape[0]):
            out[_present(checkpoint_name(source, layout), present)] = (param, index)
    return out


def _present(name: str, files: Mapping[str, object]) -> str:
    """`name`, or its `block_sparse_moe` alias where only that is in the checkpoint: some transformers releases
    save every `.mlp.` of a published-layout model under that name (and read both back)."""
    alias = name.replace(".mlp.", ".block_sparse_moe.", 1)
    return alias if name not in files and alias in files else name


def load_vision_encoder(path: str | Path, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.bfloat16, quantization: str = "none") -> VisionEncoder | None:
    """The checkpoint's vision encoder, ready on `device`, its linears in FP8 under any `quantization` but "none"
    (m3sdk.config.QUANTIZATIONS; the others' expert formats do not apply: the tower has none); None when the
    checkpoint has no vision tower (a text-only config, a VL config whose vision tensors were left out, or a
    config-only folder)."""
    path = Path(path)
    config = vision_config(path)
    if config is None or not any((path / f).is_file() for f in (INDEX_FILE, SINGLE_FILE)):
        return None  # text only, or a config without weights (served with dummy text weights)
    files = tensor_files(path)
    layout = "minimax" if any(n.startswith("vision_tower.vision_model.") for n in files) else "hf"
    if not any(n.startswith(("vision_tower.", "model.vision_tower.")) for n in files):
        return None
    with torch.device("meta"):
        encoder = VisionEncoder(config)
    params = dict(encoder.named_parameters())
    targets = checkpoint_tensors(encoder, layout, files)
    shapes = read_headers({n: files[n] for n in targets if n in files})
    problems = []
    for name, (param, index) in targets.items():
        want = tuple(params[param][index].shape)
        if name not in shapes:
            problems.append(f"missing {name}")
        elif tuple(shapes[name][0]) != want:
            problems.append(f"{name}: shape {tuple(shapes[name][0])}, expected {want}")
    if problems:
        more = f"; and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise CheckpointError(f"{path}: incomplete vision encoder: " + "; ".join(problems[:_MAX_LISTED]) + more)
    encoder.to_empty(device=device)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in targets:
        by_file[files[name]].append(name)
    tensors = dict(encoder.named_parameters())
    with torch.no_grad():
        for file, group in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name in group:
                    param, index = targets[name]
                    tensors[param][index].copy_(f.get_tensor(name))
    return quantize_vision_encoder(encoder.to(dtype).eval(), quantization)
