"""ChainDrafter: the drafting loop shared by the model-based drafters (EAGLE3, MTP).

Both run a small draft network with its own KV cache. Draft entry t reads a hidden state for position t and the
embedding of token t + 1, and predicts token t + 2:
  - for a committed position, the hidden state comes from the target (`observe`): these entries are kept;
  - along a proposal chain, it is the draft's own output at the previous entry: these entries are dropped
    after `propose` (the verified positions are rebuilt from the target's states at the next `observe`).
So a verify step that accepted a drafts costs the draft one forward over a + 1 entries, and proposing k tokens
k - 1 more forwards of one entry per request. A subclass supplies the network: `new_context`, `run`, `tokens`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from m3sdk.runner import PLACEHOLDER
from m3sdk.speculative.base import DeviceDrafts, DraftRequest, Proposal, TargetStates
from m3sdk.staging import HostCopy


class DraftContext(Protocol):
    """A request's draft cache: entries for positions `first ... end - 1`; setting `length` truncates."""

    first: int
    length: int

    @property
    def end(self) -> int: ...


@dataclass
class DraftSeq:
    ctx: DraftContext
    next_token: int  # the first draft, read at the last committed entry
    hidden: torch.Tensor  # that entry's output hidden [H]: the chain's next input
    # or, when the drafter drafted ahead (`read_ahead`), its k drafts: row i of those (next_token / hidden unused)
    ahead: tuple[DeviceDrafts, int] | None = None


@dataclass
class Unverified:
    """A verify step's draft read launched before the host read the step (`ChainDrafter.read_unverified`): its
    drafts (context i is request_ids[i]'s), and the step's argmax followed by the drafts it verified, on their way
    to the host."""

    drafts: DeviceDrafts
    request_ids: list[str]
    verdict: HostCopy


