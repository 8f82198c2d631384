"""Quantized weights under tensor and expert parallel on the CPU (gloo, worker processes), on the bundled m3-tiny.

Each rank quantizes its own shard (model/quantize.py's formats), so:
- column-parallel FP8 linears (rows split: the packed qkv, gate_up) and MXFP4 experts (rows split, or whole experts,
  or the width split on the 32-wide MX blocks) hold exactly the values of the one-rank quantization's slices;
- row-parallel FP8 linears (o_proj, down_proj: inputs split) hold their slice quantized with its own per-row
  scales, and their inputs are quantized per token over that slice too. No rank sees the whole row, so the
  quantized model over 2 ranks is not bit-identical to the one-rank quantized model: their outputs differ by
  quantization noise of the same size as each one's own error against the unquantized model, which is what the
  engine test bounds. (Greedy tokens are no test of it: that noise flips near-ties, and one flip changes every
  token after it.)
"""

import asyncio
import shutil

import pytest
import torch

from m3sdk import Engine
from m3sdk.config import BUNDLED_MODELS
from m3sdk.model.config import ModelConfig
from m3sdk.model.loader import load_model
from m3sdk.model.memory import plan_memory
from m3sdk.model.quantize import Fp8Linear, QuantizedMoE
from m3sdk.parallel import Shard, load_shard
from m3sdk.parallel.sharding import dummy_shard, param_pieces
from m3sdk_kernels.experts import dequantize_experts
from m3sdk_kernels.formats import quantize_fp8_weight

