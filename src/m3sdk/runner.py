"""ModelRunner: owns the device tensors (model, KV pool) and turns a StepPlan into one forward (Contract 2)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from m3sdk.attention.base import AttentionMetadata
from m3sdk.cache.kv_pool import KVPool
from m3sdk.cache.manager import CacheManager
from m3sdk.graphs import DecodeGraphs
from m3sdk.images import ImagePrompts
from m3sdk.model.minimax_m3 import MiniMaxM3ForCausalLM
from m3sdk.scheduler.base import StepPlan
from m3sdk.staging import to_device

# Stands in `Request.token_ids` for a token sampled by the step still running on the device (overlapped steps).
PLACEHOLDER = -1


class Carry(NamedTuple):
    """Tokens still on the device that stand as PLACEHOLDERs at the end of a request's scheduled ids: the previous
    overlapped step's sampled tokens (one per request), or a drafter's drafts (speculative/decoding.py: several).
    `rows[id(request)]` is the row of the request's first such token; the others follow it."""

    tokens: torch.Tensor
    rows: dict[int, int]


class StepMirror(Protocol):
    """Told of every eager model call before the runner makes it (tensor parallel: the worker ranks make the same
    call, parallel/group.py TensorParallel)."""

    def mirror(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVPool,
               logits_indices: torch.Tensor | None, aux_layers: Sequence[int],
               embed_override: tuple[torch.Tensor, torch.Tensor] | None = None) -> None: ...


class ModelRunner:
    def __init__(self, model: MiniMaxM3ForCausalLM, cache: CacheManager, device: torch.device,
                 graphs: DecodeGraphs | None = None, mirror: StepMirror | None = None,
                 images: ImagePrompts | None = None):
        self.model = model
        self.cache = cache
        self.device = device
        self.graphs = graphs  # captured decode/verify steps (m3sdk/graphs.py), or None: every step eager
        self.mirror = mirror
        self.images = images  # the vision encoder's side of image prompts, or None: a text-only engine

    def run(self, plan: StepPlan, carry: Carry | None = None, layer_hook: Callable[[int], None] | None = None,
            aux_layers: Sequence[int] = ()) -> torch.Tensor | None:
        """Write every scheduled token's K/V (and index keys) and return float32 logits [N, vocab], one row per
        request that samples, in plan order (None when none samples, e.g. all are mid-prefill chunks).
        `carry`: the overlapped step's tokens still on the device (see `Carry`); `aux_layers`: computed and
        dropped (a speculating engine's plain steps name its drafter's, so they replay its graphs)."""
        return self.forward(plan, aux_layers=aux_layers, carry=carry, layer_hook=layer_hook)[0]

    def forward(self, plan: StepPlan, num_logits: Sequence[int] | None = None, aux_layers: Sequence[int] = (),
                carry: Carry | None = None, layer_hook: Callable[[int], None] | None = None
                ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """`run` with what speculative decoding needs: logits at the last `num_logits[i]` positions of entry i
        (default: 1 if it samples, else 0), and (hidden [T, H], aux [T, len(aux_layers) * H] or None) of every
        scheduled token. `layer_hook(i)` runs after layer i's attention; such a step runs eagerly (a replayed graph
        calls no Python)."""
        dst: list[int] = []
        src: list[int] = []
        ids: list[int] = []
        counts, context_lens, tables, logits_rows = [], [], [], []
        with_images = []
        for i, (request, n, samples) in enumerate(plan.scheduled):
            start = request.num_computed_tokens
            if request.images:
                with_images.append((request, start, n, len(ids)))
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
        override = self.images.overrides(with_images) if with_images and self.images is not None else None
        key = None
        if self.graphs is not None and logits_rows and layer_hook is None and override is None:
            key = self.graphs.key(len(counts), max(counts), max(context_lens), max(map(len, tables)), aux_layers)
        if key is not None:
            return self._replay(key, ids, counts, context_lens, tables, logits_rows, dst, src, carry)
        meta = AttentionMetadata.build(counts, context_lens, tables, device=self.device)
        # the carried tokens' destination and source rows ride in the ids' upload
        packed = to_device(ids + dst + src, torch.int64, self.device)
        input_ids = packed[:len(ids)]
        if dst:
            input_ids[packed[len(ids):len(ids) + len(dst)]] = carry.tokens[packed[len(ids) + len(dst):]]
        indices = to_device(logits_rows, torch.int64, self.device) if logits_rows else None
        if self.mirror is not None:
            self.mirror.mirror(input_ids, meta, self.cache.kv, indices, aux_layers, override)
        hidden, logits, *aux = self.model(input_ids, meta, self.cache.kv, indices, aux_layers, layer_hook,
                                          embed_override=override)
        return logits, hidden, aux[0] if aux else None

    def _replay(self, key: tuple[int, int, int], ids: list[int], counts: list[int], context_lens: list[int],
                tables: list[list[int]], logits_rows: list[int], dst: list[int], src: list[int], carry: Carry | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A step that fits the graphs: its host lists go straight into the graph's static inputs (one upload,
        graphs.DecodeGraphs.stage), the carried tokens are copied in on the device, and the graph replays.
        Sequence i's token j sits at row i * q + j there; the outputs are gathered back to the step's order."""
        q = key[2]
        padded = len(ids) != len(counts) * q
        rows = [i * q + j for i, c in enumerate(counts) for j in range(c)] if padded else None
        logit_rows = [rows[r] for r in logits_rows] if padded else logits_rows
        carried = [rows[r] for r in dst] if padded else dst
        whole = logit_rows == list(range(len(ids)))  # every token's logits, in row order: a prefix of the rows
        # (an overlapped decode step whose batch kept its order: row i takes the step before's token i, one copy)
        aligned = bool(dst) and carried == src == list(range(len(src)))
        extra = ([] if aligned else carried + src) + (rows or []) + ([] if whole else logit_rows)
        lists = self.graphs.stage(key, ids, counts, context_lens, tables, extra)
        d = len(dst)
        if aligned:
            self.graphs.input_ids[:d].copy_(carry.tokens[:d])
        elif dst:
            self.graphs.input_ids.index_copy_(0, lists[:d], carry.tokens.index_select(0, lists[d:2 * d]))
        hidden, logits, *aux = self.graphs.replay(key)
        at = 0 if aligned else 2 * d
        if padded:
            order = lists[at:at + len(rows)]
            at += len(rows)
            hidden, aux = hidden[order], [a[order] for a in aux]
        else:
            hidden, aux = hidden[:len(ids)], [a[:len(ids)] for a in aux]
        logits = logits[:len(ids)] if whole else logits[lists[at:at + len(logit_rows)]]
        return logits, hidden, aux[0] if aux else None
