"""Writes the cache: allocate every array up front, then one whole unit at a time.

The forward loop fills a unit buffer in shared memory; a separate writer process
(not a thread: compression would fight the forward loop for the GIL) compresses the
unit's chunk-aligned region of every array, then writes the unit's commit record. A
unit is visible to readers only once its commit record exists.
"""

from __future__ import annotations

import logging
import mmap
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dspark_precompute.contract.arrays import codec_chain
from dspark_precompute.contract.commits import CommitRecord
from dspark_precompute.contract.layout import Layout
from dspark_precompute.contract.spec import FINAL_NORM, HIDDEN_GROUP, INPUT_IDS, LOSS_MASK, STORAGE_DTYPES, layer_array
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.errors import StorageWriteError
from dspark_precompute.faults import fault_point
from dspark_precompute.write.config import StorageConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ArraySpec:
    """One token-axis array: its name, on-disk dtype and row width (None for 1-D)."""

    name: str
    dtype: str
    width: int | None = None
    logical_dtype: str | None = None
    layer_id: int | None = None

    @property
    def row_bytes(self) -> int:
        return np.dtype(self.dtype).itemsize * (self.width or 1)


def token_array_specs(layer_ids: list[int], num_layers: int, hidden: int, storage_dtype: str) -> list[ArraySpec]:
    disk, logical = STORAGE_DTYPES[storage_dtype]
    specs = [ArraySpec(INPUT_IDS, "int32"), ArraySpec(LOSS_MASK, "uint8")]
    for lid in layer_ids:
        specs.append(ArraySpec(layer_array(lid), np.dtype(disk).name, hidden, logical, lid))
    if (num_layers - 1) not in layer_ids:
        specs.append(ArraySpec(f"{HIDDEN_GROUP}/{FINAL_NORM}", np.dtype(disk).name, hidden, logical,
                               num_layers - 1))
    return specs


def allocate(store: CacheStore, specs: list[ArraySpec], layout: Layout, storage: StorageConfig,
             samples: dict[str, np.ndarray], attributes: dict[str, Any]) -> None:
    """Create the group and every array at its final shape, and write the sample tables."""
    import zarr

    group = zarr.create_group(store.zarr_store(), overwrite=False, attributes=attributes)
    total, chunk = layout.total_slots, layout.chunk_tokens
    for i, s in enumerate(specs):
        if i == 2:
            fault_point("allocate")
        shape = (total,) if s.width is None else (total, s.width)
        chunks = (chunk,) if s.width is None else (chunk, s.width)
        attrs: dict[str, Any] = {"logical_dtype": s.logical_dtype or s.dtype}
        if s.layer_id is not None:
            attrs["layer_id"] = s.layer_id
        group.create_array(
            s.name, shape=shape, chunks=chunks, dtype=s.dtype, fill_value=0,
            compressors=codec_chain(storage.compressor, storage.compression_level, storage.shuffle,
                                    np.dtype(s.dtype).itemsize),
            dimension_names=("token",) if s.width is None else ("token", "hidden"), attributes=attrs,
            # every chunk of a written unit exists on disk, zeros included, so a missing
            # chunk file is always damage (verify relies on it)
            config={"write_empty_chunks": True},
        )
    tables = dict(samples)
    tables["units/token_start"] = layout.unit_start
    tables["units/token_stop"] = layout.unit_stop
    for name, values in tables.items():
        values = np.asarray(values)
        arr = group.create_array(
            name, shape=values.shape, chunks=(max(1, min(len(values), 1 << 20)),), dtype=values.dtype,
            fill_value=0,
            compressors=codec_chain(storage.compressor, storage.compression_level, storage.shuffle,
                                    values.dtype.itemsize),
            dimension_names=("sample",) if name.startswith("samples/") else ("unit",),
            # all-zero table chunks are written too: a missing chunk is damage, never zeros
            config={"write_empty_chunks": True},
        )
        if len(values):
            arr[:] = values


