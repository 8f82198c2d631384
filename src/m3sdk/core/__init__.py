"""The engine core: a synchronous loop (engine_core.py) over schedule -> execute (executor.py) -> process
(output.py), wired by builder.py, with the extension points of hooks.py; the async face drives it through
handle.py's CoreHandle, in a thread (EngineCore) or in a process of its own (process.py: CoreProcess)."""

from m3sdk.core.builder import build_core
from m3sdk.core.engine_core import EngineCore
from m3sdk.core.handle import CoreHandle
from m3sdk.core.hooks import Admission, FinishListener, Handover, PageHold, StepObserver
from m3sdk.core.process import CoreProcess
from m3sdk.core.resolved import ResolvedConfig
from m3sdk.core.warmup import warm_up

__all__ = ["Admission", "CoreHandle", "CoreProcess", "EngineCore", "FinishListener", "Handover", "PageHold",
           "ResolvedConfig", "StepObserver", "build_core", "warm_up"]
