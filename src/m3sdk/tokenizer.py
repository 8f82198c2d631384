"""Tokenizer (a `tokenizers` tokenizer.json plus the checkpoint's jinja2 chat template) and TextStream, the
per-request incremental detokenizer that also cuts the text at stop strings."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from m3sdk.chat.messages import validate_messages, validate_tools
from m3sdk.errors import CheckpointError, InvalidRequestError
from m3sdk.params import SamplingParams


def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or a serialized AddedToken."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from e


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, separators=None,
            sort_keys: bool = False) -> str:
    # jinja2's own tojson HTML-escapes (<, >, &, '): chat templates expect plain JSON, as transformers renders it
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table): printable Latin-1 bytes stand for
    themselves, the others for chr(256 + n) in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = (b for b in range(256) if b not in printable)
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(extra)}


_BYTE_OF_CHAR = _byte_level_alphabet()


class _TemplateRaised(jinja2.TemplateError):
    """raise_exception(...) called by a chat template: the messages do not fit it."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _compile_template(source: str) -> jinja2.Template:
    # the options transformers uses, so checkpoint templates render the same whitespace
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"chat template does not compile: {e}") from e


class Tokenizer:
    """Text <-> token ids, and chat messages -> prompt text."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, special_tokens: Mapping[str, str] | None = None,
                 chat_template: str | None = None, eos_token_ids: Iterable[int] = ()) -> None:
        """`special_tokens`: the named ones of tokenizer_config.json ("bos_token", "eos_token", ...), exposed to
        the chat template; `eos_token_ids`: extra end-of-sequence ids (generation_config.json lists several)."""
        self._tok = tokenizer
        self.special_tokens = dict(special_tokens or {})
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos = set(eos_token_ids)
        if self.eos_token and (eos_id := self._tok.token_to_id(self.eos_token)) is not None:
            eos.add(eos_id)
        self.eos_token_ids: set[int] = eos
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template is not None else None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, generation_config.json and the chat template (from
        chat_template.jinja, else chat_template.json, else tokenizer_config.json) of a checkpoint folder."""
        root = Path(path)
        if not (root / "tokenizer.json").is_file():
            raise CheckpointError(f"{root}: no tokenizer.json")
        try:
            tok = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"{root / 'tokenizer.json'}: cannot be loaded ({e})") from e
        config = _read_json(root / "tokenizer_config.json")
        special = {k: c for k, v in config.items() if k.endswith("_token") and (c := _token_content(v))}
        eos_ids = _read_json(root / "generation_config.json").get("eos_token_id") or []
        eos_ids = [eos_ids] if isinstance(eos_ids, int) else eos_ids
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        else:
            template = _read_json(root / "chat_template.json").get("chat_template") or config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        return cls(tok, special_tokens=special, chat_template=template, eos_token_ids=eos_ids)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocabulary_bytes(self, size: int) -> list[bytes]:
        """The bytes each token id below `size` stands for in generated text, b"" for special tokens and ids the
        tokenizer does not have (what a grammar engine needs to know which tokens spell what)."""
        added = self._tok.get_added_tokens_decoder()
        byte_level = json.loads(self._tok.to_str()).get("decoder", {}) or {}
        byte_level = byte_level.get("type") == "ByteLevel"
        out = []
        for i in range(size):
            if i in added:
                out.append(b"" if added[i].special else added[i].content.encode())
            elif (piece := self._tok.id_to_token(i)) is None:
                out.append(b"")
            elif byte_level:
                out.append(bytes(_BYTE_OF_CHAR[c] for c in piece))
            else:
                out.append(self._tok.decode([i], skip_special_tokens=False).encode())
        return out

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            chat_template_kwargs: Mapping[str, Any] | None = None, **variables: Any) -> str:
        """Render chat messages ([{"role": ..., "content": ...}, ...]) with the checkpoint's template. The
        messages are checked and normalized first (m3sdk.chat.validate_messages: text parts joined, tool-call
        arguments as dicts); `tools` (OpenAI function tools), the `chat_template_kwargs` (e.g. MiniMax-M3's
        `thinking_mode`) and any extra variables reach the template as they are."""
        if self._template is None:
            raise InvalidRequestError("this tokenizer has no chat template: pass a text prompt or token ids")
        messages = validate_messages(messages)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise InvalidRequestError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        kwargs = dict(chat_template_kwargs or {})
        if reserved := {"messages", "add_generation_prompt", "tools"} & kwargs.keys():
            raise InvalidRequestError(f"chat_template_kwargs cannot set {sorted(reserved)}: pass them as arguments")
        try:
            return self._template.render({**self.special_tokens, **variables, **kwargs}, messages=messages,
                                         tools=validate_tools(tools), add_generation_prompt=add_generation_prompt)
        # raise_exception(), or messages the template cannot walk (a TypeError: a None content it concatenates)
        except (jinja2.TemplateError, TypeError) as e:
            raise InvalidRequestError(f"chat template refused the messages: {str(e)[:200]}") from e


