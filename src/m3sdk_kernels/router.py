"""MoE router: sigmoid scores, biased choice, top-k, renormalized unbiased weights.

    p = sigmoid(logits)              (fp32)
    chosen = top_k(p + bias)         (the correction bias steers the choice only)
    weights = p[chosen] / sum(p[chosen]) * routed_scale

With `shared=n` (True: 1) n more columns name experts E .. E + n - 1 (the shared expert stacked after the routed
ones, in n pieces of the routed width where it is wider: `experts.stack_shared`) with weight 1, so the fused MoE
serves routed and shared experts in one pass.

The logits (hidden @ router_weight.T) stay a plain fp32 GEMM outside: a tf32 product would flip near-ties of the
choice. The kernel does the rest in one pass per token block, with the E scores of a token in registers; the
top-k is k rounds of argmax-and-mask, so a token can never pick the same expert twice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .arch import Arch, current_arch, tiles


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, T, E, stride_l, routed_scale, TOP_K: tl.constexpr,
                  SHARED: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = cols < E
    logits = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_l + cols[None, :],
                     mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    p = tl.sigmoid(logits)
    bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    choice = tl.where(col_ok[None, :], p + bias[None, :], float("-inf"))
    slots = tl.arange(0, K_PAD)
    w = tl.zeros((BLOCK_T, K_PAD), tl.float32)
    ids = tl.zeros((BLOCK_T, K_PAD), tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=1)
        picked = cols[None, :] == best[:, None]
        wj = tl.sum(tl.where(picked, p, 0.0), axis=1)
        w = tl.where(slots[None, :] == j, wj[:, None], w)
        ids = tl.where(slots[None, :] == j, best[:, None].to(tl.int32), ids)
        choice = tl.where(picked, float("-inf"), choice)
    w = w / tl.sum(w, axis=1)[:, None] * routed_scale
    # SHARED columns after the routed ones: experts E, E + 1, .. with weight 1
    w = tl.where(slots[None, :] >= TOP_K, 1.0, w)
    ids = tl.where(slots[None, :] >= TOP_K, E + slots[None, :] - TOP_K, ids)
    width = TOP_K + SHARED
    out = rows[:, None] * width + slots[None, :]
    mask = row_ok[:, None] & (slots[None, :] < width)
    tl.store(w_ptr + out, w, mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, routed_scale: float = 1.0,
          shared: bool | int = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `route_ref`."""
    t, e = logits.shape
    if top_k > e:
        raise ValueError(f"top_k {top_k} > {e} experts")
    width = top_k + int(shared)
    w = torch.empty((t, width), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, width), dtype=torch.int32, device=logits.device)
    if t:
        cfg = tiles("router", current_arch(logits.device))
        _route_kernel[(triton.cdiv(t, cfg["BLOCK_T"]),)](
            logits, bias, w, ids, t, e, logits.stride(0), routed_scale, TOP_K=top_k, SHARED=int(shared),
            K_PAD=triton.next_power_of_2(width), BLOCK_T=cfg["BLOCK_T"], BLOCK_E=triton.next_power_of_2(e),
            num_warps=cfg["num_warps"])
    return w, ids


def aot_variants(arch: Arch) -> list:
    from .aot import AotVariant

    cfg = tiles("router", arch)
    return [AotVariant("route_sigmoid_top4_of_128_shared", _route_kernel,
                       {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": "*i32", "T": "i32",
                        "E": "i32", "stride_l": "i32", "routed_scale": "fp32"},
                       {"TOP_K": 4, "SHARED": True, "K_PAD": 8, "BLOCK_T": cfg["BLOCK_T"], "BLOCK_E": 128},
                       num_warps=cfg["num_warps"], num_stages=1, aligned=("stride_l",))]
