"""Structured logging: one JSON object per line on stderr, with the service name on every record."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

__all__ = ["setup_logging", "get_logger"]

_RESERVED = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class _JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(service: str, level: str | None = None) -> None:
    """Send every logger's records, as JSON lines, to stderr. ``EMBEDMESH_LOG_LEVEL`` sets the level."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("EMBEDMESH_LOG_LEVEL", "INFO")).upper())


def get_logger(name: str) -> logging.Logger:
    """A module logger; pass structured fields with ``extra={...}``."""
    return logging.getLogger(name)
