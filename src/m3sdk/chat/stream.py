"""Splitting an assistant reply into content, reasoning and tool calls, whole or as it streams.

One scanner serves both: it walks the text as far as the text decides, and stops where a marker could still be
cut (a partial `</mm:think>`, a namespace not yet followed by its tag, an `<invoke>` not yet closed). Fed the
whole text at once it is `parse_assistant`; fed token deltas it is `AssistantStreamParser`, and the deltas join
into exactly what `parse_assistant` returns for the joined text, whatever the cuts.

The rules:
- Reasoning is the text inside `<mm:think>...</mm:think>` (M2: `<think>...</think>`), anywhere in the reply; a
  reply that starts inside reasoning (thinking mode "enabled") has reasoning up to the first closer (an opener
  written again at its start is dropped). A closer at the very start of a reply that does not start inside
  reasoning is dropped. An unclosed block is reasoning to the end.
- Tool calls are the invokes of `NS<tool_call>...NS</tool_call>` blocks (M2: `<minimax:tool_call>`), emitted one
  whole call at a time once its `</invoke>` arrives. An invoke that does not parse, or is cut off by the end of
  the reply, is kept as content; so is anything but invokes inside a block (which ends the block there).
- Content is everything else, each stretch between markers stripped of surrounding whitespace, stretches
  joined by a newline.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from m3sdk.chat.markup import (
    INVOKE_CLOSE,
    M2_THINK_CLOSE,
    M2_THINK_OPEN,
    M2_TOOL_CALL_CLOSE,
    M2_TOOL_CALL_OPEN,
    NS,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
)
from m3sdk.chat.markup import starts_in_reasoning as _mode_starts_in_reasoning
from m3sdk.chat.messages import AssistantDelta, AssistantMessage, ToolCallDelta, join_deltas, tool_schemas
from m3sdk.chat.tool_parser import parse_m2_invoke, parse_m3_invoke

_CONTENT, _REASONING, _M3_BLOCK, _M2_BLOCK = "content", "reasoning", "m3", "m2"
_CONTENT_TRIGGERS = (THINK_OPEN, M2_THINK_OPEN, NS, M2_TOOL_CALL_OPEN)
_THINK_PAIRS = {THINK_OPEN: THINK_CLOSE, M2_THINK_OPEN: M2_THINK_CLOSE}
_INVOKE_OPEN = "<invoke"
_WAIT = object()  # the text so far does not decide: wait for more


@functools.cache
def _longest(markers: tuple[str, ...]) -> int:
    return max(len(m) for m in markers)


def _held_prefix(buf: str, start: int, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of buf[start:] that is a proper prefix of a marker (it may grow into one)."""
    for k in range(min(_longest(markers) - 1, len(buf) - start), 0, -1):
        tail = buf[len(buf) - k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


def _skip_ws(buf: str, i: int) -> int:
    while i < len(buf) and buf[i].isspace():
        i += 1
    return i


class _Scanner:
    """The state of one reply's walk: the text not yet decided is buf[pos:]."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None, starts_in_reasoning: bool) -> None:
        self.schemas = tool_schemas(tools)
        self.buf = ""
        self.pos = 0  # text before it is decided (emitted or dropped)
        self.scan = 0  # where to look for the next marker (>= pos: held whitespace lies between)
        self.mode = _REASONING if starts_in_reasoning else _CONTENT
        self.closers: tuple[str, ...] = (THINK_CLOSE, M2_THINK_CLOSE) if starts_in_reasoning else ()
        self.started = False  # past the start, where a stray closer (or a repeated opener) is dropped
        self.lstrip = True  # at the start of a stretch: leading whitespace is dropped
        self.calls = 0
        self.has_content = False
        self.events: list[tuple[str, Any]] = []

    # ---- emission ------------------------------------------------------------------------------------------
    def _text(self, kind: str, end: int, closed: bool) -> None:
        """Emit buf[pos:end] as `kind`, stripped: leading whitespace at a stretch's start, trailing whitespace
        always (held, not dropped, while the stretch is not `closed`)."""
        if self.lstrip:
            self.pos = min(_skip_ws(self.buf, self.pos), end)
        text = self.buf[self.pos:end].rstrip()
        self.pos = end if closed else self.pos + len(text)
        self.scan = max(self.scan, self.pos)
        if text:
            if self.lstrip and kind == _CONTENT and self.has_content:
                text = "\n" + text  # stretches of content apart (before and after a tool call) stay apart
            self.lstrip = False
            self.has_content |= kind == _CONTENT
            self.events.append((kind, text))

    def _raw(self, end: int) -> None:
        """Emit buf[pos:end] verbatim as content (a tool call that did not parse)."""
        if end > self.pos:
            self.events.append((_CONTENT, "\n" * self.has_content + self.buf[self.pos:end]))
            self.has_content = True
        self.pos = self.scan = end

    def _enter(self, mode: str, at: int) -> None:
        self.mode, self.pos, self.scan, self.lstrip = mode, at, at, True

    # ---- modes: each returns False when it must wait for more text ----------------------------------------
    def _drop_at_start(self, tags: tuple[str, ...], final: bool) -> bool:
        """At the very start of the reply, drop one of `tags` (whitespace before it too); False while the text
        could still grow into one."""
        if self.started:
            return True
        at = _skip_ws(self.buf, self.pos)
        for tag in tags:
            if self.buf.startswith(tag, at):
                self.pos = self.scan = at + len(tag)
                break
            if not final and tag.startswith(self.buf[at:]):
                return False
        self.started = True
        return True

    def _content(self, final: bool) -> bool:
        buf = self.buf
        if not self._drop_at_start((THINK_CLOSE, M2_THINK_CLOSE), final):  # a stray closer
            return False
        while True:
            hits = [(at, m) for m in _CONTENT_TRIGGERS if (at := buf.find(m, self.scan)) >= 0]
            if not hits:
                if final:
                    self._text(_CONTENT, len(buf), closed=True)
                    return True
                end = len(buf) - _held_prefix(buf, self.scan, _CONTENT_TRIGGERS)
                self._text(_CONTENT, end, closed=False)
                self.scan = max(self.scan, end)
                return False
            at, marker = min(hits)
            if marker in _THINK_PAIRS:
                self._text(_CONTENT, at, closed=True)
                self.closers = (_THINK_PAIRS[marker],)
                self._enter(_REASONING, at + len(marker))
                return True
            if marker == M2_TOOL_CALL_OPEN:
                self._text(_CONTENT, at, closed=True)
                self._enter(_M2_BLOCK, at + len(marker))
                return True
            # the namespace opens a block only when <tool_call> follows (whitespace between allowed)
            tag = _skip_ws(buf, at + len(NS))
            if buf.startswith(TOOL_CALL_OPEN, tag):
                self._text(_CONTENT, at, closed=True)
                self._enter(_M3_BLOCK, tag + len(TOOL_CALL_OPEN))
                return True
            if not final and TOOL_CALL_OPEN.startswith(buf[tag:]):
                self._text(_CONTENT, at, closed=False)
                self.scan = at
                return False
            self.scan = at + len(NS)  # a namespace in plain text: content

    def _reasoning(self, final: bool) -> bool:
        buf = self.buf
        if not self._drop_at_start((THINK_OPEN, M2_THINK_OPEN), final):  # the prefilled opener, written again
            return False
        hits = [(at, c) for c in self.closers if (at := buf.find(c, self.scan)) >= 0]
        if hits:
            at, closer = min(hits)
            self._text(_REASONING, at, closed=True)
            self._enter(_CONTENT, at + len(closer))
            return True
        if final:
            self._text(_REASONING, len(buf), closed=True)
            return True
        end = len(buf) - _held_prefix(buf, self.scan, self.closers)
        self._text(_REASONING, end, closed=False)
        self.scan = max(self.scan, end)
        return False

    def _block(self, final: bool) -> bool:
        buf, m3 = self.buf, self.mode == _M3_BLOCK
        start = _skip_ws(buf, self.pos)
        if start == len(buf):
            self.pos = self.scan = start
            return final  # an unterminated block that held only whitespace ends with the reply
        tag = _skip_ws(buf, start + len(NS)) if m3 and buf.startswith(NS, start) else start
        close = TOOL_CALL_CLOSE if m3 else M2_TOOL_CALL_CLOSE
        if buf.startswith(close, tag):
            self._enter(_CONTENT, tag + len(close))
            return True
        if buf.startswith(_INVOKE_OPEN, tag):
            # scan past the text already searched, so a long argument streams in linear time
            end = buf.find(INVOKE_CLOSE, max(tag, self.scan - len(INVOKE_CLOSE) + 1))
            if end < 0:
                if final:  # cut off by the end of the reply
                    self.pos = start
                    self._raw(len(buf))
                else:
                    self.scan = len(buf)
                return final
            body = buf[tag:end].rstrip()
            if m3 and body.endswith(NS):
                body = body[:-len(NS)]
            parsed = (parse_m3_invoke if m3 else parse_m2_invoke)(body, self.schemas)
            if parsed is None:
                self.pos = start
                self._raw(end + len(INVOKE_CLOSE))
            else:
                self.events.append(("tool", (self.calls, f"call_{uuid.uuid4().hex[:24]}", *parsed)))
                self.calls += 1
                self.pos = self.scan = end + len(INVOKE_CLOSE)
            return True
        rest = buf[tag:]
        if not final and (tag == len(buf) or close.startswith(rest) or _INVOKE_OPEN.startswith(rest)
                          or (m3 and tag == start and NS.startswith(rest))):
            return False
        # anything else ends the block: it is content from here on
        self._enter(_CONTENT, start)
        return True

    def run(self, final: bool) -> list[tuple[str, Any]]:
        step = {_CONTENT: self._content, _REASONING: self._reasoning, _M3_BLOCK: self._block,
                _M2_BLOCK: self._block}
        # a mode returns True having moved on (or changed mode), so this ends; at the end of the reply
        # (final) every mode moves on, so the whole text is decided
        while step[self.mode](final) and self.pos < len(self.buf):
            pass
        if self.pos > 4096:  # drop the decided text, so a long stream keeps a short buffer
            self.buf, self.scan, self.pos = self.buf[self.pos:], self.scan - self.pos, 0
        events, self.events = self.events, []
        return events


def _deltas(events: list[tuple[str, Any]]) -> list[AssistantDelta]:
    """Events -> deltas: one per tool call, one per run of text of the same kind."""
    out: list[AssistantDelta] = []
    for kind, payload in events:
        if kind == "tool":
            index, call_id, name, arguments = payload
            out.append(AssistantDelta(tool_calls=[ToolCallDelta(index, call_id, name, arguments)]))
        elif kind == _CONTENT:
            if out and out[-1].content is not None:
                payload = out.pop().content + payload
            out.append(AssistantDelta(content=payload))
        else:
            if out and out[-1].reasoning_content is not None:
                payload = out.pop().reasoning_content + payload
            out.append(AssistantDelta(reasoning_content=payload))
    return out


class AssistantStreamParser:
    """Incremental parse of one reply: feed() the text deltas as they are decoded, then finish()."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None, starts_in_reasoning: bool = False) -> None:
        self._scanner = _Scanner(tools, starts_in_reasoning)
        self._finished = False

    def feed(self, text: str) -> list[AssistantDelta]:
        """The deltas that `text` (appended to what came before) decides; possibly none."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._scanner.buf += text
        return _deltas(self._scanner.run(final=False))

    def finish(self) -> list[AssistantDelta]:
        """The deltas still held back, at the end of the reply."""
        if self._finished:
            return []
        self._finished = True
        return _deltas(self._scanner.run(final=True))


def parse_assistant(text: str, tools: Sequence[Mapping[str, Any]] | None = None, *,
                    thinking_mode: str | None = None, starts_in_reasoning: bool = False) -> AssistantMessage:
    """A whole reply -> content, reasoning and tool calls (arguments typed by `tools`' schemas). The reply starts
    inside reasoning when `starts_in_reasoning`, or when `thinking_mode` is "enabled". Never raises on the text:
    what does not parse stays content."""
    parser = AssistantStreamParser(tools, starts_in_reasoning or _mode_starts_in_reasoning(thinking_mode))
    return join_deltas(parser.feed(text) + parser.finish())
