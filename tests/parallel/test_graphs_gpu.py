"""CUDA graphs under tensor parallel (2 GPUs only): an engine sharded over 2 ranks, each rank capturing and replaying
its own graphs in lockstep (all-reduces and the logits all-gather inside the graphs), gives the same greedy tokens
as the same engine run eagerly."""

import asyncio

import pytest
import torch

from m3sdk import Engine

# 4 equal-length prompts: every decode step after the shared prefill has the 4 sequences (no padding rows)
PROMPTS = [list(range(100 + 40 * i, 140 + 40 * i)) for i in range(4)]


async def _greedy(**config) -> tuple[list[list[int]], int, int]:
    """The bundled m3-tiny in float32 (near-tied logits would make bf16 rounding a coin flip)."""
    async with Engine(device="cuda", dtype="float32", max_num_seqs=4, max_model_len=512, kv_cache_memory=1 << 30,
                      tensor_parallel_size=2, **config) as e:
        before = e.stats()
        outs = await asyncio.gather(*[e.generate(p, max_tokens=32, temperature=0, ignore_eos=True) for p in PROMPTS])
        after = e.stats()
    return [o.token_ids for o in outs], after["graph_steps"] - before["graph_steps"], after["steps"] - before["steps"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallel CUDA graphs need 2 GPUs")
def test_two_ranks_with_graphs_give_the_eager_greedy_tokens(monkeypatch):
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")  # fp32 tl.dot is TF32 by default (the worker inherits it)
    graphs, graph_steps, steps = asyncio.run(_greedy())
    eager, eager_graph_steps, _ = asyncio.run(_greedy(cuda_graphs=False))
    assert graphs == eager
    # every step replayed but the prefill steps (up to one per prompt, when the prompts reach the engine apart)
    assert graph_steps >= max(20, steps - len(PROMPTS)) and eager_graph_steps == 0
