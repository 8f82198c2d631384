"""Schedulers, picked by name in EngineConfig.scheduler (or passed as a factory)."""

from collections.abc import Callable
from typing import Any

from m3sdk.registry import Registry
from m3sdk.scheduler.base import EncoderWork, Scheduled, Scheduler, StepPlan
from m3sdk.scheduler.continuous import ContinuousScheduler

# name -> factory (cache_manager, config, encoder work or None) -> Scheduler
SCHEDULERS: Registry[Callable[[Any, Any, Any], Scheduler]] = Registry("scheduler")
SCHEDULERS.register("continuous")(ContinuousScheduler.from_config)

__all__ = ["SCHEDULERS", "ContinuousScheduler", "EncoderWork", "Scheduled", "Scheduler", "StepPlan"]
