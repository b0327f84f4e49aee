"""Reading ahead: chunk bytes from object storage before they are needed, batches onto the GPU before the step.

:class:`ChunkPrefetcher` keeps a queue of the stored chunks a process will read (byte ranges
of shards, :class:`~dspark_precompute.contract.chunks.ChunkRef`), in the order it will read
them (the loader knows its next tasks), and fetches them with at most ``max_requests``
requests in flight and at most ``max_bytes`` held (fetched and not yet taken, plus every
request in flight counted at its size). A chunk is taken once; a read that was not planned (a
plan that guessed wrong) drops the plan and is fetched at once, so a wrong guess costs
requests, never a wrong or missing chunk.

:func:`to_device` overlaps each batch's host-to-device copy with the previous step.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from dspark_precompute.contract.chunks import ChunkRef

log = logging.getLogger(__name__)

Fetch = Callable[[ChunkRef], "Future[bytes | None]"]  # a chunk's byte range -> its bytes (None: no object)


@dataclass(eq=False)  # compared by identity
class _Entry:
    ref: ChunkRef
    reserved: int = 0
    state: str = "planned"  # planned | inflight | done
    dropped: bool = False
    data: bytes | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class ChunkPrefetcher:
    """Objects fetched ahead, in the order they will be taken, within a byte and a request bound.

    One thread takes (the one building batches); fetches complete on another.

    ``fetch(ref)`` returns a future of the bytes ``ref`` names (None when its object is
    absent). ``max_bytes`` bounds what is held; one chunk larger than it is still fetched,
    alone. A chunk known to be absent (``None`` for its ref) is never fetched: taking it gives None.
    """

    def __init__(self, fetch: Fetch, max_bytes: int, max_requests: int):
        if max_bytes < 1 or max_requests < 1:
            raise ValueError(f"max_bytes={max_bytes} and max_requests={max_requests} must be >= 1")
        self._fetch = fetch
        self.max_bytes = int(max_bytes)
        self.max_requests = int(max_requests)
        self._lock = threading.RLock()  # a future already done runs its callback inside _pump
        self._queue: deque[_Entry] = deque()
        self._held = 0
        self._inflight = 0
        self.peak_bytes = 0
        self.peak_requests = 0
        self.requests = 0
        self.wasted = 0  # objects fetched (or in flight) for a plan that was dropped

    # -- what is planned ---------------------------------------------------------------------
    def plan(self, items: Iterable[ChunkRef | None]) -> None:
        """Append chunks to the queue, in the order they will be taken (absent ones are skipped)."""
        with self._lock:
            self._queue.extend(_Entry(ref) for ref in items if ref is not None)
            self._pump()

    def reset(self) -> None:
        """Drop everything planned (fetches in flight finish and are thrown away)."""
        with self._lock:
            while self._queue:
                self._drop(self._queue.popleft())

    @property
    def held_bytes(self) -> int:
        return self._held

    @property
    def queued(self) -> int:
        return len(self._queue)

    def take(self, ref: ChunkRef | None) -> bytes | None:
        """The chunk ``ref``: the planned one (chunks planned before it are dropped) or, unplanned, fetched now."""
        if ref is None:
            return None
        with self._lock:
            entry = next((e for e in self._queue if e.ref == ref), None)
            if entry is None:
                while self._queue:
                    self._drop(self._queue.popleft())
                entry = _Entry(ref)
                self._queue.append(entry)
            else:
                while self._queue[0] is not entry:
                    self._drop(self._queue.popleft())
            self._pump()
        entry.done.wait()
        with self._lock:
            if entry in self._queue:
                self._queue.remove(entry)
            self._release(entry)
            self._pump()
        if entry.error is not None:
            raise entry.error
        return entry.data

    def take_many(self, items: Sequence[ChunkRef | None]) -> list[bytes | None]:
        return [self.take(ref) for ref in items]

    # -- internals (called with the lock held) ---------------------------------------------
    def _drop(self, e: _Entry) -> None:
        if e.state == "planned":
            return
        self.wasted += 1
        if e.state == "done":
            self._release(e)
        else:
            e.dropped = True  # released when it lands

    def _release(self, e: _Entry) -> None:
        self._held -= e.reserved
        e.reserved = 0

    def _pump(self) -> None:
        for e in self._queue:
            if e.state != "planned":
                continue
            if self._inflight >= self.max_requests:
                return
            need = e.ref.nbytes
            if self._held and self._held + need > self.max_bytes:
                return  # in order: nothing behind the head of the line starts before it
            e.state, e.reserved = "inflight", need
            self._held += need
            self._inflight += 1
            self.requests += 1
            self.peak_bytes = max(self.peak_bytes, self._held)
            self.peak_requests = max(self.peak_requests, self._inflight)
            try:
                fut = self._fetch(e.ref)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever takes it
                self._landed(e, None, exc)
                continue
            fut.add_done_callback(functools.partial(self._on_done, e))

    def _landed(self, e: _Entry, data: bytes | None, error: BaseException | None) -> None:
        self._inflight -= 1
        e.data, e.error, e.state = data, error, "done"
        self._held -= e.reserved
        e.reserved = 0 if e.dropped or data is None else len(data)
        self._held += e.reserved
        if e.dropped:
            e.data = None
        e.done.set()

    def _on_done(self, e: _Entry, fut: Future[bytes | None]) -> None:
        try:
            data, error = fut.result(), None
        except BaseException as exc:  # noqa: BLE001
            data, error = None, exc
        with self._lock:
            self._landed(e, data, error)
            self._pump()


def zarr_fetcher(zstore: Any) -> Fetch:
    """``fetch`` for a zarr store (an fsspec URL): range requests run on zarr's own event loop thread."""
    import asyncio

    from zarr.abc.store import RangeByteRequest
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import _get_loop

    proto = default_buffer_prototype()

    async def one(ref: ChunkRef) -> bytes | None:
        got = await zstore.get(ref.key, proto, byte_range=RangeByteRequest(ref.start, ref.stop))
        return None if got is None else got.to_bytes()

    def fetch(ref: ChunkRef) -> Future[bytes | None]:
        return asyncio.run_coroutine_threadsafe(one(ref), _get_loop())

    return fetch


# -- host to device ---------------------------------------------------------------------------
def to_device(batches: Iterable[dict[str, torch.Tensor]], device: str | torch.device,
              ) -> Iterator[dict[str, torch.Tensor]]:
    """``batches`` moved to ``device``; on CUDA each batch's copy runs on a side stream while the
    previous batch's step runs (``non_blocking`` from pinned memory), one batch ahead.

    Usable around any iterable of batch dicts: ``for batch in to_device(loader, "cuda"): ...``.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        for b in batches:
            yield {k: v.to(dev) for k, v in b.items()}
        return
    stream = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]  # torch leaves it unannotated

    def send(b: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Any, dict[str, torch.Tensor]]:
        with torch.cuda.stream(stream):
            out = {k: v.to(dev, non_blocking=True) for k, v in b.items()}
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
            ev.record(stream)
        return out, ev, b  # the host batch stays referenced until its copy is waited for

    it = iter(batches)
    first = next(it, None)
    pending = None if first is None else send(first)
    while pending is not None:
        out, ev, _host = pending
        nxt = next(it, None)
        pending = None if nxt is None else send(nxt)
        main = torch.cuda.current_stream(dev)
        main.wait_event(ev)
        for v in out.values():
            v.record_stream(main)  # memory allocated on the side stream, used on this one
        yield out
