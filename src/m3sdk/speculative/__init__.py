"""Speculative decoding: the SpeculativeDecoder seam, the shared verifier, and the ngram / eagle3 / mtp drafters."""

from m3sdk.speculative.base import SpecConfig, SpeculativeDecoder, build_drafter

__all__ = ["SpecConfig", "SpeculativeDecoder", "build_drafter"]
