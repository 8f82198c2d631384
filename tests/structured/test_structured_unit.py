"""m3sdk.structured without a model: the vocabulary a grammar engine sees, the per-draft masks of speculative
decoding (the matcher walks the drafts and returns to where it was), the sampler's masking, the cache."""

import json

import pytest
import torch

from m3sdk.config import EngineConfig
from m3sdk.params import SamplingParams
from m3sdk.sampler import Sampler, SamplingState
from m3sdk.structured import GrammarCompiler, StructuredOutput, fill_draft_masks, new_bitmask
from m3sdk.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_pretrained(EngineConfig().model_path())


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, 2048, tokenizer.eos_token_ids)


def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    bits = (bitmask[row].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.reshape(-1).nonzero().flatten().tolist())


def test_vocabulary_bytes_spell_what_the_tokenizer_decodes(tokenizer):
    vocab = tokenizer.vocabulary_bytes(2050)
    assert vocab[0] == vocab[1] == vocab[2] == b""  # special tokens spell nothing
    assert vocab[2048:] == [b"", b""]  # ids past the tokenizer
    for i in range(3, 2048):
        text = tokenizer.decode([i], skip_special_tokens=False)
        if "\ufffd" not in text:
            assert vocab[i] == text.encode(), i


def test_choice_literals_are_escaped_and_masks_allow_exactly_their_spelling(tokenizer, compiler):
    choices = ['say "hi"', "back\\slash", "new\nline"]
    grammar = compiler.grammar(StructuredOutput(choice=choices))
    for choice in choices:
        g = compiler.grammar(StructuredOutput(choice=choices))
        for t in tokenizer.encode(choice, add_special_tokens=False):
            assert g.accept(t)
        assert g.accept(1) and g.terminated  # eos ends it
    assert not grammar.accept(tokenizer.encode("nope", add_special_tokens=False)[0])


def test_draft_masks_walk_the_drafts_and_roll_back(tokenizer, compiler):
    grammar = compiler.grammar(StructuredOutput(regex="(ab|cd)+"))
    a, b, c = (tokenizer.token_to_id(x) for x in "abc")
    assert grammar.accept(a)
    bitmask = new_bitmask(4, 2048, torch.device("cpu"))
    fill_draft_masks(bitmask, 0, grammar, [b, c, c])  # the second c is forbidden after "abc"
    assert allowed(bitmask, 0) == {b}  # after "a": only b
    assert c in allowed(bitmask, 1) and a in allowed(bitmask, 1) and b not in allowed(bitmask, 1)
    assert allowed(bitmask, 2) == {tokenizer.token_to_id("d")}  # c is rejected here
    assert len(allowed(bitmask, 3)) == 2048  # never reached: left all-allowed
    # rolled back: the matcher is after "a" again
    assert not grammar.accept(c) and grammar.accept(b)


def test_the_sampler_never_draws_a_forbidden_token(compiler):
    so = StructuredOutput(choice=["yes", "no"])
    states = [SamplingState(SamplingParams(temperature=1.0, seed=i, structured_output=so), [5],
                            grammar=compiler.grammar(so)) for i in range(8)]
    states.append(SamplingState(SamplingParams(temperature=0), [5]))  # unconstrained: its argmax
    logits = torch.randn(9, 2048, generator=torch.Generator().manual_seed(0))
    first = {t.token_id for t in Sampler().sample(logits, states)[:8]}
    bitmask = new_bitmask(1, 2048, torch.device("cpu"))
    compiler.grammar(so).fill(bitmask, 0)
    assert first and first <= allowed(bitmask, 0) and len(allowed(bitmask, 0)) < 20
    assert Sampler().sample(logits, states)[8].token_id == int(logits[8].argmax())


def test_compiled_grammars_are_cached_by_key(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    first = compiler.compile(StructuredOutput(json=schema))
    assert compiler.compile(StructuredOutput(json=json.dumps(schema))) is first
    assert StructuredOutput(json={"b": 1, "a": 2}).key != StructuredOutput(json={"a": 2, "b": 1}).key  # order kept
