"""CUDA/HIP graphs of decode and verify steps: one forward per (batch bucket, context bucket, query length),
captured at start or on first use and replayed after, so a step costs one launch instead of hundreds.

A step where every sequence adds at most q tokens (q = 1: plain decode; q = 1 + k: a speculative verify step, the
last token plus up to k drafts, or a mix of those and plain decode rows) is copied into static buffers, each
sequence padded to q tokens at its end (its context grows by the padding, so its real queries keep their positions
and causal masks) and the batch padded up to the batch bucket. Padding tokens and sequences write
nowhere (slot -1: the cache-write kernels skip negative slots) and attend to their own q positions 0 .. q - 1 of a
real page (context q, whatever page their stale page-table row names), so they stay finite and touch no real
sequence; their rows are dropped. The host ints that pick kernel grids (`max_seqlen_q` = q, `max_context_len`) are
fixed per graph: the context bucket (a power of two, at least 4096, at most max_model_len) bounds every sequence of
the step, which is all the kernels need. With `aux_layers` (an EAGLE3 drafter reads them) every graph also returns
those layers' inputs. Graphs share one memory pool; they never run concurrently, and the outputs of a replay are
read before the next one. Off CUDA each step runs eagerly on the static buffers (`Replay`), so CPU tests check the
padded path (and tensor parallel's lockstep of graph steps, parallel/graphs.py).

Steps reach the graphs only from host lists (`stage`, then `replay`): one pinned upload per step fills every static
input (token ids, positions, slots, context lengths, each step's index lists, the page-table entries that changed)
at once, because on the serving host every torch call costs tens of microseconds and a copy per field from device
metadata made a batch-64 step host-bound. The static inputs are typed views of one byte buffer, so tensor parallel
mirrors a step with one broadcast of that buffer's used prefix (parallel/graphs.py).

The page table stays on the device between steps (`page_table`, one row per batch row, max_model_len wide): a
row remembers which page list it mirrors and how many of its entries it holds, and a step uploads only the
entries that list gained since (a decode step: a page every 16 tokens, none otherwise), so the host's work and the
upload of a step do not grow with the context (a 1M-token sequence holds 65,536 pages). A row whose list changed
(another request in that row, or a list the cache manager replaced: CacheManager.page_table) is uploaded whole
once. `replay` scatters the step's entries into the table before the graph runs.

A forward can be captured only if none of its ops syncs the host: the triton attention backend (its kernels take
the step's host ints from the metadata) and MoE layers that run the fused kernels or, while a capture runs, their
sync-free dense form (`layers.moe_experts`: float32, or widths the kernels do not tile).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from m3sdk.attention.base import PAGE_SIZE, AttentionMetadata
from m3sdk.attention.triton_backend import TritonAttentionBackend
from m3sdk.cache.kv_pool import KVPool
from m3sdk.model.minimax_m3 import MiniMaxM3ForCausalLM
from m3sdk.staging import UploadRing

MIN_CONTEXT_BUCKET = 4096


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16, up to max_num_seqs (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


def capture(fn: Callable[[], object], pool: object, device: torch.device) -> tuple[torch.cuda.CUDAGraph, object]:
    """A graph of `fn` (which reads and writes only static buffers) and its outputs. An eager run first, on a side
    stream: Triton compiles (and autotunes) outside the capture, on the buffers' real values."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class Replay:
    """A CUDA graph of `fn` (fixed shapes, static buffers) called to replay it; off CUDA, `fn` itself, run eagerly
    on the same buffers (so the fixed-shape path is the one CPU tests check)."""

    def __init__(self, fn: Callable[[], object], pool: object, device: torch.device):
        self.fn = fn
        self.graph, self.out = capture(fn, pool, device) if device.type == "cuda" else (None, None)
        self.calls = 0

    def __call__(self) -> object:
        self.calls += 1
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out


