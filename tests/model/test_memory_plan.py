"""plan_memory: the weight bytes a rank holds, as the loaders make them (m3-tiny: bf16 / FP8 / FP8 experts / MXFP4,
one rank and tensor-parallel shards; quantized shards: tests/parallel/test_tensor_parallel_quantized.py), KV bytes
from the cache's own spec, and the full MiniMax-M3 config's published size."""

from __future__ import annotations

import pytest
import torch

from m3sdk.cache.kv_pool import KVCacheSpec
from m3sdk.config import BUNDLED_MODELS
from m3sdk.model.config import ModelConfig
from m3sdk.model.dummy import dummy_model
from m3sdk.model.memory import plan_memory
from m3sdk.parallel.sharding import Shard, dummy_shard

TINY = ModelConfig.from_pretrained(BUNDLED_MODELS["m3-tiny"])
M3 = ModelConfig.from_pretrained(BUNDLED_MODELS["minimax-m3"])


def held_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


@pytest.mark.parametrize("quantization", ["none", "fp8", "fp8_experts", "mxfp4"])
def test_weights_are_what_a_load_holds(quantization):
    model = dummy_model(TINY, "cpu", torch.bfloat16, quantization=quantization)
    assert plan_memory(TINY, quantization=quantization).weight_bytes_per_rank == held_bytes(model)


@pytest.mark.parametrize(("world", "expert_parallel", "quantization"),
                         [(2, True, "none"), (2, False, "none"), (4, False, "mxfp4"), (4, True, "fp8_experts")])
def test_weights_per_rank_are_what_a_shard_holds(world, expert_parallel, quantization):
    """4 ranks: more than m3-tiny's 2 KV heads (replicated), and an expert width of 16 (the stack pads it)."""
    plan = plan_memory(TINY, tensor_parallel_size=world, expert_parallel=expert_parallel, quantization=quantization)
    for rank in range(world):
        model = dummy_shard(TINY, Shard(rank, world, expert_parallel), "cpu", torch.bfloat16, "torch", seed=0,
                            quantization=quantization)
        assert plan.weight_bytes_per_rank == held_bytes(model)
        assert model.config.num_kv_heads == 2 // min(world, 2)


def test_minimax_m3_size():
    plan = plan_memory(M3)
    assert abs(plan.total_params / 428e9 - 1) < 0.03
    assert abs(plan.active_params / 23e9 - 1) < 0.05
    bf16 = plan.weight_bytes_per_rank
    assert abs(bf16 / (2 * plan.total_params) - 1) < 0.01  # everything bf16 but the fp32 router
    mxfp4 = plan_memory(M3, quantization="mxfp4").weight_bytes_per_rank
    assert 225e9 < mxfp4 < 245e9  # MXFP4 experts, FP8 attention: about 235 GB
    fp8 = plan_memory(M3, quantization="fp8_experts").weight_bytes_per_rank
    assert 425e9 < fp8 < 445e9  # FP8 experts too: about 430 GB (four GPUs)


def test_kv_and_what_fits_on_two_gpus():
    plan = plan_memory(M3, tensor_parallel_size=2, expert_parallel=True, quantization="mxfp4", kv_cache_dtype="fp8",
                       device_memory=140 * 10**9, context=32768)
    # per rank: 2 of the 4 KV heads; per layer K and V (fp8) + their float32 scales; an fp8 index key per sparse layer
    assert plan.kv_bytes_per_token == 60 * (2 * 2 * 128 + 2 * 2 * 4) + 57 * 128
    spec = KVCacheSpec.for_model(M3, 1, kv_dtype="fp8", index_dtype="fp8")
    assert plan.kv_bytes_per_page * 2 - spec.bytes_per_page == 57 * 128 * 16  # the index key is whole on each rank
    budget = int((140e9 - plan.weight_bytes_per_rank) * 0.9)
    assert plan.kv_budget_bytes == budget and plan.pages == budget // plan.kv_bytes_per_page
    assert plan.max_sequences == plan.pages // (32768 // 16 + 1) > 0 and plan.fits
    one_gpu = plan_memory(M3, quantization="mxfp4", device_memory=140 * 10**9)
    assert one_gpu.pages == 0 and not one_gpu.fits and "no:" in dict(one_gpu.rows())["fits"]


def test_ranks_must_split_the_heads():
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide num_attention_heads=64, .*"
                                         r"num_key_value_heads=4 \(or be a multiple of it\)"):
        plan_memory(M3, tensor_parallel_size=3)
    # 8 ranks over 4 KV heads: each caches the one its 8 query heads attend with (and its index head)
    plan = plan_memory(M3, tensor_parallel_size=8, expert_parallel=True, quantization="fp8_experts",
                       kv_cache_dtype="fp8", device_memory=141 * 10**9)
    assert plan.kv_bytes_per_token == 60 * (2 * 128 + 2 * 4) + 57 * 128
    assert plan.fits
