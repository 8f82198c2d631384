"""Registry[T]: the one shape of every "pick it by name" seam (schedulers, cache managers, attention backends,
drafters, KV transports).

A registry maps a name to a T (a class or a factory). Built-in entries may live in modules that are costly to import
(Triton kernels, ucxx): those are declared by module path (`builtin`) and imported on the first `get` of their name,
where they `register` themselves. An unknown name is an `UnknownNameError` that lists the names known.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from m3sdk.errors import M3Error

T = TypeVar("T")


class UnknownNameError(M3Error, ValueError):
    """A name that no registry entry answers to (the message lists the known names)."""

    def __init__(self, kind: str, name: object, known: list[str]):
        super().__init__(f"unknown {kind} {name!r}; registered: {known}")
        self.kind, self.name, self.known = kind, name, known


class Registry(Generic[T]):
    """Names -> T for one kind of plug-in. `builtin`: name -> the module that registers it when imported."""

    def __init__(self, kind: str, builtin: Mapping[str, str] | None = None):
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._builtin = dict(builtin or {})

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: `@REGISTRY.register("name")` over a class or a factory; a later registration replaces it."""

        def add(entry: T) -> T:
            self._entries[name] = entry
            return entry

        return add

    def get(self, name: str) -> T:
        """The entry registered as `name`, importing its built-in module first if need be."""
        if name not in self._entries and name in self._builtin:
            importlib.import_module(self._builtin[name])
        if name not in self._entries:
            raise UnknownNameError(self.kind, name, self.names())
        return self._entries[name]

    def names(self) -> list[str]:
        """Every name `get` answers to, sorted (built-ins not imported yet included)."""
        return sorted({*self._entries, *self._builtin})

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._builtin
