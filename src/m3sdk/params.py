"""SamplingParams: what one request asks of the sampler and the stop logic, validated on creation."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from m3sdk.errors import InvalidRequestError
from m3sdk.structured import StructuredOutput

MAX_LOGPROBS = 20


def _int(name: str, value: object) -> int:
    # bool is an int subclass in Python, but `max_tokens=True` is a caller bug, not a request for 1 token.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidRequestError(f"{name} must be an int, got {value!r}")
    return int(value)


def _float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping parameters of one request.

    Frozen so that a validated object stays valid: derive variants with `replace(**overrides)`.
    `temperature == 0` means greedy (penalties still apply, the other filters are moot).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # vLLM semantics: over prompt + output; > 1 discourages
    presence_penalty: float = 0.0  # over the output only, subtracted once per seen token
    frequency_penalty: float = 0.0  # over the output only, subtracted once per occurrence
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # top-n logprobs per sampled token; 0 = only the sampled token's
    # the output must match this (a StructuredOutput, or {"json": schema} / {"regex": ...} / {"choice": [...]} /
    # {"grammar": EBNF}); the engine compiles it before queueing
    structured_output: StructuredOutput | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalize types (numpy scalars, ints for floats) in place once
        set_(self, "max_tokens", _int("max_tokens", self.max_tokens))
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            set_(self, name, _float(name, getattr(self, name)))
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        set_(self, "top_k", _int("top_k", self.top_k))
        if self.top_k < -1 or self.top_k == 0:
            raise InvalidRequestError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        self._check_stop()
        if not isinstance(self.stop_token_ids, list | tuple):
            raise InvalidRequestError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        set_(self, "stop_token_ids", [_int("stop_token_ids", t) for t in self.stop_token_ids])
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None:
            set_(self, "seed", _int("seed", self.seed))
        if self.logprobs is not None:
            set_(self, "logprobs", _int("logprobs", self.logprobs))
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.structured_output is not None:
            set_(self, "structured_output", StructuredOutput.of(self.structured_output))

    def _check_stop(self) -> None:
        stop = self.stop
        if stop is None:
            return
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequestError(f"stop must be a str or a list of str, got {self.stop!r}")
        if any(s == "" for s in stop):
            raise InvalidRequestError("stop must not contain an empty string (it would match at once)")
        if isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", list(self.stop))

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings as a tuple (empty when none)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0)

    def replace(self, **overrides: object) -> SamplingParams:
        """A validated copy with some fields changed; an unknown field is a TypeError."""
        return dataclasses.replace(self, **overrides)

    def check_against(self, vocab_size: int) -> None:
        """Refuse stop_token_ids outside the model's vocabulary."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"stop_token_ids {bad} are outside the vocabulary (size {vocab_size})")
