"""Tensor + expert parallel on the CPU (gloo, worker processes): each rank's weights are exactly its slices of the
checkpoint, and an engine sharded over 2 ranks gives the same greedy tokens as one rank, on the oracle model
(where MSA drops blocks past position 24), eagerly and through the graph steps' lockstep protocol."""

import asyncio

import pytest
import torch

from m3sdk import Engine
from m3sdk.model.loader import load_model
from m3sdk.parallel import MirroredGraphs, Shard, load_shard
from m3sdk.parallel.sharding import param_pieces

# 37..55 tokens: past the sparse threshold; the last one repeats itself, so an ngram drafter proposes at once
PROMPTS = [list(range(3 + i, 40 + 9 * i)) for i in range(3)] + [list(range(21, 40)) * 2]


@pytest.mark.parametrize(("world", "expert_parallel"), [(2, True), (2, False), (4, False)])
@pytest.mark.parametrize("layout", ["hf", "minimax"])
def test_rank_weights_are_slices_of_the_checkpoint(layout, world, expert_parallel, oracle_checkpoint,
                                                   oracle_checkpoint_minimax):
    """world 4 > the 2 KV (and index) heads: ranks 0, 1 hold KV head 0, ranks 2, 3 KV head 1."""
    path = oracle_checkpoint if layout == "hf" else oracle_checkpoint_minimax  # minimax: one tensor per expert
    full = dict(load_model(path, "cpu", torch.float32).named_parameters())
    covered = {name: torch.zeros(p.shape, dtype=torch.bool) for name, p in full.items()}
    for rank in range(world):
        shard = Shard(rank, world, expert_parallel)
        local = dict(load_shard(path, shard, "cpu", torch.float32, "torch").named_parameters())
        assert local.keys() == full.keys()
        for name, param in local.items():
            pieces = param_pieces(name, load_model_config(path), shard)
            if pieces is None:
                assert torch.equal(param, full[name]), name
                covered[name][...] = True
                continue
            dim, spans = pieces
            assert param.shape[dim] == sum(e - s for s, e, _ in spans), name
            for s, e, at in spans:
                assert torch.equal(param.narrow(dim, at, e - s), full[name].narrow(dim, s, e - s)), name
                covered[name].narrow(dim, s, e - s)[...] = True
    assert all(c.all() for c in covered.values())  # the ranks together hold every weight


def load_model_config(path):
    from m3sdk.model.config import ModelConfig

    return ModelConfig.from_pretrained(path)


async def _greedy(path, attach=None, **config) -> tuple[list[list[int]], list, int]:
    """`attach(core)`: called once the engine runs, before any request."""
    async with Engine(model=str(path), device="cpu", kv_cache_memory=8 << 20, max_model_len=256, max_num_seqs=4,
                      **config) as e:
        if attach is not None:
            attach(e._core)
        outs = await asyncio.gather(*[e.generate(p, max_tokens=10, temperature=0) for p in PROMPTS])
        procs = list(e._core.tensor_parallel.procs) if config.get("tensor_parallel_size", 1) > 1 else []
        head_rows = e._core.runner.model.lm_head.weight.shape[0]
    return [o.token_ids for o in outs], procs, head_rows


@pytest.fixture(scope="module")
def single_rank_tokens(engine_checkpoint):
    torch.set_num_threads(1)
    return asyncio.run(_greedy(engine_checkpoint))[0]


