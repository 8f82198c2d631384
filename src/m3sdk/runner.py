"""ModelRunner: owns the device tensors (model, KV pool) and turns a StepPlan into one forward (Contract 2)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from m3sdk.attention.base import AttentionMetadata, to_device
from m3sdk.cache.manager import CacheManager
from m3sdk.graphs import DecodeGraphs
from m3sdk.model.minimax_m3 import MiniMaxM3ForCausalLM
from m3sdk.scheduler.base import StepPlan

# Stands in `Request.token_ids` for a token sampled by the step still running on the device (overlapped steps).
PLACEHOLDER = -1


class Carry(NamedTuple):
    """Tokens still on the device that stand as PLACEHOLDERs at the end of a request's scheduled ids: the previous
    overlapped step's sampled tokens (one per request), or a drafter's drafts (spec/decoding.py: several).
    `rows[id(request)]` is the row of the request's first such token; the others follow it."""

    tokens: torch.Tensor
    rows: dict[int, int]


class ModelRunner:
    def __init__(self, model: MiniMaxM3ForCausalLM, cache: CacheManager, device: torch.device):
        self.model = model
        self.cache = cache
        self.device = device
        self.graphs: DecodeGraphs | None = None  # captured decode/verify steps (m3sdk/graphs.py): the core sets it

    def run(self, plan: StepPlan, carry: Carry | None = None) -> torch.Tensor | None:
        """Write every scheduled token's K/V (and index keys) and return float32 logits [N, vocab], one row per
        request that samples, in plan order (None when none samples, e.g. all are mid-prefill chunks).
        `carry`: the overlapped step's tokens still on the device (see `Carry`)."""
        return self.forward(plan, carry=carry)[0]

    def forward(self, plan: StepPlan, num_logits: Sequence[int] | None = None, aux_layers: Sequence[int] = (),
                carry: Carry | None = None) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """`run` with what speculative decoding needs: logits at the last `num_logits[i]` positions of entry i
        (default: 1 if it samples, else 0), and (hidden [T, H], aux [T, len(aux_layers) * H] or None) of every
        scheduled token."""
        dst: list[int] = []
        src: list[int] = []
        ids: list[int] = []
        counts, context_lens, tables, logits_rows = [], [], [], []
        for i, (request, n, samples) in enumerate(plan.scheduled):
            start = request.num_computed_tokens
            ids += request.token_ids[start:start + n]
            if carry is not None and ids[-1] == PLACEHOLDER:  # tokens still on the device (see Carry)
                m = 1
                while m < n and ids[-1 - m] == PLACEHOLDER:
                    m += 1
                first = carry.rows[id(request)]
                dst += range(len(ids) - m, len(ids))
                src += range(first, first + m)
            counts.append(n)
            context_lens.append(start + n)
            tables.append(self.cache.page_table(request))
            m = int(samples) if num_logits is None else num_logits[i]
            logits_rows.extend(range(len(ids) - m, len(ids)))
        meta = AttentionMetadata.build(counts, context_lens, tables, device=self.device)
        # the carried tokens' destination and source rows ride in the ids' upload
        packed = to_device(ids + dst + src, torch.int64, self.device)
        input_ids = packed[:len(ids)]
        if dst:
            input_ids[packed[len(ids):len(ids) + len(dst)]] = carry.tokens[packed[len(ids) + len(dst):]]
        q = self.graphs.query_len(meta, aux_layers) if self.graphs is not None and logits_rows else None
        if q is not None:
            # sequences shorter than q are padded inside the graph: each token's row there, when any is
            dest = None if len(ids) == len(counts) * q else to_device(
                [i * q + j for i, n in enumerate(counts) for j in range(n)], torch.int64, self.device)
            rows = None if len(logits_rows) == len(ids) else to_device(logits_rows, torch.int64, self.device)
            hidden, logits, aux = self.graphs.run(input_ids, meta, q, dest, rows)
            return logits, hidden, aux
        indices = to_device(logits_rows, torch.int64, self.device) if logits_rows else None
        hidden, logits, *aux = self.model(input_ids, meta, self.cache.kv, indices, aux_layers)
        return logits, hidden, aux[0] if aux else None
