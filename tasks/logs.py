"""How the worker and the gateway log: plain text lines, or one JSON object per line.

``--log-format json`` (``RQ_LOG_FORMAT`` / ``RQ_API_LOG_FORMAT``) writes every
record as ``{"time", "level", "logger", "message", "node"}`` (and
``"exception"`` when one is attached), for log collectors that parse lines.
vLLM configures its own ``vllm`` loggers (also in its engine processes): their
lines keep vLLM's format (``VLLM_LOGGING_CONFIG_PATH`` changes it).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Literal

LogFormat = Literal["text", "json"]


class JsonFormatter(logging.Formatter):
    """One JSON object per record; ``node`` names the process (worker node or gateway)."""

    def __init__(self, node: str) -> None:
        super().__init__()
        self.node = node

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "node": self.node,
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(level: str, log_format: LogFormat, node: str, text_format: str) -> None:
    """The root logger's one handler, on stderr: ``text_format`` lines or JSON objects."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(node) if log_format == "json" else logging.Formatter(text_format))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
