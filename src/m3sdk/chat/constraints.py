"""What a chat call's `tool_choice` and `response_format` constrain the reply to, as a StructuredOutput.

`tool_choice="required"` or a named function: the reply is one `<tool_call>` block in MiniMax-M3's markup (the
shape `render_tool_calls` writes and the parsers read) holding calls of the allowed tools (one or more for
"required", exactly one for a named function), each argument an element whose text is a value of the argument's
JSON-schema type. The grammar is EBNF (xgrammar's dialect) built from the tools' parameter schemas: properties in
schema order, the required ones always present; strings exclude `]` and `<` (so a value never opens or closes
markup, namespaced or not); numbers have bounded digits; an integer with both bounds is a list of its values when
they are few (up to 1000), wider bounds are not enforced. `response_format` `{"type": "json_object"}` or
`{"type": "json_schema", "json_schema": {"schema": ...}}` is a JSON-schema constraint.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from m3sdk.chat.markup import INVOKE_CLOSE, NS, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, render_value
from m3sdk.chat.messages import tool_schemas
from m3sdk.errors import InvalidRequestError
from m3sdk.structured import StructuredOutput

TOOL_CHOICES = ("none", "auto", "required")

_PRIMITIVES = {
    "string": r"[^\]<]*",
    "integer": r'"-"? ("0" | [1-9] [0-9]{0,15})',
    "number": r'"-"? ("0" | [1-9] [0-9]{0,15}) ("." [0-9]{1,8})? ([eE] [-+]? [0-9]{1,3})?',
    "boolean": r'"true" | "false"',
    "null": r'"null"',
}


# an integer argument with both bounds is listed when it spans this many values or fewer; a wider one is written
# as digits (a non-negative minimum drops the sign), its bounds not enforced
_MAX_LISTED = 1000


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # JSON string escapes are EBNF string escapes


class _Rules:
    """EBNF rules, one per schema node, named by their path."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}

    def add(self, name: str, body: str) -> str:
        self.rules[name] = body
        return name

    def value(self, name: str, schema: Any) -> str:
        """A rule for the text inside an argument's element, of this schema's type."""
        if not isinstance(schema, Mapping):
            return self.add(name, _PRIMITIVES["string"])
        if "const" in schema:
            return self.add(name, _literal(render_value(schema["const"])))
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return self.add(name, " | ".join(_literal(render_value(v)) for v in schema["enum"]))
        options = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(options, list) and options:
            return self.add(name, " | ".join(self.value(f"{name}_{i}", s) for i, s in enumerate(options)))
        kinds = schema.get("type")
        if isinstance(kinds, list) and kinds:
            return self.add(name, " | ".join(self.value(f"{name}_{k}", {**schema, "type": k}) for k in kinds))
        kind = kinds if isinstance(kinds, str) else "object" if "properties" in schema else (
            "array" if "items" in schema else "string")
        if kind == "object":
            return self.add(name, self.elements(name, schema, "") or '""')
        if kind == "array":
            item = self.value(f"{name}_item", schema.get("items", {}))
            element = self.add(f"{name}_el", f'{_literal(NS + "<item>")} {item} {_literal(NS + "</item>")}')
            lo = int(schema.get("minItems", 0))
            hi = schema.get("maxItems")
            return self.add(name, f"{element}{{{lo},{'' if hi is None else int(hi)}}}" if (lo or hi is not None)
                            else f"{element}*")
        if kind == "integer" and (span := _integer_range(schema)) is not None:
            return self.add(name, " | ".join(_literal(str(v)) for v in span))
        if kind == "integer" and isinstance(schema.get("minimum"), int | float) and schema["minimum"] >= 0:
            return self.add(name, r'"0" | [1-9] [0-9]{0,15}')
        if kind == "string":
            lo, hi = schema.get("minLength"), schema.get("maxLength")
            if lo is not None or hi is not None:
                return self.add(name, rf"[^\]<]{{{int(lo or 0)},{'' if hi is None else int(hi)}}}")
        if kind not in _PRIMITIVES:
            raise InvalidRequestError(f"tool parameter type {kind!r} is not supported for constrained tool calls")
        return self.add(name, _PRIMITIVES[kind])

    def elements(self, name: str, schema: Mapping[str, Any], sep: str) -> str:
        """An object's properties as elements in schema order (each followed by `sep`), the optional ones
        optional: the EBNF expression, "" for an object without properties."""
        properties = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
        required = set(schema.get("required") or ())
        parts = []
        for i, (key, sub) in enumerate(properties.items()):
            value = self.value(f"{name}_p{i}", sub)
            element = self.add(f"{name}_e{i}", f"{_literal(f'{NS}<{key}>')} {value} "
                                              f"{_literal(f'{NS}</{key}>' + sep)}")
            parts.append(element if key in required else f"{element}?")
        return " ".join(parts)


