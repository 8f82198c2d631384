import numpy as np
import pytest

from m3sdk.errors import InvalidRequestError
from m3sdk.params import SamplingParams

BAD = [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 1.5), ("max_tokens", True), ("max_tokens", "8"),
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "1"),
    ("temperature", True),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", None),
    ("top_k", 0), ("top_k", -2), ("top_k", 2.0), ("top_k", False),
    ("min_p", -0.01), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0), ("frequency_penalty", -2.5),
    ("stop", 5), ("stop", ["ok", 3]), ("stop", [""]), ("stop", ""), ("stop", {"a"}), ("stop", b"x"),
    ("stop_token_ids", [1.0]), ("stop_token_ids", [-1]), ("stop_token_ids", 5), ("stop_token_ids", [True]),
    ("ignore_eos", 1), ("ignore_eos", "yes"),
    ("seed", 1.0), ("seed", "42"), ("seed", True), ("seed", -1), ("seed", 2**64),
    # values float32 sampling cannot represent (they sampled BOS with NaN logprobs)
    ("temperature", 1e-45), ("temperature", 1e-4), ("temperature", 1e300), ("top_p", 1e-46), ("top_p", 1e-7),
    ("repetition_penalty", 1e-300), ("repetition_penalty", 1e300), ("top_k", 2**31),
    ("stop", ["a\ud800"]), ("timeout", 0), ("timeout", -1.0), ("timeout", float("inf")), ("timeout", "5"),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 2.0), ("logprobs", True),
]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_bad_field_is_refused_naming_it(name, value):
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams(**{name: value})
    with pytest.raises(InvalidRequestError, match=name):  # replace() validates as well
        SamplingParams().replace(**{name: value})


def test_invalid_request_error_is_a_value_error():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)


def test_unknown_field_is_a_type_error():
    with pytest.raises(TypeError):
        SamplingParams(max_new_tokens=3)
    with pytest.raises(TypeError):
        SamplingParams().replace(topk=3)


def test_defaults_and_edges_are_accepted():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (256, 1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.stop is None and p.stop_token_ids == [] and not p.ignore_eos and p.seed is None
    assert p.logprobs is None and not p.greedy and not p.has_penalties and p.stop_strings == ()
    edge = SamplingParams(max_tokens=1, temperature=0, top_p=1, top_k=1, min_p=1, repetition_penalty=0.01,
                          presence_penalty=-2, frequency_penalty=2, stop=[], seed=2**64 - 1, logprobs=20)
    assert edge.greedy and edge.has_penalties and edge.stop_strings == ()
    assert SamplingParams(logprobs=0).logprobs == 0


def test_values_are_normalized():
    p = SamplingParams(max_tokens=np.int64(7), temperature=np.float32(0.5), top_p=1, stop=("a", "bc"),
                       stop_token_ids=(np.int32(3),))
    assert type(p.max_tokens) is int and p.max_tokens == 7
    assert type(p.temperature) is float and p.temperature == 0.5 and type(p.top_p) is float
    assert p.stop == ["a", "bc"] and p.stop_strings == ("a", "bc")
    assert p.stop_token_ids == [3] and type(p.stop_token_ids[0]) is int
    assert SamplingParams(stop="###").stop_strings == ("###",)


def test_frozen_and_replace():
    p = SamplingParams(temperature=0.3, seed=1)
    with pytest.raises(AttributeError):
        p.temperature = 1.0
    q = p.replace(max_tokens=5)
    assert (q.max_tokens, q.temperature, q.seed) == (5, 0.3, 1) and p.max_tokens == 256


def test_error_messages_do_not_echo_huge_values():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(stop=["x"] * 100_000 + [3])
    assert len(str(info.value)) < 300


def test_float32_edges_are_accepted():
    p = SamplingParams(temperature=1e-3, top_p=1e-6, repetition_penalty=100, top_k=2**31 - 1, seed=0, timeout=0.5)
    assert (p.temperature, p.top_p, p.repetition_penalty, p.timeout) == (1e-3, 1e-6, 100.0, 0.5)


def test_stop_limits_are_the_engines():
    p = SamplingParams(stop=["ab"] * 5, stop_token_ids=[1, 2, 3])
    p.check_against(100, max_stop_strings=5, max_stop_length=2)
    with pytest.raises(InvalidRequestError, match="max_stop_strings"):
        p.check_against(100, max_stop_strings=4)
    with pytest.raises(InvalidRequestError, match="max_stop_strings"):
        SamplingParams(stop_token_ids=[1, 2, 3]).check_against(100, max_stop_strings=2)
    with pytest.raises(InvalidRequestError, match="max_stop_length"):
        p.check_against(100, max_stop_strings=5, max_stop_length=1)


def test_check_against_vocab():
    p = SamplingParams(stop_token_ids=[0, 99])
    p.check_against(100)
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        p.check_against(99)
