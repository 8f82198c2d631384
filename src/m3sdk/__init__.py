"""m3sdk: an embedded async engine serving MiniMax-M3.

    async with Engine() as engine:
        done = await engine.generate("The capital of France is", SamplingParams(max_tokens=32))
"""

from m3sdk.chat.completion import ChatCompletion, ChatCompletionChunk
from m3sdk.config import EngineConfig
from m3sdk.engine import Engine
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
from m3sdk.request import Chunk, Completion, Timings, Usage
from m3sdk.structured import StructuredOutput

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "CheckpointError",
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
