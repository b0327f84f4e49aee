"""Typed errors. Each one says what value is wrong, why, and what to do next."""

from __future__ import annotations

import errno as _errno


class DsparkError(Exception):
    """Base class for every error this package raises on purpose."""

    exit_code = 2  # a user-facing problem: the message says what to change


class ConfigError(DsparkError, ValueError):
    """One or more configuration values are invalid; all problems are listed together."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")


def difference_rows(differences: list[tuple[str, object, object]]) -> str:
    """What a resume found changed, one ``key: recorded ..., requested ...`` line each (every refusal to resume)."""
    return "\n".join(f"  - {k}: recorded {r!r}, requested {q!r}" for k, r, q in differences)


class IncompatibleCacheError(DsparkError):
    """The cache at storage.path was written with a different configuration."""

    def __init__(self, path: str, differences: list[tuple[str, object, object]]):
        self.path = path
        self.differences = differences
        rows = difference_rows(differences)
        super().__init__(
            f"refusing to resume into {path}: it was written with a different configuration.\n{rows}\n"
            "Re-run with the recorded settings, choose another storage.path, or pass overwrite=true "
            "to delete the cache and start over."
        )


class CacheFormatError(DsparkError):
    """A cache on disk is missing pieces, has the wrong version, or is malformed."""


class NotRegularFileError(CacheFormatError, OSError):
    """An entry of a cache that must be a file is something else (a directory, a FIFO, a device, a socket).

    It is never read: a FIFO would block the reader forever. An ``OSError`` too, so code that
    treats an unreadable file as absent keeps doing so. ``kind`` says what it is ("a FIFO (named pipe)").
    """

    def __init__(self, message: str, *, kind: str = "not a regular file"):
        self.kind = kind
        super().__init__(message)


class ForeignDirectoryError(CacheFormatError):
    """storage.path holds files this tool did not write: it is neither used nor cleared."""


class IncompleteCacheError(CacheFormatError):
    """The cache has not been finished; readers refuse it unless allow_incomplete=True."""


class ChecksumError(CacheFormatError):
    """Stored bytes do not match their checksum (a chunk's crc32c, the weights file's sha256): they are corrupt.

    ``ChecksumError(message)`` alone (how a DataLoader worker's exception is rebuilt in the
    main process) keeps the message and leaves ``array``/``chunk`` unset.
    """

    def __init__(self, array: str, chunk: tuple[int, ...] | str | None = None, detail: str = "", *,
                 file: str | None = None):
        self.array: str | None = array
        self.chunk = chunk
        self.file = file
        if file is not None:
            message = (f"checksum mismatch in {file}: the stored bytes are corrupt or were replaced"
                       + (f" ({detail})" if detail else "")
                       + ". Re-run the precompute job with the same command to rewrite it, or re-create the cache.")
        elif chunk is None:
            self.array = None
            message = array
        else:
            message = (f"checksum mismatch in array {array!r}, chunk {chunk}: the stored bytes are corrupt"
                       + (f" ({detail})" if detail else "")
                       + ". Run `dspark-cache verify --repair PATH` or re-run the precompute job to rewrite it.")
        super().__init__(message)


class ExportError(DsparkError, ValueError):
    """An export cannot be written as asked: the cache lacks what the target format needs, or an option does not fit it.

    The message names the value, why the format cannot take it, and the fix (a precompute
    option such as ``capture.last_state=pre_norm``, another ``--layers``, a destination).
    """


class MissingChunkError(CacheFormatError):
    """A chunk file of a written array is absent: read through zarr it would come back as zeros.

    The writer writes every chunk of a committed unit (empty ones included) and every chunk
    of the sample/unit tables, so an absent one is always damage. ``array``, ``chunk`` and
    ``samples`` (the sample ids whose tokens it holds) name it; built from a message alone
    (a DataLoader worker's exception re-raised) they are unset.
    """

    def __init__(self, message: str, *, array: str | None = None, chunk: tuple[int, ...] | None = None,
                 samples: tuple[int, ...] = ()):
        self.array = array
        self.chunk = chunk
        self.samples = tuple(samples)
        super().__init__(message)


class DamagedShardError(CacheFormatError):
    """A shard object of a token array cannot be trusted: its index fails its checksum (a flipped byte, a
    truncated or overwritten object) or points outside the object, an inner chunk it names is cut short, or
    (format 3) it, or a chunk in it, is not what its unit's commit record binds to that place.

    ``array``, ``shard`` (the object's grid index) and ``samples`` (the sample ids with tokens in it)
    name it; ``checksum`` says whether the index's own crc32c failed, ``misplaced`` whether the shard
    disagrees with its record (moved, copied from another cache, reordered). Nothing is decoded from it.
    """

    def __init__(self, message: str, *, array: str | None = None, shard: tuple[int, ...] | None = None,
                 samples: tuple[int, ...] = (), checksum: bool = False, misplaced: bool = False):
        self.array = array
        self.shard = shard
        self.samples = tuple(samples)
        self.checksum = checksum
        self.misplaced = misplaced
        super().__init__(message)


class LoaderStateError(DsparkError, ValueError):
    """A saved loader position does not fit this loader (another cache, plan or world size): resuming would
    repeat or skip samples."""


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


class NonFiniteStatesError(DsparkError):
    """A sample's hidden states hold NaN or Inf and ``data.on_nonfinite=error``."""


class RankFailedError(DsparkError):
    """Another rank of the same torchrun/SLURM job failed; this one stops too."""


class MissingDependencyError(DsparkError, ImportError):
    """An optional extra needed for this feature is not installed (the message names the pip extra)."""


# what an OS error of a write means, in words, and what makes the place writable again
_WRITE_FAILURES = {
    _errno.ENOSPC: ("the disk is full", "free space on that disk"),
    _errno.EDQUOT: ("the disk quota is used up", "free space or raise the quota"),
    _errno.EROFS: ("the file system is read-only", "make it writable"),
    _errno.EACCES: ("permission denied", "fix its permissions"),
    _errno.EPERM: ("permission denied", "fix its permissions"),
    _errno.ENOENT: ("a directory on the path does not exist", "create it"),
    _errno.ENOTDIR: ("a part of the path is not a directory", "fix the path"),
}


class StorageWriteError(DsparkError):
    """Writing a cache or an export failed (a full disk, a read-only or unwritable path, a failing object store).

    ``errno`` is the OS error's number when one caused it (``errno.ENOSPC``: the disk is full).
    """

    def __init__(self, message: str, *, errno: int | None = None):
        self.errno = errno
        super().__init__(message)

    @classmethod
    def of(cls, exc: OSError, doing: str, then: str, instead: str | None = None) -> StorageWriteError:
        """The error for ``exc`` raised while ``doing`` (which names the path): why in words (the disk is full),
        what fixes that place (or ``instead``, another way out), then what to run."""
        why, fix = _WRITE_FAILURES.get(exc.errno or 0, (exc.strerror or "the write failed", "fix the storage"))
        fix = f"{fix} or {instead}" if instead else fix
        return cls(f"{doing} failed: {why} ({exc}). {fix[0].upper()}{fix[1:]}, then {then}.", errno=exc.errno)


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


class RegenerateError(DsparkError):
    """Regeneration cannot start or go on: no server answers, or it serves another model than asked."""


class RegenerateResumeError(RegenerateError):
    """The regenerated rows already on disk were made with other settings: resuming would mix two recipes."""

    def __init__(self, path: str, differences: list[tuple[str, object, object]]):
        self.path = path
        self.differences = differences
        rows = difference_rows(differences)
        super().__init__(
            f"refusing to resume the regeneration in {path}: its rows were made with other settings.\n{rows}\n"
            "Re-run with the recorded settings, give another regenerate.output, or delete that directory to "
            "start the regeneration over."
        )


class WindowError(DsparkError):
    """A windowed (streamed) cache cannot go on as asked: a window on a finished cache, a stalled trainer, a second
    trainer group, a released unit asked for."""


class ReleasedUnitError(WindowError, MissingChunkError):
    """A unit's hidden states were released by the stream's trainer and deleted: gone on purpose, not damage
    (a MissingChunkError too: it is a chunk that is not there, and code catching that catches this)."""

    def __init__(self, message: str, *, unit: int | None = None, array: str | None = None,
                 chunk: tuple[int, ...] | None = None, samples: tuple[int, ...] = ()):
        MissingChunkError.__init__(self, message, array=array, chunk=chunk, samples=samples)
        self.unit = unit
