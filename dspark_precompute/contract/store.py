"""Where a cache's files live: a local directory (or, through fsspec, an object store).

Small files (manifest, commits, rejects, weights) go through :class:`CacheStore`, which
writes each one atomically (temporary name, fsync, rename) so a kill never leaves half a
file; zarr arrays go through the zarr store it hands out.

A URL (``s3://bucket/prefix``, ``gs://...``) goes through fsspec (``pip install
'dspark-precompute[s3]'`` for S3). Its options come from the environment so that the
spawned writer process, which opens the store from the URL alone, gets the same ones:
``DSPARK_STORAGE_OPTIONS`` (a JSON object of fsspec options, e.g. ``{"anon": false}``),
then, for S3, the endpoint in ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` (MinIO,
Ceph, a local test server); credentials are left to botocore's usual chain
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, instance roles). No
option is ever logged or put in a ``repr``.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import io
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from dspark_precompute.contract.spec import TEMPORARY
from dspark_precompute.errors import NotRegularFileError
from dspark_precompute.faults import fault_point

STORAGE_OPTIONS_ENV = "DSPARK_STORAGE_OPTIONS"
_S3_PROTOCOLS = ("s3", "s3a")


@functools.cache
def _umask() -> int:
    """The process umask, read once when first needed (reading it means setting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(path: str | Path) -> None:
    """Make a rename (or a new file) in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, parts: Iterable[Any], *, tmp: Path | None = None, fsync: bool = True,
                     faults: bool = False, before_publish: Callable[[], None] | None = None) -> int:
    """``parts`` (buffers, taken one at a time) written one after the other as ``path``, whole or not at all; the
    bytes written. The one atomic file writer of the package (the cache's files, exports, the regeneration log).

    A temporary beside ``path`` (``tmp``, else mkstemp's ``.<name>.<8 random>.tmp``, given the umask's mode:
    readers may be other users) is written, fsynced, renamed over ``path``, and the directory fsynced (both
    skipped when ``fsync`` is false), so after a power loss the file is absent or whole. Any error removes
    the temporary and propagates: callers wrap it in their own message. ``faults``: the crash tests'
    ``write_part`` and ``atomic_write`` points (the cache's own files only, so their counts stay the cache's).
    ``before_publish``: called last before the rename; what it raises leaves nothing (a writer whose run died).
    """
    made = tmp is None
    if tmp is None:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        tmp = Path(name)
    else:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        if made:
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600
        written = 0
        with os.fdopen(fd, "wb") as fh:  # buffered: many small parts (log lines) cost few syscalls
            for part in parts:
                view = memoryview(part).cast("B")
                written += view.nbytes
                fh.write(view)  # a buffered write writes it all (or raises)
                if faults:
                    fh.flush()  # a kill here leaves exactly the parts before it on disk
                    fault_point("write_part")
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        if faults:
            fault_point("atomic_write")
        if before_publish is not None:
            before_publish()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)
    return written


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def open_regular(path: str | Path) -> io.FileIO:
    """``path`` opened for unbuffered binary reading, only when it is a regular file (or a symlink to one).

    Opened non-blocking first, so a FIFO put where a file belongs cannot hang the reader (a plain
    ``open`` waits forever for a writer); a directory, FIFO, device or socket raises
    :class:`~dspark_precompute.errors.NotRegularFileError` (a CacheFormatError and an OSError)
    naming what it is, and so does a symlink loop. Missing files raise FileNotFoundError as usual.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise NotRegularFileError(f"{path} is a symlink loop, not a file: the cache was altered (this tool writes "
                                  "only regular files); it is not read. Put the file back or re-create the cache",
                                  kind="a symlink loop") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            raise NotRegularFileError(f"{path} is {kind}, not a file: the cache was altered (this tool writes only "
                                      "regular files); it is not read. Put the file back or re-create the cache",
                                      kind=kind)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def is_url(path: str) -> bool:
    return "://" in str(path)


def storage_options(path: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """fsspec options for ``path``: ``$DSPARK_STORAGE_OPTIONS``, then ``options``, then S3's endpoint.

    Listing caches are off: the writer process adds commit records behind this process's
    back, and a cached listing would hide them.
    """
    opts: dict[str, Any] = {}
    raw = os.environ.get(STORAGE_OPTIONS_ENV, "").strip()
    if raw:
        try:
            env_opts = json.loads(raw)
        except json.JSONDecodeError as exc:  # never echo the value: it may hold a secret
            raise ValueError(f"${STORAGE_OPTIONS_ENV} is not valid JSON ({exc.msg} at char {exc.pos})") from None
        if not isinstance(env_opts, dict):
            raise ValueError(f"${STORAGE_OPTIONS_ENV} must be a JSON object of fsspec storage options")
        opts.update(env_opts)
    opts.update(options or {})
    protocol = str(path).split("://", 1)[0].lower()
    if protocol in _S3_PROTOCOLS:
        client_kwargs = opts.get("client_kwargs") or {}
        if not opts.get("endpoint_url") and not client_kwargs.get("endpoint_url"):
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
            if endpoint:
                opts["endpoint_url"] = endpoint
    opts.setdefault("use_listings_cache", False)
    return opts


class CacheStore:
    """Byte-level access to one cache directory."""

    def __init__(self, path: str | Path, options: dict[str, Any] | None = None):
        self.path = str(path).rstrip("/") if is_url(str(path)) else str(path)
        self.url = is_url(self.path)
        if self.url:
            import fsspec

            self._options = storage_options(self.path, options)
            try:
                self.fs, root = fsspec.core.url_to_fs(self.path, **self._options)
            except ImportError as exc:
                raise ImportError(f"storage.path={self.path!r} needs an fsspec backend that is not installed "
                                  f"({exc}); for s3:// run: pip install 'dspark-precompute[s3]'") from None
            self.root = root.rstrip("/")
        else:
            self.root = str(Path(self.path).expanduser().resolve())

    def __repr__(self) -> str:
        return f"CacheStore({self.path!r})"

    def _local(self, key: str) -> Path:
        return Path(self.root) / key

    def _remote(self, key: str = "") -> str:
        return f"{self.root}/{key.strip('/')}".rstrip("/")

    def exists(self, key: str = "") -> bool:
        if self.url:
            return bool(self.fs.exists(self._remote(key)))
        return self._local(key).exists()

    def read_bytes(self, key: str) -> bytes:
        if self.url:
            return bytes(self.fs.cat_file(self._remote(key)))
        with open_regular(self._local(key)) as fh:
            return bytes(fh.read())

    def write_bytes(self, key: str, data: bytes, fsync: bool = True) -> None:
        """Atomic: readers see the old file or the whole new one, never a part."""
        self.write_parts(key, [data], fsync)

    def write_parts(self, key: str, parts: Iterable[Any], fsync: bool = True,
                    before_publish: Callable[[], None] | None = None) -> int:
        """``parts`` (buffers, taken one at a time) written one after the other as the object ``key``,
        atomically; the bytes written.

        Locally: a temporary in the same directory, written, fsynced (unless ``fsync`` is
        false), renamed over ``key``, and the directory fsynced, so after a power loss the
        file is either absent or whole. On an object store: one object, uploaded in parts
        when large (a multipart upload completed only when every part is in, aborted on an
        error), so it appears whole or not at all. ``before_publish`` runs just before the object appears (the
        rename; the upload's completion): what it raises aborts the write.
        """
        if self.url:
            return self._put_parts(key, parts, before_publish)
        target = self._local(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        return write_atomically(target, parts, fsync=fsync, faults=True, before_publish=before_publish)

    def _put_parts(self, key: str, parts: Iterable[Any], before_publish: Callable[[], None] | None = None) -> int:
        """One object from ``parts``: fsspec's buffered writer uploads blocks as they fill (multipart) and
        completes the upload on close; an error aborts it, so no partial object ever appears."""
        fh = self.fs.open(self._remote(key), "wb")
        written = 0
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                fh.write(view)
                written += view.nbytes
                fault_point("write_part")
            fault_point("atomic_write")
            if before_publish is not None:
                before_publish()
        except BaseException:
            discard = getattr(fh, "discard", None)
            if discard is not None:
                discard()
            raise
        fh.close()
        return written

    def temporaries(self) -> list[str]:
        """Keys of the files named like a temporary of an atomic write (``.c.3.0.<8 random>.tmp``); none on object
        stores. Which of them this tool left is for the caller to judge (``spec.is_own_temporary_key``)."""
        if self.url:
            return []
        root = Path(self.root)
        return sorted(p.relative_to(root).as_posix() for p in root.rglob(".*.tmp")
                      if p.is_file() and TEMPORARY.match(p.name))

    def read_range(self, key: str, start: int, end: int) -> bytes | None:
        """Bytes ``[start, end)`` of object ``key`` (fewer at its end); None when it does not exist."""
        if self.url:
            try:
                return bytes(self.fs.cat_file(self._remote(key), start=start, end=end))
            except FileNotFoundError:
                return None
        try:
            with open_regular(self._local(key)) as fh:
                return os.pread(fh.fileno(), max(0, end - start), start)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError, NotRegularFileError):
            return None

    def size(self, key: str) -> int | None:
        """The size of object ``key`` in bytes; None when it does not exist."""
        if self.url:
            try:
                return int(self.fs.size(self._remote(key)))
            except FileNotFoundError:
                return None
        try:
            return self._local(key).stat().st_size
        except (FileNotFoundError, NotADirectoryError):
            return None

    def entries(self) -> tuple[int, int]:
        """(files, directories) under the cache, dotfiles included (on an object store: objects, 0)."""
        if self.url:
            return len(self._files()), 0
        files = dirs = 0
        for _root, dnames, fnames in os.walk(self.root):
            files += len(fnames)
            dirs += len(dnames)
        return files, dirs

    def list_keys(self, prefix: str) -> list[str]:
        if self.url:
            names = self._children(self._remote(prefix))
            return sorted(f"{prefix.strip('/')}/{n}" if prefix.strip("/") else n for n in names)
        d = self._local(prefix)
        if not d.is_dir():
            return []
        return sorted(f"{prefix}/{p.name}" for p in d.iterdir() if not p.name.startswith("."))

    def _children(self, base: str) -> list[str]:
        """Names directly under ``base`` in the object store (no dotfiles, like the local branch)."""
        try:
            entries = self.fs.ls(base, detail=False)
        except FileNotFoundError:
            return []
        base = base.rstrip("/")
        names = {str(p).rstrip("/").rsplit("/", 1)[-1] for p in entries if str(p).rstrip("/") != base}
        return [n for n in names if n and not n.startswith(".")]

    def _files(self) -> dict[str, int]:
        """Every object under the cache with its size."""
        try:
            found = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return {}
        return {p: int(info.get("size") or 0) for p, info in found.items() if info.get("type", "file") == "file"}

    def delete(self, key: str) -> None:
        if self.url:
            target = self._remote(key)
            if not key.strip("/"):
                raise ValueError("delete('') would delete the whole cache; use remove_all()")
            try:
                self.fs.rm(target, recursive=True)
            except FileNotFoundError:
                pass
            return
        p = self._local(key)
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)

    def remove_all(self) -> None:
        if self.url:  # the objects only: a cache at a bucket's top level must not take the bucket along
            files = sorted(self._files())
            if files:
                self.fs.rm(files)
            return
        shutil.rmtree(self.root, ignore_errors=True)

    def file_keys(self, prefixes: Iterable[str]) -> list[str]:
        """Keys of every file (object) below each of ``prefixes`` (directories of the cache), recursively."""
        out: list[str] = []
        for prefix in prefixes:
            if self.url:
                base = self._remote(prefix)
                try:
                    found = self.fs.find(base)
                except FileNotFoundError:
                    continue
                out += [f"{prefix}/{str(p)[len(base):].lstrip('/')}" for p in found if str(p).rstrip("/") != base]
                continue
            top = self._local(prefix)
            if top.is_symlink() or not top.is_dir():
                continue
            for root, _dirs, files in os.walk(top):
                rel = Path(root).relative_to(self.root).as_posix()
                out += [f"{rel}/{f}" for f in files]
        return sorted(out)

    def top_level_names(self) -> list[str]:
        """Every entry directly under the cache (dotfiles included), sorted; [] when it does not exist."""
        if self.url:
            try:
                entries = self.fs.ls(self.root, detail=False)
            except FileNotFoundError:
                return []
            base = self.root.rstrip("/")
            return sorted({str(p).rstrip("/").rsplit("/", 1)[-1] for p in entries if str(p).rstrip("/") != base})
        p = Path(self.root)
        return sorted(c.name for c in p.iterdir()) if p.is_dir() else []

    def is_empty(self) -> bool:
        if self.url:
            return not self._children(self.root)
        p = Path(self.root)  # dotfiles (the writer lock, temporaries) do not make a cache
        return not p.exists() or not any(not c.name.startswith(".") for c in p.iterdir())

    def nbytes(self) -> int:
        """Bytes on disk (or in the bucket) under the cache."""
        if self.url:
            return sum(self._files().values())
        return sum(f.stat().st_size for f in Path(self.root).rglob("*") if f.is_file())

    def sha256(self, key: str) -> str:
        """sha256 of one stored file, streamed for a local cache (the weights of a large target are GBs)."""
        h = hashlib.sha256()
        if self.url:
            h.update(self.read_bytes(key))
        else:
            with open_regular(self._local(key)) as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
        return h.hexdigest()

    def zarr_store(self, read_only: bool = False) -> Any:
        import zarr.storage

        if self.url:  # zarr wants an asynchronous filesystem instance: from_url asks fsspec for one
            return zarr.storage.FsspecStore.from_url(self.path, storage_options=dict(self._options),
                                                     read_only=read_only)
        Path(self.root).mkdir(parents=True, exist_ok=True) if not read_only else None
        return zarr.storage.LocalStore(self.root, read_only=read_only)
