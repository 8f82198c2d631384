"""Prompt-lookup drafting."""

import numpy as np

from m3sdk.speculative.base import DraftRequest, SpecConfig
from m3sdk.speculative.ngram import NgramDrafter, lookup


def test_lookup_prefers_the_longest_then_latest_match():
    t = np.array([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3])
    # suffix [2, 3] occurs at 1 and 5: the latest (5) wins -> 5, 6, 7
    assert lookup(t, 3, 1, 4) == [5, 6, 7]
    t = np.array([7, 1, 2, 3, 8, 8, 5, 2, 3, 4, 4, 1, 2, 3])
    # [1, 2, 3] (n = 3) matches at 1 only; the shorter [2, 3] would match later at 7
    assert lookup(t, 2, 1, 4) == [8, 8]
    assert lookup(t, 2, 4, 4) == []  # no 4-gram repeats
    assert lookup(np.array([5]), 3, 1, 4) == []
    assert lookup(np.array([1, 2, 1]), 5, 1, 2) == [2, 1]  # runs into the end: fewer than k


def test_drafter_respects_max_drafts():
    d = NgramDrafter(3)
    reqs = [DraftRequest("a", [1, 2, 3, 1, 2], 3), DraftRequest("b", [1, 2, 3, 1, 2], 1),
            DraftRequest("c", [4, 5, 6], 3), DraftRequest("d", [1, 2, 1], 0)]
    assert [p.tokens for p in d.propose(reqs)] == [[3, 1, 2], [3], [], []]


def test_config_forms():
    assert SpecConfig.parse("eagle3:/x/y") == SpecConfig("eagle3", model="/x/y")
    assert SpecConfig.parse({"method": "ngram", "num_speculative_tokens": 5}).num_speculative_tokens == 5
    assert SpecConfig.parse(None) is None
    for bad in ("medusa", {"method": "ngram", "k": 3}, {"num_speculative_tokens": 2},
                {"method": "ngram", "num_speculative_tokens": 0}, "ngram:/path"):
        try:
            SpecConfig.parse(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was accepted")
