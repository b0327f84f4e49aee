"""Progress of the forward loop: samples, tokens/s, ETA, raw bytes written (before compression).

On a terminal it is a tqdm bar on stderr; elsewhere (SLURM logs, CI) it logs one line
every ``interval`` seconds, so log files stay readable instead of filling with redraws.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from dspark_precompute.humanize import human_bytes, human_seconds

log = logging.getLogger(__name__)


class Progress:
    def __init__(self, total_samples: int, total_tokens: int, enabled: bool = True, interval: float = 10.0):
        self.total_samples, self.total_tokens = total_samples, total_tokens
        self.samples = self.tokens = 0
        self.bytes = 0
        self.t0 = time.perf_counter()
        self.enabled = enabled
        self.interval = interval
        self._last = 0.0
        self._bar: Any = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, dynamic_ncols=True,
                             desc="precompute", file=sys.stderr, smoothing=0.1)

    def update(self, samples: int = 0, tokens: int = 0, bytes_written: int | None = None) -> None:
        self.samples += samples
        self.tokens += tokens
        if bytes_written is not None:
            self.bytes = bytes_written
        if self._bar is not None:
            self._bar.update(tokens)
            self._bar.set_postfix_str(f"{self.samples}/{self.total_samples} samples, "
                                      f"{human_bytes(self.bytes)} raw written", refresh=False)
            return
        now = time.perf_counter()
        if self.enabled and now - self._last >= self.interval:
            self._last = now
            log.info(self.line())

    def line(self) -> str:
        dt = max(1e-9, time.perf_counter() - self.t0)
        rate = self.tokens / dt
        left = (self.total_tokens - self.tokens) / rate if rate > 0 else 0.0
        pct = 100.0 * self.tokens / max(1, self.total_tokens)
        return (f"{pct:5.1f}% | {self.samples}/{self.total_samples} samples | {rate:,.0f} tok/s | "
                f"ETA {human_seconds(left)} | {human_bytes(self.bytes)} raw written")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(f"{self.samples}/{self.total_samples} samples, "
                                      f"{human_bytes(self.bytes)} raw written")
            self._bar.close()
            self._bar = None
        elif self.enabled:
            log.info(self.line())