def _integer_range(schema: Mapping[str, Any]) -> range | None:
    """The integers a schema with both bounds allows, when few enough to list (up to _MAX_LISTED)."""
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if not all(isinstance(b, int | float) and not isinstance(b, bool) for b in (lo, hi)):
        return None
    lo = math.ceil(lo) + (lo == math.ceil(lo) and schema.get("exclusiveMinimum") is True)
    hi = math.floor(hi) - (hi == math.floor(hi) and schema.get("exclusiveMaximum") is True)
    return range(lo, hi + 1) if 0 < hi + 1 - lo <= _MAX_LISTED else None


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], names: Sequence[str], parallel: bool) -> str:
    """EBNF for one `<tool_call>` block of calls to the tools `names` (one call, or one or more if `parallel`)."""
    schemas = tool_schemas(tools)
    r = _Rules()
    invokes = []
    for i, name in enumerate(names):
        if '"' in name or "\n" in name:
            raise InvalidRequestError(f"tool name {name!r} cannot be written in a constrained tool call")
        args = r.elements(f"t{i}", schemas[name], "\n")
        head = _literal(f'{NS}<invoke name="{name}">\n')
        invokes.append(r.add(f"invoke{i}", f"{head} {args} {_literal(NS + INVOKE_CLOSE + chr(10))}"))
    call = r.add("call", " | ".join(invokes))
    body = f"{call}+" if parallel else call
    root = f"root ::= {_literal(NS + TOOL_CALL_OPEN + chr(10))} {body} {_literal(NS + TOOL_CALL_CLOSE)}"
    return "\n".join([root] + [f"{n} ::= {b}" for n, b in r.rules.items()])


def chat_constraint(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any, response_format: Any,
                    parallel_tool_calls: bool = True) -> StructuredOutput | None:
    """The StructuredOutput a chat call's `tool_choice` and `response_format` ask for (None: unconstrained):
    "required" allows several calls when `parallel_tool_calls`, a named function one. Bad values are an
    InvalidRequestError."""
    names = list(tool_schemas(tools))
    forced: list[str] | None = None
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                                      f"'function': {{'name': str}}}}, got {tool_choice!r:.120}")
        if name not in names:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools {names}")
        forced = [name]
    elif tool_choice not in TOOL_CHOICES:
        raise InvalidRequestError(f"tool_choice must be one of {TOOL_CHOICES} or a named function, got "
                                  f"{tool_choice!r:.120}")
    elif tool_choice == "required":
        if not names:
            raise InvalidRequestError("tool_choice 'required' needs tools")
        forced = names
    if forced is not None and response_format is not None and _format_schema(response_format) is not None:
        raise InvalidRequestError("response_format cannot constrain a reply that tool_choice forces to be a call")
    if forced is not None:
        parallel = parallel_tool_calls and isinstance(tool_choice, str)
        return StructuredOutput(grammar=tool_call_grammar(tools, forced, parallel))
    schema = _format_schema(response_format)
    return None if schema is None else StructuredOutput(json=schema)


def _format_schema(response_format: Any) -> Mapping[str, Any] | None:
    """The JSON schema of a response_format (None for none or {"type": "text"})."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if isinstance(schema, Mapping):
            return schema
    raise InvalidRequestError("response_format must be {'type': 'text'}, {'type': 'json_object'} or "
                              "{'type': 'json_schema', 'json_schema': {'name': str, 'schema': {...}}}, got "
                              f"{response_format!r:.120}")
