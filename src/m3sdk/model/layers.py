"""The building blocks of MiniMax-M3: Gemma RMSNorm, partial NeoX RoPE, SwiGLU-OAI, the sigmoid router and MoE.

`moe_experts` is the one function a fused MoE kernel replaces; everything around it stays. The norm and the
SwiGLU-OAI math are m3sdk_kernels' references (`gemma_rms_norm_ref`, `swiglu_oai_ref`): one definition each.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from m3sdk.observability import get_logger
from m3sdk_kernels.experts import Experts
from m3sdk_kernels.moe import fused_moe, moe_unsupported
from m3sdk_kernels.norm import add_rms_norm
from m3sdk_kernels.reference import add_rms_norm_ref, gemma_rms_norm_ref, swiglu_oai_ref
from m3sdk_kernels.router import route as fused_route

log = get_logger("m3sdk.model")


class RMSNorm(nn.Module):
    """Gemma RMSNorm: normalize in fp32 and scale by (1 + w) (the stored weight is an offset from 1)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm_ref(x, self.weight, self.eps)


class Fp8Activation(NamedTuple):
    """A norm's output quantized per token for the FP8 projection that reads it (`quantize.Fp8Linear`)."""

    data: torch.Tensor  # fp8 [T, H]
    scale: torch.Tensor  # float32 [T]


def residual_rms_norm(x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor | None = None,
                      fp8_dtype: torch.dtype | None = None) -> tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
    """h = x + residual (x alone without one) and its Gemma norm in one pass -> (normed, h). With `fp8_dtype` the
    normed rows come quantized per token from fp32, so the FP8 projection after the norm needs no quantization
    launch of its own. The Triton kernel on a GPU, its reference elsewhere: the same math."""
    op = add_rms_norm if x.is_cuda else add_rms_norm_ref
    y, scale, h = op(x, norm.weight, norm.eps, residual, fp8_dtype)
    return (y if scale is None else Fp8Activation(y, scale)), h


class RotaryEmbedding:
    """cos/sin of partial NeoX RoPE for absolute positions, computed per step (a 1M-position table is waste)."""

    def __init__(self, rotary_dim: int, theta: float):
        self.rotary_dim = rotary_dim
        self.theta = theta
        self._inv_freq: torch.Tensor | None = None

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T] -> (cos, sin) float32 [T, rotary_dim // 2]."""
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            # built on the host in fp32 like the reference, then moved: identical frequencies on every device
            exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device="cpu") / self.rotary_dim
            self._inv_freq = (1.0 / (self.theta**exponent)).to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        return freqs.cos(), freqs.sin()


