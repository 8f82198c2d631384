"""One `<invoke>` of a tool-call block -> (name, arguments JSON), M3 and M2 dialects, values typed by the tool's
JSON schema. A call that does not parse is None (the caller keeps its text as content); nothing here raises.

M3: each argument is an element named after it, every tag optionally preceded by the namespace; an element whose
inside is only elements is an object (list items are `<item>`, a repeated name is a list). M2: arguments are
`<parameter name="k">v</parameter>`, objects and lists written as JSON."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from m3sdk.chat.markup import NS

_NS = re.escape(NS)
_INVOKE = re.compile(r"""<invoke\s+name\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))\s*>""")
# an argument element: its name is the property's, whatever characters it holds but markup and line breaks
_OPEN = re.compile(rf"\s*(?:{_NS}\s*)?<([^\s<>/][^<>/\n]*)>")
_M2_PARAM = re.compile(r"""<parameter\s+name\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))\s*>(.*?)</parameter>""",
                       re.S)
_TRUE, _FALSE, _NULL = ("true", "1", "yes", "on"), ("false", "0", "no", "off"), ("null", "none", "nil", "")
_FAIL = object()  # a value that does not fit the schema type being tried


@dataclass
class _Node:
    name: str
    raw: str  # the text between the tags, verbatim
    children: list[_Node] | None  # None when the inside is not made of elements only


def _close(name: str) -> re.Pattern[str]:
    return re.compile(rf"(?:{_NS}\s*)?</{re.escape(name)}>")


def _elements(s: str, i: int) -> tuple[list[_Node], int]:
    """As many consecutive elements as parse from i on, and where they end."""
    nodes: list[_Node] = []
    while (m := _OPEN.match(s, i)) is not None and (parsed := _element(s, m.end(), m.group(1))) is not None:
        node, i = parsed
        nodes.append(node)
    return nodes, i


def _element(s: str, start: int, name: str) -> tuple[_Node, int] | None:
    """The rest of an element whose open tag ends at `start`: as children when its inside is only elements,
    else as text up to the first matching close tag."""
    close = _close(name)
    children, j = _elements(s, start)
    if children and (m := close.match(s, j + len(s[j:]) - len(s[j:].lstrip()))) is not None:
        return _Node(name, s[start:m.start()], children), m.end()
    if (m := close.search(s, start)) is None:
        return None
    return _Node(name, s[start:m.start()], None), m.end()


def _types(schema: Mapping[str, Any]) -> list[str]:
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    if "properties" in schema:
        return ["object"]
    if "items" in schema:
        return ["array"]
    if isinstance(schema.get("enum"), list):
        kinds = {type(v) for v in schema["enum"]}
        return [k for k, py in (("null", type(None)), ("boolean", bool), ("integer", int), ("number", float),
                                ("string", str)) if py in kinds]
    return []


def _number(text: str) -> Any:
    s = text.strip()
    try:
        return int(s)
    except ValueError:
        pass
    try:
        value = float(s)
    except ValueError:
        return _FAIL
    return value if math.isfinite(value) else _FAIL


def _json(text: str, kind: type) -> Any:
    try:
        value = json.loads(text, parse_constant=lambda c: _FAIL)
    except (json.JSONDecodeError, RecursionError):
        return _FAIL
    return value if isinstance(value, kind) else _FAIL


def _as(node: _Node, kind: str, schema: Mapping[str, Any]) -> Any:
    text = node.raw.strip()
    if kind == "string":
        return node.raw
    if kind == "null":
        return None if text.lower() in _NULL else _FAIL
    if kind == "boolean":
        return True if text.lower() in _TRUE else False if text.lower() in _FALSE else _FAIL
    if kind == "integer":
        value = _number(text)
        value = int(value) if isinstance(value, float) and value.is_integer() else value
        return value if isinstance(value, int) else _FAIL
    if kind == "number":
        return _number(text)
    if kind == "object":
        if node.children is None:
            return {} if not text else _json(text, dict)
        return _object(node.children, schema)
    if kind == "array":
        items = schema.get("items") if isinstance(schema.get("items"), Mapping) else {}
        if node.children is None:
            return [] if not text else _json(text, list)
        if all(c.name == "item" for c in node.children):
            return [_value(c, items) for c in node.children]
        return _FAIL
    return _FAIL


def _guess(node: _Node) -> Any:
    """A value with no schema: elements as an object (or a list of `<item>`s), JSON scalars typed, other text
    verbatim."""
    if node.children:
        if all(c.name == "item" for c in node.children):
            return [_guess(c) for c in node.children]
        return _object(node.children, {})
    value = _json(node.raw.strip(), object)
    return node.raw if value is _FAIL or isinstance(value, str) else value


def _value(node: _Node, schema: Mapping[str, Any]) -> Any:
    options = schema.get("anyOf") or schema.get("oneOf")
    candidates = [s for s in options if isinstance(s, Mapping)] if isinstance(options, list) else [schema]
    kinds = [(k, s) for s in candidates for k in _types(s)]
    if not kinds:
        return _guess(node)
    # null first: the text "null" for a ["string", "null"] argument means null
    for kind, sub in sorted(kinds, key=lambda ks: ks[0] != "null"):
        if (value := _as(node, kind, sub)) is not _FAIL:
            return value
    return _guess(node) if node.children else node.raw  # fits no type: as if untyped, elements kept apart


def _object(children: list[_Node], schema: Mapping[str, Any]) -> dict[str, Any]:
    properties = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
    extra = schema.get("additionalProperties")
    by_name: dict[str, list[_Node]] = {}
    for child in children:
        by_name.setdefault(child.name, []).append(child)
    out: dict[str, Any] = {}
    for name, nodes in by_name.items():
        sub = properties.get(name, extra)
        sub = sub if isinstance(sub, Mapping) else {}
        if len(nodes) == 1:
            out[name] = _value(nodes[0], sub)
        else:  # a repeated element is a list, each element one item
            items = sub.get("items") if _types(sub) == ["array"] and isinstance(sub.get("items"), Mapping) else sub
            out[name] = [_value(n, items) for n in nodes]
    return out


def _invoke_name(text: str) -> tuple[str, int] | None:
    m = _INVOKE.match(text)
    if m is None:
        return None
    name = next(g for g in m.groups() if g is not None)
    return (name, m.end()) if name else None


def _dumps(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False)


def parse_m3_invoke(text: str, schemas: Mapping[str, Mapping[str, Any]]) -> tuple[str, str] | None:
    """`<invoke name="X">` + argument elements (the text up to, not including, the close tag and its namespace)
    -> (name, arguments JSON); None when it does not parse."""
    head = _invoke_name(text)
    if head is None:
        return None
    name, start = head
    nodes, end = _elements(text, start)
    if text[end:].strip():
        return None
    return name, _dumps(_object(nodes, schemas.get(name) or {}))


def parse_m2_invoke(text: str, schemas: Mapping[str, Mapping[str, Any]]) -> tuple[str, str] | None:
    """M2's `<invoke name="X">` + `<parameter name="k">v</parameter>`s -> (name, arguments JSON); None when it
    does not parse."""
    head = _invoke_name(text)
    if head is None:
        return None
    name, start = head
    properties = (schemas.get(name) or {}).get("properties") or {}
    arguments: dict[str, Any] = {}
    end = start
    for m in _M2_PARAM.finditer(text, start):
        if text[end:m.start()].strip():
            return None
        key = next(g for g in m.groups()[:3] if g is not None)
        raw = m.group(4)
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        sub = properties.get(key) if isinstance(properties, Mapping) else None
        arguments[key] = _value(_Node(key, raw, None), sub if isinstance(sub, Mapping) else {})
        end = m.end()
    if text[end:].strip():
        return None
    return name, _dumps(arguments)
