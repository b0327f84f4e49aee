"""Progress of a run's forward loop and of an export: samples, tokens/s, MB/s, ETA, bytes written.

One reporter for both sides (a shared leaf: it imports only ``humanize``). On a terminal it
is a tqdm bar on stderr; elsewhere (SLURM logs, CI) it logs one line every ``interval``
seconds and one at the end, so log files stay readable instead of filling with redraws.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from dspark_precompute.humanize import human_bytes, human_seconds

log = logging.getLogger(__name__)


class Progress:
    """``what`` names the work in the bar and the log lines ("precompute", "export nemo"); ``written`` says what
    the byte count is ("raw written": states before compression). ``total_samples`` None: the count is shown
    without a total."""

    def __init__(self, what: str, total_tokens: int, total_samples: int | None = None, *, enabled: bool = True,
                 interval: float = 10.0, written: str = "written"):
        self.what, self.written = what, written
        self.total_tokens, self.total_samples = int(total_tokens), total_samples
        self.samples = self.tokens = self.bytes = 0
        self.t0 = time.perf_counter()
        self._last = self.t0
        self.enabled, self.interval = enabled, interval
        self._bar: Any = None
        self.status = ""  # what the work waits on, when it waits (a window waiting for the trainer)
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=self.total_tokens, unit="tok", unit_scale=True, dynamic_ncols=True, desc=what,
                             file=sys.stderr, smoothing=0.1)

    def update(self, samples: int = 0, tokens: int = 0, nbytes: int = 0, *, bytes_total: int | None = None) -> None:
        """``samples`` and ``tokens`` done since the last call, and ``nbytes`` more written (or ``bytes_total``
        written so far, where the writer counts them)."""
        self.samples += samples
        self.tokens += tokens
        self.bytes = self.bytes + nbytes if bytes_total is None else int(bytes_total)
        if self._bar is not None:
            self._bar.update(tokens)
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            return
        now = time.perf_counter()
        if self.enabled and now - self._last >= self.interval:
            self._last = now
            log.info("%s: %s", self.what, self.line())

    def note(self, status: str) -> None:
        """Show ``status`` after the counts ("" clears it); logged at once when there is no bar."""
        self.status = status
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix())
        elif self.enabled and status:
            log.info("%s: %s", self.what, self.line())

    def _samples(self) -> str:
        return f"{self.samples}" if self.total_samples is None else f"{self.samples}/{self.total_samples}"

    def _postfix(self) -> str:
        return f"{self._samples()} samples, {human_bytes(self.bytes)} {self.written}" + (
            f", {self.status}" if self.status else "")

    def line(self) -> str:
        dt = max(1e-9, time.perf_counter() - self.t0)
        rate = self.tokens / dt
        left = (self.total_tokens - self.tokens) / rate if rate > 0 else 0.0
        pct = 100.0 * self.tokens / max(1, self.total_tokens)
        return (f"{pct:5.1f}% | {self._samples()} samples | {rate:,.0f} tok/s | {self.bytes / dt / 1e6:,.1f} MB/s | "
                f"ETA {human_seconds(left)} | {human_bytes(self.bytes)} {self.written}"
                + (f" | {self.status}" if self.status else ""))

    def close(self) -> None:
        """The bar's last state (or the last log line); a second call does nothing."""
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix())
            self._bar.close()
            self._bar = None
        elif self.enabled:
            log.info("%s: %s", self.what, self.line())
        self.enabled = False
