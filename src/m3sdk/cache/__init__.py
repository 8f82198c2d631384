"""Paged KV cache: tensors (kv_pool), ref-counted pages (page_pool), prefix reuse (prefix_cache), manager."""

from m3sdk.cache.manager import CacheManager, PagedCacheManager

# EngineConfig.cache_manager names one of these.
CACHE_MANAGERS: dict[str, type] = {"paged": PagedCacheManager}

__all__ = ["CACHE_MANAGERS", "CacheManager", "PagedCacheManager"]
