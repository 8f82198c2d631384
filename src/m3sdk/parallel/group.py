"""Tensor parallel at run time: rank 0 is the engine's own process; ranks 1..N-1 are worker processes.

Design (docs/serving.md): only rank 0 schedules. Rank 0's ModelRunner hands every eager forward to
`TensorParallel.mirror` before it runs it (the runner's StepMirror): a small header (token count, batch, page-table
width, host ints, aux layers) goes over a pipe, then the step's integer inputs (token ids, positions, slots,
cu_seqlens, context lengths, page table) go as one int64 tensor broadcast over the process group (NCCL between GPUs,
gloo on a CPU), and every rank runs the same forward. The row-parallel layers all-reduce their partial outputs
themselves (o_proj and each MLP/MoE: model/layers.py RowParallelLinear), which makes the hidden states identical on
every rank; lm_head is split over the vocabulary (sharding.VocabParallelHead), so every rank computes its slice of
the logits at the step's logits indices (broadcast too) and an all-gather joins them; rank 0 alone samples. Workers
hold their own KV pool of the same page count (its spec comes over the pipe before the first step) and never see
requests.

With CUDA graphs (parallel/graphs.py) every worker builds the same DecodeGraphs as rank 0, so all ranks capture the
same graphs, with the same collectives inside, in the same order; a step rank 0 replays goes to the workers as a
REPLAY message (the graph's key) and one broadcast of rank 0's static graph inputs, and each worker replays its own.

Workers are started with `python -m m3sdk.parallel.worker` (not multiprocessing's spawn, which would re-run the
application's main module), and talk to rank 0 over an inherited socket pair. One tensor-parallel engine per
process: torch.distributed's default group is process-wide.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from m3sdk.attention.base import AttentionMetadata
from m3sdk.cache.kv_pool import KVPool
from m3sdk.graphs import DecodeGraphs
from m3sdk.model.config import ModelConfig
from m3sdk.model.minimax_m3 import MiniMaxM3ForCausalLM
from m3sdk.parallel.sharding import Shard, check_divisible, load_rank

HELLO, READY, ERROR, STEP, KV, STOP = "hello", "ready", "error", "step", "kv", "stop"
GRAPHS, REPLAY = "graphs", "replay"  # build DecodeGraphs (its arguments); replay the graph of a step
_STARTUP_TIMEOUT_S = 600.0


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU after the engine's own (cuda:k -> cuda:k+r); the CPU for every rank."""
    if device.type == "cpu":
        return device
    return torch.device(device.type, (device.index or 0) + rank)


def init_distributed(rank: int, world: int, store_port: int, device: torch.device) -> None:
    store = dist.TCPStore("127.0.0.1", store_port, world, is_master=False, timeout=timedelta(seconds=300))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=300), device_id=device if device.type == "cuda" else None)


def pack_step(input_ids: torch.Tensor, meta: AttentionMetadata, tail: torch.Tensor | None) -> torch.Tensor:
    """One int64 tensor of an eager step's inputs; `tail`: its logits indices."""
    extra = [] if tail is None else [tail.long()]
    return torch.cat([input_ids, meta.positions, meta.slot_mapping, meta.cu_seqlens_q.long(), meta.context_lens.long(),
                      meta.page_table.long().flatten(), *extra])


def step_numel(t: int, b: int, width: int, n_tail: int) -> int:
    return 3 * t + 2 * b + 1 + b * width + max(n_tail, 0)


def unpack_step(payload: torch.Tensor, t: int, b: int, width: int, max_seqlen_q: int, max_context_len: int,
                n_tail: int) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor | None]:
    """`n_tail` -1: rank 0 packed no tail (None)."""
    ids, pos, slots, cu, ctx, table, tail = payload.split([t, t, t, b + 1, b, b * width, max(n_tail, 0)])
    meta = AttentionMetadata(positions=pos, slot_mapping=slots, cu_seqlens_q=cu.int(), context_lens=ctx.int(),
                             page_table=table.int().view(b, width), max_seqlen_q=max_seqlen_q,
                             max_context_len=max_context_len)
    return ids, meta, tail if n_tail >= 0 else None


def release_graphs(graphs: DecodeGraphs) -> None:
    """Destroy a rank's captured graphs once the device is done with them: NCCL destroys no communicator (not even
    on abort) while a graph that captured its collectives lives, so leaving the process group would hang."""
    if graphs.device.type == "cuda":
        torch.cuda.synchronize(graphs.device)
    graphs.release()


