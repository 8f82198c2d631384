"""Speculative decoding with image prompts (the tiny VL checkpoint of tests/oracle.py, with a random MTP module
and the EAGLE3 head of conftest.py): greedy tokens with each drafter equal those without speculation, for a batch
that mixes image and text requests, with 16-token chunks that cut through the 20-token images; drafts start after
the prompt, so the drafters' reads of the image positions change no token."""

import asyncio
import random

import pytest
from conftest import add_mtp
from oracle import ORACLE_IMAGE_TOKEN, make_vl_checkpoint, random_png

from m3sdk import Engine
from m3sdk.core import resolved
from m3sdk.graphs import DecodeGraphs
from m3sdk.model import ModelConfig

pytest.importorskip("PIL.Image")
IMG = ORACLE_IMAGE_TOKEN
MAX_TOKENS = 12


def prompts() -> list:
    """Image prompts whose 20-token images start at offsets 10 and 3 (16-token chunks cut them), one with two
    images, and text prompts; the phrase repeated after an image gives the n-gram drafter matches to draft from."""
    rng = random.Random(0)
    phrase = [rng.randrange(3, 250) for _ in range(5)]
    text = [rng.randrange(3, 250) for _ in range(10)]
    a, b, c = random_png(100, 150, 0), random_png(60, 90, 1), random_png(100, 150, 2)
    return [
        {"prompt_token_ids": text + [IMG] + phrase * 3, "images": [a]},
        text[:6] + phrase * 3,
        {"prompt_token_ids": [7, 8, 9, IMG, 11, IMG, 12] + phrase * 2, "images": [c, b]},
        text,
        {"prompt_token_ids": phrase * 2 + [IMG] + phrase, "images": [a]},
    ]


@pytest.fixture(scope="module")
def vl_spec_checkpoint(tmp_path_factory):
    """The tiny VL checkpoint with an `mtp.layers.0.*` module beside its text model."""
    path = make_vl_checkpoint(tmp_path_factory.mktemp("vl-spec") / "ckpt")
    return add_mtp(path, ModelConfig.from_pretrained(path))


async def run(checkpoint, **overrides) -> tuple[list[list[int]], dict]:
    config = dict(model=str(checkpoint), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8,
                  max_num_batched_tokens=16, kv_cache_memory=1 << 22, enable_prefix_caching=False)
    async with Engine(**{**config, **overrides}) as e:
        done = await asyncio.gather(*[e.generate(p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
                                      for p in prompts()])
        stats = e.stats()
    assert all(c.finish_reason == "length" for c in done)
    return [c.token_ids for c in done], stats


@pytest.fixture(scope="module")
def reference(vl_spec_checkpoint):
    return asyncio.run(run(vl_spec_checkpoint))[0]


@pytest.mark.parametrize("method", ["ngram", "eagle3", "mtp"])
async def test_image_prompts_greedy_identical_with_each_drafter(vl_spec_checkpoint, eagle3_head, reference, method):
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "eagle3":
        spec["model"] = str(eagle3_head)
    out, stats = await run(vl_spec_checkpoint, speculative=spec)
    assert out == reference
    assert stats["spec_method"] == method and stats["spec_drafted_tokens"] > 0
    assert stats["pages_free"] == stats["pages_total"]


async def test_image_prompts_with_speculation_and_the_prefix_cache(vl_spec_checkpoint, reference):
    """A repeated image prompt hits the prefix cache (its image pages included) and drafts the same tokens."""
    first = prompts()[0]
    async with Engine(model=str(vl_spec_checkpoint), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=8,
                      max_num_batched_tokens=16, kv_cache_memory=1 << 22, speculative="ngram") as e:
        outs = [await e.generate(first, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True) for _ in range(2)]
    assert [c.token_ids for c in outs] == [reference[0]] * 2
    assert outs[1].usage.cached_prompt_tokens == 32




@pytest.mark.parametrize("method", ["eagle3", "mtp"])
async def test_image_prompts_with_the_gpus_graph_wiring(vl_spec_checkpoint, eagle3_head, reference, monkeypatch,
                                                        method):
    """With the GPU's graph wiring (on the CPU each graph step runs eagerly on its static buffers): decode and verify
    steps go through the graphs' static inputs (steps with image tokens run eagerly), drafts reach the verify
    forward on the device and the drafter's read is launched behind it; the tokens are unchanged."""
    monkeypatch.setattr(resolved, "cuda_graphs_wanted", lambda config, device, backend: True)
    monkeypatch.setattr(DecodeGraphs, "supported", staticmethod(lambda model: True))
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "eagle3":
        spec["model"] = str(eagle3_head)
    out, stats = await run(vl_spec_checkpoint, speculative=spec)
    assert out == reference
    assert stats["graph_steps"] > 0 and stats["spec_drafted_tokens"] > 0
    assert stats["pages_free"] == stats["pages_total"]


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["ngram", "eagle3", "mtp"])
async def test_image_prompts_with_speculation_and_graphs_on_the_gpu(vl_spec_checkpoint, eagle3_head, method):
    """The same on CUDA: decode and verify steps replay graphs (steps with image tokens run eagerly), and so do the
    EAGLE3 drafter's fixed-shape reads."""
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "eagle3":
        spec["model"] = str(eagle3_head)
    reference, _ = await run(vl_spec_checkpoint, device="cuda")
    out, stats = await run(vl_spec_checkpoint, device="cuda", speculative=spec)
    assert out == reference
    assert stats["graph_steps"] > 0 and stats["spec_drafted_tokens"] > 0
