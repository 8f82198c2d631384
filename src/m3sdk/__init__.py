"""m3sdk: an embedded async engine serving MiniMax-M3.

    async with Engine() as engine:
        done = await engine.generate("The capital of France is", SamplingParams(max_tokens=32))
"""

from typing import TYPE_CHECKING, Any

from m3sdk.chat.completion import ChatCompletion, ChatCompletionChunk
from m3sdk.config import EngineConfig
from m3sdk.errors import (
    CheckpointError,
    ConfigError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    M3Error,
    PrefillNodeError,
)
from m3sdk.params import SamplingParams
from m3sdk.request import Choice, Chunk, Completion, Timings, Usage
from m3sdk.structured import StructuredOutput

if TYPE_CHECKING:
    from m3sdk.engine import Engine

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "CheckpointError",
    "Choice",
    "Chunk",
    "Completion",
    "ConfigError",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineOverloadedError",
    "InvalidRequestError",
    "M3Error",
    "PrefillNodeError",
    "SamplingParams",
    "StructuredOutput",
    "Timings",
    "Usage",
]


def __getattr__(name: str) -> Any:
    # the engine (torch, the kernels) loads on first use: `from m3sdk import EngineConfig` stays light
    if name == "Engine":
        from m3sdk.engine import Engine

        return Engine
    raise AttributeError(f"module 'm3sdk' has no attribute {name!r}")
