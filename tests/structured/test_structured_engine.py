"""Structured outputs on the bundled m3-tiny: seeded samples at temperature 1.0 validate against their JSON schema /
fullmatch their regex / are in the choice set / match the EBNF grammar, alone and batched with unconstrained
requests (which the masks leave untouched), with overlapped steps, after preemption and under speculative
decoding (EAGLE3 and n-gram: the verifier never accepts a token the grammar forbids, and greedy constrained output
equals the non-speculative one); a constraint that does not compile is refused before queueing."""

import asyncio
import json
import re

import jsonschema
import pytest

from m3sdk import Engine, SamplingParams
from m3sdk.errors import InvalidRequestError
from m3sdk.structured import StructuredOutput

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"], "additionalProperties": False}
# a list of bounded length whose items are an enum or null (a number's digits are unbounded: a sample at
# temperature 1.0 could run past max_tokens)
ORDER = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"enum": ["tea", "cake", None]}, "minItems": 1, "maxItems": 3},
    "price": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["items", "price"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,3}"
CHOICE = ["Elizabeth", "Darcy", "Jane Bennet"]
GRAMMAR = 'root ::= "Dear " name ("," | "!")\nname ::= "Emma" | "Harriet" | "Mr. " [A-Z] [a-z]{1,6}'
GRAMMAR_RE = r"Dear (Emma|Harriet|Mr\. [A-Z][a-z]{1,6})[,!]"
N = 20


def check(kind: str, text: str) -> None:
    if kind == "person":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "order":
        jsonschema.validate(json.loads(text), ORDER)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICE, text
    else:
        assert re.fullmatch(GRAMMAR_RE, text), text


CONSTRAINTS = {"person": {"json": PERSON}, "order": {"json": json.dumps(ORDER)}, "regex": {"regex": REGEX},
               "choice": {"choice": CHOICE}, "grammar": StructuredOutput(grammar=GRAMMAR)}


def params(kind: str, seed: int, temperature: float = 1.0) -> SamplingParams:
    return SamplingParams(max_tokens=48, temperature=temperature, seed=seed, structured_output=CONSTRAINTS[kind])


async def run(engine: Engine, kinds: list[str], temperature: float = 1.0) -> list:
    done = await asyncio.gather(*[engine.generate("Write it out:", params(k, i, temperature))
                                  for i, k in enumerate(kinds)])
    for kind, c in zip(kinds, done, strict=True):
        check(kind, c.text)
        assert c.finish_reason == "stop", (kind, c.text)
    return done


def free(engine: Engine) -> bool:
    stats = engine.stats()
    return stats["pages_free"] == stats["pages_total"] and stats["running"] == stats["waiting"] == 0


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
async def test_twenty_seeded_samples_match(kind):
    async with Engine(device="cpu") as e:
        await run(e, [kind] * N)
        assert free(e)


async def test_batched_with_unconstrained_requests_which_the_masks_leave_alone():
    """Constrained rows of every kind share steps with seeded unconstrained rows, with overlapped steps on and off;
    the unconstrained rows give what they give alone, the constrained ones what they give without overlap."""
    kinds = list(CONSTRAINTS) * 2
    plain = [SamplingParams(max_tokens=24, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(6)]
    async with Engine(device="cpu", overlap_scheduling=False) as e:
        alone = [(await e.generate("She said", p)).token_ids for p in plain]
        sync = [c.token_ids for c in await run(e, kinds)]
    for overlap in (False, True):
        async with Engine(device="cpu", overlap_scheduling=overlap) as e:
            assert e._core.config.overlap is overlap
            mixed, *others = await asyncio.gather(run(e, kinds), *[e.generate("She said", p) for p in plain])
            assert [c.token_ids for c in others] == alone
            assert [c.token_ids for c in mixed] == sync
            assert free(e)


async def test_preemption_keeps_the_matcher_in_step():
    """A KV budget that holds about two of the sixteen requests: they preempt each other and recompute, and their
    outputs still match (the matcher follows accepted tokens, which a preemption keeps); greedy constrained
    output equals the unpreempted run's."""
    kinds = ["person", "order", "regex", "grammar"] * 4
    async with Engine(device="cpu") as e:
        roomy = [c.token_ids for c in await run(e, kinds, temperature=0)]
        page_bytes = e._core.cache.kv.spec.bytes_per_page
    async with Engine(device="cpu", kv_cache_memory=12 * page_bytes, max_model_len=96) as e:
        tight = [c.token_ids for c in await run(e, kinds, temperature=0)]
        assert e.stats()["preemptions"] > 0
        await run(e, kinds)  # sampled ones too
        assert free(e)
    assert tight == roomy


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
async def test_speculative_decoding_never_accepts_a_forbidden_draft(method):
    kinds = list(CONSTRAINTS) * 2
    async with Engine(device="cpu") as e:
        greedy = [c.token_ids for c in await run(e, kinds, temperature=0)]
    async with Engine(device="cpu", speculative=method) as e:
        assert [c.token_ids for c in await run(e, kinds, temperature=0)] == greedy
        await run(e, ["person", "order", "regex"] * 4)
        stats = e.stats()
        assert stats["spec_drafted_tokens"] > 0 and free(e)
    if method == "eagle3":
        assert stats["spec_accepted_tokens"] > 0


async def test_bad_constraints_are_refused_before_queueing():
    async with Engine(device="cpu") as e:
        for bad in ({"json": {"type": "nonsense"}}, {"regex": "(unclosed"}, {"grammar": "start ::= \"x\""},
                    {"regex": "(?=look)ahead"}):
            with pytest.raises(InvalidRequestError, match="does not compile"):
                await e.generate("x", structured_output=bad)
        for bad in ({"json": "{not json"}, {"choice": []}, {"choice": "abc"}, {"json": PERSON, "regex": "a"},
                    {"xml": "<a/>"}, "json"):
            with pytest.raises(InvalidRequestError):
                SamplingParams(structured_output=bad)
        assert e.stats()["steps"] == 0
        await run(e, ["choice"])  # still serving
