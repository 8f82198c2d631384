"""The SpeculativeDecoder seam: what a drafter is told after each target step, what it proposes, and the registry
that builds one by name from `EngineConfig.speculative`.

The life of a speculating request, one engine step at a time:
  1. the target model runs the request's new tokens (a prefill chunk, or the last token plus its drafts);
  2. the shared verifier (verify.py) turns the logits into the accepted drafts plus one token;
  3. the core calls `observe` with the target states of the positions that are now committed to the cache
     (rejected drafts' positions are not part of it) and the request's token ids;
  4. before the next step the scheduler asks `propose` for up to k draft tokens of each decoding request.
A drafter owns whatever per-request state it keeps (the EAGLE3 head's own KV cache, n-gram nothing) and drops it
in `release` (finished, aborted or preempted requests: a preempted request recomputes its prompt, and `observe`
sees those positions again).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from m3sdk.config import SpecConfig
from m3sdk.speculative.registry import DRAFTERS

if TYPE_CHECKING:
    from torch import nn


@dataclass
class TargetStates:
    """What the target computed for one request's positions `start ... start + n - 1` this step (all committed
    to the cache): the token after each of them (`next_tokens`, known once a position is committed, n of them), the
    final-normed hidden states and, when the drafter asked for `aux_layers`, those layers' inputs concatenated
    (`[n, len(aux_layers) * hidden]`). `hidden` and `aux` are these n rows, or the whole step's tensors of which
    rows `row ..` are these (`of`): the core passes the step's, so a step costs no slicing per request."""

    start: int
    next_tokens: list[int]
    hidden: torch.Tensor  # [n, hidden], or the step's [T, hidden]
    aux: torch.Tensor | None = None
    row: int = 0

    @property
    def n(self) -> int:
        return len(self.next_tokens)

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """These positions' rows of `hidden` or `aux`."""
        return t if self.row == 0 and t.shape[0] == self.n else t[self.row:self.row + self.n]


@dataclass
class DraftRequest:
    """A request that may speculate this step: all its known tokens (the last one not yet in the target's
    cache) and how many drafts it can use (fewer near max_tokens or the context limit)."""

    request_id: str
    token_ids: Sequence[int]
    max_drafts: int


class DeviceDrafts:
    """Draft tokens [B, k] a drafter launched on the device and did not read: the verify forward takes them from
    there (`Proposal.pending`), and the host reads them with the verify's own result (speculative/decoding.py), so
    nothing waits for the drafter. Valid until the drafter's next step of the same shape overwrites them."""

    def __init__(self, drafts: torch.Tensor):
        self.drafts = drafts

    def host(self) -> list[list[int]]:
        """Read them (waits for the drafter)."""
        return self.drafts.tolist()


@dataclass
class Proposal:
    """Draft tokens and, when they were sampled rather than picked, the distribution each was drawn from
    (`[len(tokens), vocab]`); None means each draft is deterministic (a point mass), which the verifier
    handles exactly too.

    `pending`: the drafts are row `row` of these device drafts, not read on the host; `tokens` then holds one
    placeholder per draft (their count is known) until the verify step reads them."""

    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None
    pending: DeviceDrafts | None = None
    row: int = 0


@runtime_checkable
class SpeculativeDecoder(Protocol):
    method: str
    num_speculative_tokens: int
    aux_layers: tuple[int, ...]  # target layers whose *input* hidden states `observe` needs (empty: none)
    # whether it reads a greedy verify step launched behind it, before the host has (`read_unverified` and `settle`
    # of spec/chain.py)
    reads_unverified: bool

    def observe(self, items: Sequence[tuple[str, TargetStates]]) -> None:
        """Take the target states of newly committed positions, for the requests of one step."""

    def propose(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        """Up to `max_drafts` draft tokens per request (possibly none)."""

    def release(self, request_id: str) -> None:
        """Forget a request (finished, aborted, preempted)."""

    def capture_graphs(self, max_num_seqs: int) -> None:
        """Record its fixed-shape steps as CUDA graphs (the engine calls it when it captures its own); a drafter
        without any does nothing."""


@dataclass
class TargetInfo:
    """What a drafter may need from the target: its config, weights it shares, and where it was loaded from."""

    config: Any  # m3sdk.model.config.ModelConfig
    embed_tokens: nn.Module | None = None
    lm_head: nn.Module | None = None
    checkpoint: str | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    model: Any = None  # the target model (mtp runs its embedding, rotary, lm_head and attention backend)
    kv_spec: Any = None  # the target's KVCacheSpec (mtp sizes its own one-layer pool like it)
    num_cache_pages: int = 0
    max_num_seqs: int = 1  # requests a step may hold (eagle3 sizes its draft cache pool and graph buckets by it)
    max_model_len: int = 0  # 0: the draft checkpoint's max_position_embeddings bounds a request's draft cache


register = DRAFTERS.register


def build_drafter(config: SpecConfig, target: TargetInfo) -> SpeculativeDecoder:
    """The drafter named by `config.method`."""
    return DRAFTERS.get(config.method)(config, target)