@pytest.mark.parametrize(("expert_parallel", "overlap"), [(True, False), (False, False), (True, True)])
def test_two_ranks_give_the_same_greedy_tokens(expert_parallel, overlap, engine_checkpoint, single_rank_tokens):
    """lm_head is vocab-parallel (each rank holds half its rows; the logits are all-gathered), also when the
    engine overlaps its steps."""
    torch.set_num_threads(1)
    tokens, procs, head_rows = asyncio.run(_greedy(engine_checkpoint, tensor_parallel_size=2,
                                                   expert_parallel=expert_parallel, overlap_scheduling=overlap))
    assert tokens == single_rank_tokens
    assert head_rows == -(-load_model_config(engine_checkpoint).vocab_size // 2)
    assert [p.returncode for p in procs] == [0]  # the worker left cleanly at shutdown


def test_graph_steps_replay_in_lockstep(engine_checkpoint, single_rank_tokens):
    """Off CUDA a DecodeGraphs step runs eagerly on its static buffers (graphs.Replay), so the protocol that keeps the
    worker's graphs in step with rank 0's runs here for real: the worker builds the same DecodeGraphs and replays each
    step rank 0 replays, from the same broadcast inputs. Plain decode steps (q = 1) and ngram verify steps (q = 4,
    shorter rows padded inside the graph) give the single rank's greedy tokens."""
    torch.set_num_threads(1)
    replays = []

    def attach(core):
        tp = core.tensor_parallel
        graphs = MirroredGraphs(tp, core.runner.model, core.cache.kv, 4, core.max_model_len, core.runner.device,
                                query_lens=(1, 4))
        stage = graphs.stage

        def staged(key, ids, counts, *args):
            replays.append((key[2], any(c < key[2] for c in counts)))  # (q, some row padded)
            return stage(key, ids, counts, *args)

        graphs.stage = staged
        core.runner.graphs = graphs

    tokens, procs, _ = asyncio.run(_greedy(engine_checkpoint, attach, tensor_parallel_size=2,
                                           speculative={"method": "ngram", "num_speculative_tokens": 3}))
    assert tokens == single_rank_tokens
    assert (1, False) in replays and (4, True) in replays  # decode steps, and verify steps with padded rows
    assert [p.returncode for p in procs] == [0]


def test_four_ranks_replicate_the_kv_heads(engine_checkpoint, single_rank_tokens):
    """4 ranks over 4 query heads and 2 KV heads: each KV head (and its index head) on two ranks."""
    torch.set_num_threads(1)
    tokens, procs, _ = asyncio.run(_greedy(engine_checkpoint, tensor_parallel_size=4))
    assert tokens == single_rank_tokens
    assert [p.returncode for p in procs] == [0, 0, 0]


def test_ranks_must_divide_the_heads(engine_checkpoint):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide num_attention_heads=4"):
        asyncio.run(_greedy(engine_checkpoint, tensor_parallel_size=3))


def test_a_build_that_fails_after_the_launch_stops_the_workers(engine_checkpoint, monkeypatch):
    """Whatever fails after the workers started (here max_model_len past the model's, found once the model is
    loaded) stops them and leaves the process group: else they outlive the error and no later engine can start."""
    import torch.distributed as dist

    from m3sdk.config import EngineConfig
    from m3sdk.core import build_core
    from m3sdk.parallel import TensorParallel

    launched = []
    launch = TensorParallel.launch

    def record(*args, **kwargs):
        launched.append(launch(*args, **kwargs))
        return launched[-1]

    monkeypatch.setattr(TensorParallel, "launch", record)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        build_core(EngineConfig(model=str(engine_checkpoint), device="cpu", tensor_parallel_size=2,
                                max_model_len=1 << 30, kv_cache_memory=8 << 20))
    assert [p.returncode for p in launched[0].procs] == [0]
    assert not dist.is_initialized()


def test_graphs_that_fail_before_any_capture_still_let_the_engine_shut_down(engine_checkpoint):
    """Rank 0's MirroredGraphs registers for release at shutdown before it builds anything (a capture that fails
    midway must still be released): a failure before its graph table existed (here no query length; on a GPU an
    out-of-memory static buffer) must not stop the shutdown from stopping the workers and the process group."""
    import torch.distributed as dist

    from m3sdk.config import EngineConfig
    from m3sdk.core import build_core

    torch.set_num_threads(1)
    core = build_core(EngineConfig(model=str(engine_checkpoint), device="cpu", tensor_parallel_size=2,
                                   max_model_len=256, kv_cache_memory=8 << 20))
    tp = core.tensor_parallel
    with pytest.raises(IndexError):
        MirroredGraphs(tp, core.runner.model, core.cache.kv, 4, core.max_model_len, core.runner.device, query_lens=())
    tp.shutdown()
    assert all(p.returncode is not None for p in tp.procs)
    assert not dist.is_initialized()
