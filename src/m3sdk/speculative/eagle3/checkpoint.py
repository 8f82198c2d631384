"""Reading and writing an EAGLE3 draft head's checkpoint (`config.json` + `model.safetensors` or
`pytorch_model.bin`, the published layout: the package docstring lists its tensors), tied to the target it drafts
for."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from m3sdk.errors import CheckpointError
from m3sdk.speculative.base import TargetInfo
from m3sdk.speculative.eagle3.config import Eagle3Config, default_aux_layers
from m3sdk.speculative.eagle3.head import Eagle3Head

BUNDLED_HEAD_DIR = "m3-tiny-eagle3"  # next to the bundled target in m3sdk/assets


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


def bundled_head_path(target_checkpoint: str | None) -> Path | None:
    """The head shipped beside the bundled target (m3sdk/assets/m3-tiny-eagle3), if the target is it."""
    if target_checkpoint is None:
        return None
    here = Path(target_checkpoint).resolve()
    candidate = here.parent / BUNDLED_HEAD_DIR
    if here.name == "m3-tiny" and (candidate / "config.json").is_file():
        return candidate
    return None
