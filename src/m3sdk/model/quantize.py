"""Online quantization of a loaded MiniMax-M3 (`load_model(..., quantization=...)`).

- "none":  as loaded.
- "fp8":   the attention projections (the packed q|k|v|index GEMM and o_proj), the dense layers' MLPs and the shared
           experts become FP8 W8A8 linears: e4m3 weights (e4m3fnuz on gfx942) with one scale per output channel,
           activations quantized per token on the fly. Embeddings, norms, the router, lm_head and the routed
           experts stay as loaded.
- "mxfp4": "fp8", plus the routed experts in MXFP4 (E2M1, one E8M0 scale per 32 inputs) with the shared expert
           stacked after them in the same format, so one fused MoE launch pair serves both (AMD's published MXFP4
           checkpoint quantizes the shared experts too).
- "fp8_experts": "fp8", plus the routed experts and the shared expert stacked the same way in FP8 (one scale per
           output row; the fused MoE kernels quantize their activations per token, the intermediate per 64
           columns: the stack's width is padded to 64).
With the engine's `vision_quantization="fp8"` the vision encoder of a VL checkpoint (m3sdk.model.vision) gets FP8
W8A8 linears (`quantize_vision_encoder`): attention q/k/v/out, MLP fc1/fc2 and the projector's four, biases kept
as loaded; its patch embedding and norms stay as loaded. Otherwise the whole tower stays as loaded.
Experts a checkpoint stores in an MX format (the loader builds their QuantizedMoE) stay as stored under every
choice; "mxfp4" and "fp8_experts" refuse stored experts of another format rather than requantize them.
Any width the architecture allows is served by zero padding at load, which changes no output: FP8 weight rows
start 16 bytes apart (the GEMM reads them by TMA; the padding is storage only), and the MXFP4 stack pads the
routed and the shared expert to one intermediate width and the hidden size to the MX block of 32 (padded
intermediate channels have zero gate and up, so SwiGLU-OAI gives 0 there; padded hidden inputs are zero).
GEMMs go through m3sdk_kernels: the Triton kernels on a GPU, their references on a CPU, which quantize and
dequantize the same way (so the quantized model is testable in CI).
"""

from __future__ import annotations

import torch
from torch import nn

from m3sdk.config import QUANTIZATIONS
from m3sdk.model.layers import DenseMLP, Fp8Activation, RowParallelLinear, SparseMoE, all_reduce, local_routes
from m3sdk.model.vision import Projector, VisionEncoder, VisionMLP
from m3sdk_kernels.arch import current_arch
from m3sdk_kernels.experts import FP8_ACT_GROUP, Experts, quantize_experts, serving_layout
from m3sdk_kernels.formats import MX_BLOCK, quantize_fp8_weight
from m3sdk_kernels.moe import fused_moe
from m3sdk_kernels.quant import fp8_gemm, fp8_linear, gelu_quantize_fp8, swiglu_quantize_fp8
from m3sdk_kernels.reference import (
    fp8_gemm_ref,
    fp8_linear_ref,
    fused_moe_ref,
    gelu_quantize_fp8_ref,
    route_ref,
    swiglu_quantize_fp8_ref,
)
from m3sdk_kernels.router import route

_EXPERT_TENSORS = ("gate_up", "down", "gate_up_scale", "down_scale", "gate_up_row", "down_row")
EXPERT_FORMATS = {"mxfp4": "mxfp4", "fp8_experts": "fp8"}  # quantization -> the format of its expert stack
# what the stack's (intermediate, hidden) widths are padded to, by format
STACK_ALIGN = {"mxfp4": (MX_BLOCK, MX_BLOCK), "mxfp8": (MX_BLOCK, MX_BLOCK), "fp8": (FP8_ACT_GROUP, 1)}
_ROW_ALIGN_BYTES = 16  # TMA: every stride of a described tensor is a multiple of 16 bytes


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _row_aligned(w: torch.Tensor) -> torch.Tensor:
    """`w` [N, K] as a view whose rows start `_ROW_ALIGN_BYTES` apart (the same values; zero padding after
    each row, never read: the kernels take K from the activations)."""
    k = w.shape[1]
    per_row = _round_up(k * w.element_size(), _ROW_ALIGN_BYTES) // w.element_size()
    if per_row == k:
        return w
    padded = torch.zeros((w.shape[0], per_row), dtype=w.dtype, device=w.device)
    padded[:, :k] = w
    return padded[:, :k]


