"""The engine loop while requests wait on remote prefills (Contract 6): a request parked on a prefill node holds
its pages and a `max_num_seqs` slot, so the requests queued behind it may have nothing to run for a while. The
core must wait for the node's outcome (its inbox wake), neither dying nor spinning."""

import threading
import time

from m3sdk.config import EngineConfig
from m3sdk.core import EngineCore
from m3sdk.params import SamplingParams
from m3sdk.request import Request
from m3sdk.sampler import SamplingState
from m3sdk.tokenizer import TextStream


class FailingNode:
    """The scheduler/core face of RemotePrefill: takes the first request, and its prefill fails on `fail()`
    (prefill_fallback "local": the core then prefills it itself)."""

    fallback = "local"

    def __init__(self, wake):
        self.wake = wake
        self.taken: list[Request] = []
        self.failed: list[Request] = []

    def wants(self, request: Request, cached_tokens: int) -> bool:
        return not self.taken

    def start(self, request: Request, pages: list[int], num_cached_pages: int) -> None:
        self.taken.append(request)

    def fail(self) -> None:
        self.failed = list(self.taken)
        self.wake()

    def poll(self):
        out, self.failed = [(r, ConnectionError("node down")) for r in self.failed], []
        return out

    def close(self) -> None:
        pass


def request(core: EngineCore, rid: str) -> Request:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    ids = list(b"remote prefill " + rid.encode())
    r = Request(rid, ids, params, len(ids) + params.max_tokens)
    r.sampling = SamplingState(params, ids)
    r.text = TextStream(core.tokenizer, params, ids)
    return r


def test_requests_queued_behind_a_remote_prefill_wait_for_its_outcome(engine_checkpoint):
    core = EngineCore.build(EngineConfig(model=str(engine_checkpoint), device="cpu", max_model_len=128,
                                         max_num_seqs=1, max_num_batched_tokens=64, kv_cache_memory=1 << 21))
    node = FailingNode(core._wake)
    core.remote = core.scheduler.remote = node
    schedules = 0
    schedule = core.scheduler.schedule

    def counting_schedule():
        nonlocal schedules
        schedules += 1
        return schedule()

    core.scheduler.schedule = counting_schedule
    finished, dead, done = [], [], threading.Event()

    def emit(chunks):
        finished.extend(c.request_id for c in chunks if c.finish_reason is not None)
        if len(finished) == 2:
            done.set()

    core.start(emit, lambda exc: (dead.append(exc), done.set()))
    try:
        core.submit(request(core, "a"))
        core.submit(request(core, "b"))  # waits for a's slot (max_num_seqs=1) while a waits on its node
        time.sleep(0.3)
        assert not dead, dead
        assert node.taken and node.taken[0].request_id == "a"
        assert schedules < 10, f"the loop spins while nothing can run ({schedules} schedules in 0.3 s)"
        node.fail()
        assert done.wait(30)
        assert not dead, dead
        assert sorted(finished) == ["a", "b"]
    finally:
        core.stop()
        core.join(10)
