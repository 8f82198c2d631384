"""Image prompts under tensor parallel on the CPU (gloo, a worker process): rank 0's vision encoder computes each
image step's embeddings and sends them with the step, so an engine sharded over 2 ranks gives the same greedy
tokens as one rank (itself held against transformers in tests/engine/test_engine_vision.py), with chunks that cut
through the images, text-only requests in the same steps, and an image prompt served again from the caches."""

import asyncio

import pytest
import torch
from oracle import ORACLE_IMAGE_TOKEN, make_vl_checkpoint, random_png

from m3sdk import Engine

pytest.importorskip("PIL.Image")
IMG = ORACLE_IMAGE_TOKEN
ONE = [5, 6, 7, IMG, 40, 41, 42]
TWO = [9, IMG, 10, 11, IMG, 12]
TEXT = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]


A, B = random_png(100, 150, 0), random_png(60, 90, 1)  # 20 and 6 image tokens


async def _greedy(checkpoint, **overrides) -> list[list[int]]:
    async with Engine(model=str(checkpoint), device="cpu", dtype="float32", max_model_len=128, max_num_seqs=4,
                      max_num_batched_tokens=8, kv_cache_memory=1 << 22, **overrides) as e:
        def run(prompt):
            return e.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True)

        outs = await asyncio.gather(run({"prompt_token_ids": TWO, "images": [A, B]}), run(TEXT),
                                    run({"prompt_token_ids": ONE, "images": [B]}))
        again = await run({"prompt_token_ids": TWO, "images": [A, B]})  # the prefix and encoder caches' turn
        assert again.usage.cached_prompt_tokens > 0
    return [o.token_ids for o in (*outs, again)]


def test_two_ranks_give_one_ranks_greedy_tokens_on_image_prompts(tmp_path):
    torch.set_num_threads(1)
    checkpoint = make_vl_checkpoint(tmp_path / "vl")
    one = asyncio.run(_greedy(checkpoint))
    two = asyncio.run(_greedy(checkpoint, tensor_parallel_size=2))
    assert two == one
    assert one[0] == one[3]  # the cached turn is the first one's
