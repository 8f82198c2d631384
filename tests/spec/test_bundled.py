"""The bundled m3-tiny speculates out of the box with its bundled EAGLE3 head: same greedy tokens, drafts
accepted."""

import asyncio
import random

import pytest
from depth_helpers import sticky_random_depth

from m3sdk import Engine
from m3sdk.cache.page_pool import PAGE_SIZE
from m3sdk.core import resolved
from m3sdk.graphs import DecodeGraphs
from m3sdk.speculative.chain import ChainDrafter
from m3sdk.speculative.decoding import Speculation
from m3sdk.speculative.depth import DraftDepth

PROMPTS = ["It was a truth well known in the neighbourhood that", "Emma could not help feeling that her friend"]


async def greedy(**overrides) -> tuple[list[list[int]], dict]:
    async with Engine(device="cpu", **overrides) as e:
        done = await asyncio.gather(*[e.generate(p, max_tokens=24, temperature=0, ignore_eos=True)
                                      for p in PROMPTS])
        return [c.token_ids for c in done], e.stats()


async def test_bundled_head_is_used_by_default_and_changes_no_token():
    plain, _ = await greedy()
    spec, stats = await greedy(speculative="eagle3")
    assert spec == plain
    assert stats["spec_method"] == "eagle3" and stats["spec_accepted_tokens"] > 0
    assert stats["spec_target_forwards_per_token"] < 0.8


async def test_drafts_read_on_the_device_change_no_greedy_token(monkeypatch):
    """With the GPU's graph wiring (on the CPU each graph step runs eagerly on its static buffers) the drafts of a
    verify step reach its forward still on the device (placeholders in token_ids, `Proposal.pending`): greedy rows,
    a penalized one included, equal plain decoding while a seeded sampled row shares their batches, and every
    page is free at the end."""
    monkeypatch.setattr(resolved, "cuda_graphs_wanted", lambda config, device, backend: True)
    monkeypatch.setattr(DecodeGraphs, "supported", staticmethod(lambda model: True))
    carried, carry = [], Speculation._carry

    def counted(self, pending):
        carried.append(len(pending))
        return carry(self, pending)

    monkeypatch.setattr(Speculation, "_carry", counted)

    async def go(**overrides):
        async with Engine(device="cpu", max_num_seqs=4, **overrides) as e:
            done = await asyncio.gather(
                *[e.generate(p, max_tokens=24, temperature=0, ignore_eos=True) for p in PROMPTS],
                e.generate(PROMPTS[1], max_tokens=24, temperature=0, repetition_penalty=1.3, ignore_eos=True),
                e.generate(PROMPTS[0], max_tokens=24, temperature=0.8, seed=5, ignore_eos=True))
            return [c.token_ids for c in done], e.stats()

    plain, _ = await go()
    spec, stats = await go(speculative="eagle3")
    assert spec[:3] == plain[:3] and len(spec[3]) == 24
    assert sum(carried) > 0 and stats["spec_accepted_tokens"] > 0
    assert stats["pages_free"] == stats["pages_total"]


async def test_reads_launched_before_the_verdict_change_no_greedy_token(monkeypatch):
    """With the GPU's graph wiring, a batch of greedy rows verifying drafts still on the device has the drafter's
    read launched right behind the verify forward (acceptance counted on the device, `ChainDrafter.settle` told
    the host's count after): output equals plain decoding, and every page is free at the end."""
    monkeypatch.setattr(resolved, "cuda_graphs_wanted", lambda config, device, backend: True)
    monkeypatch.setattr(DecodeGraphs, "supported", staticmethod(lambda model: True))
    settled, settle = [], ChainDrafter.settle

    def counted(self, read, committed):
        settled.append(len(committed))
        return settle(self, read, committed)

    monkeypatch.setattr(ChainDrafter, "settle", counted)

    async def go(**overrides):
        async with Engine(device="cpu", max_num_seqs=2, **overrides) as e:
            done = await asyncio.gather(*[e.generate(p, max_tokens=32, temperature=0, ignore_eos=True)
                                          for p in PROMPTS])
            return [c.token_ids for c in done], e.stats()

    plain, _ = await go()
    spec, stats = await go(speculative="eagle3")
    assert spec == plain and sum(settled) > 10
    assert stats["pages_free"] == stats["pages_total"]


