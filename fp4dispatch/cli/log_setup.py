"""``tune -v``'s log lines on stderr: INFO and up, each naming its logger once."""
from __future__ import annotations

import logging
import sys

__all__ = ["NamedFormatter", "log_to_stderr"]


class NamedFormatter(logging.Formatter):
    """``logger: message``, without naming the logger twice: fp4dispatch's messages start with its name already."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if text.startswith(record.name + ":") else f"{record.name}: {text}"


def log_to_stderr() -> None:
    """INFO and up of every logger to stderr (unless the root logger has a handler already)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(NamedFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