class SharedBuffer:
    """Anonymous shared memory that a spawned process maps by inheriting its file descriptor.

    Nothing is ever named in ``/dev/shm`` (a ``memfd``, or an already-unlinked temporary
    file where there is none), so however the run dies, even SIGKILL of the whole
    process group, the kernel frees the memory with the last process that maps it.
    Pickling it is only possible while a process is being spawned (the descriptor is
    handed to the child then).
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
        os.ftruncate(fd, self.nbytes)
        self.fd: int | None = fd
        self.mm = mmap.mmap(fd, self.nbytes)

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


class _Slot:
    """One unit buffer: a shared array per token array."""

    def __init__(self, specs: list[ArraySpec], capacity: int):
        self.shapes = {s.name: (capacity,) if s.width is None else (capacity, s.width) for s in specs}
        self.dtypes = {s.name: s.dtype for s in specs}
        self.shm = {s.name: SharedBuffer(int(np.prod(self.shapes[s.name])) * np.dtype(s.dtype).itemsize)
                    for s in specs}
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


def _writer_main(path: str, specs: list[ArraySpec], slot_list: list[_Slot], unit_start: np.ndarray,
                 chunk: int, tasks: Any, done: Any, env: dict[str, str]) -> None:
    """Writer process: one task = one unit buffer to compress, write and commit."""
    import zarr

    from dspark_precompute import faults
    from dspark_precompute.write import signals

    # forked from a server that may predate this run: take the run's environment (storage
    # credentials and endpoints, fault injection) as the forward loop has it now
    os.environ.clear()
    os.environ.update(env)
    faults.reload()

    # Ctrl-C / scancel reach the whole process group: the forward loop decides when to stop,
    # the writer finishes the units it was given (the None sentinel, or orphan detection).
    signals.ignore()
    # numcodecs' blosc takes a multiprocessing.Lock of the default context on first use; in a
    # spawned child that is a named semaphore, which a SIGKILL of the group would leave in
    # /dev/shm. This process starts no others: the fork context unlinks its semaphores at once.
    mp.set_start_method("fork", force=True)
    try:
        store = CacheStore(path)
        group = zarr.open_group(store.zarr_store(), mode="r+")
        # write_empty_chunks is a runtime setting, not stored metadata: set it on every handle
        members: dict[str, Any] = {s.name: group[s.name] for s in specs}
        arrays = {name: arr.with_config({"write_empty_chunks": True}) for name, arr in members.items()}
        slots = [slot.arrays for slot in slot_list]
    except BaseException as exc:
        done.send(("error", -1, -1, (f"{type(exc).__name__}: {exc}", traceback.format_exc())))
        return
    parent = mp.parent_process()

    def orphaned() -> bool:
        # A killed forward loop must not leave a writer that commits behind a resumed run.
        return parent is not None and not parent.is_alive()

    while True:
        try:
            if not tasks.poll(1.0):
                if orphaned():
                    break
                continue
            task = tasks.recv()
        except (EOFError, OSError):  # the forward loop's end of the pipe is gone: it died
            break
        if task is None:
            break
        unit, slot, n_tokens, record = task
        try:
            busy = time.perf_counter()
            t0 = int(unit_start[unit])
            n_slots = -(-n_tokens // chunk) * chunk
            raw = 0
            for s in specs:
                buf = slots[slot][s.name]
                buf[n_tokens:n_slots] = 0  # slot buffers are reused: the chunk tail must be zeros
                arrays[s.name][t0:t0 + n_slots] = buf[:n_slots]
                raw += n_slots * s.row_bytes
                fault_point("writer_array")
                if orphaned():
                    raise SystemExit(1)
            fault_point("writer_before_commit")
            if orphaned():
                raise SystemExit(1)
            record.write(store)
            done.send(("done", unit, slot, (raw, time.perf_counter() - busy)))
        except SystemExit:
            break
        except (EOFError, OSError, BrokenPipeError) as exc:
            if orphaned():
                break
            _send_error(done, unit, slot, exc)
            break
        except BaseException as exc:
            _send_error(done, unit, slot, exc)
            break
    del slots, arrays
    for slot in slot_list:
        slot.close()


def _send_error(done: Any, unit: int, slot: int, exc: BaseException) -> None:
    try:
        done.send(("error", unit, slot, (f"{type(exc).__name__}: {exc}", traceback.format_exc())))
    except OSError:
        pass


def writer_context() -> Any:
    """The multiprocessing context writer processes start from: a fork server with this module preloaded.

    The server is a fresh interpreter (never a fork of a process that holds CUDA or torch
    threads) that imports numpy, zarr and this module once; each writer is then forked from
    it in milliseconds instead of importing them again (several writers per run, several
    runs per process in tests and sweeps).
    """
    if "forkserver" not in mp.get_all_start_methods():  # pragma: no cover - not Linux/macOS
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "zarr", "dspark_precompute.write.writer"])
    return ctx


class UnitWriter:
    """Main-process side: hands out free unit buffers and collects finished units."""

    def __init__(self, store: CacheStore, specs: list[ArraySpec], layout: Layout, n_slots: int = 2,
                 todo: list[int] | None = None):
        self.specs = specs
        self.path = store.path
        self.todo = list(range(layout.num_units)) if todo is None else list(todo)
        row = sum(s.row_bytes for s in specs)
        self.unit_bytes = {u: layout.unit_slots(u) * row for u in self.todo}
        capacity = max([layout.unit_slots(u) for u in range(layout.num_units)] or [layout.chunk_tokens])
        self.slots = [_Slot(specs, capacity) for _ in range(max(1, n_slots))]
        self.free = list(range(len(self.slots)))
        ctx = writer_context()
        # Pipes, not Queues: a spawn-context Queue carries named semaphores that a SIGKILL of the
        # process group would leave in /dev/shm; pipes are plain file descriptors.
        tasks_out, self.tasks = ctx.Pipe(duplex=False)
        self.done, done_in = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=_writer_main,
            args=(store.path, specs, self.slots, layout.unit_start, layout.chunk_tokens, tasks_out, done_in,
                  dict(os.environ)),
            daemon=True, name="dspark-writer",
        )
        self.proc.start()
        tasks_out.close()  # the writer holds its ends now: when it dies, recv() here sees EOF
        done_in.close()
        self.pending = 0
        self.raw_bytes = 0
        self.busy_s = 0.0  # seconds the writer process spent compressing and writing
        self.wait_s = 0.0  # seconds the forward loop waited for a free unit buffer
        self.committed: list[int] = []

    def buffers(self, slot: int) -> dict[str, np.ndarray]:
        return self.slots[slot].arrays

    def _collect(self, block: bool) -> None:
        while True:
            try:
                if not self.done.poll(1.0 if block else 0):
                    if not block:
                        return
                    if self.proc.is_alive():
                        continue
                    raise EOFError
                msg = self.done.recv()
            except (EOFError, OSError):
                self.proc.join(5)
                raise StorageWriteError(
                    f"the writer process died (exit code {self.proc.exitcode}); the cache is resumable: "
                    "re-run the same command") from None
            kind, unit, slot, payload = msg
            if kind == "error":
                log.debug("writer traceback:\n%s", payload[1])
                left = sum(self.unit_bytes[u] for u in self.todo if u not in self.committed)
                what = f"writing unit {unit} of {self.path}" if unit >= 0 else f"opening {self.path} for writing"
                raise StorageWriteError(
                    f"{what} failed: {payload[0]}. About {left / 1e6:,.1f} MB "
                    "(uncompressed) are still to be written; free space or fix the storage, then re-run the "
                    "same command: committed units are kept and the cache resumes."
                )
            self.pending -= 1
            self.free.append(slot)
            self.raw_bytes += int(payload[0])
            self.busy_s += float(payload[1])
            self.committed.append(unit)
            return

    def acquire(self) -> int:
        self._collect(block=False)
        t0 = time.perf_counter()
        while not self.free:
            self._collect(block=True)
        self.wait_s += time.perf_counter() - t0
        return self.free.pop()

    def release(self, slot: int) -> None:
        """Give back a slot whose unit was dropped (interrupted before it was complete)."""
        self.free.append(slot)

    def submit(self, unit: int, slot: int, n_tokens: int, record: CommitRecord) -> None:
        try:
            self.tasks.send((unit, slot, n_tokens, record))
        except OSError:
            self._collect(block=True)  # the writer is gone: report why
        self.pending += 1

    def poll(self) -> None:
        while True:
            before = self.pending
            self._collect(block=False)
            if self.pending == before:
                return

    def drain(self) -> None:
        t0 = time.perf_counter()
        while self.pending:
            self._collect(block=True)
        self.wait_s += time.perf_counter() - t0

    def close(self, timeout: float = 30.0) -> None:
        try:
            if self.proc.is_alive():
                try:
                    self.tasks.send(None)
                except OSError:
                    pass
                self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(5)
        finally:
            self.tasks.close()
            self.done.close()
            for s in self.slots:
                s.close()
