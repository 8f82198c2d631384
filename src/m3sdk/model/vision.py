"""MiniMax-M3's vision encoder: a ViT with a partial 3D RoPE, and the projector that maps its patches to the text
width and fuses each 2x2 merge window into one text embedding.

Input is the preprocessor's output (m3sdk.model.image_processor, `ImageProcessor.patches`): `pixels`
[P, C*T*ps*ps] for P patches of all images, laid out 2x2-merge-window-major, and `grid_thw` [N, 3] = (t, h, w) in
patches per image. Output is [P / merge**2, text_hidden]: one embedding per image token, images in order.
Attention is bidirectional and never crosses images (one SDPA call per image). q, k and v come from one packed
linear; their split and RoPE are one pass (m3sdk_kernels.vision_rope) into the layout SDPA reads without a copy.

With the engine's `vision_quantization="fp8"` the loader puts the linears of every layer and of the projector into
FP8 W8A8 (`quantize.quantize_vision_encoder`); the patch embedding, the norms and the biases stay as loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from m3sdk.errors import CheckpointError
from m3sdk_kernels.reference import vision_qkv_rope_ref
from m3sdk_kernels.vision_rope import vision_qkv_rope


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's and projector's shapes (config.json's `vision_config`, plus the VL wrapper's fields)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    text_hidden_size: int
    projector_hidden_size: int
    image_token_id: int
    num_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.temporal_patch_size * self.patch_size ** 2

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> VisionConfig | None:
        """The vision config of a VL config.json, or None when it has no `vision_config` (a text-only model)."""
        vision = raw.get("vision_config")
        if not vision:
            return None
        text = raw.get("text_config") or raw  # a VL wrapper's text_config, or a flat config's own fields
        try:
            rope = vision.get("rope_parameters") or {}
            return cls(
                hidden_size=int(vision.get("hidden_size", 1280)),
                intermediate_size=int(vision.get("intermediate_size", 5120)),
                num_hidden_layers=int(vision.get("num_hidden_layers", 32)),
                num_attention_heads=int(vision.get("num_attention_heads", 16)),
                text_hidden_size=int(text["hidden_size"]),
                projector_hidden_size=int(raw.get("projector_hidden_size", text["hidden_size"])),
                image_token_id=int(raw.get("image_token_index", raw.get("image_token_id", 200025))),
                num_channels=int(vision.get("num_channels", 3)),
                patch_size=int(vision.get("patch_size", 14)),
                temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
                spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
                layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5)),
                rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", 10000.0))),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: bad vision_config ({e})") from e


def vision_positions(grid_thw: list[tuple[int, int, int]], merge: int, device: torch.device) -> torch.Tensor:
    """(t, h, w) coordinates [P, 3] of every patch, in the preprocessor's merge-window-major order."""
    out = []
    for t, h, w in grid_thw:
        hh, ww = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        window = (h // merge, merge, w // merge, merge)
        hh = hh.reshape(window).transpose(1, 2).flatten()
        ww = ww.reshape(window).transpose(1, 2).flatten()
        tt = torch.arange(t, device=device).repeat_interleave(h * w)
        out.append(torch.stack([tt, hh.repeat(t), ww.repeat(t)], dim=-1))
    return torch.cat(out)


class VisionRope(nn.Module):
    """Partial 3D RoPE: equal frequency bands for t, h and w over the first 2*3*(head_dim//6) channels of a head;
    the remaining channels pass through unrotated."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        # frequencies are computed per call in fp32 (no buffer: the module may be built on meta and cast to bf16)
        self.band, self.theta = 2 * ((config.head_dim // 3) // 2), config.rope_theta

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        steps = torch.arange(0, self.band, 2, dtype=torch.float32, device=positions.device)
        inv_freq = 1.0 / self.theta ** (steps / self.band)
        freqs = (positions[..., None].float() * inv_freq).flatten(1)  # [P, 3 * band/2], t|h|w
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos(), freqs.sin()


class VisionAttention(nn.Module):
    """q, k and v from one packed linear `qkv_proj` [3 * width, width] (rows q | k | v, biases likewise: the
    loader fills the slices from the checkpoint's q_proj / k_proj / v_proj), then `attend`, then out_proj. The
    FP8 encoder swaps both linears for FP8 ones in place (`quantize.quantize_vision_encoder`)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.qkv_proj = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        return self.out_proj(attend(self.qkv_proj(x), cos, sin, lengths, self.heads, self.head_dim))


def attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int], heads: int,
           head_dim: int) -> torch.Tensor:
    """Bidirectional attention within each image (`lengths`: patches per image, in order) of the packed projection
    qkv [P, 3 * heads * head_dim], q and k rotated by cos, sin [P, R] -> [P, heads * head_dim]."""
    # q, k (rotated) and v in one pass into one [3, P, heads, head_dim] buffer: the Triton kernel on a GPU, its
    # reference elsewhere
    rope = vision_qkv_rope if qkv.is_cuda else vision_qkv_rope_ref
    q, k, v = rope(qkv, cos, sin, heads, head_dim)
    outs = []
    # one image at a time, each [1, heads, patches, head_dim] (a view of the buffer): SDPA's flash and
    # memory-efficient kernels take 4-D inputs only (3-D ones fall back to the math kernel, which materializes every
    # score)
    for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
        qi, ki, vi = (t.transpose(0, 1)[None] for t in (qi, ki, vi))
        outs.append(F.scaled_dot_product_attention(qi, ki, vi)[0].transpose(0, 1))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    # the GPU kernels return [patches, heads, head_dim] in memory (vision_rope.py says why), so this is a view there
    return out.reshape(out.shape[0], heads * head_dim)


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), cos, sin, lengths)
        return x + self.mlp(self.layer_norm2(x))


