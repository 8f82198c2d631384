"""The n-gram (prompt lookup) drafter: no weights. Find the latest earlier occurrence of the request's last n
tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) in its own prompt + output and propose the
tokens that followed it. Strong on text that copies its context (code edits, extraction, summaries, agents
re-quoting tool output); proposes nothing when there is no match, and the request then decodes plainly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from m3sdk.speculative.base import DraftRequest, Proposal, SpecConfig, TargetInfo, TargetStates, register


def lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest matching suffix (n_max..n_min)."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n:]
        # windows starting at 0 .. length - n - 1: every earlier occurrence, not the suffix itself
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramDrafter:
    method = "ngram"
    aux_layers: tuple[int, ...] = ()
    reads_unverified = False

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4):
        self.num_speculative_tokens = num_speculative_tokens
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max

    def observe(self, items: Sequence[tuple[str, TargetStates]]) -> None:
        pass  # stateless: every proposal reads the request's tokens afresh

    def propose(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        out = []
        for r in requests:
            k = min(self.num_speculative_tokens, r.max_drafts)
            tokens = lookup(np.asarray(r.token_ids, dtype=np.int64), k, self.n_min, self.n_max) if k > 0 else []
            out.append(Proposal(tokens))
        return out

    def release(self, request_id: str) -> None:
        pass

    def capture_graphs(self, max_num_seqs: int) -> None:
        pass  # no device steps of its own


@register("ngram")
def _build(config: SpecConfig, target: TargetInfo) -> NgramDrafter:
    return NgramDrafter(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
