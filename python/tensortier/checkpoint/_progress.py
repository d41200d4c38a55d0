"""The progress bar of long loads."""

from __future__ import annotations

import sys
import time

from ._format import _PROGRESS_MIN_BYTES, _require


class _Progress:
    """A one-line progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self, label: str, total: int, enabled: bool | None) -> None:
        if enabled is None:
            try:
                enabled = total >= _PROGRESS_MIN_BYTES and sys.stderr.isatty()
            except (AttributeError, ValueError):  # no stderr (None), or a closed one
                enabled = False
        self.enabled = bool(enabled) and total > 0
        self.label = label
        self.total = total
        self.done = 0
        self.start = time.perf_counter()
        self.last = 0.0
        self.drawn = -1  # `done` at the last draw

    def update(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.last >= 0.1 or self.done >= self.total:
            self.last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        self.drawn = self.done
        # The line is the pipeline's (ProgressLine in C++, the CLI's too); written here, through
        # sys.stderr.
        sys.stderr.write(_require("progress_line")(self.label, self.done, self.total,
                                                   now - self.start))
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            if self.drawn != self.done:  # the final state is drawn once
                self._draw(time.perf_counter())
            sys.stderr.write("\n")
            sys.stderr.flush()
