"""Typed errors. Each one says what value is wrong, why, and what to do next."""

from __future__ import annotations


class DsparkError(Exception):
    """Base class for every error this package raises on purpose."""

    exit_code = 2  # a user-facing problem: the message says what to change


class ConfigError(DsparkError, ValueError):
    """One or more configuration values are invalid; all problems are listed together."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")


class IncompatibleCacheError(DsparkError):
    """The cache at storage.path was written with a different configuration."""

    def __init__(self, path: str, differences: list[tuple[str, object, object]]):
        self.path = path
        self.differences = differences
        rows = "\n".join(f"  - {k}: recorded {r!r}, requested {q!r}" for k, r, q in differences)
        super().__init__(
            f"refusing to resume into {path}: it was written with a different configuration.\n{rows}\n"
            "Re-run with the recorded settings, choose another storage.path, or pass overwrite=true "
            "to delete the cache and start over."
        )


class CacheFormatError(DsparkError):
    """A cache on disk is missing pieces, has the wrong version, or is malformed."""


class ForeignDirectoryError(CacheFormatError):
    """storage.path holds files this tool did not write: it is neither used nor cleared."""


class IncompleteCacheError(CacheFormatError):
    """The cache has not been finished; readers refuse it unless allow_incomplete=True."""


class ChecksumError(CacheFormatError):
    """A stored chunk does not match its checksum: the bytes on disk are corrupt."""

    def __init__(self, array: str, chunk: tuple[int, ...] | str, detail: str = ""):
        self.array = array
        self.chunk = chunk
        super().__init__(
            f"checksum mismatch in array {array!r}, chunk {chunk}: the stored bytes are corrupt"
            + (f" ({detail})" if detail else "")
            + ". Run `dspark-cache verify --repair PATH` or re-run the precompute job to rewrite it."
        )


class DataError(DsparkError):
    """The input data cannot be read or too many of its rows are invalid."""


class InvalidRowError(DataError):
    """One input row cannot become a sample (raised only with data.on_invalid=error)."""

    def __init__(self, source: str, row: int, reason: str, message: str):
        self.source, self.row, self.reason, self.detail = source, row, reason, message
        super().__init__(f"{source}: row {row} is invalid ({reason}): {message}")


class TargetError(DsparkError):
    """The target model cannot be loaded or is of an unsupported kind."""


class LockedError(DsparkError):
    """Another live run holds the cache's writer lock."""


class StorageWriteError(DsparkError):
    """Writing to the cache failed (disk full, permissions, failing object store)."""


class StoppedBySignal(BaseException):
    """SIGINT/SIGTERM stopped the command; nothing half-written is left behind.

    A BaseException, like KeyboardInterrupt: code that turns any ``Exception`` into a
    typed result (a row's template error becomes a reject) must never swallow a stop.
    """

    exit_code = 130

    def __init__(self, signum: int, detail: str = ""):
        import signal as _signal

        self.signum = signum
        self.exit_code = 128 + signum
        name = _signal.Signals(signum).name
        super().__init__(f"stopped by {name}{detail}; resume with the same command")


class InterruptedRunError(StoppedBySignal):
    """SIGINT/SIGTERM stopped the run; the cache is resumable."""

    def __init__(self, signum: int, path: str, committed: int, total: int):
        super().__init__(signum, f" with {committed}/{total} units committed in {path}")
