"""MiniMax-M3's reply markup: the markers, the thinking modes' prefill, and a tool call rendered as the model
writes it. The chat template, the parsers and the tool-call grammar all take their shapes from here."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from m3sdk.errors import InvalidRequestError

# Every structural tag of an M3 tool call is preceded by this namespace.
NS = "]<]minimax[>["
THINK_OPEN, THINK_CLOSE = "<mm:think>", "</mm:think>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
INVOKE_CLOSE = "</invoke>"
# MiniMax-M2: plain tags, arguments as <parameter name="k">v</parameter>
M2_THINK_OPEN, M2_THINK_CLOSE = "<think>", "</think>"
M2_TOOL_CALL_OPEN, M2_TOOL_CALL_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"

GENERATION_PROMPT = "]~b]ai\n"
THINKING_MODES = ("enabled", "disabled", "adaptive")


def reply_prefix(thinking_mode: str | None = None) -> str:
    """The text the chat template prefills after the generation prompt: "enabled" opens the reasoning
    (`<mm:think>`), "disabled" closes it before it starts (`</mm:think>`), "adaptive" (the default, None)
    leaves the choice to the model."""
    if thinking_mode is None or thinking_mode == "adaptive":
        return ""
    if thinking_mode == "enabled":
        return THINK_OPEN
    if thinking_mode == "disabled":
        return THINK_CLOSE
    raise InvalidRequestError(f"thinking_mode must be one of {THINKING_MODES}, got {thinking_mode!r}")


def starts_in_reasoning(thinking_mode: str | None = None) -> bool:
    """Whether the reply to a prompt rendered with this thinking mode starts inside the reasoning block."""
    return reply_prefix(thinking_mode) == THINK_OPEN


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends on an open reasoning tag (`<mm:think>`, or M2's `<think>`), so that the
    reply starts inside reasoning, whichever template rendered it."""
    tail = prompt.rstrip()
    return tail.endswith(THINK_OPEN) or tail.endswith(M2_THINK_OPEN)


def render_value(value: Any) -> str:
    """An argument value as the inside of its element: scalars as JSON writes them (strings verbatim), objects
    as one child element per key (None fields dropped), lists as `<item>` elements."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return "".join(_element(str(k), v) for k, v in value.items() if v is not None)
    if isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        return "".join(_element("item", v) for v in value)
    return json.dumps(value, ensure_ascii=False)


def _element(name: str, value: Any) -> str:
    return f"{NS}<{name}>{render_value(value)}{NS}</{name}>"


def render_invoke(name: str, arguments: Mapping[str, Any]) -> str:
    """One call: `NS<invoke name="X">`, one argument element per line, `NS</invoke>`."""
    lines = [f'{NS}<invoke name="{name}">']
    lines += [_element(str(k), v) for k, v in arguments.items() if v is not None]
    return "\n".join(lines) + f"\n{NS}{INVOKE_CLOSE}\n"


def render_tool_calls(calls: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """Several calls (parallel) in one `<tool_call>` block, exactly as the chat template renders them."""
    return f"{NS}{TOOL_CALL_OPEN}\n" + "".join(render_invoke(n, a) for n, a in calls) + f"{NS}{TOOL_CALL_CLOSE}"


def render_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """One call in its own `<tool_call>` block."""
    return render_tool_calls([(name, arguments)])
