"""The continuous-batching scheduler driven step by step without a model: each sampled request gets a token that
is a function of its whole token history (as a model's greedy output would be), so recompute after preemption
must reproduce it."""

import zlib

from m3sdk.cache.kv_pool import KVCacheSpec
from m3sdk.cache.manager import PagedCacheManager
from m3sdk.params import SamplingParams
from m3sdk.request import Request
from m3sdk.scheduler import ContinuousScheduler, StepPlan


def make(num_pages: int, max_num_seqs: int = 8, budget: int = 64, prefix: bool = True):
    spec = KVCacheSpec(num_pages=num_pages, num_layers=1, num_kv_heads=1, head_dim=4, sparse_layers=(),
                       index_head_dim=4, kv_dtype="fp32", index_dtype="fp32")
    cache = PagedCacheManager(spec, enable_prefix_caching=prefix)
    return cache, ContinuousScheduler(cache, max_num_seqs, budget)


def req(rid: str, prompt_len: int, max_tokens: int, priority: int = 0) -> Request:
    prompt = [(7 * i + zlib.crc32(rid.encode())) % 50 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), prompt_len + max_tokens, priority)


def fake_token(tokens: list[int]) -> int:
    return zlib.crc32(bytes(str(tokens), "ascii")) % 1000


def step(sched: ContinuousScheduler) -> StepPlan:
    plan = sched.schedule()
    sched.update(plan)
    for s in plan.scheduled:
        if s.samples:
            r = s.request
            r.append_token(fake_token(r.token_ids))
            if r.num_tokens >= r.max_total_tokens:
                sched.finish(r, "length")
    return plan


def run_all(sched: ContinuousScheduler, max_steps: int = 10_000) -> list[StepPlan]:
    plans = []
    while sched.num_running or sched.num_waiting:
        plans.append(step(sched))
        assert len(plans) < max_steps, "no progress"
    return plans


def expected(r: Request) -> list[int]:
    tokens = list(r.prompt_token_ids)
    while len(tokens) < r.max_total_tokens:
        tokens.append(fake_token(tokens))
    return tokens


def test_chunked_prefill_within_budget_mixed_with_decodes():
    cache, sched = make(64, budget=32)
    a, b = req("a", 10, 20), req("b", 100, 3)
    sched.add(a)
    step(sched)  # a's prefill
    sched.add(b)
    plans = run_all(sched)
    assert all(p.num_tokens <= 32 for p in plans)
    # b's 100-token prompt is chunked, and a decodes in every one of those steps
    b_chunks = [n for p in plans for (r, n, _) in p.scheduled if r is b and n > 1]
    assert len(b_chunks) == 4 and sum(b_chunks) == 100
    assert all(any(r is a for r, _, _ in p.scheduled) for p in plans[:4])
    assert a.token_ids == expected(a) and b.token_ids == expected(b)
    assert cache.num_free_pages() == 64


def test_max_num_seqs_and_fcfs_admission():
    cache, sched = make(64, max_num_seqs=2)
    reqs = [req(f"r{i}", 5, 4) for i in range(5)]
    for r in reqs:
        sched.add(r)
    order = []
    while sched.num_running or sched.num_waiting:
        plan = step(sched)
        assert sched.num_running <= 2
        order += [r.request_id for r, n, _ in plan.scheduled if n == 5]
    assert order == [r.request_id for r in reqs]


def test_lower_priority_value_runs_first():
    cache, sched = make(64, max_num_seqs=1)
    low, high = req("low", 5, 2, priority=5), req("high", 5, 2, priority=-1)
    sched.add(low)
    sched.add(high)
    first = sched.schedule()
    assert [r.request_id for r, _, _ in first.scheduled] == ["high"]


def test_preemption_under_tiny_cache_completes_with_same_tokens():
    # 8 pages = 128 slots; 6 requests growing to 40 tokens each (3 pages) cannot all fit
    cache, sched = make(8, max_num_seqs=6, budget=64)
    reqs = [req(f"r{i}", 12 + i, 28 - i) for i in range(6)]
    for r in reqs:
        sched.add(r)
    plans = run_all(sched)
    assert sum(len(p.preempted) for p in plans) > 0 and sched.num_preemptions > 0
    for r in reqs:
        assert r.is_finished and r.token_ids == expected(r)
    assert cache.num_free_pages() == 8 and all(n == 0 for n in cache.pool.ref_counts)


def test_preemption_with_priorities_keeps_the_first():
    cache, sched = make(6, max_num_seqs=4, budget=64, prefix=False)
    reqs = [req(f"r{i}", 16, 40, priority=i) for i in range(4)]
    for r in reqs:
        sched.add(r)
    plans = run_all(sched)
    preempted = {r.request_id for p in plans for r in p.preempted}
    assert "r0" not in preempted and preempted
    assert all(r.token_ids == expected(r) for r in reqs)
    assert cache.num_free_pages() == 6


def test_abort_waiting_and_running_frees_pages():
    cache, sched = make(16, max_num_seqs=1)
    a, b = req("a", 20, 10), req("b", 20, 10)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.get("a") is a and a.num_computed_tokens == 20
    sched.finish(b, "abort")  # waiting
    sched.finish(a, "abort")  # running
    sched.finish(a, "abort")  # idempotent
    assert (sched.num_running, sched.num_waiting) == (0, 0) and sched.get("a") is None
    assert a.finish_reason == "abort" and cache.num_free_pages() == 16


def test_recompute_hits_its_own_cached_pages():
    cache, sched = make(10, max_num_seqs=4, budget=64)
    reqs = [req(f"r{i}", 40, 24) for i in range(3)]
    for r in reqs:
        sched.add(r)
    run_all(sched)
    assert sched.num_preemptions > 0
    assert cache.stats()["prefix_cache_hits"] > 0
    assert all(r.token_ids == expected(r) for r in reqs)
