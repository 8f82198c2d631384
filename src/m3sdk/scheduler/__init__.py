"""Schedulers, picked by name in EngineConfig.scheduler (or passed as an instance)."""

from m3sdk.scheduler.base import Scheduled, Scheduler, StepPlan
from m3sdk.scheduler.continuous import ContinuousScheduler

SCHEDULERS: dict[str, type] = {"continuous": ContinuousScheduler}

__all__ = ["SCHEDULERS", "ContinuousScheduler", "Scheduled", "Scheduler", "StepPlan"]
