"""Checkpoint load progress for `parley serve`: a bar on a terminal (tqdm), a log line every
few seconds otherwise (a service's log has no terminal to redraw)."""

from __future__ import annotations

import logging
import sys
import time
from typing import IO

from tqdm import tqdm

log = logging.getLogger("parley.server")

LINE_EVERY_S = 5.0


class LoadProgress:
    """A `models.checkpoint.Progress` callback: (what, tensors done, tensors in total)."""

    def __init__(self, stream: IO[str] = sys.stderr) -> None:
        self._tty = stream.isatty()
        self._stream = stream
        self._bar: tqdm | None = None
        self._what = ""
        self._last_line = 0.0

    def __call__(self, what: str, done: int, total: int) -> None:
        if what != self._what:
            self.close()
            self._what, self._last_line = what, time.monotonic()
            if self._tty:
                self._bar = tqdm(total=total, desc=f"loading {what}", unit="tensor", file=self._stream, leave=False)
        if self._bar is not None:
            self._bar.update(done - self._bar.n)
        elif time.monotonic() - self._last_line >= LINE_EVERY_S or done == total:
            self._last_line = time.monotonic()
            log.info("loading %s: %d%% (%d/%d tensors)", what, done * 100 // total, done, total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
