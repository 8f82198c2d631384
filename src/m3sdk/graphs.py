"""CUDA/HIP graphs of decode steps: one forward per (batch bucket, context bucket), captured on first use and
replayed after, so a decode step costs one launch instead of hundreds.

A decode step (every sequence adds one token and samples it) is copied into static buffers padded up to the
batch bucket. Padding rows write nowhere (slot -1: the cache-write kernels skip negative slots) and attend to one
key of a real page (context 1, whatever page their stale page-table row names), so they stay finite and touch
no real sequence; their logits are dropped. The host ints that pick kernel grids (`max_seqlen_q` = 1,
`max_context_len`) are fixed per graph: the context bucket (a power of two, at least 4096, at most
max_model_len) bounds every sequence of the step, which is all the kernels need. Graphs share one memory pool;
they never run concurrently, and the outputs of a replay are read (sampled) before the next one.
"""

from __future__ import annotations

import torch

from m3sdk.attention.base import PAGE_SIZE, AttentionMetadata
from m3sdk.cache.kv_pool import KVPool
from m3sdk.model.layers import fused_moe_fits
from m3sdk.model.minimax_m3 import MiniMaxM3ForCausalLM

MIN_CONTEXT_BUCKET = 4096


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16, up to max_num_seqs (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    def __init__(self, model: MiniMaxM3ForCausalLM, kv: KVPool, max_num_seqs: int, max_model_len: int,
                 device: torch.device):
        self.model, self.kv, self.device = model, kv, device
        self.buckets = batch_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        n, width = max_num_seqs, -(-max_model_len // PAGE_SIZE)
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slots = torch.full((n,), -1, **i64)
        self.cu_seqlens = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, **i64)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        # every batch bucket of the smallest context bucket now (padding-only steps), so serving never stalls on
        # a capture at common sizes; other context buckets are captured when first needed
        for bucket in self.buckets:
            self.graphs[(bucket, self._context_bucket(1))] = self._capture(bucket, self._context_bucket(1))

    @staticmethod
    def supported(model: MiniMaxM3ForCausalLM) -> bool:
        """Every op of the forward must run without a host sync: the MoE layers need the fused kernels."""
        c = model.config
        return not c.moe_layers or fused_moe_fits(c.hidden_size, c.moe_intermediate_size)

    def _context_bucket(self, max_context_len: int) -> int:
        return min(max(MIN_CONTEXT_BUCKET, 1 << (max_context_len - 1).bit_length()), self.max_model_len)

    def fits(self, meta: AttentionMetadata, num_logits: int) -> bool:
        """A pure decode step that samples every sequence, within the captured sizes."""
        b = meta.context_lens.shape[0]
        return (meta.max_seqlen_q == 1 and meta.positions.shape[0] == b == num_logits
                and b <= self.buckets[-1] and meta.max_context_len <= self.max_model_len
                and meta.page_table.shape[1] <= self.page_table.shape[1])

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [B, H], logits [B, V]) of a step that `fits`; views of the graph's outputs, valid until the
        next replay."""
        b = input_ids.shape[0]
        bucket = next(s for s in self.buckets if s >= b)
        context = self._context_bucket(meta.max_context_len)
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(meta.positions)
        self.slots[:b].copy_(meta.slot_mapping)
        self.slots[b:bucket].fill_(-1)
        self.context_lens[:b].copy_(meta.context_lens)
        self.context_lens[b:bucket].fill_(1)
        self.page_table[:b, :meta.page_table.shape[1]].copy_(meta.page_table)
        key = (bucket, context)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bucket, context)
        graph, hidden, logits = self.graphs[key]
        graph.replay()
        return hidden[:b], logits[:b]

    def _forward(self, bucket: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        meta = AttentionMetadata(positions=self.positions[:bucket], slot_mapping=self.slots[:bucket],
                                 cu_seqlens_q=self.cu_seqlens[:bucket + 1], context_lens=self.context_lens[:bucket],
                                 page_table=self.page_table[:bucket], max_seqlen_q=1, max_context_len=context)
        return self.model(self.input_ids[:bucket], meta, self.kv, self.rows[:bucket])

    def _capture(self, bucket: int, context: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        # an eager run first: Triton compiles (and autotunes) outside the capture, on the buffers' real values
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(bucket, context)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden, logits = self._forward(bucket, context)
        return graph, hidden, logits
