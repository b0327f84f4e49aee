"""Writes the hidden states: one whole unit at a time, one shard per array, committed when all are durable.

The forward loop fills a unit buffer in shared memory (:mod:`~dspark_precompute.write.store.buffers`);
``storage.writers`` writer processes (not threads: compression would fight the forward loop for
the GIL) each take one array of a unit at a time, encode its whole shard (inner chunks, then the
index: :func:`~dspark_precompute.contract.shards.encode_shard`, the bytes zarr would write) and
write it as one object: a temporary file, fsynced and renamed (the directory fsynced after), or
one put on an object store. Once every array of the unit is written the forward loop's process
writes the unit's commit record. A unit is visible to readers only once that record exists, so
it stays all-or-nothing however many writers wrote it, and a power loss never leaves a committed
unit without its bytes.

Tasks are dealt to whichever writer has the fewest in flight (at most two each), largest first,
so writers stay busy across unit boundaries.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import traceback
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from typing import Any, cast

import numpy as np

from dspark_precompute.contract.arrays import chunk_encoder
from dspark_precompute.contract.commits import CommitRecord
from dspark_precompute.contract.layout import Layout
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.contract.vocab import Message
from dspark_precompute.errors import StorageWriteError
from dspark_precompute.faults import fault_point
from dspark_precompute.write.config.schema import StorageConfig
from dspark_precompute.write.parallel import processes
from dspark_precompute.write.plan.array_specs import ArraySpec, array_codec
from dspark_precompute.write.store.allocate import encode_unit_shard, shard_key
from dspark_precompute.write.store.buffers import Slot, pin, unpin

log = logging.getLogger(__name__)
DEPTH = 2  # tasks in flight per writer: one being written, one queued behind it


def resolve_writers(writers: int | None) -> int:
    """``storage.writers``: null = the cores this rank may use, less one for the forward loop (at least 1)."""
    return max(1, int(writers)) if writers else max(1, processes.available_cores() - 1)


def _writer_main(path: str, slot_list: list[Slot], tasks: Any, done: Any, env: dict[str, str], chunk: int,
                 per_shard: int, codecs: dict[str, tuple[Any, ...]], fsync: bool) -> None:
    """Writer process: one task = one array of one unit, written as one shard object."""
    processes.child_setup(env)
    try:
        store = CacheStore(path)
        encoders = {name: chunk_encoder(*codec) for name, codec in codecs.items()}
        slots = [slot.arrays for slot in slot_list]
    except BaseException as exc:
        _send_error(done, -1, -1, exc)
        return
    parent = mp.parent_process()

    def orphaned() -> bool:
        # A killed forward loop must not leave a writer that keeps writing behind a resumed run.
        return parent is not None and not parent.is_alive()

    def still_ours() -> None:
        # Checked again just before a shard is put in place: a shard that appears after its run died could land
        # after a resumed run committed the unit again, or after a trainer released and deleted it.
        if orphaned():
            raise _Orphaned

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
        unit, slot, name, n_slots = task
        try:
            busy = time.perf_counter()
            if orphaned():
                break
            rows = slots[slot][name][:n_slots]
            shard = encode_unit_shard(rows, chunk, per_shard, encoders[name])
            store.write_parts(shard_key(name, unit, two_d=rows.ndim == 2), _parts(shard), fsync,  # a chunk at a time
                              before_publish=still_ours)
            fault_point("writer_array")
            done.send((Message.done, unit, slot, (rows.nbytes, time.perf_counter() - busy, name, shard.digest.hex())))
        except _Orphaned:
            break  # the temporary is gone, nothing was put in place
        except (EOFError, OSError) as exc:
            if orphaned():
                break
            _send_error(done, unit, slot, exc)
            break
        except BaseException as exc:
            _send_error(done, unit, slot, exc)
            break
    del slots
    for slot_ in slot_list:
        slot_.close()


class _Orphaned(Exception):
    """A writer's run died while it wrote a shard: the shard is dropped, never put in place."""


def _parts(parts: Iterable[Any]) -> Iterator[Any]:
    """A shard's parts, with the ``shard_part`` fault point between them (a kill there: half a shard written)."""
    for part in parts:
        yield part
        fault_point("shard_part")


