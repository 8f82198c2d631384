"""Attention over the paged KV cache: the metadata of a step, the backend seam, and its registry."""

from m3sdk.attention.base import AttentionBackend, AttentionMetadata, get_backend, register_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend", "register_backend"]
