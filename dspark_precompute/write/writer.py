"""Writes the cache: allocate every array up front, then one whole unit at a time.

The forward loop fills a unit buffer in shared memory; ``storage.writers`` writer
processes (not threads: compression would fight the forward loop for the GIL) split the
unit into pieces (a chunk-aligned range of one array each), compress and write them in
parallel, and once every piece of the unit is written the forward loop's process writes
the unit's commit record. A unit is visible to readers only once that record exists, so
it stays all-or-nothing however many writers wrote it.
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
from typing import Any, cast

import numpy as np

from dspark_precompute.contract.arrays import codec_chain
from dspark_precompute.contract.commits import CommitRecord
from dspark_precompute.contract.layout import Layout
from dspark_precompute.contract.spec import FINAL_NORM, HIDDEN_GROUP, INPUT_IDS, LOSS_MASK, STORAGE_DTYPES, layer_array
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.errors import StorageWriteError
from dspark_precompute.faults import fault_point
from dspark_precompute.write import processes
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


def _writer_main(index: int, path: str, specs: list[ArraySpec], slot_list: list[_Slot], tasks: Any, done: Any,
                 env: dict[str, str]) -> None:
    """Writer process: one task = one piece (a chunk-aligned token range of one array) to write."""
    import zarr

    processes.child_setup(env)
    try:
        # one core per writer: parallelism comes from the writers, not from codec threads
        zarr.config.set({"threading.max_workers": 1})
        store = CacheStore(path)
        group = zarr.open_group(store.zarr_store(), mode="r+")
        # write_empty_chunks is a runtime setting, not stored metadata: set it on every handle
        members: dict[str, Any] = {s.name: group[s.name] for s in specs}
        arrays = {name: arr.with_config({"write_empty_chunks": True}) for name, arr in members.items()}
        slots = [slot.arrays for slot in slot_list]
    except BaseException as exc:
        _send_error(done, -1, -1, exc)
        return
    parent = mp.parent_process()

    def orphaned() -> bool:
        # A killed forward loop must not leave a writer that keeps writing behind a resumed run.
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
        unit, slot, name, t0, lo, hi = task  # token slots [lo, hi) of the unit starting at t0
        try:
            busy = time.perf_counter()
            if orphaned():
                raise SystemExit(1)
            arrays[name][t0 + lo:t0 + hi] = slots[slot][name][lo:hi]
            fault_point("writer_array")
            done.send(("done", unit, slot, ((hi - lo) * _row_bytes(specs, name), time.perf_counter() - busy)))
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
    for slot_ in slot_list:
        slot_.close()


def _row_bytes(specs: list[ArraySpec], name: str) -> int:
    return next(s.row_bytes for s in specs if s.name == name)


def _send_error(done: Any, unit: int, slot: int, exc: BaseException) -> None:
    try:
        done.send(("error", unit, slot, (f"{type(exc).__name__}: {exc}", traceback.format_exc())))
    except OSError:
        pass


def resolve_writers(writers: int | None) -> int:
    """``storage.writers``: null = the cores this rank may use, less one for the forward loop (at least 1)."""
    return max(1, int(writers)) if writers else max(1, processes.available_cores() - 1)


def split_unit(specs: list[ArraySpec], n_slots: int, chunk: int, writers: int) -> list[list[tuple[str, int, int]]]:
    """The pieces of one unit, dealt to ``writers`` writers with balanced bytes.

    Each piece is a chunk-aligned token range ``[lo, hi)`` of one array, so no two writers
    ever touch the same chunk. Each array's range is cut into at most ``writers`` parts
    (one part per array with a single writer), largest pieces first onto the least loaded.
    """
    n_chunks = n_slots // chunk
    pieces: list[tuple[int, str, int, int]] = []
    for s in specs:
        parts = max(1, min(writers, n_chunks))
        for k in range(parts):
            c0, c1 = k * n_chunks // parts, (k + 1) * n_chunks // parts
            if c1 > c0:
                pieces.append(((c1 - c0) * chunk * s.row_bytes, s.name, c0 * chunk, c1 * chunk))
    load = [0] * writers
    out: list[list[tuple[str, int, int]]] = [[] for _ in range(writers)]
    for nbytes, name, lo, hi in sorted(pieces, key=lambda p: -p[0]):
        w = min(range(writers), key=lambda i: (load[i], i))
        out[w].append((name, lo, hi))
        load[w] += nbytes
    return out


class UnitWriter:
    """Main-process side: hands out free unit buffers, deals units to the writers, commits whole units."""

    def __init__(self, store: CacheStore, specs: list[ArraySpec], layout: Layout, n_slots: int = 2,
                 todo: list[int] | None = None, writers: int = 1, pin_memory: bool = False):
        self.specs = specs
        self.store = store
        self.path = store.path
        self.layout = layout
        self.todo = list(range(layout.num_units)) if todo is None else list(todo)
        row = sum(s.row_bytes for s in specs)
        self.unit_bytes = {u: layout.unit_slots(u) * row for u in self.todo}
        capacity = max([layout.unit_slots(u) for u in range(layout.num_units)] or [layout.chunk_tokens])
        self.slots = [_Slot(specs, capacity) for _ in range(max(1, n_slots))]
        self.pinned = pin_memory and _pin(self.slots)
        self.free = list(range(len(self.slots)))
        self.n_writers = max(1, int(writers))
        ctx = processes.context()
        # Pipes, not Queues: a spawn-context Queue carries named semaphores that a SIGKILL of the
        # process group would leave in /dev/shm; pipes are plain file descriptors.
        self.tasks: list[Any] = []
        self.done: list[Any] = []
        self.procs: list[Any] = []
        env = dict(os.environ)
        for i in range(self.n_writers):
            tasks_out, tasks_in = ctx.Pipe(duplex=False)
            done_out, done_in = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_writer_main, args=(i, store.path, specs, self.slots, tasks_out, done_in, env),
                               daemon=True, name=f"dspark-writer-{i}")
            processes.start(proc)
            tasks_out.close()  # the writer holds its ends now: when it dies, recv() here sees EOF
            done_in.close()
            self.tasks.append(tasks_in)
            self.done.append(done_out)
            self.procs.append(proc)
        self.waiting: dict[int, int] = {}  # unit -> pieces not yet written
        self.unit_slot: dict[int, int] = {}
        self.records: dict[int, CommitRecord] = {}
        self.pending = 0  # units handed to the writers, not yet committed
        self.raw_bytes = 0
        self.busy_s = 0.0  # seconds the writers spent compressing and writing (summed over writers)
        self.wait_s = 0.0  # seconds the forward loop waited for a free unit buffer
        self.committed: list[int] = []

    def buffers(self, slot: int) -> dict[str, np.ndarray]:
        return self.slots[slot].arrays

    def _dead_writer(self) -> StorageWriteError:
        for p in self.procs:
            p.join(0.1)
        codes = [p.exitcode for p in self.procs if p.exitcode is not None]
        return StorageWriteError(f"a writer process died (exit codes {codes}); the cache is resumable: re-run the "
                                 "same command")

    def _collect(self, block: bool) -> None:
        """Take the writers' reports; commit each unit whose pieces are all written. Returns after one commit
        (or at once when nothing is ready and ``block`` is false)."""
        from multiprocessing.connection import wait

        while True:
            ready = wait(self.done, timeout=1.0 if block else 0)
            if not ready:
                if not block:
                    return
                if all(p.is_alive() for p in self.procs):
                    continue
                raise self._dead_writer()
            committed_one = False
            for conn in ready:
                try:
                    kind, unit, slot, payload = cast(Any, conn).recv()
                except (EOFError, OSError):
                    raise self._dead_writer() from None
                if kind == "error":
                    log.debug("writer traceback:\n%s", payload[1])
                    left = sum(self.unit_bytes[u] for u in self.todo if u not in self.committed)
                    what = f"writing unit {unit} of {self.path}" if unit >= 0 else f"opening {self.path} for writing"
                    raise StorageWriteError(
                        f"{what} failed: {payload[0]}. About {left / 1e6:,.1f} MB "
                        "(uncompressed) are still to be written; free space or fix the storage, then re-run the "
                        "same command: committed units are kept and the cache resumes.")
                self.raw_bytes += int(payload[0])
                self.busy_s += float(payload[1])
                self.waiting[unit] -= 1
                if self.waiting[unit] == 0:
                    self._commit(unit)
                    committed_one = True
            if committed_one:
                return

    def _commit(self, unit: int) -> None:
        """Every piece of ``unit`` is written: its record makes it visible, and its buffer is free again."""
        fault_point("writer_before_commit")
        record = self.records.pop(unit)
        try:
            record.write(self.store)
        except OSError as exc:
            raise StorageWriteError(f"writing the commit record of unit {unit} in {self.path} failed: {exc}. Free "
                                    "space or fix the storage, then re-run the same command.") from exc
        del self.waiting[unit]
        self.free.append(self.unit_slot.pop(unit))
        self.pending -= 1
        self.committed.append(unit)

    def acquire(self) -> int:
        self.poll()
        t0 = time.perf_counter()
        while not self.free:
            self._collect(block=True)
        self.wait_s += time.perf_counter() - t0
        return self.free.pop()

    def release(self, slot: int) -> None:
        """Give back a slot whose unit was dropped (interrupted before it was complete)."""
        self.free.append(slot)

    def submit(self, unit: int, slot: int, n_tokens: int, record: CommitRecord) -> None:
        """Hand unit ``unit`` (its first ``n_tokens`` slots of buffer ``slot`` filled) to the writers."""
        chunk = self.layout.chunk_tokens
        n_slots = -(-n_tokens // chunk) * chunk
        bufs = self.slots[slot].arrays
        for s in self.specs:
            bufs[s.name][n_tokens:n_slots] = 0  # buffers are reused: the last chunk's tail must be zeros
        t0 = int(self.layout.unit_start[unit])
        shares = split_unit(self.specs, n_slots, chunk, self.n_writers)
        self.waiting[unit] = sum(len(share) for share in shares)
        self.unit_slot[unit] = slot
        self.records[unit] = record
        self.pending += 1
        for w, share in enumerate(shares):
            for name, lo, hi in share:
                try:
                    self.tasks[w].send((unit, slot, name, t0, lo, hi))
                except OSError:
                    self._collect(block=True)  # the writer is gone: report why
                    raise self._dead_writer() from None

    def poll(self) -> None:
        while self.pending:
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
            for conn in self.tasks:
                try:
                    conn.send(None)
                except OSError:
                    pass
            deadline = time.monotonic() + timeout
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
            for p in self.procs:
                if p.is_alive():  # SIGKILL: writers ignore SIGTERM; an uncommitted unit is simply rewritten
                    p.kill()
                    p.join(5)
        finally:
            for conn in (*self.tasks, *self.done):
                conn.close()
            if self.pinned:
                _unpin(self.slots)
            for s in self.slots:
                s.close()


def _pin(slots: list[_Slot]) -> bool:
    """Page-lock the unit buffers for CUDA, so device-to-host copies into them run asynchronously."""
    import torch

    if not torch.cuda.is_available():
        return False
    cudart = torch.cuda.cudart()
    for slot in slots:
        for arr in slot.arrays.values():
            if arr.nbytes:
                err = cudart.cudaHostRegister(arr.ctypes.data, arr.nbytes, 0)
                if int(err) != 0:  # not fatal: the copies are synchronous then
                    log.warning("could not pin a unit buffer for CUDA (error %s); device-to-host copies will be "
                                "synchronous", err)
                    return False
    return True


def _unpin(slots: list[_Slot]) -> None:
    import torch

    cudart = torch.cuda.cudart()
    for slot in slots:
        for arr in slot.arrays.values():
            if arr.nbytes:
                cudart.cudaHostUnregister(arr.ctypes.data)