class PatchEmbedding(nn.Module):
    """Conv3d with kernel = stride = (temporal_patch, patch, patch), i.e. one linear map per flattened patch."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.num_channels, config.hidden_size, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return pixels.to(self.proj.weight.dtype) @ self.proj.weight.flatten(1).t()


class Projector(nn.Module):
    """Each patch to the text width (GELU MLP), then each merge window's patches, concatenated, to one text
    embedding (a second GELU MLP)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.window = config.spatial_merge_size ** 2
        text, hidden = config.text_hidden_size, config.projector_hidden_size
        self.linear_1 = nn.Linear(config.hidden_size, hidden)
        self.linear_2 = nn.Linear(hidden, text)
        self.merge_linear_1 = nn.Linear(text * self.window, hidden)
        self.merge_linear_2 = nn.Linear(hidden, text)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.linear_2(F.gelu(self.linear_1(patches)))
        x = x.reshape(x.shape[0] // self.window, -1)
        return self.merge_linear_2(F.gelu(self.merge_linear_1(x)))


class VisionEncoder(nn.Module):
    """Vision tower + projector: pixels of N images -> one text-width embedding per image token."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = PatchEmbedding(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(config.num_hidden_layers))
        self.rope = VisionRope(config)
        self.projector = Projector(config)

    @property
    def dtype(self) -> torch.dtype:
        """Its weights' dtype, the one its input patches are cast to."""
        return self.embeddings.proj.weight.dtype

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixels))
        # cos, sin stay fp32: the rotation computes in fp32 and rounds once, whatever the tower's dtype
        cos, sin = self.rope(vision_positions(grid_thw, self.config.spatial_merge_size, x.device))
        lengths = [t * h * w for t, h, w in grid_thw]
        for layer in self.layers:
            x = layer(x, cos, sin, lengths)
        return self.projector(x)


def tokens_per_image(grid_thw: tuple[int, int, int], merge: int) -> int:
    """How many image tokens (text positions) an image of patch grid `grid_thw` takes."""
    t, h, w = grid_thw
    return t * h * w // merge ** 2
