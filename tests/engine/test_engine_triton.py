"""attention_backend="triton" through the whole engine: its greedy tokens and top-5 candidates equal the torch
backend's, and its top-5 logprobs agree to 1e-4 where the kernels' dots are fp32 (under TRITON_INTERPRET=1 on a
CPU, every cache dtype; compiled on a GPU, an fp32 cache), on the oracle checkpoint, the torch backend's engine on
the same device. Compiled with a bf16 or FP8 cache, the dots take bf16 operands (the tensor cores' inputs: q and
the probabilities rounded to bf16): 1.7e-2 (bf16) and 9e-4 (FP8) measured on the H200, bound 2e-2.

A mixed batch: with 32 tokens per step, the 12-token prompt decodes while the others still prefill in chunks;
contexts of 30-51 tokens make MSA (top 3 blocks of 8) drop blocks, so the indexer's selection steers the sparse
kernel. Tokens alone are a weak check on this tiny random model: attending densely on its sparse layers, or
dropping one selected block, changed no greedy token in our trials, but it changes the top-5 candidates and
moves their logprobs by ~3e-2."""

import asyncio

import pytest
import torch
from test_engine_greedy import engine

PROMPTS = ([(7 * i + 3) % 253 + 3 for i in range(12)], [(5 * i + 1) % 253 + 3 for i in range(30)],
           [(11 * i + 9) % 253 + 3 for i in range(47)])
MAX_TOKENS = 4


@pytest.mark.parametrize(("kv_dtype", "layout"), [("bf16", "plain"), ("fp8", "shuffle"),
                                                   pytest.param("fp32", "plain", marks=pytest.mark.gpu)])
async def test_triton_engine_equals_torch_engine(engine_checkpoint, device, ieee_fp32, few_prefill_splits, kv_dtype,
                                                 layout):
    tokens, top, top_ids = {}, {}, {}
    for backend in ("torch", "triton"):
        async with engine(engine_checkpoint, device=str(device), attention_backend=backend, kv_cache_dtype=kv_dtype,
                          kv_cache_layout=layout, enable_prefix_caching=False) as e:
            assert e.describe()["backend"] == backend
            done = await asyncio.gather(*[e.generate(p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                                     logprobs=5) for p in PROMPTS])
            tokens[backend] = [c.token_ids for c in done]
            top[backend] = torch.tensor([[lp for s in c.logprobs for _, lp in s.top_logprobs] for c in done])
            top_ids[backend] = [[i for s in c.logprobs for i, _ in s.top_logprobs] for c in done]
    assert all(len(t) == MAX_TOKENS for t in tokens["torch"])
    assert tokens["triton"] == tokens["torch"]
    assert top_ids["triton"] == top_ids["torch"]
    fp32_dots = device.type == "cpu" or kv_dtype == "fp32"
    torch.testing.assert_close(top["triton"], top["torch"], atol=1e-4 if fp32_dots else 2e-2, rtol=0)
