"""Structured outputs: a request's constraint (a JSON schema, a regex, a choice of strings or an EBNF grammar),
compiled by xgrammar, and the per-request matcher that turns it into a token bitmask at each step.

Ownership: one `GrammarCompiler` per engine (built from the checkpoint's tokenizer) compiles in the caller's thread
before the request is queued, and caches compiled grammars by constraint; each request gets a `Grammar` of its
own (an xgrammar matcher), advanced by the engine thread as its tokens are accepted (`SamplingState.append`). The
sampler fills one bitmask row per constrained row and applies it to the logits after the forward (outside any
CUDA graph); the verifier of speculative decoding fills one row per draft position, walking the matcher over the
drafts and rolling it back.

Why xgrammar (over llguidance): on m3-tiny's tokenizer its per-step mask costs 2-7 us against llguidance's 7-33
us, it compiles every constraint kind here natively (llguidance takes Lark, not EBNF), and it rolls back cheaply
(benchmarks/grammar_engines.py measures both).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from m3sdk.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch
    import xgrammar

    from m3sdk.tokenizer import Tokenizer

_KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of: `json` (a JSON schema, as a dict or JSON text), `regex` (the whole output fullmatches it),
    `choice` (the output is one of these strings) or `grammar` (EBNF in xgrammar's dialect, rule `root` first:
    `root ::= "yes" | "no"`)."""

    json: Mapping[str, Any] | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise InvalidRequestError(f"structured_output takes exactly one of {', '.join(_KINDS)}; got "
                                      f"{', '.join(given) or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise InvalidRequestError(f"structured_output json is not valid JSON: {e}") from e
            else:
                schema = self.json
            if not isinstance(schema, Mapping | bool):
                raise InvalidRequestError(f"structured_output json must be a JSON schema object, got {schema!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"structured_output {name} must be a non-empty str, got {value!r}")
        if self.choice is not None:
            if (isinstance(self.choice, str) or not isinstance(self.choice, Sequence) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidRequestError("structured_output choice must be a non-empty list of non-empty str, "
                                          f"got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))

    @classmethod
    def of(cls, value: StructuredOutput | Mapping[str, Any]) -> StructuredOutput:
        """A StructuredOutput, or a one-key dict `{"json": schema}`, `{"regex": ...}`, `{"choice": [...]}`,
        `{"grammar": ...}`."""
        if isinstance(value, StructuredOutput):
            return value
        if not isinstance(value, Mapping) or len(value) != 1 or next(iter(value)) not in _KINDS:
            raise InvalidRequestError(f"structured_output must be a StructuredOutput or a dict with one key of "
                                      f"{', '.join(_KINDS)}, got {value!r}")
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) is not None)

    @property
    def key(self) -> tuple[str, str]:
        """What the compiled grammar depends on (the cache key). A schema's key keeps its property order: the
        output follows it."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            return kind, json.dumps(schema, ensure_ascii=False)
        if kind == "choice":
            return kind, json.dumps(value, ensure_ascii=False)
        return kind, value

    def ebnf(self) -> str | None:
        """The EBNF this constraint compiles from when it is given as one (grammar, choice), else None."""
        if self.grammar is not None:
            return self.grammar
        if self.choice is not None:
            # JSON string literals are valid EBNF literals (the same escapes)
            return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
        return None


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # the optional `structured` extra
        raise InvalidRequestError("structured outputs need xgrammar: pip install 'm3sdk[structured]'") from e
    return xgrammar


class Grammar:
    """One request's matcher: the tokens accepted so far decide the next token's bitmask row."""

    def __init__(self, compiled: xgrammar.CompiledGrammar):
        self._matcher = _xgrammar().GrammarMatcher(compiled)

    @property
    def terminated(self) -> bool:
        """It accepted a stop token at the end of a complete match: nothing may follow."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 words, bit i of word w is token 32 w + i). A
        terminated matcher leaves the row as it is (its request is finished; the row is not read)."""
        if not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (the state unchanged) if the grammar forbids it."""
        return not self._matcher.is_terminated() and self._matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)


class GrammarCompiler:
    """Compiles StructuredOutputs against one tokenizer, with an LRU cache of compiled grammars by key.
    Thread-safe: callers compile from their own threads."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Iterable[int],
                 cache_size: int = 256):
        xgr = _xgrammar()
        info = xgr.TokenizerInfo(tokenizer.vocabulary_bytes(vocab_size), xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        self._cache: OrderedDict[tuple[str, str], xgrammar.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, constraint: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The compiled grammar (cached); InvalidRequestError if the constraint does not compile."""
        key = constraint.key
        with self._lock:
            if (hit := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            if constraint.json is not None:
                # no free whitespace between JSON tokens: a small model would spend its tokens on it
                compiled = self._compiler.compile_json_schema(key[1], any_whitespace=False)
            elif constraint.regex is not None:
                compiled = self._compiler.compile_regex(constraint.regex)
            else:
                compiled = self._compiler.compile_grammar(constraint.ebnf())
        except RuntimeError as e:  # xgrammar reports every refusal so, with the parser's message last
            message = str(e).strip().splitlines()[-1]
            raise InvalidRequestError(f"structured_output {constraint.kind} does not compile: {message}") from e
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def grammar(self, constraint: StructuredOutput) -> Grammar:
        """A fresh matcher for one request."""
        return Grammar(self.compile(constraint))


def new_bitmask(rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """An all-allowed host bitmask [rows, ceil(V / 32)] int32, pinned when it will be copied to a GPU."""
    import torch  # (SamplingParams imports this module; `import m3sdk` stays without torch)

    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=device.type == "cuda")


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the forbidden tokens of `rows` to -inf, in place (the host bitmask is copied to the logits' device
    without blocking the host)."""
    if rows:
        mask = bitmask.to(logits.device, non_blocking=True)
        _xgrammar().apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1], indices=rows)


def fill_draft_masks(bitmask: torch.Tensor, first_row: int, grammar: Grammar, drafts: Sequence[int]) -> None:
    """bitmask rows first_row .. first_row + len(drafts): the mask at the request's last token and after each
    draft in turn. The matcher walks the drafts and is rolled back to where it was; past a draft the grammar
    forbids, the rows stay all-allowed: that draft is rejected at its own row, so the positions after it are
    never reached."""
    walked = 0
    for i in range(len(drafts) + 1):
        grammar.fill(bitmask, first_row + i)
        if i == len(drafts) or not grammar.accept(drafts[i]):
            break
        walked += 1
    grammar.rollback(walked)
