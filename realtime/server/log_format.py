"""One log format for the whole process: Parley's loggers and uvicorn's go through the root
handler installed here (uvicorn is started with `log_config=None`, so it adds no handlers of
its own). `text` is `2026-01-01 12:00:00,000 INFO parley.server: ...`; `json` is one object a
line with `time` (ISO 8601, UTC), `level`, `logger`, `message` and `exception` when there is one.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
                 .isoformat(timespec="milliseconds"),
                 "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def formatter(kind: str) -> logging.Formatter:
    return JsonFormatter() if kind == "json" else logging.Formatter(TEXT_FORMAT)


def current_kind() -> str:
    """The format the process logs in (`json` once configure_logging installed it), so worker
    processes started later log in it too."""
    return "json" if any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers) else "text"


def configure_logging(level: str = "info", kind: str = "text") -> None:
    """Install the single root handler (stderr) in format `kind`; uvicorn's loggers propagate to it."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(kind))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uv = logging.getLogger(name)
        uv.handlers.clear()
        uv.setLevel(logging.NOTSET)  # follow the root's level (an earlier uvicorn.Config may have set one)
        uv.propagate = True
