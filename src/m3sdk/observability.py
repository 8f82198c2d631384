"""Logging: structlog when the application configured structlog, else the stdlib logger "m3sdk". Silent by
default either way: an embedded engine must not print into its host application."""

from __future__ import annotations

import logging
from typing import Any

import structlog

logging.getLogger("m3sdk").addHandler(logging.NullHandler())


class Logger:
    """`log.info("event", key=value, ...)`. Decides per call, so configuring logging after import works."""

    def __init__(self, name: str):
        self.name = name
        self._std = logging.getLogger(name)

    def _log(self, level: int, event: str, exc_info: bool, fields: dict[str, Any]) -> None:
        if structlog.is_configured():
            bound = structlog.get_logger(self.name)
            method = bound.exception if exc_info else getattr(bound, logging.getLevelName(level).lower())
            method(event, **fields)
        elif self._std.isEnabledFor(level):
            extra = " ".join(f"{k}={v!r}" for k, v in fields.items())
            self._std.log(level, f"{event} {extra}".rstrip(), exc_info=exc_info)

    def debug(self, event: str, **fields: Any) -> None:
        self._log(logging.DEBUG, event, False, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log(logging.INFO, event, False, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log(logging.WARNING, event, False, fields)

    def exception(self, event: str, **fields: Any) -> None:
        """An error with the current exception's traceback."""
        self._log(logging.ERROR, event, True, fields)


def get_logger(name: str = "m3sdk") -> Logger:
    return Logger(name)
