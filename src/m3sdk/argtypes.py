"""Checked argument types of the `m3sdk` command: a value out of range is an argparse error (one line, exit 2)
when the command line is parsed, before torch or the model loads. A leaf: imports nothing of m3sdk."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

Parse = Callable[[str], object]


def number(kind: type[int] | type[float], low: float | None = None, high: float | None = None, *,
           low_open: bool = False, allow_inf: bool = False) -> Parse:
    """An int or float in [low, high] ((low, high] with low_open); "inf" only with allow_inf."""
    name = "an int" if kind is int else "a number"
    bounds = []
    if low is not None:
        bounds.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        bounds.append(f"<= {high:g}")
    wanted = f"{name} {' and '.join(bounds)}".strip() + (" (or inf)" if allow_inf else "")

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"want {wanted}, got {text!r}") from None
        if math.isinf(value) and allow_inf and value > 0:
            return value
        ok = math.isfinite(value) and (low is None or (value > low if low_open else value >= low)) and (
            high is None or value <= high)
        if not ok:
            raise argparse.ArgumentTypeError(f"want {wanted}, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


def comma_list(item: Parse) -> Parse:
    """A comma list whose every item `item` accepts; the value stays the text (a sweep parses it when it runs)."""

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError("want a value or a comma list, got nothing")
        for part in text.split(","):
            item(part.strip())
        return text

    return parse


def byte_size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 1024): "512M", "2G", "1048576"."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    body = text.strip().lower().removesuffix("b")
    scale = units.get(body[-1:], 1)
    try:
        value = float(body[:-1] if scale != 1 else body) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a size such as 512M or 2G, got {text!r}") from None
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"want a positive size, got {text!r}")
    return int(value)


POSITIVE_INT = number(int, 1)
NON_NEGATIVE_INT = number(int, 0)