class ChainDrafter(ABC):
    method: str
    aux_layers: tuple[int, ...] = ()
    reads_unverified = True

    def __init__(self, num_speculative_tokens: int):
        self.num_speculative_tokens = num_speculative_tokens
        self._seqs: dict[str, DraftSeq] = {}
        # the last observe's drafts: the only ones still where its replay left them (the next replay of the same
        # graph overwrites them)
        self._latest: DeviceDrafts | None = None
        self._verdict = HostCopy()  # `read_unverified`'s copy of a step's argmax and drafts for the host

    # -- the network (subclass) --

    @abstractmethod
    def new_context(self, first: int, device: torch.device) -> DraftContext | None:
        """An empty cache starting at position `first` (None: no room; the request is not drafted for)."""

    def drop_context(self, ctx: DraftContext) -> None:  # noqa: B027 (optional hook: most contexts hold nothing)
        """Give back what the context holds."""

    def capture_graphs(self, max_num_seqs: int) -> None:  # noqa: B027 (optional: a network with fixed-shape steps)
        """Record its fixed-shape steps as CUDA graphs (none by default)."""

    def run(self, ctxs: list[DraftContext], counts: list[int], token_ids: torch.Tensor, hidden: torch.Tensor,
            positions: torch.Tensor, from_target: bool) -> torch.Tensor:
        """One draft forward over flat entries (counts[i] of them appended to ctxs[i]): token ids [N], hidden
        inputs [N, *] (the target's states when `from_target`, else the draft's outputs), absolute positions
        [N] -> output hidden [N, H] (what `tokens` reads and the chain feeds back). The default `read` and `chain`
        run the network through this and `tokens`; a subclass that overrides both needs neither."""
        raise NotImplementedError

    def tokens(self, out: torch.Tensor) -> list[int]:
        """Greedy draft tokens (target vocabulary ids) from output hidden rows [M, H]."""
        raise NotImplementedError

    def has_room(self, ctx: DraftContext, n: int) -> bool:
        """Whether the context can take n more entries (a fixed-size draft cache says no near its end)."""
        return True

    def chain(self, seqs: list[DraftSeq], steps: int) -> list[list[int]]:
        """`steps` more draft tokens per sequence, each read at the previous one's entry (its token, its output
        hidden); the chain's entries are dropped after. One `run` per step (a subclass may fuse the steps)."""
        committed = [seq.ctx.length for seq in seqs]
        hidden = torch.stack([seq.hidden for seq in seqs])
        dev = hidden.device
        drafted = [[seq.next_token] for seq in seqs]
        for _ in range(steps):
            tokens = torch.tensor([d[-1] for d in drafted], device=dev)
            positions = torch.tensor([seq.ctx.end for seq in seqs], device=dev)
            hidden = self.run([seq.ctx for seq in seqs], [1] * len(seqs), tokens, hidden, positions,
                              from_target=False)
            for d, t in zip(drafted, self.tokens(hidden), strict=True):
                d.append(t)
        for seq, n in zip(seqs, committed, strict=True):
            seq.ctx.length = n
        return [d[1:] for d in drafted]

    def features(self, states: TargetStates) -> torch.Tensor:
        """The target states this drafter reads (their tensor: `states.of` picks the rows): aux layers when it
        asked for them, else the final hidden."""
        return states.aux if self.aux_layers else states.hidden

    # -- the loop --

    @torch.inference_mode()
    def observe(self, items: Sequence[tuple[str, TargetStates]]) -> None:
        """Draft entries for the committed positions of several requests: those of verify-sized steps (at most
        k + 1 entries) drafted ahead in one launch where the drafter can (`read_ahead`), the others (prefill chunks)
        in one eager forward, which then drafts their first token."""
        entries = []
        for rid, st in items:
            n = st.n
            if n == 0:
                continue
            seq = self._seqs.get(rid)
            if seq is None or seq.ctx.end != st.start:
                # new request, or a gap (prefix-cache hit, recompute): the draft context starts here
                self.release(rid)
                ctx = self.new_context(st.start, st.hidden.device)
                if ctx is None:
                    continue
                seq = self._seqs[rid] = DraftSeq(ctx, -1, st.hidden.new_empty(0))
            if not self.has_room(seq.ctx, n + self.num_speculative_tokens):
                # no room left for this and a chain's entries: the context is dropped, and the request's next
                # observe starts a new one there (weaker drafts, never wrong)
                self.release(rid)
                continue
            entries.append((rid, seq, st))
        if not entries:
            return
        short = [e for e in entries if e[2].n <= self.num_speculative_tokens + 1]
        ahead = self.read_ahead(*self._flat(short, rows=True)) if short else None
        if ahead is not None:
            self._latest = ahead
            for i, (_, seq, _) in enumerate(short):
                seq.ahead = (ahead, i)
            entries = [e for e in entries if e[2].n > self.num_speculative_tokens + 1]
            if not entries:
                return
        ctxs, counts, toks, feats, pos = self._flat(entries)
        last, tokens = self.read(ctxs, counts, toks, feats, pos)
        for (_, seq, _), token, row in zip(entries, tokens, last, strict=True):
            seq.next_token, seq.hidden, seq.ahead = token, row, None

    def _flat(self, entries: list[tuple[str, DraftSeq, TargetStates]], rows: bool = False
              ) -> tuple[list, list[int], list[int], torch.Tensor | tuple[torch.Tensor, list[int]], list[int]]:
        """Draft contexts, entry counts, next tokens, features and positions of these entries. Features: their rows
        in order [N, F], or with `rows` (features, each context's first row in them): the step's tensor itself
        when every entry's states are rows of it (what the core passes: no copy)."""
        ctxs, counts, toks, pos = [], [], [], []
        for _, seq, st in entries:
            ctxs.append(seq.ctx)
            counts.append(st.n)
            toks.extend(st.next_tokens)
            pos.extend(range(st.start, st.start + st.n))
        step = self.features(entries[0][2])
        if rows and all(self.features(st) is step for _, _, st in entries):
            return ctxs, counts, toks, (step, [st.row for _, _, st in entries]), pos
        feats = torch.cat([st.of(self.features(st)) for _, _, st in entries])
        if rows:
            return ctxs, counts, toks, (feats, [sum(counts[:i]) for i in range(len(counts))]), pos
        return ctxs, counts, toks, feats, pos

    def read_ahead(self, ctxs: list[DraftContext], counts: list[int], token_ids: list[int],
                   features: tuple[torch.Tensor, list[int]], positions: list[int]) -> DeviceDrafts | None:
        """`read` and the whole chain after it, launched on the device without waiting for it: k drafts per
        context, which the next `propose` hands over still on the device (so the engine's bookkeeping of the step
        runs while the device drafts). `features`: a tensor and each context's first row in it. None: not
        supported here, `read` then runs (the default)."""
        return None

    @torch.inference_mode()
    def read_unverified(self, items: Sequence[tuple[str, int, int, int, int]], logits: torch.Tensor,
                        features: torch.Tensor, drafts: torch.Tensor) -> Unverified | None:
        """The read of a greedy verify step launched right behind its forward, before the host has read the
        verdict (the drafter works out on the device how many drafts each request accepted: `launch_unverified`),
        so the device drafts the next step straight after verifying this one. `items`: per request (id, its
        first verify position, tokens verified n, its first row in the step's logits [T, V] and features [T, *],
        the flat index of its first draft in `drafts`, the flat drafts the step verified: the latest
        `read_ahead`'s). The step's argmax and those drafts leave for the host (`Unverified.verdict`). All or
        none: None where a request's context does not continue at that position or lacks room, or the drafter
        cannot; the step is then read and observed as usual."""
        ctxs = []
        for rid, start, n, _, _ in items:
            seq = self._seqs.get(rid)
            if seq is None or seq.ctx.end != start or not self.has_room(seq.ctx, n + self.num_speculative_tokens):
                return None
            ctxs.append(seq.ctx)
        read = self.launch_unverified(ctxs, items, logits, features, drafts)
        return None if read is None else Unverified(read, [item[0] for item in items], self._verdict)

    def launch_unverified(self, ctxs: list[DraftContext], items: Sequence[tuple[str, int, int, int, int]],
                          logits: torch.Tensor, features: torch.Tensor, drafts: torch.Tensor) -> DeviceDrafts | None:
        """`read_unverified`'s launch, which sends [argmax of logits | drafts] through `_verdict` before anything
        overwrites those drafts (None: not supported here, the default)."""
        return None

    def settle(self, read: Unverified, committed: dict[str, int]) -> None:
        """The host's verdict on a step read by `read_unverified`: each request's committed entries (1 + its
        accepted drafts, which the device counted alike); a request missing here finished meanwhile."""
        self._latest = read.drafts
        for i, rid in enumerate(read.request_ids):
            seq = self._seqs.get(rid)
            if seq is not None and rid in committed:
                seq.ctx.length += committed[rid]
                seq.ahead = (read.drafts, i)

    def read(self, ctxs: list[DraftContext], counts: list[int], token_ids: list[int], features: torch.Tensor,
             positions: list[int]) -> tuple[torch.Tensor, list[int]]:
        """One draft forward over committed entries (`run` from the target's features) -> each context's last
        output row [len(ctxs), *] (a copy: the other rows are not kept) and the first draft read there."""
        dev = features.device
        out = self.run(ctxs, counts, torch.tensor(token_ids, dtype=torch.long, device=dev), features,
                       torch.tensor(positions, dtype=torch.long, device=dev), from_target=True)
        last = out[torch.tensor(counts, device=dev).cumsum(0) - 1]
        return last, self.tokens(last)

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> list[Proposal]:
        out = [Proposal() for _ in requests]
        live, ahead = [], []
        for i, r in enumerate(requests):
            seq = self._seqs.get(r.request_id)
            # drafts start once the draft has read every committed position, the one before the last token
            if seq is not None and r.max_drafts > 0 and seq.ctx.end == len(r.token_ids) - 1:
                k = min(r.max_drafts, self.num_speculative_tokens)
                if seq.ahead is not None:
                    ahead.append((i, seq, k))
                else:
                    out[i].tokens.append(seq.next_token)
                    live.append((i, seq, k))
        for i, seq, k in ahead:  # drafted at an observe, still on the device: the verify forward reads them there
            drafts, row = seq.ahead
            # (only the last observe's: an earlier one's were overwritten by the drafter's later steps; a request
            # that sat out a step goes without drafts once, and its next step's observe drafts again)
            if drafts is self._latest:
                out[i] = Proposal([PLACEHOLDER] * k, pending=drafts, row=row)
        if not live:
            return out
        steps = max(k for _, _, k in live) - 1
        if steps:
            # every live chain grows by `steps` entries (chains that want fewer drafts ignore the extra tokens)
            for (i, _, k), toks in zip(live, self.chain([seq for _, seq, _ in live], steps), strict=True):
                out[i].tokens.extend(toks[:k - 1])
        return out

    def release(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.drop_context(seq.ctx)