class Fp8Linear(nn.Module):
    """y = x @ W.T (+ b) with W in FP8 (per-output-channel scales) and x quantized per token, here or already by
    the norm before it (an `Fp8Activation`). A bias stays as loaded and is added in the GEMM's epilogue (the vision
    encoder's linears have one; a RowParallelLinear has none). A RowParallelLinear that reduces keeps doing so: its
    rank's W holds its slice of the inputs, scaled per output row over that slice (and x per token over it), and the
    partial products are all-reduced."""

    def __init__(self, linear: nn.Linear, fp8_dtype: torch.dtype):
        super().__init__()
        self.out_dtype = linear.weight.dtype
        self.reduce = linear.reduce if isinstance(linear, RowParallelLinear) else False
        w_q, w_scale = quantize_fp8_weight(linear.weight.detach(), fp8_dtype)
        self.register_buffer("weight", _row_aligned(w_q))
        self.register_buffer("weight_scale", w_scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        linear = fp8_linear if self.weight.is_cuda else fp8_linear_ref
        if isinstance(x, Fp8Activation):
            y = linear(x.data, self.weight, self.weight_scale, x.scale, out_dtype=self.out_dtype, bias=self.bias)
        else:
            flat = x.reshape(-1, x.shape[-1])
            y = linear(flat, self.weight, self.weight_scale, out_dtype=x.dtype,
                       bias=self.bias).reshape(*x.shape[:-1], -1)
        return all_reduce(y, self.reduce)


class Fp8DenseMLP(nn.Module):
    """A DenseMLP (a dense layer's MLP, a shared expert) with FP8 gate_up and down: the SwiGLU-OAI and the down
    projection's per-token quantization are one launch (`swiglu_quantize_fp8`; eager torch was ~7 elementwise
    launches plus the quantization's), the same bf16 rounding as `swiglu_oai_ref`."""

    def __init__(self, mlp: DenseMLP, fp8_dtype: torch.dtype):
        super().__init__()
        self.alpha, self.limit = mlp.alpha, mlp.limit
        self.gate_up_proj = Fp8Linear(mlp.gate_up_proj, fp8_dtype)
        self.down_proj = Fp8Linear(mlp.down_proj, fp8_dtype)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        flat = gate_up.reshape(-1, gate_up.shape[-1])
        down = self.down_proj
        if flat.is_cuda:
            h, h_scale = swiglu_quantize_fp8(flat, self.alpha, self.limit, down.weight.dtype, pdl=True)
            y = fp8_gemm(h, h_scale, down.weight, down.weight_scale, out_dtype=down.out_dtype)
        else:
            h, h_scale = swiglu_quantize_fp8_ref(flat, self.alpha, self.limit, down.weight.dtype)
            y = fp8_gemm_ref(h, h_scale, down.weight, down.weight_scale, out_dtype=down.out_dtype)
        return all_reduce(y.reshape(*gate_up.shape[:-1], -1), down.reduce)


class QuantizedMoE(nn.Module):
    """SparseMoE with its routed experts and shared expert stacked into one `Experts` (shared last): the router
    kernel appends the shared expert (id E, weight 1) to each token's routed choice, scaled by the routing factor.
    The stack's tensors are buffers, so `to`/`to_empty` move them and the loader can read a checkpoint into them.
    Under tensor parallel it keeps the SparseMoE's split: the stack holds this rank's experts (expert parallel:
    whole experts from `first_expert`, routes to the others weigh 0) or its slice of every expert's width, and its
    slice of the shared expert; the output is this rank's partial sum, all-reduced when `reduce`."""

    def __init__(self, moe: SparseMoE, experts: Experts):
        super().__init__()
        if experts.num_experts != moe.w_down.shape[0] + 1:
            raise ValueError("the stack holds the routed experts and the shared expert last")
        self.top_k, self.scaling, self.alpha, self.limit = moe.top_k, moe.scaling, moe.alpha, moe.limit
        self.reduce, self.first_expert = moe.reduce, moe.first_expert
        self.router_weight = moe.router_weight
        self.e_score_correction_bias = moe.e_score_correction_bias
        self.fmt = experts.fmt
        for name in _EXPERT_TENSORS:
            self.register_buffer(name, getattr(experts, name))

    @classmethod
    def quantize(cls, moe: SparseMoE, fmt: str) -> QuantizedMoE:
        """`moe`'s float experts and shared expert quantized to `fmt`, zero-padded to one intermediate width and
        the hidden size to the format's block where they differ from it (the outputs are the same)."""
        shared = moe.shared_experts
        hidden = moe.w_down.shape[1]
        inter_block, hidden_block = STACK_ALIGN[fmt]
        inter = _round_up(max(moe.w_down.shape[2], shared.down_proj.weight.shape[1]), inter_block)
        padded_hidden = _round_up(hidden, hidden_block)
        gate_up = torch.cat([_pad_gate_up(w, inter, padded_hidden)
                             for w in (moe.w_gate_up, shared.gate_up_proj.weight[None])])
        down = torch.cat([_pad_down(w, inter, padded_hidden) for w in (moe.w_down, shared.down_proj.weight[None])])
        return cls(moe, quantize_experts(gate_up, down, fmt))

    @property
    def experts(self) -> Experts:
        return Experts(self.fmt, *(getattr(self, name) for name in _EXPERT_TENSORS))

    def serve_layout(self) -> None:
        """The stack rearranged once, after loading, into the layout the kernels serve fastest on its device
        (`experts.serving_layout`: MXFP4 on an H200 becomes the planes layout; the values stay)."""
        experts = serving_layout(self.experts)
        for name in _EXPERT_TENSORS:
            setattr(self, name, getattr(experts, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(x.to(self.router_weight.dtype), self.router_weight).float()
        router, moe = (route, fused_moe) if x.is_cuda else (route_ref, fused_moe_ref)
        weights, ids = router(logits, self.e_score_correction_bias, self.top_k, self.scaling, shared=True)
        routed = self.down.shape[0] - 1
        if routed != logits.shape[1]:  # expert parallel: this rank's experts, and the shared one last
            ids, weights = local_routes(ids, weights, self.first_expert, routed, shared=logits.shape[1])
        hidden = x.shape[-1]
        padded = self.down.shape[1]  # the stack's hidden size, padded to the MX block
        if padded == hidden:
            out = moe(x, ids, weights, self.experts, self.alpha, self.limit)
        else:
            out = moe(nn.functional.pad(x, (0, padded - hidden)), ids, weights, self.experts, self.alpha,
                      self.limit)[:, :hidden].contiguous()  # the all-reduce works in place on whole rows
        return all_reduce(out, self.reduce)


def _pad_gate_up(w: torch.Tensor, inter: int, hidden: int) -> torch.Tensor:
    """[E, 2I, H] (gate | up) -> [E, 2 inter, hidden], each half zero-padded to `inter` rows."""
    e, rows, h = w.shape
    if rows == 2 * inter and h == hidden:
        return w
    out = w.new_zeros((e, 2 * inter, hidden))
    out[:, : rows // 2, :h] = w[:, : rows // 2]
    out[:, inter : inter + rows // 2, :h] = w[:, rows // 2 :]
    return out


def _pad_down(w: torch.Tensor, inter: int, hidden: int) -> torch.Tensor:
    """[E, H, I] -> [E, hidden, inter], zero-padded."""
    return nn.functional.pad(w, (0, inter - w.shape[2], 0, hidden - w.shape[1]))


@torch.no_grad()
def quantize_model(model: nn.Module, quantization: str) -> nn.Module:
    """Quantize `model` (a loaded MiniMaxM3ForCausalLM) in place, layer by layer (the bf16 weights of a layer
    are freed as it is done), and return it."""
    fp8 = fp8_for(quantization, model.embed_tokens.weight.device)
    for layer in model.layers:
        quantize_layer(layer, quantization, fp8)
    return model


def fp8_for(quantization: str, device: torch.device) -> torch.dtype | None:
    """The FP8 dtype `quantization` serves its linears in on `device` (None for "none"); a ValueError for an
    unknown choice."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    return None if quantization == "none" else current_arch(device).fp8_dtype


@torch.no_grad()
def quantize_layer(layer: nn.Module, quantization: str, fp8_dtype: torch.dtype | None) -> None:
    """One decoder layer, loaded, into its served format (`fp8_for` gives `fp8_dtype`), in place."""
    if quantization != "none":
        attn = layer.self_attn
        attn.qkv_proj = Fp8Linear(attn.qkv_proj, fp8_dtype)
        attn.o_proj = Fp8Linear(attn.o_proj, fp8_dtype)
        layer.attn_input_fp8 = fp8_dtype  # the input norm quantizes for qkv_proj
        if isinstance(layer.mlp, DenseMLP):
            layer.mlp = Fp8DenseMLP(layer.mlp, fp8_dtype)
            layer.mlp_input_fp8 = fp8_dtype  # MoE layers keep bf16: the router and the experts read it too
        elif isinstance(layer.mlp, QuantizedMoE):  # stored quantized by the checkpoint: served as stored
            if quantization in EXPERT_FORMATS and layer.mlp.fmt != EXPERT_FORMATS[quantization]:
                raise ValueError(f"quantization={quantization!r} would requantize the checkpoint's "
                                 f"{layer.mlp.fmt} experts; use 'fp8' or 'none' (the stored experts are served as "
                                 "they are)")
        elif quantization in EXPERT_FORMATS:
            layer.mlp = QuantizedMoE.quantize(layer.mlp, EXPERT_FORMATS[quantization])
        else:
            layer.mlp.shared_experts = Fp8DenseMLP(layer.mlp.shared_experts, fp8_dtype)
    if isinstance(layer.mlp, QuantizedMoE):
        layer.mlp.serve_layout()


def _fp8_gelu_mlp(first: Fp8Linear, second: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """second(gelu(first(x))) with both linears in FP8. bf16 rows on a GPU: the GELU and `second`'s per-token
    quantization are one launch (`gelu_quantize_fp8`); elsewhere its reference, the same math."""
    h = first(x)
    fused = h.is_cuda and h.dtype == torch.bfloat16
    quantize, gemm = (gelu_quantize_fp8, fp8_gemm) if fused else (gelu_quantize_fp8_ref, fp8_gemm_ref)
    h_q, h_scale = quantize(h, second.weight.dtype)
    return gemm(h_q, h_scale, second.weight, second.weight_scale, out_dtype=second.out_dtype, bias=second.bias)


class Fp8VisionMLP(nn.Module):
    """A VisionMLP with FP8 fc1 and fc2 (the GELU between them fused with fc2's input quantization)."""

    def __init__(self, mlp: VisionMLP, fp8_dtype: torch.dtype):
        super().__init__()
        self.fc1, self.fc2 = Fp8Linear(mlp.fc1, fp8_dtype), Fp8Linear(mlp.fc2, fp8_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _fp8_gelu_mlp(self.fc1, self.fc2, x)


class Fp8Projector(nn.Module):
    """The vision Projector with its four linears in FP8 (each GELU fused with the next linear's quantization)."""

    def __init__(self, projector: Projector, fp8_dtype: torch.dtype):
        super().__init__()
        self.window = projector.window
        self.linear_1 = Fp8Linear(projector.linear_1, fp8_dtype)
        self.linear_2 = Fp8Linear(projector.linear_2, fp8_dtype)
        self.merge_linear_1 = Fp8Linear(projector.merge_linear_1, fp8_dtype)
        self.merge_linear_2 = Fp8Linear(projector.merge_linear_2, fp8_dtype)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = _fp8_gelu_mlp(self.linear_1, self.linear_2, patches)
        return _fp8_gelu_mlp(self.merge_linear_1, self.merge_linear_2, x.reshape(x.shape[0] // self.window, -1))


@torch.no_grad()
def quantize_vision_encoder(encoder: VisionEncoder, quantization: str) -> VisionEncoder:
    """`encoder` (loaded) with its linears in FP8 W8A8 under any `quantization` but "none", in place, layer by layer
    (each layer's float weights are freed as it is done), and returned. The attention's packed q|k|v linear becomes
    one FP8 linear (one quantization of the input, one GEMM; the scales are per output row, so the packing changes
    no value) and out_proj another, in place; each GELU is fused with the quantization of the linear after it."""
    fp8 = fp8_for(quantization, encoder.embeddings.proj.weight.device)
    if fp8 is None:
        return encoder
    for layer in encoder.layers:
        attn = layer.self_attn
        attn.qkv_proj, attn.out_proj = Fp8Linear(attn.qkv_proj, fp8), Fp8Linear(attn.out_proj, fp8)
        layer.mlp = Fp8VisionMLP(layer.mlp, fp8)
    encoder.projector = Fp8Projector(encoder.projector, fp8)
    return encoder