class RowParallelLinear(nn.Linear):
    """A bias-free linear layer whose input features are split over the tensor-parallel ranks (parallel/sharding.py):
    each rank's product is a partial sum. With `reduce`, the forward all-reduces it over the process group in
    place, so every rank returns the whole output; without (one rank, or a caller that adds several partial sums
    before one reduction), it is a plain nn.Linear."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, reduce: bool = False):
        super().__init__(in_features, out_features, bias=False, dtype=dtype)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x), self.reduce)


def all_reduce(partial: torch.Tensor, reduce: bool) -> torch.Tensor:
    """`partial` summed over the tensor-parallel ranks in place when `reduce`, else as it is."""
    if reduce:
        dist.all_reduce(partial)
    return partial


class DenseMLP(nn.Module):
    """SwiGLU-OAI MLP: the dense layers' MLP and the MoE's shared expert. `reduce`: its down_proj's input is this
    rank's slice of the intermediate, and the output is all-reduced (RowParallelLinear)."""

    def __init__(self, hidden: int, inter: int, alpha: float, limit: float, dtype: torch.dtype, reduce: bool = False):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False, dtype=dtype)
        self.down_proj = RowParallelLinear(inter, hidden, dtype, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu_oai_ref(self.gate_up_proj(x), self.alpha, self.limit))


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with a selection-only bias -> (weights float32 [T, k], expert ids [T, k]).

    Experts are chosen by sigmoid + bias, but weighted by the unbiased sigmoids, renormalized to sum 1. On a GPU
    the Triton router does all that follows the logits GEMM in one launch (int32 ids; torch's ops take seven).
    """
    logits = torch.nn.functional.linear(x.to(weight.dtype), weight).float()
    if logits.is_cuda:
        return fused_route(logits, bias, top_k)
    probs = torch.sigmoid(logits)
    _, ids = torch.topk(probs + bias.float(), top_k, dim=-1, sorted=False)
    weights = probs.gather(1, ids)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def local_routes(ids: torch.Tensor, weights: torch.Tensor, first: int, count: int,
                 shared: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes over all experts -> routes over the `count` experts from id `first` that this rank holds: pairs
    routed elsewhere get weight 0 on local expert 0, so the expert kernels see fixed shapes (no host sync, CUDA-graph
    safe); the router's shared-expert column (id `shared`) goes to local id `count` (the stack's last expert)."""
    local = ids - first
    mine = (local >= 0) & (local < count)
    if shared is not None:
        is_shared = ids == shared
        local = torch.where(is_shared, count, local)
        mine = mine | is_shared
    return torch.where(mine, local, 0), torch.where(mine, weights, 0.0)


@functools.cache
def fused_moe_fits(hidden: int, inter: int) -> bool:
    """Whether m3sdk_kernels' fused MoE tiles bf16 experts of these widths (`moe_unsupported`; m3-tiny's 256 / 64
    fit). Asked when a MoE layer is built on a GPU: where it does not, one log line says why and the torch path
    serves the experts."""
    why = moe_unsupported(hidden, inter, "bf16")
    if why:
        log.info("fused MoE kernels off: the torch path serves the experts", reason=why)
    return why is None


def moe_experts(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]) for hidden [T, H] -> [T, H] (hidden's dtype).

    Experts: w_gate_up [E, 2I, H] (gate | up), w_down [E, H, I]. Plain version: tokens sorted by expert, one
    GEMM pair per expert that has tokens (what a fused grouped-GEMM kernel does in one launch).
    """
    if hidden.is_cuda and hidden.dtype == torch.bfloat16 and fused_moe_fits(hidden.shape[1], w_down.shape[2]):
        # the fused Triton kernels: two launches, no host sync, so CUDA graphs can capture the step
        return fused_moe(hidden, topk_ids, topk_weights, Experts("bf16", w_gate_up, w_down), alpha, limit)
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        return _moe_experts_dense(hidden, topk_ids, topk_weights, w_gate_up, w_down, alpha, limit)
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w_gate_up.shape[0]).tolist()
    tokens = order // top_k
    weights = topk_weights.reshape(-1)[order]
    out = torch.zeros_like(hidden)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        idx = tokens[start : start + n]
        h = swiglu_oai_ref(torch.nn.functional.linear(hidden[idx], w_gate_up[expert]), alpha, limit)
        y = torch.nn.functional.linear(h, w_down[expert]) * weights[start : start + n, None]
        out.index_add_(0, idx, y.to(out.dtype))
        start += n
    return out


def _moe_experts_dense(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       w_gate_up: torch.Tensor, w_down: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """`moe_experts` with every expert on every token, weighted by the router (0 for the experts not picked):
    E / k times the work, but no host sync (the per-expert loop reads token counts on the host), so a CUDA graph
    captures it where the fused kernels do not run (float32, odd widths). Decode-sized steps only."""
    combine = torch.zeros(hidden.shape[0], w_gate_up.shape[0], dtype=torch.float32, device=hidden.device)
    combine.scatter_(1, topk_ids.long(), topk_weights.float())
    h = swiglu_oai_ref(torch.matmul(hidden, w_gate_up.transpose(1, 2)), alpha, limit)  # [E, T, I]
    y = torch.matmul(h, w_down.transpose(1, 2))  # [E, T, H]
    return torch.einsum("eth,te->th", y.float(), combine).to(hidden.dtype)


class SparseMoE(nn.Module):
    """Routed experts (top-k of E, sigmoid router with bias, scaled) plus one always-on shared expert. `reduce`:
    both are this rank's partial sums (a slice of every expert's width, or whole experts of its own), added
    first and all-reduced once. `first_expert`: the router id of the first expert held (expert parallel: this
    rank's first of its whole experts; the router always scores all of them)."""

    def __init__(self, hidden: int, num_experts: int, inter: int, shared_inter: int, top_k: int, scaling: float,
                 alpha: float, limit: float, dtype: torch.dtype, reduce: bool = False, first_expert: int = 0):
        super().__init__()
        self.top_k, self.scaling, self.alpha, self.limit = top_k, scaling, alpha, limit
        self.reduce = reduce
        self.first_expert = first_expert
        # router in fp32: its logits pick experts, and bf16 rounding flips near-ties
        self.router_weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32))
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, dtype=dtype))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, inter, dtype=dtype))
        self.shared_experts = DenseMLP(hidden, shared_inter, alpha, limit, dtype)
        if torch.cuda.is_available():
            fused_moe_fits(hidden, inter)  # decided (and logged) at build, not at the first request

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_experts(x)
        weights, ids = route(x, self.router_weight, self.e_score_correction_bias, self.top_k)
        routed = moe_experts(x, ids, weights, self.w_gate_up, self.w_down, self.alpha, self.limit)
        return all_reduce(routed * self.scaling + shared, self.reduce)
