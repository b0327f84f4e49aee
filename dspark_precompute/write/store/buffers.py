"""Unit buffers: anonymous shared memory the forward loop fills and the writer processes read.

Nothing is ever named in ``/dev/shm`` (a ``memfd``, or an already-unlinked temporary file
where there is none), so however the run dies, even SIGKILL of the whole process group, the
kernel frees the memory with the last process that maps it. On CUDA the buffers are
page-locked (``cudaHostRegister``) so device-to-host copies into them run asynchronously;
a registration that fails part-way unregisters what it had registered.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


class SharedBuffer:
    """Anonymous shared memory that a spawned process maps by inheriting its file descriptor.

    Pickling it is only possible while a process is being spawned (the descriptor is handed
    to the child then).
    """

    def __init__(self, nbytes: int):
        self.nbytes = max(1, int(nbytes))
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("dspark-unit-buffer", os.MFD_CLOEXEC)
        else:  # pragma: no cover - non-Linux POSIX
            shm = Path("/dev/shm")
            fh = tempfile.TemporaryFile(dir=shm if shm.is_dir() else None)
            fd = os.dup(fh.fileno())
            fh.close()
        try:
            os.ftruncate(fd, self.nbytes)
            self.mm = mmap.mmap(fd, self.nbytes)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd

    def array(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return np.ndarray(shape, dtype=dtype, buffer=self.mm)

    def __getstate__(self) -> dict[str, Any]:
        from multiprocessing import reduction

        if self.fd is None:
            raise RuntimeError("a mapped copy of a unit buffer cannot be handed on (only its creator can)")
        return {"nbytes": self.nbytes, "fd": reduction.DupFd(self.fd)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.nbytes = state["nbytes"]
        fd = state["fd"].detach()
        self.mm = mmap.mmap(fd, self.nbytes)
        os.close(fd)
        self.fd = None

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:  # an array still views it: the mapping goes with the process
            pass
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Slot:
    """One unit buffer: a shared array per token array (``shapes``: name -> rows x width)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str]):
        self.shapes, self.dtypes = dict(shapes), dict(dtypes)
        self.shm: dict[str, SharedBuffer] = {}
        try:
            for name, shape in self.shapes.items():
                self.shm[name] = SharedBuffer(int(np.prod(shape)) * np.dtype(self.dtypes[name]).itemsize)
        except BaseException:
            self.close()
            raise
        self.arrays = self.views()

    def views(self) -> dict[str, np.ndarray]:
        return {name: buf.array(self.shapes[name], self.dtypes[name]) for name, buf in self.shm.items()}

    def __getstate__(self) -> dict[str, Any]:
        return {"shapes": self.shapes, "dtypes": self.dtypes, "shm": self.shm}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.arrays = self.views()

    def close(self) -> None:
        self.arrays = {}
        for m in self.shm.values():
            m.close()


def pin(slots: list[Slot]) -> list[np.ndarray]:
    """Page-lock the slots' arrays for CUDA; the arrays pinned (all, or none when a registration fails).

    Not fatal when it fails: device-to-host copies are synchronous then. Whatever was
    registered before a failure is unregistered again.
    """
    import torch

    if not torch.cuda.is_available():
        return []
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch leaves cudart() unannotated
    done: list[np.ndarray] = []
    for arr in (a for slot in slots for a in slot.arrays.values() if a.nbytes):
        err = cudart.cudaHostRegister(arr.ctypes.data, arr.nbytes, 0)
        if int(err) != 0:
            log.warning("could not pin a unit buffer for CUDA (error %s); device-to-host copies will be synchronous",
                        err)
            unpin(done)
            return []
        done.append(arr)
    return done


def unpin(arrays: list[np.ndarray]) -> None:
    """Undo :func:`pin` for these arrays."""
    if not arrays:
        return
    import torch

    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch leaves cudart() unannotated
    for arr in arrays:
        cudart.cudaHostUnregister(arr.ctypes.data)
