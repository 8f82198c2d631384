"""Chat messages: the assistant's parsed reply (OpenAI message shape) and the checks on the messages a caller
sends, which turn every bad role or shape into an InvalidRequestError before anything is rendered or queued."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from m3sdk.errors import InvalidRequestError

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: str  # a JSON object, its values typed by the tool's parameter schema


@dataclass(frozen=True)
class ToolCall:
    id: str
    function: FunctionCall
    type: str = "function"

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type,
                "function": {"name": self.function.name, "arguments": self.function.arguments}}


@dataclass(frozen=True)
class AssistantMessage:
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI message shape; also valid input for the next turn's messages."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        return out


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # the call's position among the reply's calls
    id: str | None = None  # set on a call's first delta only
    name: str | None = None  # set on a call's first delta only
    arguments: str = ""  # a fragment of the arguments' JSON; a call's fragments join into its arguments


@dataclass(frozen=True)
class AssistantDelta:
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI streaming `delta` shape (fields that carry nothing left out)."""
        out: dict[str, Any] = {}
        if self.content is not None:
            out["content"] = self.content
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [
                {"index": d.index, **({"id": d.id, "type": "function"} if d.id is not None else {}),
                 "function": {**({"name": d.name} if d.name is not None else {}), "arguments": d.arguments}}
                for d in self.tool_calls]
        return out


def join_deltas(deltas: Sequence[AssistantDelta]) -> AssistantMessage:
    """The message that a stream's deltas add up to."""
    content = "".join(d.content for d in deltas if d.content is not None)
    reasoning = "".join(d.reasoning_content for d in deltas if d.reasoning_content is not None)
    calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]
    for d in deltas:
        for t in d.tool_calls:
            call = calls.setdefault(t.index, ["", "", ""])
            call[0] = t.id if t.id is not None else call[0]
            call[1] = t.name if t.name is not None else call[1]
            call[2] += t.arguments
    return AssistantMessage(content or None, reasoning or None,
                            [ToolCall(i, FunctionCall(n, a)) for _, (i, n, a) in sorted(calls.items())])


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes | bytearray):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif (isinstance(part, Mapping) and part.get("type", "text") == "text"
                  and isinstance(part.get("text"), str)):
                parts.append(part["text"])
            else:
                raise InvalidRequestError(f"{where}.content: only text parts ({{'type': 'text', 'text': str}}) "
                                          f"are supported here (image parts: Engine.chat), got {part!r:.80}")
        return "".join(parts)
    raise InvalidRequestError(f"{where}.content must be a str or a list of text parts, got {type(content).__name__}")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequestError(f"{where} must be {{'type': 'function', 'function': {{'name': str, "
                                  f"'arguments': ...}}}}, got {call!r:.120}")
    if call.get("type", "function") != "function":
        raise InvalidRequestError(f"{where}.type must be 'function', got {call.get('type')!r}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{where}.function.arguments is not valid JSON ({e})") from e
    if not isinstance(arguments, Mapping):
        raise InvalidRequestError(f"{where}.function.arguments must be a JSON object, got {arguments!r:.80}")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise InvalidRequestError(f"{where}.id must be a str, got {call_id!r}")
    return {"id": call_id or "", "type": "function",
            "function": {"name": function["name"], "arguments": dict(arguments)}}


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages and normalize them for a chat template: every content a string (text parts joined,
    an assistant's missing content ""), an assistant's tool-call arguments a dict (parsed when sent as JSON
    text), `reasoning_content`, `tool_calls`, `tool_call_id` and `name` kept where given."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role': str, 'content': ...}")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"{where} must be a dict with 'role' and 'content', got "
                                      f"{type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"{where}.role must be one of {ROLES}, got {role!r}")
        norm: dict[str, Any] = {"role": role}
        content = message.get("content")
        calls = message.get("tool_calls") if role == "assistant" else None
        if content is None and not (role == "assistant"):
            raise InvalidRequestError(f"{where} ({role}) needs a 'content'")
        norm["content"] = "" if content is None else _text(content, where)
        if role == "assistant":
            reasoning = message.get("reasoning_content")
            if reasoning is not None:
                norm["reasoning_content"] = _text(reasoning, where + ".reasoning")
            if calls is not None:
                if isinstance(calls, str | bytes) or not isinstance(calls, Sequence):
                    raise InvalidRequestError(f"{where}.tool_calls must be a list, got {type(calls).__name__}")
                norm["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        for key in ("tool_call_id", "name"):
            if (value := message.get(key)) is not None:
                if not isinstance(value, str):
                    raise InvalidRequestError(f"{where}.{key} must be a str, got {value!r}")
                norm[key] = value
        out.append(norm)
    return out


def validate_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Check a tools list: OpenAI's `{"type": "function", "function": {"name", "description", "parameters"}}`
    entries (a bare function dict is taken as one). Returned as given, for templates that render it whole."""
    if tools is None:
        return None
    if isinstance(tools, str | bytes) or not isinstance(tools, Sequence):
        raise InvalidRequestError(f"tools must be a list of tool dicts, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, "
                                      f"...}}}}, got {tool!r:.120}")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object")
    return list(tools)


def tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    """name -> parameters schema of each tool (an empty schema where none is given; entries that are not tools
    are skipped: parsing never fails on them)."""
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            out[function["name"]] = parameters if isinstance(parameters, Mapping) else {}
    return out
