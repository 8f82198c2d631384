"""CUDA graphs under tensor parallel: rank 0's DecodeGraphs, mirrored to the workers step by step.

The all-reduces and the logits all-gather inside a graph are NCCL collectives, so every rank must capture the same
graphs and replay them in the same order. Each worker therefore builds the same DecodeGraphs (same batch buckets, query
lengths, aux layers and max_model_len: the same captures at start, in the same order), and each replay of rank 0 goes to
the workers first: a REPLAY message names the graph (and its count of page-table entries), and one broadcast of the used
prefix of rank 0's static input bytes (token ids, positions, slots, context lengths, the page-table entries that
changed: graphs.DecodeGraphs.inputs) lands in each worker's identical buffer, so the worker updates its own page table
the same way and replays its graph of the same key on the same inputs; a key first seen mid-serving is captured on every
rank at that same step. Rank 0's model calls inside DecodeGraphs (its captures, or the eager steps off CUDA) are not
mirrored as eager steps (only the runner's own calls are): the workers make them themselves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from m3sdk.cache.kv_pool import KVPool
from m3sdk.graphs import DecodeGraphs
from m3sdk.model.minimax_m3 import MiniMaxM3ForCausalLM
from m3sdk.parallel.group import GRAPHS, READY, REPLAY, TensorParallel


class MirroredGraphs(DecodeGraphs):
    """Rank 0's DecodeGraphs under tensor parallel (same arguments, after the TensorParallel handle)."""

    def __init__(self, tp: TensorParallel, model: MiniMaxM3ForCausalLM, kv: KVPool, max_num_seqs: int,
                 max_model_len: int, device: torch.device, query_lens: Sequence[int] = (1,),
                 aux_layers: Sequence[int] = ()):
        self.tp = tp
        tp.graphs = self  # released at shutdown, before the process group goes
        tp.use_kv(kv)
        tp.send((GRAPHS, dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len, query_lens=tuple(query_lens),
                              aux_layers=tuple(aux_layers))))
        super().__init__(model, kv, max_num_seqs, max_model_len, device, query_lens, aux_layers)
        tp.expect(READY)  # the workers captured the same graphs

    def replay(self, key: tuple[int, int, int], num_updates: int | None = None) -> tuple:
        n = self._num_updates if num_updates is None else num_updates
        self.tp.send((REPLAY, (key, n)))
        dist.broadcast(self.used_inputs(n), src=0)
        return super().replay(key, n)
