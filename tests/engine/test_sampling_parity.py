"""Sampling parameters vLLM and SGLang users expect, on the bundled m3-tiny: n choices sharing one prefill (with
their own seeds, streamed with an index), min_tokens, logit_bias, stop_reason, include_stop_str_in_output,
skip_special_tokens, prompt_logprobs (a plain forward's log-softmax, never read from the prefix cache), the public
tokenizer; with overlapped steps, speculative decoding and preemption; bad values refused before queueing."""

import asyncio
import math

import pytest
import torch

from m3sdk import Engine, InvalidRequestError, SamplingParams
from m3sdk.cache.page_pool import PAGE_SIZE
from m3sdk.config import BUNDLED_MODELS

PROMPT = "The quick brown fox jumps over the lazy dog, and then the dog"
EOS = 1


def engine(**overrides) -> Engine:
    config = dict(model="m3-tiny", device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8,
                  max_num_batched_tokens=64, kv_cache_memory=1 << 23)
    return Engine(**{**config, **overrides})


async def prefilled(e: Engine, **params) -> tuple[object, int]:
    """A completion and the prompt tokens its engine ran through the model for it."""
    before = e.stats()["prefill_tokens"]
    done = await e.generate(PROMPT, **params)
    return done, e.stats()["prefill_tokens"] - before


