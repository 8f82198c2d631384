"""load_format="dummy": m3-tiny's config alone gives the model a checkpoint load gives (names, shapes, dtypes,
formats), with finite outputs at any depth, reproducible from the seed; the engine serves it."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from oracle import PagedSequences

from m3sdk import Engine, SamplingParams
from m3sdk.cache.kv_pool import KVCacheSpec, KVPool
from m3sdk.config import BUNDLED_MODELS
from m3sdk.model.config import ModelConfig
from m3sdk.model.dummy import dummy_model
from m3sdk.model.loader import load_model

TINY = BUNDLED_MODELS["m3-tiny"]


@pytest.fixture
def config_only(tmp_path):
    """A folder holding m3-tiny's config.json and nothing else."""
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    return tmp_path


def tensors(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def logits_of(model, ids: list[int]) -> torch.Tensor:
    kv = KVPool(KVCacheSpec.for_model(model.config, 8, kv_dtype="fp32", index_dtype="fp32", model_dtype=model.dtype,
                                      device=torch.device("cpu")))
    return PagedSequences(kv).step(model, {"s": ids})["s"]


@pytest.mark.parametrize("quantization", ["none", "fp8", "mxfp4"])
def test_same_tensors_as_a_checkpoint_load(quantization):
    real = tensors(load_model(TINY, "cpu", torch.float32, quantization=quantization))
    dummy = tensors(dummy_model(ModelConfig.from_pretrained(TINY), "cpu", torch.float32, quantization=quantization))
    assert sorted(dummy) == sorted(real)
    for name, t in real.items():
        assert (dummy[name].shape, dummy[name].dtype) == (t.shape, t.dtype), name
    assert any(t.dtype not in (torch.float32,) for t in dummy.values()) == (quantization != "none")


def test_reproducible_from_the_seed_and_finite(config_only):
    config = ModelConfig.from_pretrained(config_only)
    a, b, c = (dummy_model(config, "cpu", torch.float32, seed=s) for s in (7, 7, 8))
    ta, tb, tc = tensors(a), tensors(b), tensors(c)
    assert all(torch.equal(ta[n], tb[n]) for n in ta)
    linears = [n for n in ta if "norm" not in n and "bias" not in n]
    assert all(not torch.equal(ta[n], tc[n]) for n in linears)
    std = ta["layers.1.mlp.w_gate_up"].std().item()
    assert abs(std - config.initializer_range) < 0.1 * config.initializer_range
    out = logits_of(a, list(range(3, 40)))
    assert torch.isfinite(out).all() and out.std() > 0
    assert torch.equal(out, logits_of(b, list(range(3, 40))))


def test_sixty_layers_stay_finite(tmp_path):
    raw = json.loads((TINY / "config.json").read_text())
    raw["num_hidden_layers"] = 60
    raw["layer_types"] = ["full_attention"] * 3 + ["minimax_m3_sparse"] * 57
    raw["mlp_layer_types"] = ["dense"] * 3 + ["sparse"] * 57
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = dummy_model(ModelConfig.from_pretrained(tmp_path), "cpu", torch.bfloat16, quantization="fp8", seed=3)
    out = logits_of(model, list(range(3, 70)))
    assert torch.isfinite(out).all() and out.abs().max() < 1e4 and out.std() > 0


def test_engine_serves_dummy_weights_from_a_config_alone(config_only):
    async def run(seed):
        async with Engine(model=str(config_only), load_format="dummy", seed=seed, device="cpu",
                          kv_cache_memory=8 << 20, max_model_len=256) as e:
            done = await e.generate("hello there", SamplingParams(max_tokens=12, temperature=0.0))
            return done.token_ids

    first, again, other = asyncio.run(run(1)), asyncio.run(run(1)), asyncio.run(run(2))
    assert len(first) == 12 and first == again and first != other


def test_load_format_is_checked():
    with pytest.raises(ValueError, match="load_format must be one of"):
        Engine(load_format="pt")
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        Engine(load_format="dummy", seed=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["none", "fp8", "mxfp4"])
def test_made_on_the_gpu_in_the_planned_bytes(config_only, quantization):
    """On a GPU: made there, reproducible, the bytes plan_memory names (the H200's MXFP4 planes layout included),
    and the engine serves it with CUDA graphs."""
    from m3sdk.model.memory import plan_memory

    config = ModelConfig.from_pretrained(config_only)
    a, b = (dummy_model(config, "cuda", torch.bfloat16, "triton", quantization=quantization, seed=4) for _ in "ab")
    ta, tb = tensors(a), tensors(b)
    assert all(t.is_cuda for t in ta.values()) and all(torch.equal(ta[n], tb[n]) for n in ta)
    held = sum(t.numel() * t.element_size() for t in ta.values())
    assert held == plan_memory(config, quantization=quantization).weight_bytes_per_rank

    async def run():
        async with Engine(model=str(config_only), load_format="dummy", quantization=quantization, device="cuda",
                          kv_cache_memory=64 << 20, max_model_len=256) as e:
            return (await e.generate("hello there", SamplingParams(max_tokens=8, temperature=0.0))).token_ids

    assert len(asyncio.run(run())) == 8
