"""DRAFTERS: the speculative methods by name. A light module: EngineConfig checks a method's name against it
without importing a drafter (or torch)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from m3sdk.registry import Registry

# (SpecConfig, TargetInfo) -> SpeculativeDecoder (speculative/base.py)
Builder = Callable[[Any, Any], Any]
# the built-in drafters register themselves when their module is imported
DRAFTERS: Registry[Builder] = Registry("speculative method", builtin={
    m: f"m3sdk.speculative.{m}" for m in ("ngram", "eagle3", "mtp")})