class DecodeGraphs:
    def __init__(self, model: MiniMaxM3ForCausalLM, kv: KVPool, max_num_seqs: int, max_model_len: int,
                 device: torch.device, query_lens: Sequence[int] = (1,), aux_layers: Sequence[int] = ()):
        self.model, self.kv, self.device = model, kv, device
        # first: `release` must work on an instance whose construction failed (tensor parallel releases it)
        self.graphs: dict[tuple[int, int, int], Replay] = {}
        self.replays = 0  # steps run through the graphs (the engine's stats report it)
        self.buckets = batch_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self.query_lens = tuple(sorted(set(query_lens)))
        self.aux_layers = tuple(aux_layers)
        n, width, qmax = max_num_seqs, -(-max_model_len // PAGE_SIZE), self.query_lens[-1]
        nq = n * qmax
        i64 = dict(dtype=torch.int64, device=device)
        # the static inputs, typed views of one byte buffer: int64 [ids | positions | slots | scratch (4 nq: a step's
        # index lists)], then int32 [context lens (n) | page-table updates: (flat index, page) pairs]; a step fills a
        # prefix of it (its updates: none on most decode steps, a whole table at most)
        self._off32 = 7 * nq * 8
        self.inputs = torch.zeros(self._off32 + (n + 2 * n * width) * 4, dtype=torch.uint8, device=device)
        whole64 = self.inputs[:self._off32].view(torch.int64)
        whole32 = self.inputs[self._off32:].view(torch.int32)
        self.input_ids, self.positions, self.slots, self.scratch = whole64.split([nq, nq, nq, 4 * nq])
        self.slots.fill_(-1)
        self.context_lens, self._updates = whole32.split([n, 2 * n * width])
        self.context_lens.fill_(1)
        # the page table every graph reads (entries past a sequence's pages are stale real pages: never read past its
        # context), and per row the page list it mirrors and how many of that list's entries it holds
        self.page_table = torch.zeros(n, width, dtype=torch.int32, device=device)
        self._rows: list[tuple[Sequence[int] | None, int]] = [(None, 0)] * n
        self._num_updates = 0  # page-table entries of the step staged last, applied by `replay`
        # per query length q: the fixed cu_seqlens (every sequence has q tokens) and the padding positions 0..q-1
        self.cu_seqlens = {q: torch.arange(0, (n + 1) * q, q, dtype=torch.int32, device=device)
                           for q in self.query_lens}
        self.pad_positions = {q: torch.arange(q, **i64).repeat(n) for q in self.query_lens}
        self._pad_positions_host = {q: torch.arange(q).repeat(n).numpy() for q in self.query_lens}
        self.rows = torch.arange(nq, **i64)
        # host staging for `stage`: three copies of the byte buffer, used in turn (an upload may still be queued
        # behind the step in flight when the next step is staged)
        self._staging = UploadRing(self.inputs.shape, torch.uint8, device, copies=3)
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        # every batch bucket of every query length at the smallest context bucket now (padding-only steps), so
        # serving never stalls on a capture at common sizes; other context buckets are captured when first needed
        # (a capture alone takes milliseconds), but on a GPU their kernels compile now: a bucket's host ints pick
        # its own split counts and top-k widths, and Triton compiling them at a request's first step at a new
        # context held that step for seconds. One eager padding-only step per bucket pair and query length.
        contexts = self.context_buckets()
        for q in self.query_lens:
            for bucket in self.buckets:
                self._pad(0, bucket, q)
                self.graphs[(bucket, contexts[0], q)] = Replay(
                    lambda b=bucket, q=q: self._forward(b, contexts[0], q), self.pool, device)
                for context in contexts[1:] if device.type == "cuda" else ():
                    self._forward(bucket, context, q)

    def release(self) -> None:
        """Drop every captured graph. Under tensor parallel this comes before the process group is destroyed: NCCL
        does not destroy a communicator while graphs that captured its collectives live."""
        self.graphs.clear()

    @staticmethod
    def supported(model: MiniMaxM3ForCausalLM) -> bool:
        """Whether a step of `model` can be captured: its attention backend must not sync the host (the torch
        backend's references read sequence lengths on the host: the engine then runs every step eagerly)."""
        return isinstance(model.attn_backend, TritonAttentionBackend)

    def context_buckets(self) -> list[int]:
        """Every context bucket a step can fall in, smallest first."""
        buckets, context = [], 1
        while not buckets or buckets[-1] < self.max_model_len:
            buckets.append(self._context_bucket(context))
            context = buckets[-1] + 1
        return buckets

    def _context_bucket(self, max_context_len: int) -> int:
        return min(max(MIN_CONTEXT_BUCKET, 1 << (max_context_len - 1).bit_length()), self.max_model_len)

    def key(self, batch: int, max_seqlen_q: int, max_context_len: int, width: int, aux_layers: Sequence[int] = ()
            ) -> tuple[int, int, int] | None:
        """The graph (batch bucket, context bucket, query length q) of a step of `batch` sequences that each add
        1 .. max_seqlen_q tokens (padded to q), or None when the step does not fit the graphs: a longer sequence
        (a prefill chunk), other aux layers, too many sequences, a padded context past max_model_len, or more
        pages than a page-table row holds."""
        q = next((q for q in self.query_lens if q >= max_seqlen_q), None)
        if (q is None or max_seqlen_q < 1 or tuple(aux_layers) != self.aux_layers or batch > self.buckets[-1]
                or max_context_len + q - 1 > self.max_model_len or width > self.page_table.shape[1]):
            return None
        return next(s for s in self.buckets if s >= batch), self._context_bucket(max_context_len + q - 1), q

    def stage(self, key: tuple[int, int, int], ids: Sequence[int], counts: Sequence[int],
              context_lens: Sequence[int], tables: Sequence[Sequence[int]], extra: Sequence[int] = ()
              ) -> torch.Tensor:
        """Fill the static inputs for graph `key` from a step's host lists, in one upload: per sequence i its
        `counts[i]` new tokens `ids` (flattened), its context after the step and its pages; sequence i's token j
        goes to row i * q + j (the graph's padded layout) and sequences past the batch are padding. `extra` int64
        values ride along: -> their device copy (`scratch`'s prefix), for index lists the step needs there.
        Every padding row writes nowhere; a padded sequence's extra rows sit after its tokens, in positions."""
        bucket, _, q = key
        b, n = len(counts), self.buckets[-1]
        host = self._staging.take()
        h8 = host.numpy()
        h64, h32 = h8[:self._off32].view(np.int64), h8[self._off32:].view(np.int32)
        nq = self.input_ids.shape[0]
        ids_h, pos_h, slot_h, extra_h = h64[:nq], h64[nq:2 * nq], h64[2 * nq:3 * nq], h64[3 * nq:]
        ctx_h = h32[:n]
        padded_ids, positions, slots = [], [], []
        k = 0
        for c, ctx, pages in zip(counts, context_lens, tables, strict=True):
            start = ctx - c
            padded_ids += ids[k:k + c]
            padded_ids += [0] * (q - c)
            k += c
            for p in range(start, start + c):
                slots.append(pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE)
            slots += [-1] * (q - c)
            positions += range(start, start + q)
        ids_h[:b * q] = padded_ids
        pos_h[:b * q] = positions
        slot_h[:b * q] = slots
        ids_h[b * q:bucket * q] = 0  # the staging may hold an earlier step's placeholders (-1) there
        pos_h[b * q:bucket * q] = self._pad_positions_host[q][b * q:bucket * q]
        slot_h[b * q:bucket * q] = -1
        ctx_h[:b] = [ctx + q - c for c, ctx in zip(counts, context_lens, strict=True)]
        ctx_h[b:bucket] = q
        self._num_updates = self._table_updates(tables, h32[n:].reshape(-1, 2))
        extra_h[:len(extra)] = extra
        self._staging.upload(self.inputs, self.used_inputs(self._num_updates).shape[0])
        return self.scratch[:len(extra)]

    def _table_updates(self, tables: Sequence[Sequence[int]], out: np.ndarray) -> int:
        """Write into `out` [*, 2] the (flat index, page) entries that bring rows 0 .. len(tables) - 1 of the device
        table to `tables` -> their count. A row that holds a prefix of the same list object gets that list's new
        entries only (page lists grow by appends: CacheManager.page_table); any other row gets its list whole."""
        width = self.page_table.shape[1]
        k = 0
        for i, pages in enumerate(tables):
            have, held = self._rows[i]
            if have is not pages or len(pages) < held:
                held = 0
            if (new := len(pages) - held) > 0:
                out[k:k + new, 0] = np.arange(i * width + held, i * width + len(pages))
                out[k:k + new, 1] = np.asarray(pages[held:], dtype=np.int32)
                k += new
            self._rows[i] = (pages, len(pages))
        return k

    def replay(self, key: tuple[int, int, int], num_updates: int | None = None) -> tuple:
        """Replay graph `key` (capturing it first if new) on the static inputs as they stand, after writing the
        page-table entries that the last `stage` uploaded, once (`num_updates` of them; tensor parallel's workers
        are told the count) -> its outputs (hidden, logits, *aux) over all bucket x q rows, views valid until the
        next replay."""
        self.apply_updates(self._num_updates if num_updates is None else num_updates)
        if key not in self.graphs:
            bucket, context, q = key
            self.graphs[key] = Replay(lambda: self._forward(bucket, context, q), self.pool, self.device)
        self.replays += 1
        return self.graphs[key]()

    def apply_updates(self, n: int) -> None:
        """Write the first `n` staged (flat index, page) entries into the device page table (stream-ordered after
        their upload, before the replay that reads them)."""
        if n:
            updates = self._updates[:2 * n].view(n, 2)
            self.page_table.view(-1)[updates[:, 0]] = updates[:, 1]
        self._num_updates = 0

    def used_inputs(self, num_updates: int) -> torch.Tensor:
        """The prefix of the static input bytes that a step with `num_updates` page-table entries reads (tensor
        parallel broadcasts it)."""
        return self.inputs[:self._off32 + (self.buckets[-1] + 2 * num_updates) * 4]

    def _pad(self, b: int, bucket: int, q: int) -> None:
        """Sequences b .. bucket - 1 are padding: no writes, q tokens at positions 0 .. q - 1, context q."""
        self.slots[b * q:bucket * q].fill_(-1)
        self.positions[b * q:bucket * q].copy_(self.pad_positions[q][b * q:bucket * q])
        self.context_lens[b:bucket].fill_(q)

    def _forward(self, bucket: int, context: int, q: int) -> tuple:
        t = bucket * q
        meta = AttentionMetadata(positions=self.positions[:t], slot_mapping=self.slots[:t],
                                 cu_seqlens_q=self.cu_seqlens[q][:bucket + 1], context_lens=self.context_lens[:bucket],
                                 page_table=self.page_table[:bucket], max_seqlen_q=q, max_context_len=context)
        return self.model(self.input_ids[:t], meta, self.kv, self.rows[:t], self.aux_layers)
