"""A progress bar that goes through ``logging``: samples, tokens/s, ETA, bytes written.

On a terminal it redraws one line on stderr; elsewhere (SLURM logs, CI) it logs a line
every ``interval`` seconds so log files stay readable.
"""

from __future__ import annotations

import logging
import sys
import time

from dspark_precompute.humanize import human_bytes, human_seconds

log = logging.getLogger(__name__)


class Progress:
    def __init__(self, total_samples: int, total_tokens: int, enabled: bool = True, interval: float = 10.0):
        self.total_samples, self.total_tokens = total_samples, total_tokens
        self.samples = self.tokens = 0
        self.bytes = 0
        self.t0 = time.perf_counter()
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.interval = interval if not self.tty else 0.2
        self._last = 0.0

    def update(self, samples: int = 0, tokens: int = 0, bytes_written: int | None = None) -> None:
        self.samples += samples
        self.tokens += tokens
        if bytes_written is not None:
            self.bytes = bytes_written
        now = time.perf_counter()
        if self.enabled and now - self._last >= self.interval:
            self._last = now
            self._emit(final=False)

    def line(self) -> str:
        dt = max(1e-9, time.perf_counter() - self.t0)
        rate = self.tokens / dt
        left = (self.total_tokens - self.tokens) / rate if rate > 0 else 0.0
        pct = 100.0 * self.tokens / max(1, self.total_tokens)
        return (f"{pct:5.1f}% | {self.samples}/{self.total_samples} samples | {rate:,.0f} tok/s | "
                f"ETA {human_seconds(left)} | {human_bytes(self.bytes)} written")

    def _emit(self, final: bool) -> None:
        if self.tty:
            sys.stderr.write("\r" + self.line() + ("\n" if final else ""))
            sys.stderr.flush()
        else:
            log.info(self.line())

    def close(self) -> None:
        if self.enabled:
            self._emit(final=True)
