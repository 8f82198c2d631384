"""The bundled m3-tiny speculates out of the box with its bundled EAGLE3 head: same greedy tokens, drafts
accepted."""

import asyncio

from m3sdk import Engine

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