@pytest.mark.parametrize("overlap", [False, True])
async def test_n_choices_differ_share_one_prefill_and_stream_with_an_index(overlap):
    async with engine(overlap_scheduling=overlap) as e:
        p = len(e.tokenizer.encode(PROMPT))
        assert p > PAGE_SIZE
        one, one_prefill = await prefilled(e, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
        assert one_prefill == p and one.outputs == (one.outputs[0],) and one.outputs[0].index == 0
    async with engine(overlap_scheduling=overlap) as e:
        three, prefill = await prefilled(e, n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
        # the first choice prefills the prompt; the others find its full pages in the prefix cache and compute
        # only the last partial page (at least the last token, whose logits start them)
        tail = p - (p - 1) // PAGE_SIZE * PAGE_SIZE
        assert prefill == p + 2 * tail < 3 * p
        texts = [c.text for c in three.outputs]
        assert [c.index for c in three.outputs] == [0, 1, 2] and len(set(texts)) == 3
        assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in three.outputs)
        # choice 0 has the request's seed (the n=1 result); choice i has seed + i
        assert three.outputs[0].token_ids == one.token_ids and three.text == one.text
        second = await e.generate(PROMPT, temperature=1.0, seed=12, max_tokens=12, ignore_eos=True)
        assert second.token_ids == three.outputs[1].token_ids
        assert three.usage.prompt_tokens == p and three.usage.completion_tokens == 36
        # streamed: chunks of every choice, each with its index, adding up to the same choices
        by_index: dict[int, list] = {0: [], 1: [], 2: []}
        async for chunk in e.stream(PROMPT, n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True,
                                    request_id="fan"):
            assert chunk.request_id == "fan"
            by_index[chunk.index].append(chunk)
        for i, chunks in by_index.items():
            assert "".join(c.text for c in chunks) == texts[i]
            assert [c.finish_reason for c in chunks].count("length") == 1 and chunks[-1].finish_reason == "length"
        stats = e.stats()
        assert stats["running"] == stats["waiting"] == 0 and stats["pages_free"] == stats["pages_total"]


async def test_n_choices_survive_preemption_and_abort_together():
    # room for about two sequences: the choices preempt each other and still give their seeded tokens
    async with engine() as e:
        big = await e.generate(PROMPT, n=4, temperature=0.9, seed=5, max_tokens=60, ignore_eos=True)
    async with engine(kv_cache_memory=77824 * 18, max_model_len=128) as e:
        assert e.stats()["pages_total"] < 4 * 6
        small = await e.generate(PROMPT, n=4, temperature=0.9, seed=5, max_tokens=60, ignore_eos=True)
        assert e.stats()["preemptions"] > 0
        assert [c.token_ids for c in small.outputs] == [c.token_ids for c in big.outputs]
        # leaving a stream of choices early aborts the rest
        async for _ in e.stream(PROMPT, n=3, max_tokens=60, ignore_eos=True, request_id="left"):
            break
        # a structured output keeps its eos under min_tokens: it ends where its grammar completes
        both = await e.generate(PROMPT, n=2, temperature=1.0, seed=2, max_tokens=12, min_tokens=10,
                                structured_output={"choice": ["yes", "no"]})
        assert all(c.text in ("yes", "no") and c.finish_reason == "stop" for c in both.outputs)
        # aborting the request aborts every choice, the held ones too
        task = asyncio.ensure_future(e.generate(PROMPT, n=3, max_tokens=60, ignore_eos=True, request_id="gone"))
        await asyncio.sleep(0.05)
        await e.abort("gone")
        done = await task
        assert {c.finish_reason for c in done.outputs} <= {"abort", "length"} and len(done.outputs) == 3
        for _ in range(200):
            stats = e.stats()
            if stats["running"] == stats["waiting"] == 0:
                break
            await asyncio.sleep(0.01)
        assert stats["pages_free"] == stats["pages_total"]


@pytest.mark.parametrize("overlap", [False, True])
async def test_min_tokens_masks_eos_stop_ids_and_stop_strings(overlap):
    async with engine(overlap_scheduling=overlap) as e:
        # eos forced by logit_bias: masked for the first 5 tokens, then it ends the request at once
        forced = await e.generate(PROMPT, temperature=0, max_tokens=20, logit_bias={EOS: 100}, min_tokens=5)
        assert forced.token_ids[-1] == EOS and EOS not in forced.token_ids[:-1] and len(forced.token_ids) == 6
        assert forced.finish_reason == "stop" and forced.stop_reason is None
        without = await e.generate(PROMPT, temperature=0, max_tokens=20, logit_bias={EOS: 100})
        assert without.token_ids == [EOS]
        # a stop token id, sampled at temperature 1
        token = e.tokenizer.encode(" dog", add_special_tokens=False)[-1]
        ids = await e.generate(PROMPT, temperature=1.0, seed=3, max_tokens=20, logit_bias={token: 100},
                               stop_token_ids=[token], min_tokens=3)
        assert ids.token_ids == ids.token_ids[:3] + [token] and token not in ids.token_ids[:3]
        assert ids.finish_reason == "stop" and ids.stop_reason == token
        # a stop string the greedy text holds early is not honoured before min_tokens
        free = await e.generate(PROMPT, temperature=0, max_tokens=24, ignore_eos=True)
        stop = free.text[2:4]
        early = await e.generate(PROMPT, temperature=0, max_tokens=24, ignore_eos=True, stop=stop)
        late = await e.generate(PROMPT, temperature=0, max_tokens=24, ignore_eos=True, stop=stop, min_tokens=10)
        assert early.stop_reason == stop and len(early.token_ids) < 10
        assert len(late.token_ids) >= 10 and late.token_ids == free.token_ids[:len(late.token_ids)]
        if late.finish_reason == "stop":
            assert late.stop_reason == stop and late.text.count(stop) == free.text[:len(late.text) + len(stop)
                                                                                  ].count(stop) - 1


async def test_logit_bias_forces_and_bans_tokens():
    async with engine() as e:
        token = e.tokenizer.encode(" fox", add_special_tokens=False)[-1]
        forced = await e.generate(PROMPT, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True,
                                  logit_bias={token: 100.0})
        assert forced.token_ids == [token] * 6
        free = await e.generate(PROMPT, temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
        first = free.token_ids[0]
        banned = await e.generate(PROMPT, temperature=0, max_tokens=4, ignore_eos=True, logprobs=2,
                                  logit_bias={str(first): -100})  # JSON-style string keys work too
        assert banned.token_ids[0] != first
        # the logprobs are those of the biased distribution (what was sampled from)
        assert banned.logprobs[0].top_logprobs[0][0] == banned.token_ids[0]


async def test_stop_reason_include_stop_str_and_skip_special_tokens():
    async with engine() as e:
        free = await e.generate(PROMPT, temperature=0, max_tokens=24, ignore_eos=True)
        stop = free.text[5:8]
        cut = await e.generate(PROMPT, temperature=0, max_tokens=24, ignore_eos=True, stop=["zzzz", stop])
        assert cut.finish_reason == "stop" and cut.stop_reason == stop
        assert cut.text == free.text[:free.text.index(stop)]
        kept = await e.generate(PROMPT, temperature=0, max_tokens=24, ignore_eos=True, stop=stop,
                                include_stop_str_in_output=True)
        assert kept.text == free.text[:free.text.index(stop) + len(stop)] and kept.stop_reason == stop
        length = await e.generate(PROMPT, temperature=0, max_tokens=3, ignore_eos=True)
        assert length.finish_reason == "length" and length.stop_reason is None
        # a special token forced into the output: text only when skip_special_tokens=False
        bos = e.tokenizer.bos_token_id
        skipped = await e.generate(PROMPT, temperature=0, max_tokens=3, ignore_eos=True, logit_bias={bos: 100})
        shown = await e.generate(PROMPT, temperature=0, max_tokens=3, ignore_eos=True, logit_bias={bos: 100},
                                 skip_special_tokens=False)
        assert skipped.token_ids == shown.token_ids == [bos] * 3
        assert skipped.text == "" and shown.text == e.tokenizer.bos_token * 3


def plain_prompt_logprobs(ids: list[int]) -> torch.Tensor:
    """log_softmax of a plain transformers forward of the prompt (float32): row j is the distribution of token
    j + 1."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    model = MiniMaxM3VLForCausalLM.from_pretrained(BUNDLED_MODELS["m3-tiny"], dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("mode", [{}, dict(speculative="ngram"), dict(overlap_scheduling=True)])
async def test_prompt_logprobs_are_a_plain_forwards_and_skip_the_prefix_cache(mode):
    # chunks of 16 tokens: the prompt is prefilled over several steps
    async with engine(max_num_batched_tokens=16, **mode) as e:
        ids = e.tokenizer.encode(PROMPT)
        warm = await e.generate(PROMPT, temperature=0, max_tokens=4)  # its pages now sit in the prefix cache
        got = await e.generate(PROMPT, temperature=0, max_tokens=4, prompt_logprobs=3)
        again = await e.generate(PROMPT, temperature=0, max_tokens=4, prompt_logprobs=3)
        assert got.usage.cached_prompt_tokens == 0 and warm.token_ids == got.token_ids
        assert again.prompt_logprobs == got.prompt_logprobs
        streamed = [c async for c in e.stream(PROMPT, temperature=0, max_tokens=4, prompt_logprobs=0)]
    ref = plain_prompt_logprobs(ids)
    lps = got.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None
    for j in range(1, len(ids)):
        entry = lps[j]
        assert entry.token_id == ids[j]
        assert math.isclose(entry.logprob, float(ref[j - 1, ids[j]]), abs_tol=2e-3)
        top = ref[j - 1].topk(3)
        assert [t for t, _ in entry.top_logprobs] == top.indices.tolist()
        values = [v for _, v in entry.top_logprobs]
        assert all(math.isclose(v, float(r), abs_tol=2e-3) for v, r in zip(values, top.values, strict=True))
    # streamed: the first chunk carries them (top-0: only the prompt token's own)
    assert streamed[0].prompt_logprobs is not None and all(c.prompt_logprobs is None for c in streamed[1:])
    assert [x and (x.token_id, x.top_logprobs) for x in streamed[0].prompt_logprobs][1:] == [
        (t, []) for t in ids[1:]]


async def test_speculation_and_overlap_see_the_same_processed_logits():
    params = dict(temperature=0, max_tokens=24, min_tokens=8, logit_bias={EOS: 30.0, 300: 4.0})
    async with engine() as e:
        plain = await e.generate(PROMPT, **params)
        n_plain = await e.generate(PROMPT, n=2, temperature=0.8, seed=4, max_tokens=16, min_tokens=8,
                                   logit_bias={EOS: 5.0})
    assert len(plain.token_ids) == 9 and plain.token_ids[-1] == EOS
    for overrides in (dict(speculative="ngram"), dict(overlap_scheduling=True)):
        async with engine(**overrides) as e:
            assert (await e.generate(PROMPT, **params)).token_ids == plain.token_ids
            if "overlap_scheduling" in overrides:  # (seeded rejection sampling draws differently from the sampler)
                again = await e.generate(PROMPT, n=2, temperature=0.8, seed=4, max_tokens=16, min_tokens=8,
                                         logit_bias={EOS: 5.0})
                assert [c.token_ids for c in again.outputs] == [c.token_ids for c in n_plain.outputs]


async def test_tokenizer_counts_as_the_engine_does_and_bad_values_are_refused():
    async with engine(max_waiting_requests=4) as e:
        done = await e.generate(PROMPT, max_tokens=2)
        assert len(e.tokenizer.encode(PROMPT)) == done.usage.prompt_tokens
        vocab = e._core.vocab_size
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            await e.generate(PROMPT, logit_bias={vocab: 1.0})
        with pytest.raises(InvalidRequestError, match="cannot all be live"):
            await e.generate(PROMPT, n=100, max_tokens=2)
        assert (await e.generate(PROMPT, max_tokens=2)).finish_reason == "length"  # still serving
    for bad in (dict(n=0), dict(n=129), dict(n=True), dict(min_tokens=-1), dict(max_tokens=4, min_tokens=5),
                dict(logit_bias={3: 101}), dict(logit_bias={3: math.inf}), dict(logit_bias={-1: 1}),
                dict(logit_bias={"x": 1}), dict(logit_bias=[1, 2]), dict(prompt_logprobs=21),
                dict(prompt_logprobs=-1), dict(skip_special_tokens=1), dict(include_stop_str_in_output="yes")):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)
    p = SamplingParams(n=3, seed=2**64 - 2, prompt_logprobs=2)
    assert [(c.n, c.seed, c.prompt_logprobs) for c in map(p.for_choice, range(3))] == [
        (1, 2**64 - 2, 2), (1, 2**64 - 1, None), (1, 0, None)]


@pytest.mark.gpu
async def test_on_a_gpu_with_graphs_and_overlap(device):
    """The same properties where decode steps replay CUDA graphs and steps overlap (the GPU defaults): biases and
    masks apply to the graph's logits, min_tokens settles its steps, choices share the prefill."""
    async with engine(device=str(device), dtype="bfloat16") as e:
        assert e._core.config.overlap and e._core.runner.graphs is not None
        forced = await e.generate(PROMPT, temperature=0, max_tokens=20, logit_bias={EOS: 100}, min_tokens=7)
        assert len(forced.token_ids) == 8 and forced.token_ids[-1] == EOS and EOS not in forced.token_ids[:-1]
        token = e.tokenizer.encode(" fox", add_special_tokens=False)[-1]
        biased = await e.generate(PROMPT, temperature=1.0, seed=1, max_tokens=16, ignore_eos=True,
                                  logit_bias={token: 100.0})
        assert biased.token_ids == [token] * 16
        other = "Once upon a time, in a land far away, there lived a small and curious fox"  # not cached yet
        p = len(e.tokenizer.encode(other))
        before = e.stats()["prefill_tokens"]
        three = await e.generate(other, n=3, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
        assert e.stats()["prefill_tokens"] - before == p + 2 * (p - (p - 1) // PAGE_SIZE * PAGE_SIZE)
        assert len({c.text for c in three.outputs}) == 3
        assert e.stats()["graph_steps"] > 0
