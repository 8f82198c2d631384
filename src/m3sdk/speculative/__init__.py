"""Speculative decoding: the SpeculativeDecoder seam, the shared verifier, and the ngram / eagle3 / mtp drafters.

Light to import: the drafters' modules (torch) load on first use, so EngineConfig can name a method's registry."""

from typing import Any

__all__ = ["SpecConfig", "SpeculativeDecoder", "build_drafter"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from m3sdk.speculative import base

        return getattr(base, name)
    raise AttributeError(f"module 'm3sdk.speculative' has no attribute {name!r}")