TINY = BUNDLED_MODELS["m3-tiny"]
PROMPTS = ["The capital of France is a city where the people",
           "Once upon a time, there was a little girl who lived in a village near the forest.",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,"]


def _fp8_linears(model) -> dict[str, Fp8Linear]:
    return {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}


def _experts(moe: QuantizedMoE, inter: int, shared: int) -> dict[str, torch.Tensor]:
    """The stack's values in float, trimmed to the real widths: routed / shared gate, up [E, I, H], down [E, H, I]."""
    gate_up, down = dequantize_experts(moe.experts)
    width = gate_up.shape[1] // 2
    out = {}
    for kind, rows, w in (("routed", slice(0, -1), inter), ("shared", slice(-1, None), shared)):
        out[f"{kind}.gate"] = gate_up[rows, :w]
        out[f"{kind}.up"] = gate_up[rows, width:width + w]
        out[f"{kind}.down"] = down[rows, :, :w]
    return out


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("quantization", ["fp8", "fp8_experts", "mxfp4"])
def test_each_rank_quantizes_its_own_shard(quantization, expert_parallel):
    config = ModelConfig.from_pretrained(TINY)
    floats = dict(load_model(TINY, "cpu", torch.float32).named_parameters())
    whole = load_model(TINY, "cpu", torch.float32, quantization=quantization)
    whole_linears = _fp8_linears(whole)
    for rank in range(2):
        shard = Shard(rank, 2, expert_parallel)
        local = load_shard(TINY, shard, "cpu", torch.float32, "torch", quantization)
        linears = _fp8_linears(local)
        assert linears.keys() == whole_linears.keys()
        for name, lin in linears.items():
            dim, spans = param_pieces(name, config, shard)
            fp8 = lin.weight.dtype
            if dim == 0:  # rows split: every row's scale covers the whole row, as on one rank
                for s, e, at in spans:
                    assert torch.equal(lin.weight[at:at + e - s].float(), whole_linears[name].weight[s:e].float())
                    assert torch.equal(lin.weight_scale[at:at + e - s], whole_linears[name].weight_scale[s:e])
            else:  # inputs split: the rank's slice with scales of its own
                (s, e, _), = spans
                w_q, w_scale = quantize_fp8_weight(floats[name][:, s:e], fp8)
                assert torch.equal(lin.weight.float(), w_q.float()), name
                assert torch.equal(lin.weight_scale, w_scale), name
                assert not torch.equal(lin.weight_scale, whole_linears[name].weight_scale), name
        if quantization != "mxfp4":
            continue
        inter, shared = config.moe_intermediate_size, config.shared_intermediate_size
        local_inter = inter if expert_parallel else inter // 2
        for i in config.moe_layers:
            mine = _experts(local.layers[i].mlp, local_inter, shared // 2)
            ref = _experts(whole.layers[i].mlp, inter, shared)
            cols = slice(rank * shared // 2, (rank + 1) * shared // 2)
            expect = {"shared.gate": ref["shared.gate"][:, cols], "shared.up": ref["shared.up"][:, cols],
                      "shared.down": ref["shared.down"][..., cols]}
            if expert_parallel:
                experts = slice(rank * config.num_experts // 2, (rank + 1) * config.num_experts // 2)
                expect |= {f"routed.{k}": ref[f"routed.{k}"][experts] for k in ("gate", "up", "down")}
            else:
                cols = slice(rank * local_inter, (rank + 1) * local_inter)
                expect |= {"routed.gate": ref["routed.gate"][:, cols], "routed.up": ref["routed.up"][:, cols],
                           "routed.down": ref["routed.down"][..., cols]}
            for key, value in expect.items():  # the 32-wide MX blocks of the split widths are the one rank's
                assert torch.equal(mine[key], value), (i, key)


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("quantization", ["fp8", "fp8_experts", "mxfp4"])
def test_dummy_ranks_make_their_shard_in_the_served_format(quantization, expert_parallel):
    """Each rank holds just the bytes memory.py plans for it, in the served format; the values are finite and
    follow from the seed alone."""
    config = ModelConfig.from_pretrained(TINY)
    plan = plan_memory(config, tensor_parallel_size=2, expert_parallel=expert_parallel, quantization=quantization,
                       dtype=torch.bfloat16)
    for rank in range(2):
        shard = Shard(rank, 2, expert_parallel)
        made = [dummy_shard(config, shard, "cpu", torch.bfloat16, "torch", seed, quantization) for seed in (7, 7, 8)]
        tensors = [dict(m.state_dict()) for m in made]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors[0].values()}
        assert sum(storages.values()) == plan.weight_bytes_per_rank
        assert len(_fp8_linears(made[0])) == 2 * config.num_layers + len(config.dense_layers) * 2 + (
            2 * len(config.moe_layers) if quantization == "fp8" else 0)
        moes = [m for m in made[0].modules() if isinstance(m, QuantizedMoE)]
        assert len(moes) == (0 if quantization == "fp8" else len(config.moe_layers))
        assert all(m.fmt == {"fp8_experts": "fp8"}.get(quantization, quantization) for m in moes)
        for name, t in tensors[0].items():
            assert torch.equal(t, tensors[1][name]), name  # the same seed: the same bytes
            if t.dtype.is_floating_point and t.dtype.itemsize > 1:
                assert torch.isfinite(t).all(), name
        assert any(not torch.equal(t, tensors[2][n]) for n, t in tensors[0].items() if "norm" not in n)
        # realistic MXFP4 scales: N(0, 0.02) weights put each 32-block's amax near 2^-5
        for m in moes if quantization == "mxfp4" else ():
            assert 118 <= int(m.gate_up_scale.float().median()) <= 124


async def _run(model, tokens: int, **config) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens of PROMPTS, and every prompt token's logprob given the ones before it (teacher-forced)."""
    async with Engine(model=str(model), device="cpu", kv_cache_memory=8 << 20, max_model_len=256, max_num_seqs=4,
                      **config) as e:
        outs = await asyncio.gather(*[e.generate(p, max_tokens=tokens, temperature=0, prompt_logprobs=0)
                                      for p in PROMPTS])
    return [o.token_ids for o in outs], torch.tensor([lp.logprob for o in outs for lp in o.prompt_logprobs[1:]])


@pytest.fixture(scope="module")
def unquantized_logprobs():
    torch.set_num_threads(1)
    return asyncio.run(_run(TINY, 1))[1]


@pytest.mark.parametrize("quantization", ["fp8", "fp8_experts", "mxfp4"])
def test_two_ranks_serve_quantized_weights(quantization, unquantized_logprobs):
    """Over 2 ranks, expert parallel on and off, the quantized model is as close to the unquantized one as the
    one-rank quantized model is (mean |logprob error| over 109 prompt tokens within 1.2x of it: a rank that lost
    its all-reduce, misrouted an expert or mis-sliced a block is off by 10x that), and differs from the one-rank
    quantized model by what two independent quantization noises of that size differ by."""
    torch.set_num_threads(1)
    _, logprobs = asyncio.run(_run(TINY, 4, quantization=quantization))
    one_rank_error = (logprobs - unquantized_logprobs).abs().mean()
    assert 0.01 < one_rank_error < 0.2  # the quantization does change the model, and not beyond use
    for expert_parallel in (False, True):
        tp_tokens, tp_logprobs = asyncio.run(_run(TINY, 4, quantization=quantization, tensor_parallel_size=2,
                                                  expert_parallel=expert_parallel))
        assert (tp_logprobs - unquantized_logprobs).abs().mean() < 1.2 * one_rank_error
        # two quantizations' independent noise: their difference is up to sqrt(2) x either one's error
        assert (tp_logprobs - logprobs).abs().mean() < 1.5 * one_rank_error
        assert all(len(t) == 4 for t in tp_tokens)


def test_two_ranks_serve_quantized_dummy_weights(tmp_path):
    """A config alone over 2 ranks with MXFP4 experts and FP8 attention: the same seed gives the same tokens."""
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    torch.set_num_threads(1)
    runs = [asyncio.run(_run(tmp_path, 8, load_format="dummy", seed=seed, quantization="mxfp4",
                             tensor_parallel_size=2, expert_parallel=True)) for seed in (3, 3)]
    assert runs[0][0] == runs[1][0]
    assert torch.isfinite(runs[0][1]).all()
