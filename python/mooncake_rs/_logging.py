"""Python-side logging, configured by ``MOONCAKE_LOG`` (the same variable as the Rust side).

``MOONCAKE_LOG`` takes ``error``, ``warn`` (default), ``info``, ``debug`` or ``trace``; the
Rust core also accepts a full ``tracing`` filter (``mooncake_core::store=debug``), of which
Python uses the first plain level it finds.
"""

from __future__ import annotations

import logging
import os

_LEVELS = {
    "error": logging.ERROR,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "info": logging.INFO,
    "debug": logging.DEBUG,
    "trace": logging.DEBUG,
}

logger = logging.getLogger("mooncake_rs")


def level_from_env(value: str | None = None) -> int:
    """The logging level that ``MOONCAKE_LOG`` (or ``value``) asks for."""
    value = os.environ.get("MOONCAKE_LOG", "warn") if value is None else value
    for part in value.replace(";", ",").split(","):
        part = part.strip().lower()
        if "=" in part:
            continue
        if part in _LEVELS:
            return _LEVELS[part]
    return logging.WARNING


def configure() -> None:
    """Sets the package logger's level; adds a stderr handler only if the app has none."""
    logger.setLevel(level_from_env())
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
