"""Numerics through the whole engine: greedy tokens of each request in a ragged, chunked, mixed batch equal its
tokens alone and transformers' greedy continuation; preemption, the prefix cache and the cache layout change
no token; seeded sampling does not depend on the batch. The oracle model's MSA keeps 3 blocks of 8 tokens, so
every context here (30-75 tokens) drops blocks."""

import asyncio
import random

import torch

from m3sdk import Engine

PROMPT_LENS = (5, 30, 47, 61, 12, 38)
MAX_TOKENS = 14


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in PROMPT_LENS]


def engine(checkpoint, **overrides) -> Engine:
    config = dict(model=str(checkpoint), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8,
                  max_num_batched_tokens=32, kv_cache_memory=1 << 22)
    return Engine(**{**config, **overrides})


async def greedy_batch(e: Engine, ps: list[list[int]], **params) -> list[list[int]]:
    done = await asyncio.gather(*[e.generate(p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **params)
                                  for p in ps])
    assert all(c.finish_reason == "length" for c in done)
    return [c.token_ids for c in done]


def transformers_greedy_agrees(oracle_hf, prompt: list[int], output: list[int]) -> None:
    """Teacher-forced: at every step transformers' argmax is the token the engine produced, i.e. transformers'
    own greedy continuation is the same sequence."""
    with torch.no_grad():
        logits = oracle_hf(input_ids=torch.tensor([prompt + output])).logits[0].float()
    predicted = logits[len(prompt) - 1:-1].argmax(-1).tolist()
    assert predicted == output


async def test_batch_equals_alone_equals_transformers(engine_checkpoint, oracle_hf):
    ps = prompts()
    async with engine(engine_checkpoint, enable_prefix_caching=False) as e:
        batched = await greedy_batch(e, ps)
        alone = [(await greedy_batch(e, [p]))[0] for p in ps]
        assert e.stats()["steps"] > 0
    assert batched == alone
    for p, out in zip(ps, batched, strict=True):
        transformers_greedy_agrees(oracle_hf, p, out)


async def test_preemption_under_tiny_cache_keeps_greedy_output(engine_checkpoint):
    ps = prompts(1)
    async with engine(engine_checkpoint) as e:
        reference = await greedy_batch(e, ps)
    # 8 pages (= one max_model_len sequence) for 6 sequences growing to 75 tokens
    page_bytes = 4 * 2 * 2 * 16 * 16 * 4 + 2 * 16 * 16 * 4
    async with engine(engine_checkpoint, kv_cache_memory=8 * page_bytes) as e:
        assert e.stats()["pages_total"] == 8
        assert await greedy_batch(e, ps) == reference
        stats = e.stats()
    assert stats["preemptions"] > 0 and stats["pages_free"] == 8


async def test_prefix_cache_hits_and_changes_no_token(engine_checkpoint):
    shared = prompts(2)[3]  # 61 tokens: 3 full pages
    ps = [shared + [7, 8, 9], shared[:40] + [11], shared]
    async with engine(engine_checkpoint, enable_prefix_caching=False) as e:
        reference = [(await greedy_batch(e, [p]))[0] for p in ps]
    async with engine(engine_checkpoint) as e:
        first = await greedy_batch(e, [shared])
        rest = [(await e.generate(p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)) for p in ps]
        stats = e.stats()
    assert first[0] == reference[2]
    assert [c.token_ids for c in rest] == reference
    assert [c.usage.cached_prompt_tokens for c in rest] == [48, 32, 48]
    assert stats["prefix_cache_hits"] == 128


async def test_shuffle_layout_gives_the_same_tokens(engine_checkpoint):
    ps = prompts(3)[:3]
    async with engine(engine_checkpoint) as e:
        plain = await greedy_batch(e, ps)
    async with engine(engine_checkpoint, kv_cache_layout="shuffle") as e:
        assert e._core.cache.kv.k[0].dim() == 5
        assert await greedy_batch(e, ps) == plain


async def test_seeded_sampling_is_independent_of_the_batch(engine_checkpoint):
    ps = prompts(4)
    params = dict(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, ignore_eos=True)
    async with engine(engine_checkpoint) as e:
        alone = await e.generate(ps[1], seed=1234, **params)
        crowd = [e.generate(p, seed=i, **params) for i, p in enumerate(ps)]
        crowd += [e.generate(p, **params) for p in ps[:3]]  # unseeded neighbours too
        again = await asyncio.gather(e.generate(ps[1], seed=1234, **params), *crowd)
        other_seed = await e.generate(ps[1], seed=4321, **params)
    assert again[0].token_ids == alone.token_ids
    assert other_seed.token_ids != alone.token_ids
