"""The progress bar of long loads."""

from __future__ import annotations

import sys
import time

from ._format import _PROGRESS_MIN_BYTES


class _Progress:
    """A one-line progress bar on stderr, redrawn at most ten times a second."""

    def __init__(self, label: str, total: int, enabled: bool | None) -> None:
        if enabled is None:
            enabled = total >= _PROGRESS_MIN_BYTES and _stderr_is_tty()
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
        frac = self.done / self.total if self.total else 1.0
        width = 30
        bar = "#" * int(frac * width)
        rate = self.done / max(now - self.start, 1e-9) / 1e9
        sys.stderr.write(
            f"\r{self.label} [{bar:<{width}}] {frac * 100:5.1f}% "
            f"{self.done / 2**30:.2f}/{self.total / 2**30:.2f} GiB {rate:.2f} GB/s"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            if self.drawn != self.done:  # the final state is drawn once
                self._draw(time.perf_counter())
            sys.stderr.write("\n")
            sys.stderr.flush()


def _stderr_is_tty() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False