async def test_streamed_text_stop_string_and_logprobs_equal_plain():
    """A verify step's tokens reach the stream as one chunk: the streamed text up to a stop string that ends
    inside a step (or to max_tokens), the tokens and their logprobs are plain decoding's."""
    async def go(stop=None, **overrides):
        async with Engine(device="cpu", **overrides) as e:
            chunks = [c async for c in e.stream(PROMPTS[0], max_tokens=24, temperature=0, ignore_eos=True,
                                                stop=stop, logprobs=1)]
            return chunks, e.stats()

    full, _ = await go()
    text = "".join(c.text for c in full)
    # a stop string first seen past the middle of the text (greedy m3-tiny repeats itself)
    at = next(i for i in range(len(text) // 2, len(text) - 4) if text.find(text[i:i + 4]) == i)
    stop = text[at:at + 4]
    plain, _ = await go([stop])
    spec, stats = await go([stop], speculative="eagle3")
    assert stats["spec_accepted_tokens"] > 0
    assert "".join(c.text for c in spec) == "".join(c.text for c in plain) == text[:at]
    assert spec[-1].finish_reason == plain[-1].finish_reason == "stop"
    # and without the stop string (each step's text built after the next step's launch)
    spec_full, _ = await go(speculative="eagle3")
    assert "".join(c.text for c in spec_full) == text and spec_full[-1].finish_reason == "length"
    for got, want in ((spec, plain), (spec_full, full)):
        assert [t for c in got for t in c.token_ids] == [t for c in want for t in c.token_ids]
        lps = [[lp.logprob for c in run for lp in c.logprobs] for run in (got, want)]
        assert lps[0] == pytest.approx(lps[1], abs=1e-4)


async def test_streams_left_while_a_verify_step_runs_leave_nothing_behind(monkeypatch):
    """Streams left at random points (aborts that land while a verify step is on the device, its drafts read
    there): the other requests' tokens are plain decoding's, every page is free and the drafter holds no
    request at the end."""
    monkeypatch.setattr(resolved, "cuda_graphs_wanted", lambda config, device, backend: True)
    monkeypatch.setattr(DecodeGraphs, "supported", staticmethod(lambda model: True))
    rng = random.Random(0)
    prompts = [PROMPTS[i % 2] + " " * (i // 2) for i in range(12)]

    async def one(e, prompt, stop_after):
        out = []
        async for chunk in e.stream(prompt, max_tokens=20, temperature=0, ignore_eos=True):
            out += chunk.token_ids
            if len(out) >= stop_after:
                break
        return out

    async with Engine(device="cpu", max_num_seqs=4) as e:
        plain = await asyncio.gather(*[one(e, p, 99) for p in prompts])
    async with Engine(device="cpu", max_num_seqs=4, speculative="eagle3") as e:
        cut = [rng.choice([1, 3, 7, 99]) for _ in prompts]
        spec = await asyncio.gather(*[one(e, p, c) for p, c in zip(prompts, cut, strict=True)])
        await asyncio.sleep(0.2)
        stats, drafter = e.stats(), e._core.executor.spec.drafter
    for got, want, c in zip(spec, plain, cut, strict=True):
        assert got == want if c == 99 else got[:c] == want[:c]
    assert stats["pages_free"] == stats["pages_total"] and stats["running"] == stats["waiting"] == 0
    assert not drafter._seqs and len(drafter.pool.free) == drafter.pool.slots


async def test_any_depth_per_step_and_joins_through_graphs_change_no_greedy_token(monkeypatch):
    """With the GPU's graph wiring and each step's depth drawn at random from 0 .. k (a depth-0 step replays the
    plain decode graph and runs no drafter; requests switch depth mid-way): greedy output equals plain decoding;
    short prompts are prefilled through the four-page graph, requests whose prompts are prefix-cache hits join
    running ones through the one-page graph (their 16-token tail), and every page is free at the end."""
    monkeypatch.setattr(resolved, "cuda_graphs_wanted", lambda config, device, backend: True)
    monkeypatch.setattr(DecodeGraphs, "supported", staticmethod(lambda model: True))
    rng = random.Random(1)
    monkeypatch.setattr(DraftDepth, "choose", sticky_random_depth(rng))
    replayed, replay = [], DecodeGraphs.replay

    def counted(self, key):
        replayed.append(key[2])
        return replay(self, key)

    monkeypatch.setattr(DecodeGraphs, "replay", counted)
    long = [" ".join([p] * 4) for p in PROMPTS]

    async def go(**overrides):
        async with Engine(device="cpu", max_num_seqs=4, **overrides) as e:
            first = await asyncio.gather(*[e.generate(p, max_tokens=8, temperature=0, ignore_eos=True)
                                           for p in long])

            async def later(p, after):
                await asyncio.sleep(after)
                return await e.generate(p, max_tokens=16, temperature=0, ignore_eos=True)

            done = await asyncio.gather(e.generate(PROMPTS[0], max_tokens=40, temperature=0, ignore_eos=True),
                                        later(long[0], 0.3), later(long[1], 0.6))
            return [c.token_ids for c in first + done], e.stats()

    plain, _ = await go()
    replayed.clear()
    spec, stats = await go(speculative="eagle3")
    assert spec == plain
    # depth-0 steps ran as the plain overlapped executor's
    assert stats["overlap_steps"] > 0
    assert all(n > 0 for n in stats["spec_steps_by_depth"]) and stats["spec_accepted_tokens"] > 0
    assert {1, PAGE_SIZE, 4 * PAGE_SIZE} <= set(replayed) and len({2, 3, 4} & set(replayed)) >= 2
    assert stats["pages_free"] == stats["pages_total"]

