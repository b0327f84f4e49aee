"""A shared-memory region that batches are built into and recycled from.

Fresh memory is expensive: every new page is a fault plus zeroing by the kernel (measured
here: about 1 ms per MB for a new shared page against 0.13 ms per MB to rewrite one
already in use), and a batch of 8 padded rows of a 6 KB/token cache is about 60 MB. So
the loader creates one region of shared anonymous memory before its workers fork; they
inherit the mapping, the training process hands each task extents of it (with the task
number, in the DataLoader's index), a worker writes each batch into its extent and sends
back only a small :class:`SharedBatch` description, and the training process wraps the
extent as tensors without a copy. An extent returns to the region when the last tensor
(or view, or numpy array) using its memory is freed, so a batch a training step still
holds is never overwritten. When the region is full a batch goes to fresh shared memory
instead: slower, never blocked.

The region is anonymous (``MAP_SHARED | MAP_ANONYMOUS``): it has no name in ``/dev/shm``
and the kernel frees it with the last process that maps it, SIGKILL included.
"""

from __future__ import annotations

import mmap
import os
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

PAGE = 4096
_ARENAS: weakref.WeakValueDictionary[str, BatchArena] = weakref.WeakValueDictionary()
_DTYPES = {str(d): d for d in (torch.int64, torch.bfloat16, torch.float16, torch.float32)}


class BatchArena:
    """``nbytes`` of shared memory, handed out in page-aligned extents by the process that created it."""

    def __init__(self, nbytes: int):
        self.nbytes = max(PAGE, -(-int(nbytes) // PAGE) * PAGE)
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_SHARED)  # anonymous: inherited across fork
        self._array = np.frombuffer(self._map, dtype=np.uint8)
        self.id = uuid.uuid4().hex
        self.owner = os.getpid()
        self._lock = threading.RLock()  # frees run from finalizers, possibly inside an alloc
        self._free: list[list[int]] = [[0, self.nbytes]]  # sorted [offset, size]
        self._issued: dict[int, tuple[int, int]] = {}  # offset -> (size, tag): handed out, not yet wrapped
        self.in_use = 0
        self.peak = 0
        self.fallbacks = 0  # batches that did not fit and went to fresh memory
        _ARENAS[self.id] = self

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a BatchArena is inherited by forked workers, never pickled")

    @property
    def mine(self) -> bool:
        """Whether this process allocates from it (the one that created it)."""
        return os.getpid() == self.owner

    def alloc(self, nbytes: int, tag: int = 0) -> int | None:
        """The offset of an extent of ``nbytes`` (rounded up to pages), or None when none is free.

        The extent is *issued* until :meth:`tensor` wraps it; :meth:`sweep` takes back the
        issued extents of other tags (a pass whose results were dropped)."""
        size = max(PAGE, -(-int(nbytes) // PAGE) * PAGE)
        with self._lock:
            for k, (off, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[k]
                    else:
                        self._free[k] = [off + size, free - size]
                    self.in_use += size
                    self.peak = max(self.peak, self.in_use)
                    self._issued[off] = (size, tag)
                    return off
            self.fallbacks += 1
            return None

    def sweep(self, keep_tag: int) -> int:
        """Free every issued extent not tagged ``keep_tag``; call only when no worker can still write one."""
        with self._lock:
            gone = [(off, size) for off, (size, tag) in self._issued.items() if tag != keep_tag]
            for off, size in gone:
                del self._issued[off]
                self.free(off, size)
            return len(gone)

    def free(self, offset: int, nbytes: int) -> None:
        size = max(PAGE, -(-int(nbytes) // PAGE) * PAGE)
        with self._lock:
            if any(off <= offset < off + sz for off, sz in self._free):
                raise RuntimeError(f"arena extent at {offset} freed twice; a batch buffer would be handed out while "
                                   "in use (a bug in dspark_precompute; please report it)")
            self.in_use -= size
            k = 0
            while k < len(self._free) and self._free[k][0] < offset:
                k += 1
            self._free.insert(k, [offset, size])
            if k + 1 < len(self._free) and offset + size == self._free[k + 1][0]:  # join the next
                self._free[k][1] += self._free.pop(k + 1)[1]
            if k > 0 and self._free[k - 1][0] + self._free[k - 1][1] == offset:  # join the previous
                self._free[k - 1][1] += self._free.pop(k)[1]

    def array(self, offset: int, nbytes: int) -> np.ndarray:
        """The extent as a writable uint8 array (any process that maps the region)."""
        return self._array[offset:offset + nbytes]

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """The extent as a uint8 tensor that gives it back to the region when its memory is no longer used."""
        with self._lock:
            if offset not in self._issued:
                raise RuntimeError(f"arena extent at {offset} is not issued (taken back, or wrapped twice): its "
                                   "bytes may belong to another batch, so it is not read (a bug in "
                                   "dspark_precompute; please report it)")
            del self._issued[offset]
        view = self._array[offset:offset + nbytes]  # a new ndarray object, owned by the tensor's storage alone
        weakref.finalize(view, self.free, offset, nbytes)
        return torch.from_numpy(view)


@dataclass(frozen=True)
class SharedBatch:
    """A batch a worker wrote into an arena extent: what the training process needs to wrap it."""

    arena: str
    offset: int
    nbytes: int
    fields: tuple[tuple[str, str, tuple[int, ...], int, int], ...]  # key, dtype, shape, offset, bytes

    def tensors(self) -> dict[str, torch.Tensor]:
        arena = _ARENAS.get(self.arena)
        if arena is None or not arena.mine:
            raise RuntimeError("a SharedBatch can only be opened by the process whose loader created its memory")
        return views(arena.tensor(self.offset, self.nbytes), self.fields)

    def pin_memory(self, device: Any = None) -> dict[str, torch.Tensor]:
        """Called by the DataLoader's pin-memory thread: page-locked copies, and the extent is free again."""
        return {k: v.pin_memory() for k, v in self.tensors().items()}


def views(buf: torch.Tensor, fields: tuple[tuple[str, str, tuple[int, ...], int, int], ...]) -> dict[str, torch.Tensor]:
    """The named tensors laid out in the flat uint8 ``buf``."""
    return {key: buf[off:off + nb].view(_DTYPES[dt]).view(shape) for key, dt, shape, off, nb in fields}
