"""Where a cache's files live: a local directory (or, through fsspec, an object store).

Small files (manifest, commits, rejects, weights) go through :class:`CacheStore`, which
writes each one atomically (temporary name, fsync, rename) so a kill never leaves half a
file; zarr arrays go through the zarr store it hands out.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dspark_precompute.faults import fault_point


def is_url(path: str) -> bool:
    return "://" in str(path)


class CacheStore:
    """Byte-level access to one cache directory."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self.url = is_url(self.path)
        if self.url:
            import fsspec

            self.fs, self.root = fsspec.core.url_to_fs(self.path)
        else:
            self.root = str(Path(self.path).expanduser().resolve())

    def __repr__(self) -> str:
        return f"CacheStore({self.path!r})"

    def _local(self, key: str) -> Path:
        return Path(self.root) / key

    def exists(self, key: str = "") -> bool:
        if self.url:
            return self.fs.exists(f"{self.root}/{key}".rstrip("/"))
        return self._local(key).exists()

    def read_bytes(self, key: str) -> bytes:
        if self.url:
            return self.fs.cat_file(f"{self.root}/{key}")
        return self._local(key).read_bytes()

    def write_bytes(self, key: str, data: bytes) -> None:
        """Atomic: readers see the old file or the whole new one, never a part."""
        if self.url:  # object stores put whole objects atomically
            self.fs.pipe_file(f"{self.root}/{key}", data)
            return
        target = self._local(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            fault_point("atomic_write")
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dfd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def list_keys(self, prefix: str) -> list[str]:
        if self.url:
            base = f"{self.root}/{prefix}"
            if not self.fs.exists(base):
                return []
            return sorted(f"{prefix}/{p.rsplit('/', 1)[-1]}" for p in self.fs.ls(base, detail=False))
        d = self._local(prefix)
        if not d.is_dir():
            return []
        return sorted(f"{prefix}/{p.name}" for p in d.iterdir() if not p.name.startswith("."))

    def delete(self, key: str) -> None:
        if self.url:
            if self.fs.exists(f"{self.root}/{key}"):
                self.fs.rm(f"{self.root}/{key}", recursive=True)
            return
        p = self._local(key)
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)

    def remove_all(self) -> None:
        if self.url:
            if self.fs.exists(self.root):
                self.fs.rm(self.root, recursive=True)
            return
        shutil.rmtree(self.root, ignore_errors=True)

    def is_empty(self) -> bool:
        if self.url:
            return not self.fs.exists(self.root) or not self.fs.ls(self.root)
        p = Path(self.root)  # dotfiles (the writer lock, temporaries) do not make a cache
        return not p.exists() or not any(not c.name.startswith(".") for c in p.iterdir())

    def nbytes(self) -> int:
        """Bytes on disk (or in the bucket) under the cache."""
        if self.url:
            return int(sum(self.fs.du(self.root, total=False).values())) if self.fs.exists(self.root) else 0
        return sum(f.stat().st_size for f in Path(self.root).rglob("*") if f.is_file())

    def zarr_store(self, read_only: bool = False) -> Any:
        import zarr.storage

        if self.url:
            return zarr.storage.FsspecStore(self.fs, path=self.root, read_only=read_only)
        Path(self.root).mkdir(parents=True, exist_ok=True) if not read_only else None
        return zarr.storage.LocalStore(self.root, read_only=read_only)
