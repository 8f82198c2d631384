"""The engine loop while an admission holds requests (remote prefill, Contract 6): a request taken by a prefill
node holds its pages outside the scheduler, so the loop may have nothing to run for a while. The core must wait
for the admission's outcome (its wake), neither dying nor spinning, and must not wait for the admission's work
itself."""

import threading
import time

from m3sdk.cache.page_pool import PAGE_SIZE
from m3sdk.config import EngineConfig
from m3sdk.core import EngineCore, Handover, build_core
from m3sdk.params import SamplingParams
from m3sdk.request import Request, RequestStatus


class FailingNode:
    """An Admission that takes the first request (its pages for the whole prompt), whose prefill fails on `fail()`
    (prefill_fallback "local": the core then prefills it itself, into the same pages)."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.taken: list[Request] = []
        self.held: dict[str, Request] = {}
        self.failed: list[Request] = []
        self.closed = False

    def admit(self, request: Request) -> bool:
        if self.taken:
            return False
        cached = len(self.core.cache.match_prefix(request)) * PAGE_SIZE
        assert self.core.cache.allocate(request, request.num_tokens - cached, self.core.cache.match_prefix(request))
        request.num_computed_tokens = cached
        self.taken.append(request)
        self.held[request.request_id] = request
        return True

    def get(self, request_id):
        return self.held.get(request_id)

    def live_requests(self):
        return list(self.held.values())

    def drop(self, request, reason):
        del self.held[request.request_id]
        request.status = RequestStatus.FINISHED
        self.core.cache.free(request)

    def fail(self) -> None:
        self.failed = list(self.held.values())
        self.core.wake()

    def handovers(self):
        out, self.failed = [Handover(self.held.pop(r.request_id)) for r in self.failed], []
        return out

    def stats(self):
        return {"held": len(self.held)}

    def close(self) -> None:
        self.closed = True


def request(core: EngineCore, rid: str) -> Request:
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    ids = list(b"remote prefill " + rid.encode())
    return core.new_request(rid, ids, params, len(ids) + params.max_tokens)


def test_requests_held_by_an_admission_wait_for_its_outcome(engine_checkpoint):
    schedules = 0

    class Counting:  # a step observer
        def on_step(self, plan):
            nonlocal schedules
            schedules += 1

    core = build_core(EngineConfig(model=str(engine_checkpoint), device="cpu", max_model_len=128, max_num_seqs=1,
                                   max_num_batched_tokens=64, kv_cache_memory=1 << 21), observers=[Counting()])
    node = FailingNode(core)
    finished, dead, done = [], [], threading.Event()

    def emit(chunks):
        finished.extend(c.request_id for c in chunks if c.finish_reason is not None)
        if len(finished) == 2:
            done.set()

    core.start(emit, lambda exc: (dead.append(exc), done.set()), admission=node)
    try:
        core.submit(request(core, "a"))  # taken by the node
        core.submit(request(core, "b"))  # runs here meanwhile
        deadline = time.monotonic() + 30
        while finished != ["b"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert finished == ["b"] and not dead, (finished, dead)
        steps = schedules
        time.sleep(0.3)
        assert node.taken and node.taken[0].request_id == "a"
        assert core.stats()["held"] == 1  # the admission's own stats are the core's
        assert schedules - steps < 3, f"the loop spins while nothing can run ({schedules - steps} steps in 0.3 s)"
        node.fail()
        assert done.wait(30)
        assert not dead, dead
        assert sorted(finished) == ["a", "b"]
        assert core.stats()["pages_free"] == core.stats()["pages_total"]
    finally:
        core.stop()
        core.join(10)
    assert node.closed


def test_an_abort_of_a_held_request_reaches_its_admission(engine_checkpoint):
    core = build_core(EngineConfig(model=str(engine_checkpoint), device="cpu", max_model_len=128, max_num_seqs=2,
                                   kv_cache_memory=1 << 21))
    node = FailingNode(core)
    chunks, done = [], threading.Event()
    core.start(lambda cs: (chunks.extend(cs), done.set()), lambda exc: None, admission=node)
    try:
        core.submit(request(core, "a"))
        core.abort("a")
        assert done.wait(10)
        assert [(c.request_id, c.finish_reason) for c in chunks] == [("a", "abort")]
        assert not node.held
        deadline = time.monotonic() + 10
        while core.stats()["pages_free"] != core.stats()["pages_total"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.stats()["pages_free"] == core.stats()["pages_total"]
    finally:
        core.stop()
        core.join(10)
