"""load_format="dummy" under tensor parallel (CPU, gloo): each rank makes only its shard, with the shapes and dtypes
a checkpoint shard has, the whole parameters the same on every rank; an engine over 2 ranks serves it."""

import asyncio
import shutil

import pytest
import torch

from m3sdk import Engine
from m3sdk.config import BUNDLED_MODELS
from m3sdk.model.config import ModelConfig
from m3sdk.model.loader import load_model
from m3sdk.parallel import Shard, load_shard
from m3sdk.parallel.sharding import dummy_shard, param_pieces

TINY = BUNDLED_MODELS["m3-tiny"]


@pytest.mark.parametrize("expert_parallel", [True, False])
def test_each_rank_makes_only_its_shard(expert_parallel):
    config = ModelConfig.from_pretrained(TINY)
    ranks = []
    for rank in range(2):
        shard = Shard(rank, 2, expert_parallel)
        real = dict(load_shard(TINY, shard, "cpu", torch.float32, "torch").named_parameters())
        made = dict(dummy_shard(config, shard, "cpu", torch.float32, "torch", seed=5).named_parameters())
        assert {n: (p.shape, p.dtype) for n, p in made.items()} == {n: (p.shape, p.dtype) for n, p in real.items()}
        assert all(torch.isfinite(p).all() for p in made.values())
        ranks.append(made)
    for name, p in ranks[0].items():
        if param_pieces(name, config, Shard(0, 2, expert_parallel)) is None:
            assert torch.equal(p, ranks[1][name]), name  # held whole: one value on every rank
        elif "norm" not in name:
            assert not torch.equal(p, ranks[1][name]), name  # each rank's own slice of the random full tensor
    full = sum(p.numel() for p in load_model(TINY, "cpu", torch.float32).parameters())
    assert sum(p.numel() for p in ranks[0].values()) < 0.7 * full


def test_two_ranks_serve_dummy_weights(tmp_path):
    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    torch.set_num_threads(1)

    async def run():
        async with Engine(model=str(tmp_path), load_format="dummy", seed=3, device="cpu", tensor_parallel_size=2,
                          kv_cache_memory=8 << 20, max_model_len=256, max_num_seqs=4) as e:
            done = await e.generate("hello there", max_tokens=10, temperature=0)
            procs = list(e._core.tensor_parallel.procs)
        return done.token_ids, procs

    tokens, procs = asyncio.run(run())
    assert len(tokens) == 10
    assert [p.returncode for p in procs] == [0]


@pytest.mark.multi_gpu(2)
def test_two_gpus_serve_dummy_weights(tmp_path):
    shutil.copy(TINY / "config.json", tmp_path / "config.json")

    async def run():
        async with Engine(model=str(tmp_path), load_format="dummy", device="cuda", tensor_parallel_size=2,
                          expert_parallel=True, kv_cache_memory=64 << 20, max_model_len=256) as e:
            return (await e.generate("hello there", max_tokens=10, temperature=0)).token_ids

    assert len(asyncio.run(run())) == 10