def _send_error(done: Any, unit: int, slot: int, exc: BaseException) -> None:
    try:
        done.send((Message.error, unit, slot, (f"{type(exc).__name__}: {exc}", traceback.format_exc())))
    except OSError:
        pass


class UnitWriter:
    """Main-process side: hands out free unit buffers, deals units' arrays to the writers, commits whole units.

    A context manager: leaving it (or :meth:`close`) stops the writers, unpins and frees the
    buffers, also when it was left half-built by a failure.
    """

    def __init__(self, store: CacheStore, specs: list[ArraySpec], layout: Layout, storage: StorageConfig,
                 todo: list[int] | None = None, writers: int = 1, pin_memory: bool = False):
        self.specs = [s for s in specs if s.hidden]
        self.store, self.path, self.layout = store, store.path, layout
        self.todo = list(range(layout.num_units)) if todo is None else list(todo)
        self.unit_bytes = {u: layout.unit_slots(u) * sum(s.row_bytes for s in self.specs) for u in self.todo}
        self.tasks: list[Any] = []
        self.done: list[Any] = []
        self.procs: list[Any] = []
        self.pinned: list[np.ndarray] = []
        self.slots: list[Slot] = []
        self.waiting: dict[int, int] = {}  # unit -> arrays not yet written
        self.unit_slot: dict[int, int] = {}
        self.records: dict[int, CommitRecord] = {}
        self.pending: deque[tuple[int, int, str, int]] = deque()  # tasks not yet dealt
        self.inflight: list[int] = []
        self.raw_bytes = 0
        self.busy_s = 0.0  # seconds the writers spent compressing and writing (summed over writers)
        self.wait_s = 0.0  # seconds the forward loop waited for a free unit buffer
        self.committed: list[int] = []
        with ExitStack() as undo:
            undo.callback(self.close)
            capacity = max([layout.unit_slots(u) for u in self.todo] or [layout.chunk_tokens])
            shapes = {s.name: (capacity, int(s.width or 1)) for s in self.specs}
            dtypes = {s.name: s.dtype for s in self.specs}
            for _ in range(max(1, storage.writer_slots)):
                self.slots.append(Slot(shapes, dtypes))
            self.pinned = pin(self.slots) if pin_memory else []
            self.free = list(range(len(self.slots)))
            self._start(max(1, int(writers)), storage)
            undo.pop_all()

    def _start(self, n: int, storage: StorageConfig) -> None:
        codecs = {s.name: array_codec(storage, s) for s in self.specs}
        ctx = processes.context()
        env = dict(os.environ)
        per_shard = self.layout.unit_tokens // self.layout.chunk_tokens
        for i in range(n):
            # Pipes, not Queues: a spawn-context Queue carries named semaphores that a SIGKILL of the
            # process group would leave in /dev/shm; pipes are plain file descriptors.
            tasks_out, tasks_in = ctx.Pipe(duplex=False)
            done_out, done_in = ctx.Pipe(duplex=False)
            self.tasks.append(tasks_in)
            self.done.append(done_out)
            proc = ctx.Process(target=_writer_main, args=(self.store.path, self.slots, tasks_out, done_in, env,
                                                          self.layout.chunk_tokens, per_shard, codecs,
                                                          bool(storage.fsync)),
                               daemon=True, name=f"dspark-writer-{i}")
            processes.start(proc)
            tasks_out.close()  # the writer holds its ends now: when it dies, recv() here sees EOF
            done_in.close()
            self.procs.append(proc)
            self.inflight.append(0)

    def __enter__(self) -> UnitWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def buffers(self, slot: int) -> dict[str, np.ndarray]:
        return self.slots[slot].arrays

    def _dead_writer(self) -> StorageWriteError:
        """The error for a writer that is gone: the error it reported before it went, when that is still unread in
        its pipe (a send to it can fail first, the writer having exited after reporting), else that it died."""
        for conn in self.done:
            try:
                while conn.poll():
                    kind, unit, _slot, payload = cast(Any, conn).recv()
                    if kind == Message.error:
                        return self._writer_error(unit, payload)
            except (EOFError, OSError):
                continue
        for p in self.procs:
            p.join(0.1)
        codes = [p.exitcode for p in self.procs if p.exitcode is not None]
        return StorageWriteError(f"a writer process died (exit codes {codes}); the cache is resumable: re-run the "
                                 "same command")

    def _deal(self) -> None:
        """Hand pending tasks to the writers with the fewest in flight (at most DEPTH each)."""
        while self.pending:
            w = min(range(len(self.procs)), key=lambda i: (self.inflight[i], i))
            if self.inflight[w] >= DEPTH:
                return
            task = self.pending.popleft()
            try:
                self.tasks[w].send(task)
            except OSError:
                raise self._dead_writer() from None
            self.inflight[w] += 1

    def _report(self, w: int) -> bool:
        """Take one report of writer ``w``; True when it completed a unit (which is then committed)."""
        try:
            kind, unit, _slot, payload = cast(Any, self.done[w]).recv()
        except (EOFError, OSError):
            raise self._dead_writer() from None
        if kind == Message.error:
            raise self._writer_error(unit, payload)
        self.inflight[w] -= 1
        self.raw_bytes += int(payload[0])
        self.busy_s += float(payload[1])
        self.records[unit].shards[str(payload[2])] = str(payload[3])  # the digest of the shard as written
        self.waiting[unit] -= 1
        if self.waiting[unit]:
            return False
        self._commit(unit)
        return True

    def _writer_error(self, unit: int, payload: tuple[str, str]) -> StorageWriteError:
        """What a writer's error report means for the run: which unit failed, why, and how much is left to write."""
        log.debug("writer traceback:\n%s", payload[1])
        left = sum(self.unit_bytes[u] for u in self.todo if u not in self.committed)
        what = f"writing unit {unit} of {self.path}" if unit >= 0 else f"opening {self.path} for writing"
        return StorageWriteError(
            f"{what} failed: {payload[0]}. About {left / 1e6:,.1f} MB (uncompressed) are still to be "
            "written; free space or fix the storage, then re-run the same command: committed units are kept "
            "and the cache resumes.")

    def _collect(self, block: bool) -> None:
        """Take the writers' reports and deal more work; returns after one commit (or at once if not ``block``)."""
        from multiprocessing.connection import wait

        while True:
            ready = wait(self.done, timeout=1.0 if block else 0)
            if not ready:
                if not block:
                    return
                if all(p.is_alive() for p in self.procs):
                    continue
                raise self._dead_writer()
            committed = [self._report(self.done.index(conn)) for conn in ready]
            self._deal()
            if any(committed):
                return

    def _commit(self, unit: int) -> None:
        """Every array of ``unit`` is durable: its record makes it visible, and its buffer is free again."""
        fault_point("writer_before_commit")
        record = self.records.pop(unit)
        try:
            record.write(self.store)
        except OSError as exc:
            raise StorageWriteError(f"writing the commit record of unit {unit} in {self.path} failed: {exc}. Free "
                                    "space or fix the storage, then re-run the same command.") from exc
        del self.waiting[unit]
        self.free.append(self.unit_slot.pop(unit))
        self.committed.append(unit)

    @property
    def in_flight(self) -> int:
        """Units handed to the writers and not yet committed."""
        return len(self.waiting)

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
            bufs[s.name][n_tokens:n_slots] = s.fill  # buffers are reused: the last chunk's tail must be the fill
        self.waiting[unit] = len(self.specs)
        self.unit_slot[unit] = slot
        self.records[unit] = record
        for s in sorted(self.specs, key=lambda s: -s.row_bytes):
            self.pending.append((unit, slot, s.name, n_slots))
        self._deal()

    def poll(self) -> None:
        while self.waiting:
            before = len(self.committed)
            self._collect(block=False)
            if len(self.committed) == before:
                return

    def drain(self) -> None:
        t0 = time.perf_counter()
        while self.waiting:
            self._collect(block=True)
        self.wait_s += time.perf_counter() - t0

    def salvage(self) -> None:
        """On a failure elsewhere (a peer's, the forward's): commit the units already submitted, so the stop keeps
        what was finished. A writer that fails meanwhile is logged, not raised: the error on its way out wins."""
        try:
            self.drain()
        except StorageWriteError as exc:
            log.warning("stopping: %d submitted unit(s) could not be committed (%s); a re-run rewrites them",
                        len(self.waiting), exc)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the writers (each finishes its task in hand), then free the buffers. Safe to call twice."""
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
            self.tasks, self.done, self.procs = [], [], []
            unpin(self.pinned)
            self.pinned = []
            for s in self.slots:
                s.close()
            self.slots = []
