"""Schedulers, picked by name in EngineConfig.scheduler (or passed as an instance)."""

from m3sdk.scheduler.base import Scheduled, Scheduler, StepPlan
from m3sdk.scheduler.continuous import ContinuousScheduler

# name -> factory (cache_manager, config) -> Scheduler
SCHEDULERS = {"continuous": ContinuousScheduler.from_config}

__all__ = ["SCHEDULERS", "ContinuousScheduler", "Scheduled", "Scheduler", "StepPlan"]
