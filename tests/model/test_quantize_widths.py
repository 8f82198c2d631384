"""Online quantization at any width: the padding the load adds (16-byte FP8 weight rows; MXFP4 stacks of one
intermediate width, hidden sizes padded to the MX block) changes no output. On a GPU through the FP8 / MoE kernels
(bf16 activations), on a CPU through their references."""

import pytest
import torch
from torch import nn

from m3sdk.model.layers import SparseMoE
from m3sdk.model.quantize import Fp8Linear, QuantizedMoE
from m3sdk_kernels.arch import fp8_dtype
from m3sdk_kernels.experts import dequantize_experts
from m3sdk_kernels.reference import fp8_linear_ref


def model_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@pytest.mark.parametrize("k", [24, 40, 56, 64, 200])
@pytest.mark.parametrize("tokens", [1, 7, 130])
def test_fp8_linear_any_width(device, k, tokens):
    """K = 56 fp8 bytes per row would break the GEMM's TMA weight reads (rows must start 16 bytes apart)."""
    dtype = model_dtype(device)
    g = torch.Generator().manual_seed(k)
    linear = nn.Linear(k, 72, bias=False, dtype=dtype, device=device)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(72, k, generator=g).to(dtype))
    fp8 = Fp8Linear(linear, fp8_dtype(device))
    assert fp8.weight.shape == (72, k) and fp8.weight.stride(0) % 16 == 0
    x = torch.randn(tokens, k, generator=g).to(device, dtype)
    want = fp8_linear_ref(x, fp8.weight.contiguous(), fp8.weight_scale, out_dtype=dtype).float()
    torch.testing.assert_close(fp8(x).float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def random_moe(device: torch.device, hidden: int, experts: int, routed: int, shared: int, top_k: int) -> SparseMoE:
    dtype = model_dtype(device)
    moe = SparseMoE(hidden, experts, routed, shared, top_k, 2.0, 1.702, 7.0, dtype).to(device)
    g = torch.Generator().manual_seed(hidden + routed + shared)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            std = 0.05 if "bias" in name else 0.5 if "gate_up" in name else 0.2
            p.copy_((torch.randn(p.shape, generator=g) * std).to(p.dtype))
    return moe


@pytest.mark.parametrize(("hidden", "experts", "routed", "shared", "top_k"), [
    (256, 8, 64, 128, 2),  # m3-tiny: the shared expert twice the routed width
    (40, 5, 56, 24, 2),  # hidden and both widths off the MX block
    (56, 3, 32, 32, 1),
    (96, 6, 24, 48, 3),
])
def test_mxfp4_stack_pads_exactly(device, hidden, experts, routed, shared, top_k):
    """The stack's values, unpadded, in a float SparseMoE give the quantized layer's output; the padding is zero."""
    moe = random_moe(device, hidden, experts, routed, shared, top_k)
    quantized = QuantizedMoE.quantize(moe, "mxfp4")
    gate_up, down = dequantize_experts(quantized.experts)
    width = gate_up.shape[1] // 2
    assert width % 32 == 0 and width >= max(routed, shared) and gate_up.shape[2] % 32 == 0
    float_moe = random_moe(device, hidden, experts, routed, shared, top_k)
    rows = {"routed": routed, "shared": shared}
    with torch.no_grad():
        for which, stack in (("routed", slice(0, experts)), ("shared", slice(experts, experts + 1))):
            n = rows[which]
            gu = torch.cat((gate_up[stack, :n, :hidden], gate_up[stack, width : width + n, :hidden]), dim=1)
            dn = down[stack, :hidden, :n]
            if which == "routed":
                float_moe.w_gate_up.copy_(gu)
                float_moe.w_down.copy_(dn)
            else:
                float_moe.shared_experts.gate_up_proj.weight.copy_(gu[0])
                float_moe.shared_experts.down_proj.weight.copy_(dn[0])
            # everything past the real rows and columns is zero
            assert gate_up[stack, n:width].abs().sum() == 0 and gate_up[stack, width + n :].abs().sum() == 0
            assert gate_up[stack, :, hidden:].abs().sum() == 0 and down[stack, :, n:].abs().sum() == 0
        float_moe.router_weight.copy_(moe.router_weight)
        float_moe.e_score_correction_bias.copy_(moe.e_score_correction_bias)
        x = torch.randn(33, hidden, generator=torch.Generator().manual_seed(1)).to(device, model_dtype(device))
        got, want = quantized(x).float(), float_moe(x).float()
    assert got.shape == (33, hidden)
    if device.type == "cpu":  # the same float math on the same values
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    else:  # the kernels' bf16 / fp8 activations
        assert ((got - want).norm() / want.norm()).item() < 0.05
