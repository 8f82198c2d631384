"""Paged KV cache: tensors (kv_pool), ref-counted pages (page_pool), prefix reuse (prefix_cache), manager."""

from m3sdk.cache.manager import CacheManager, PagedCacheManager
from m3sdk.registry import Registry

# EngineConfig.cache_manager names one of these: a class (spec, enable_prefix_caching) -> CacheManager.
CACHE_MANAGERS: Registry[type[CacheManager]] = Registry("cache manager")
CACHE_MANAGERS.register("paged")(PagedCacheManager)

__all__ = ["CACHE_MANAGERS", "CacheManager", "PagedCacheManager"]