class TensorParallel:
    """Rank 0's side: the worker processes, their pipes, and `mirror`, which sends each eager forward to them."""

    def __init__(self, model: MiniMaxM3ForCausalLM, conns: list[Connection], procs: list[subprocess.Popen],
                 store: dist.Store):
        self.model = model
        self.conns = conns
        self.procs = procs
        self._store = store  # the rendezvous rank 0 hosts: alive until every worker has left the group
        self._kv: KVPool | None = None
        self._closed = False
        self.graphs: DecodeGraphs | None = None  # rank 0's MirroredGraphs, released before the group is destroyed

    @classmethod
    def launch(cls, path: str | Path, world: int, device: torch.device, dtype: torch.dtype, attn_backend: str,
               expert_parallel: bool = True, load_format: str = "auto", seed: int = 0,
               quantization: str = "none") -> TensorParallel:
        """Start ranks 1..world-1, join the process group, load rank 0's shard (`load_format` "dummy": make
        every rank's random shard from `seed`), every rank's in the served format of `quantization`; -> rank 0's
        handle."""
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized in this process: one tensor-parallel "
                               "engine per process")
        check_divisible(ModelConfig.from_pretrained(path), Shard(0, world, expert_parallel))
        device = rank_device(device, 0)  # "cuda" -> "cuda:0": NCCL's device_id wants an index
        if device.type == "cuda" and (device.index or 0) + world > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {world} needs GPUs {device} .. +{world - 1}; "
                             f"{torch.cuda.device_count()} visible")
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timedelta(seconds=300),
                               wait_for_workers=False)
        conns, procs = [], []
        try:
            for rank in range(1, world):
                parent, child = multiprocessing.Pipe()
                spec = {"rank": rank, "world": world, "store_port": store.port, "fd": child.fileno(),
                        "model": str(path), "device": str(rank_device(device, rank)), "dtype": str(dtype),
                        "attn_backend": attn_backend, "expert_parallel": expert_parallel,
                        "load_format": load_format, "seed": seed, "quantization": quantization,
                        "threads": torch.get_num_threads()}
                procs.append(subprocess.Popen([sys.executable, "-m", "m3sdk.parallel.worker", json.dumps(spec)],
                                              pass_fds=[child.fileno()], env=_worker_env()))
                child.close()
                conns.append(parent)
            _expect(conns, procs, HELLO)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0,
                                    world_size=world, timeout=timedelta(seconds=300),
                                    device_id=device if device.type == "cuda" else None)
            model = load_rank(path, Shard(0, world, expert_parallel), device, dtype, attn_backend, load_format, seed,
                              quantization)
            _expect(conns, procs, READY)
        except BaseException:
            _stop(conns, procs)
            raise
        return cls(model, conns, procs, store)

    def mirror(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVPool, logits_indices: torch.Tensor | None,
               aux_layers: Sequence[int], embed_override: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Send the workers the model call rank 0 is about to make (its arguments), so that every rank runs it.
        `embed_override` (an image step's rows and their input embeddings, which only rank 0's vision encoder
        computes) follows in two more broadcasts, the embeddings in the model's dtype."""
        self.use_kv(kv)
        b, width = meta.page_table.shape
        header = (input_ids.shape[0], b, width, meta.max_seqlen_q, meta.max_context_len, tuple(aux_layers),
                  -1 if logits_indices is None else logits_indices.shape[0],
                  0 if embed_override is None else embed_override[0].shape[0])
        self.send((STEP, header))
        dist.broadcast(pack_step(input_ids, meta, logits_indices), src=0)
        if embed_override is not None:
            rows, embeds = embed_override
            dist.broadcast(rows, src=0)
            dist.broadcast(embeds.to(self.model.embed_tokens.weight.dtype).contiguous(), src=0)

    def use_kv(self, kv: KVPool) -> None:
        """The workers' KV pools follow rank 0's: a new pool's spec goes over the pipe before its first use."""
        if kv is not self._kv:
            self.send((KV, dataclasses.replace(kv.spec, device="cpu")))
            self._kv = kv

    def send(self, message: tuple) -> None:
        for conn in self.conns:
            conn.send(message)

    def expect(self, kind: str) -> None:
        """Wait until every worker has sent `kind`; a worker's error or death raises."""
        _expect(self.conns, self.procs, kind)

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.graphs is not None:
            release_graphs(self.graphs)
        # the workers are told first and all ranks then leave the group together: NCCL's communicator teardown
        # waits for its peers, so leaving only after the workers had exited made every GPU shutdown wait out
        # the workers' 10 s kill (and, with the peer killed, hang in the teardown)
        _send_stop(self.conns)
        if dist.is_initialized():
            dist.destroy_process_group()
        _stop(self.conns, self.procs)


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # the m3sdk package's root, for source checkouts
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _expect(conns: list[Connection], procs: list[subprocess.Popen], kind: str) -> None:
    """Wait until every worker has sent `kind`; a worker's error or death raises at once."""
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    for rank, (conn, proc) in enumerate(zip(conns, procs, strict=True), start=1):
        while not conn.poll(0.05):
            if proc.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited with code {proc.returncode} while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel rank {rank} did not start in {_STARTUP_TIMEOUT_S:.0f} s")
        message = conn.recv()
        if message[0] == ERROR:
            raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{message[1]}")
        if message[0] != kind:
            raise RuntimeError(f"tensor-parallel rank {rank} sent {message[0]!r}, expected {kind!r}")


def _send_stop(conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send((STOP, None))
        except OSError:
            pass  # already gone


def _stop(conns: list[Connection], procs: list[subprocess.Popen]) -> None:
    _send_stop(conns)
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()  # stuck in a collective whose peer is gone
            proc.wait()
    for conn in conns:
        conn.close()
