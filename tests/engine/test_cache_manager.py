"""PagePool ref counts, block tables and the chained-hash prefix cache (no model needed: real KV tensors of a
one-layer spec)."""

import pytest

from m3sdk.cache.kv_pool import KVCacheSpec
from m3sdk.cache.manager import PagedCacheManager, num_pages_for_budget
from m3sdk.cache.prefix_cache import ROOT_HASH, page_hash
from m3sdk.params import SamplingParams
from m3sdk.request import Request


def make_cache(num_pages: int, prefix: bool = True) -> PagedCacheManager:
    spec = KVCacheSpec(num_pages=num_pages, num_layers=2, num_kv_heads=1, head_dim=8, sparse_layers=(1,),
                       index_head_dim=8, kv_dtype="fp32", index_dtype="fp32")
    return PagedCacheManager(spec, enable_prefix_caching=prefix)


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), max_total_tokens=len(tokens) + 8)


def prefill(cache: PagedCacheManager, r: Request) -> None:
    """Admit r whole (taking any cached prefix), as if the step ran."""
    prefix = cache.match_prefix(r)
    r.num_computed_tokens = len(prefix) * 16
    assert cache.allocate(r, r.num_tokens - r.num_computed_tokens, prefix)
    r.num_computed_tokens = r.num_tokens
    cache.commit(r)


def test_allocate_free_refcounts():
    cache = make_cache(8, prefix=False)
    a, b = req("a", list(range(20))), req("b", list(range(100, 133)))
    prefill(cache, a)
    prefill(cache, b)
    assert len(cache.page_table(a)) == 2 and len(cache.page_table(b)) == 3
    assert not set(cache.page_table(a)) & set(cache.page_table(b))
    assert cache.num_free_pages() == 3
    # 4 more pages do not fit: nothing is taken
    c = req("c", list(range(64)))
    assert not cache.allocate(c, 64)
    assert cache.num_free_pages() == 3 and cache.page_table(c) == []
    cache.free(a)
    cache.free(b)
    assert cache.num_free_pages() == 8 and all(n == 0 for n in cache.pool.ref_counts)


def test_kv_pool_sized_from_spec():
    cache = make_cache(5)
    assert cache.kv.k[0].shape[0] == 5 and cache.kv.index_k[0] is None and cache.kv.index_k[1].shape == (5, 16, 8)
    assert num_pages_for_budget(cache.kv.spec.bytes_per_page, 10 * cache.kv.spec.bytes_per_page + 1, 100) == 10
    assert num_pages_for_budget(cache.kv.spec.bytes_per_page, 1 << 40, 100) == 100


def test_prefix_hit_shares_full_pages_only():
    cache = make_cache(16)
    prompt = list(range(40))  # 2 full pages + 8 tokens
    a = req("a", prompt)
    prefill(cache, a)
    b = req("b", prompt[:32] + [7, 7, 7])
    hit = cache.match_prefix(b)
    assert hit == cache.page_table(a)[:2]  # the partial third page is never shared
    prefill(cache, b)
    assert cache.page_table(b)[:2] == hit and cache.page_table(b)[2] != cache.page_table(a)[2]
    assert cache.pool.ref_counts[hit[0]] == 2
    assert cache.stats()["prefix_cache_hits"] == 32
    # the last token is always computed: a prompt that is exactly cached pages reuses one page less
    c = req("c", prompt[:32])
    assert cache.match_prefix(c) == hit[:1]


def test_chained_hash_depends_on_parent():
    cache = make_cache(16)
    a = req("a", list(range(33)))
    prefill(cache, a)
    # same second page, different first page: no hit at all
    b = req("b", [999] + list(range(1, 33)))
    assert cache.match_prefix(b) == []
    assert page_hash(ROOT_HASH, range(16)) != page_hash(page_hash(ROOT_HASH, range(16)), range(16))