# Prompt tokens decoded ahead of the output, so that a decoder that treats the start of a sequence specially
# (SentencePiece-style stripping of a leading space) sees the output as a continuation.
_PROMPT_CONTEXT = 5


class TextStream:
    """Incremental detokenization of one request's output, cut at stop strings.

    Decoding: the token ids are decoded over a short window [prefix, end); the text past that of [prefix, read)
    is new (vLLM's prefix/read offsets). New text is released up to a trailing run of U+FFFD (an incomplete UTF-8
    sequence that the next bytes may complete), so a partial character never goes out and a whole one goes out
    at the token that completes it; the window slides once its text ends on a whole character.

    Stop strings: released text is held back while its tail could still grow into a stop string; when one
    completes, the text before it is the last delta (with the stop string at its end when
    `include_stop_str_in_output`). The match that completes first wins (so the result does not depend on how text
    splits into tokens), the longest one among those completing at the same character. A push with
    `match_stops=False` (before min_tokens) matches none: a stop string counts only if it completes in the text of
    a push that matches.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._include_stop = params.include_stop_str_in_output
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self._sent = 0  # characters of the window's text released beyond its prefix text
        self._stops = params.stop_strings
        self._pending = ""  # decoded text held back: it could be the start of a stop string
        self._unmatched = 0  # leading characters of _pending pushed while stops were not matched
        self.stop_reason: str | None = None

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def _decoded_delta(self, final: bool) -> str:
        prefix_text = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix)
        # everything before a trailing run of U+FFFD is final: later bytes can only complete that run
        stable = text if final else text.rstrip("\ufffd")
        start = max(self._sent, len(prefix_text.rstrip("\ufffd")))
        delta = stable[start:]
        if stable == text and len(text) > len(prefix_text):
            # the window ends on a whole character: slide it (its new prefix text is all released)
            self._prefix, self._read, self._sent = self._read, len(self._ids), 0
        else:
            self._sent = max(start, len(stable))
        return delta

    def _cut(self, text: str, final: bool, match: bool = True) -> str:
        if not self._stops:
            return text
        buf = self._pending + text
        # a match ends past the text pushed while stops were not matched (held back, so at most a stop's length)
        hits = [(pos + len(s), pos, s) for s in self._stops
                if match and (pos := buf.find(s, max(0, self._unmatched - len(s) + 1))) >= 0]
        if hits:
            _, pos, stop = min(hits)
            self.stop_reason, self._pending = stop, ""
            return buf[:pos + len(stop)] if self._include_stop else buf[:pos]
        hold = 0
        if not final:
            longest = max(len(s) for s in self._stops) - 1
            hold = next((k for k in range(min(longest, len(buf)), 0, -1)
                         if any(s.startswith(buf[-k:]) for s in self._stops)), 0)
        self._pending = buf[len(buf) - hold:]
        self._unmatched = hold if not match else max(0, self._unmatched - (len(buf) - hold))
        return buf[:len(buf) - hold]

    def push(self, token_id: int, match_stops: bool = True) -> tuple[str, str | None]:
        """Add one generated token -> (text to emit now, the stop string if one just completed). With
        `match_stops=False` no stop string completes at this token."""
        if self.stop_reason is not None:
            raise RuntimeError(f"push() after the stop string {self.stop_reason!r} ended this stream")
        self._ids.append(token_id)
        text = self._cut(self._decoded_delta(final=False), final=False, match=match_stops)
        return text, self.stop_reason

    def finish(self) -> str:
        """The text still held back, at the end of a request not ended by a stop string (eos, length, stop
        token). An incomplete UTF-8 tail comes out as U+FFFD, as a full decode would write it."""
        if self.stop_reason is not None:
            return ""
        return self._cut(self._decoded_delta(final=True), final=True)
