"""A tensor-parallel worker rank: `python -m m3sdk.parallel.worker SPEC_JSON` (started by TensorParallel.launch).

It loads its shard, then mirrors rank 0's forwards until told to stop (or until rank 0's end of the pipe closes):
eager steps through its model, replayed steps through its own DecodeGraphs (parallel/graphs.py says why they stay
in lockstep with rank 0's).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from m3sdk.cache.kv_pool import KVPool
from m3sdk.graphs import DecodeGraphs
from m3sdk.parallel.group import (
    ERROR,
    GRAPHS,
    HELLO,
    KV,
    READY,
    REPLAY,
    STEP,
    STOP,
    init_distributed,
    release_graphs,
    step_numel,
    unpack_step,
)
from m3sdk.parallel.sharding import Shard, load_rank

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


def serve(spec: dict, conn: Connection) -> None:
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    conn.send((HELLO, None))
    init_distributed(spec["rank"], spec["world"], spec["store_port"], device)
    try:
        model = load_rank(spec["model"], Shard(spec["rank"], spec["world"], spec["expert_parallel"]), device,
                          _DTYPES[spec["dtype"]], spec["attn_backend"], spec["load_format"], spec["seed"],
                          spec["quantization"])
    except Exception:
        conn.send((ERROR, traceback.format_exc()))
        raise
    conn.send((READY, None))
    kv = graphs = None
    while True:
        try:
            kind, body = conn.recv()
        except EOFError:  # rank 0 is gone
            break
        if kind == STOP:
            break
        if kind == KV:
            kv = KVPool(dataclasses.replace(body, device=device))
        elif kind == STEP:
            t, b, width, max_seqlen_q, max_context_len, aux_layers, n_logits, n_override = body
            input_ids, meta, indices = _receive(device, t, b, width, max_seqlen_q, max_context_len, n_logits)
            override = _receive_override(model, n_override) if n_override else None
            # with indices: its part of lm_head's all-gather
            model(input_ids, meta, kv, indices, aux_layers, embed_override=override)
        elif kind == REPLAY:  # rank 0's static inputs straight into this rank's identical buffer
            key, num_updates = body
            dist.broadcast(graphs.used_inputs(num_updates), src=0)
            graphs.replay(key, num_updates)
        elif kind == GRAPHS:
            try:
                graphs = DecodeGraphs(model, kv, device=device, **body)
            except Exception:
                conn.send((ERROR, traceback.format_exc()))
                raise
            conn.send((READY, None))
    if graphs is not None:
        release_graphs(graphs)
    dist.destroy_process_group()


def _receive(device: torch.device, t: int, b: int, width: int, max_seqlen_q: int, max_context_len: int, n_tail: int):
    """A step's inputs, broadcast by rank 0 (group.pack_step)."""
    payload = torch.empty(step_numel(t, b, width, n_tail), dtype=torch.int64, device=device)
    dist.broadcast(payload, src=0)
    return unpack_step(payload, t, b, width, max_seqlen_q, max_context_len, n_tail)


def _receive_override(model: torch.nn.Module, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An image step's `n` rows and their input embeddings, broadcast by rank 0 (TensorParallel.mirror)."""
    weight = model.embed_tokens.weight
    rows = torch.empty(n, dtype=torch.int64, device=weight.device)
    embeds = torch.empty((n, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    dist.broadcast(rows, src=0)
    dist.broadcast(embeds, src=0)
    return rows, embeds


def main() -> None:
    spec = json.loads(sys.argv[1])
    serve(spec, Connection(spec["fd"]))
    # Like multiprocessing's children, skip the interpreter's teardown once the rank has left its process group:
    # destroying torch.distributed's background threads there can abort (std::terminate, exit -6) a worker that
    # finished cleanly; seen under load in the 2-rank CPU test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
