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
# The sampler computes in float32. These bounds keep every step of it finite for any logits a model gives
# (|logit| well under 1e4): logits / temperature, logits / or * repetition_penalty, and a nucleus mass that
# float32 can tell apart from 0. A value outside them is refused rather than clamped, so that a request never
# samples from a distribution other than the one it names.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3  # besides 0 (greedy)
MIN_TOP_P = 1e-6
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-2, 1e2
MAX_SEED = 2**64 - 1  # what a remote prefill carries (proto uint64); the local sampler uses the same 64 bits
MAX_TOP_K = 2**31 - 1  # proto int32; any top_k >= the vocabulary means "off"
MAX_N = 128  # choices per prompt
MAX_LOGIT_BIAS = 100.0  # |bias| bound (OpenAI's): +100 all but forces a token, -100 all but bans it


def short_repr(value: object, limit: int = 80) -> str:
    """repr() cut to `limit` characters: an error message must not echo a megabyte the caller sent."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _int(name: str, value: object) -> int:
    # bool is an int subclass in Python, but `max_tokens=True` is a caller bug, not a request for 1 token.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidRequestError(f"{name} must be an int, got {short_repr(value)}")
    return int(value)


def _float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {short_repr(value)}")
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling and stopping parameters of one request.

    Frozen so that a validated object stays valid: derive variants with `replace(**overrides)`.
    `temperature == 0` means greedy (penalties still apply, the other filters are moot). Values that float32
    sampling cannot represent are refused: temperature 0 or in [1e-3, 1e3], top_p >= 1e-6, repetition_penalty in
    [0.01, 100], seed in [0, 2**64). n is in [1, 128], min_tokens in [0, max_tokens], logit_bias values in
    [-100, 100] (its ids are checked against the vocabulary by the engine), prompt_logprobs in [0, 20].
    `timeout`: seconds from submission after which the request ends with finish_reason "timeout" and its pages
    return (None: no deadline).
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
    n: int = 1  # choices from the one prompt (sharing its prefill); choice i is seeded with seed + i
    min_tokens: int = 0  # eos and stop_token_ids are masked, and stop strings not matched, before this many tokens
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    include_stop_str_in_output: bool = False  # the stop string that ended the text stays at its end
    skip_special_tokens: bool = True  # special tokens leave no text
    # per prompt token (but the first): its logprob given its prefix and the top-n alternatives (computed at prefill,
    # which then does not read those positions from the prefix cache)
    prompt_logprobs: int | None = None
    timeout: float | None = None  # seconds from submission; past it the request ends with "timeout"
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
        if self.temperature != 0 and not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequestError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                                      f"got {self.temperature}")
        if not MIN_TOP_P <= self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in [{MIN_TOP_P}, 1], got {self.top_p}")
        set_(self, "top_k", _int("top_k", self.top_k))
        if self.top_k < -1 or self.top_k == 0 or self.top_k > MAX_TOP_K:
            raise InvalidRequestError(f"top_k must be -1 (off) or in [1, {MAX_TOP_K}], got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                                      f"{MAX_REPETITION_PENALTY}], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        self._check_stop()
        if not isinstance(self.stop_token_ids, list | tuple):
            raise InvalidRequestError(f"stop_token_ids must be a list of ints, got {short_repr(self.stop_token_ids)}")
        set_(self, "stop_token_ids", [_int("stop_token_ids", t) for t in self.stop_token_ids])
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be >= 0, got {short_repr(self.stop_token_ids)}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {short_repr(self.ignore_eos)}")
        if self.seed is not None:
            set_(self, "seed", _int("seed", self.seed))
            if not 0 <= self.seed <= MAX_SEED:
                raise InvalidRequestError(f"seed must be in [0, 2**64), got {short_repr(self.seed)}")
        if self.logprobs is not None:
            set_(self, "logprobs", _int("logprobs", self.logprobs))
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        set_(self, "n", _int("n", self.n))
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {self.n}")
        set_(self, "min_tokens", _int("min_tokens", self.min_tokens))
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        self._check_logit_bias()
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a bool, got {short_repr(getattr(self, name))}")
        if self.prompt_logprobs is not None:
            set_(self, "prompt_logprobs", _int("prompt_logprobs", self.prompt_logprobs))
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise InvalidRequestError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], "
                                          f"got {self.prompt_logprobs}")
        if self.timeout is not None:
            set_(self, "timeout", _float("timeout", self.timeout))
            if self.timeout <= 0:
                raise InvalidRequestError(f"timeout must be a positive number of seconds, got {self.timeout}")
        if self.structured_output is not None:
            set_(self, "structured_output", StructuredOutput.of(self.structured_output))

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, Mapping):
            raise InvalidRequestError(f"logit_bias must be a dict of token id -> bias, got {short_repr(bias)}")
        clean: dict[int, float] = {}
        for key, value in bias.items():
            # JSON objects have string keys: "42" is token 42
            token = int(key) if isinstance(key, str) and key.strip().isdecimal() else key
            token = _int("a logit_bias token id", token)
            if token < 0:
                raise InvalidRequestError(f"logit_bias token ids must be >= 0, got {token}")
            value = _float(f"logit_bias[{token}]", value)
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                          f"got {value} for token {token}")
            clean[token] = value
        object.__setattr__(self, "logit_bias", clean or None)

    def _check_stop(self) -> None:
        stop = self.stop
        if stop is None:
            return
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequestError(f"stop must be a str or a list of str, got {short_repr(self.stop)}")
        if any(s == "" for s in stop):
            raise InvalidRequestError("stop must not contain an empty string (it would match at once)")
        for s in stop:
            check_text("stop", s)
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

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of an `n`-choice request: one choice, seeded with seed + index (mod
        2**64), and prompt logprobs asked of choice 0 alone (they are the same for every choice)."""
        if index == 0:
            return self.replace(n=1)
        seed = None if self.seed is None else (self.seed + index) % (MAX_SEED + 1)
        return self.replace(n=1, seed=seed, prompt_logprobs=None)

    def replace(self, **overrides: object) -> SamplingParams:
        """A validated copy with some fields changed; an unknown field is a TypeError."""
        return dataclasses.replace(self, **overrides)

    def check_against(self, vocab_size: int, max_stop_strings: int | None = None,
                      max_stop_length: int | None = None) -> None:
        """Refuse stop_token_ids and logit_bias ids outside the model's vocabulary, and more than `max_stop` stop
        strings (or stop token ids) or a stop string longer than `max_stop_length` characters (the engine's limits:
        every step's text is matched against them)."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or ())):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise InvalidRequestError(f"{name} token ids {short_repr(bad)} are outside the vocabulary "
                                          f"(size {vocab_size})")
        if max_stop_strings is not None:
            for name, values in (("stop", self.stop_strings), ("stop_token_ids", self.stop_token_ids)):
                if len(values) > max_stop_strings:
                    raise InvalidRequestError(f"{name} holds {len(values)} entries; the engine takes at most "
                                              f"{max_stop_strings} (EngineConfig.max_stop_strings)")
        if max_stop_length is not None:
            longest = max(map(len, self.stop_strings), default=0)
            if longest > max_stop_length:
                raise InvalidRequestError(f"stop holds a string of {longest} characters; the engine takes at most "
                                          f"{max_stop_length} (EngineConfig.max_stop_length)")


def check_text(name: str, text: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate cannot be encoded, tokenized or matched)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{name} is not valid Unicode: {e.reason} at index {e.start}") from None