def test_pages_registered_only_after_the_step_ran():
    cache = make_cache(16)
    prompt = list(range(48))
    a, b = req("a", prompt), req("b", prompt)
    # both admitted in one step: b must not see a's pages, they are not written yet
    assert cache.allocate(a, 48, cache.match_prefix(a))
    assert cache.match_prefix(b) == []
    assert cache.allocate(b, 48, [])
    a.num_computed_tokens = b.num_computed_tokens = 48
    cache.commit(a)
    cache.commit(b)  # same hashes: b's pages stay private
    cache.free(a)
    cache.free(b)
    assert cache.num_free_pages() == 16 and cache.stats()["pages_cached"] == 3


def test_generated_tokens_fill_pages_that_become_cached():
    cache = make_cache(16)
    a = req("a", list(range(10)))
    prefill(cache, a)
    for t in range(10):
        a.append_token(100 + t)
        assert cache.allocate(a, 1)
        a.num_computed_tokens += 1
        cache.commit(a)
    assert cache.stats()["pages_cached"] == 1
    b = req("b", a.token_ids[:16] + [5])
    assert cache.match_prefix(b) == cache.page_table(a)[:1]


def test_lru_eviction_of_idle_pages():
    cache = make_cache(6)
    a = req("a", list(range(49)))  # 3 full pages + 1
    prefill(cache, a)
    pa = cache.page_table(a)
    cache.free(a)
    assert cache.num_free_pages() == 6 and cache.stats()["pages_cached"] == 3
    # truly free pages are used before any cached page is evicted
    b = req("b", list(range(500, 548)))
    prefill(cache, b)
    assert not set(cache.page_table(b)) & set(pa[:3])
    cache.free(b)
    # a's pages are the least recently used: they go, b's stay
    c = req("c", list(range(1000, 1048)))
    prefill(cache, c)
    assert cache.match_prefix(req("a2", list(range(49)))) == []
    assert len(cache.match_prefix(req("b2", list(range(500, 549))))) == 3


def test_eviction_order_keeps_recent_prefix():
    cache = make_cache(5)
    a = req("a", list(range(33)))  # pages: 2 full + 1 partial
    prefill(cache, a)
    pa = cache.page_table(a)
    cache.free(a)  # idle: pa[0], pa[1] cached; pa[2] free
    b = req("b", list(range(200, 200 + 16 * 3 + 1)))  # needs 4 pages: 3 free + 1 evicted (a's tail page)
    prefill(cache, b)
    assert pa[1] in cache.page_table(b) and pa[0] not in cache.page_table(b)
    assert cache.match_prefix(req("c", list(range(33)))) == [pa[0]]


@pytest.mark.parametrize("prefix", [True, False])
def test_every_page_free_after_mixed_use(prefix):
    cache = make_cache(12, prefix)
    reqs = [req(str(i), [i % 3] * (5 + 7 * i)) for i in range(6)]
    live = []
    for r in reqs:
        if cache.num_free_pages() < 4:
            cache.free(live.pop(0))
        prefill(cache, r)
        live.append(r)
    for r in live:
        cache.free(r)
    assert cache.num_free_pages() == 12 and all(n == 0 for n in cache.pool.ref_counts)


def test_truncate_returns_pages_past_the_kept_tokens():
    cache = make_cache(8)
    a = req("a", list(range(20)))
    prefill(cache, a)
    a.token_ids += [5] * 20  # e.g. draft tokens scheduled with the next step
    assert cache.allocate(a, 21)
    assert len(cache.page_table(a)) == 3 and cache.num_free_pages() == 5
    del a.token_ids[21:]  # drafts rejected
    cache.truncate(a, 21)
    assert len(cache.page_table(a)) == 2 and cache.num_free_pages() == 6
    a.num_computed_tokens = 21
    cache.commit(a)
    cache.free(a)
    assert cache.num_free_pages() == 8 and cache.stats()["pages_cached"] == 1


def test_pages_released_more_often_than_taken_raise_and_change_nothing():
    cache = make_cache(4, prefix=False)
    a = req("a", list(range(20)))
    prefill(cache, a)
    held = cache.retain(a)
    cache.free(a)
    assert cache.num_free_pages() == 2  # the retained hold keeps them
    cache.release_pages(held)
    assert cache.num_free_pages() == 4
    with pytest.raises(RuntimeError, match="more often than taken"):
        cache.release_pages(held)
    assert cache.num_free_pages() == 4
