"""The core's extension points: a finish listener's page hold keeps a finished request's pages out of use until it
completes (the engine thread waits for nothing meanwhile, and a request that needs those pages waits for them
rather than failing), and a step observer sees every step's plan and, when it asks, each layer's attention."""

import threading
import time
from concurrent.futures import Future

from m3sdk.cache.page_pool import pages_for
from m3sdk.config import EngineConfig
from m3sdk.core import build_core
from m3sdk.params import SamplingParams


def config(checkpoint, **overrides) -> EngineConfig:
    return EngineConfig(**{**dict(model=str(checkpoint), device="cpu", max_model_len=64, max_num_seqs=2,
                                  max_num_batched_tokens=64, kv_cache_memory=1 << 21), **overrides})


def submit(core, rid: str, first: int) -> None:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = list(range(first, first + 40))
    core.submit(core.new_request(rid, prompt, params, len(prompt) + params.max_tokens))


def wait_for(predicate, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_page_hold_keeps_pages_until_it_completes(engine_checkpoint):
    probe = build_core(config(engine_checkpoint))
    page_bytes = probe.cache.kv.spec.bytes_per_page
    # room for one 64-token sequence: a second request needs the pages the first one's hold keeps
    core = build_core(config(engine_checkpoint, kv_cache_memory=page_bytes * pages_for(64)))
    holds: dict[str, Future] = {}

    def listener(request, reason):
        holds[request.request_id] = Future()
        return holds[request.request_id]

    finished, dead = [], []
    core.start(lambda chunks: finished.extend(c.request_id for c in chunks if c.finish_reason),
               dead.append, finish_listeners=[listener])
    try:
        submit(core, "a", 10)
        wait_for(lambda: finished == ["a"])
        stats = core.stats()
        assert stats["pages_free"] == stats["pages_total"] - pages_for(48)  # a's pages, held
        submit(core, "b", 100)  # needs them: it waits
        time.sleep(0.3)
        assert finished == ["a"] and not dead and core.stats()["waiting"] == 1
        holds["a"].set_result(None)
        wait_for(lambda: finished == ["a", "b"])
        assert not dead
        holds["b"].set_result(None)
        wait_for(lambda: core.stats()["pages_free"] == core.stats()["pages_total"])
    finally:
        core.stop()
        core.join(10)


def test_a_step_observer_sees_plans_and_layers(engine_checkpoint):
    seen: list[tuple[str, object]] = []
    done = threading.Event()

    class Observer:
        def on_step(self, plan):
            seen.append(("plan", [s.request.request_id for s in plan.scheduled]))
            # the layer hook only for steps that sample "x": the others run as they would
            if any(s.request.request_id == "x" and s.samples for s in plan.scheduled):
                return lambda layer: seen.append(("layer", layer))
            return None

    core = build_core(config(engine_checkpoint), observers=[Observer()])
    core.start(lambda chunks: any(c.finish_reason for c in chunks) and done.set(), lambda exc: done.set())
    try:
        submit(core, "x", 10)
        assert done.wait(30)
    finally:
        core.stop()
        core.join(10)
    num_layers = core.runner.model.config.num_layers
    plans = [v for k, v in seen if k == "plan"]
    layers = [v for k, v in seen if k == "layer"]
    assert plans and all(p == ["x"] for p in plans)
    assert layers == list(range(num_layers)) * (len(layers) // num_layers) and len(layers) >= num_layers
