"""After the engine's start (its warm-up, the attention backend's `compile_ahead` and the graphs' warm steps), a first
prompt at a context and length never seen before compiles no Triton kernel: on a GPU each compile held a request
for 0.3-2.6 s. The oracle model (MSA blocks of 8 tokens, so a 64K context has 8,192 blocks: every top-k width) with
its positions raised to 64K; prompts of odd lengths, prefilled in chunks, then decoded at a new context bucket."""

import json
import random
import shutil

import pytest

from m3sdk import Engine


@pytest.mark.gpu
async def test_a_first_request_at_a_new_context_compiles_nothing(engine_checkpoint, tmp_path):
    from triton import knobs

    checkpoint = tmp_path / "long"
    shutil.copytree(engine_checkpoint, checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    (config.get("text_config") or config)["max_position_embeddings"] = 65536
    (checkpoint / "config.json").write_text(json.dumps(config))
    compiled: list[str] = []
    hook = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *a, **kw: compiled.append(
        f'{kw["fn"].name} {kw["compile"].get("specialization_data")}')
    rng = random.Random(0)
    try:
        async with Engine(model=str(checkpoint), device="cuda", max_model_len=65536, kv_cache_dtype="fp8",
                          max_num_seqs=8, kv_cache_memory=1 << 30) as e:
            assert compiled, "the hook saw no compile at all during the start"
            compiled.clear()
            for n in (4999, 20021, 65000):
                done = await e.generate([rng.randrange(3, 256) for _ in range(n)], max_tokens=4, ignore_eos=True)
                assert len(done.token_ids) == 4
                assert compiled == [], f"a first request at {n} tokens compiled {compiled}"
    finally:
        knobs.runtime.jit_post_compile_hook = hook
