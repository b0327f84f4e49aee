"""Rows -> samples in worker processes: the encoding of one row, and a pool that runs it in order.

Kept apart from ``tokenize`` so a worker imports the chat encoder and the tokenizer's
classes only (never torch or the target); the pool's processes come from the writers'
fork server and talk over pipes, so nothing named is left behind by a killed run.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from typing import Any, cast

from dspark_precompute.contract.vocab import Message
from dspark_precompute.errors import DataError
from dspark_precompute.faults import fault_point
from dspark_precompute.write.parallel import processes
from dspark_precompute.write.samples.chat import ChatEncoder, Encoded
from dspark_precompute.write.samples.images import image_base
from dspark_precompute.write.samples.media import MediaEncoder, MediaSpec
from dspark_precompute.write.samples.normalize import Conversation, Reject, normalize
from dspark_precompute.write.samples.rows import RawRow


@dataclass(frozen=True)
class RowEncoder:
    """How to turn one input row into a sample or a reject; picklable, so a worker process can rebuild it."""

    template: str
    seq_length: int
    mask_reasoning_content: bool
    mask_generation_prompt: bool
    data_format: str
    mask_rule: str = "nemo"
    media: MediaSpec | None = None  # an image-text target: rows with images go through its processor
    data_root: str | None = None  # the folder relative image paths resolve against (with each row's file)

    def build(self, tokenizer: Any) -> ChatEncoder:
        chat = ChatEncoder(tokenizer, self.template, self.seq_length, self.mask_reasoning_content,
                           self.mask_generation_prompt, mask_rule=self.mask_rule)
        if self.media is not None:
            chat.media = MediaEncoder(chat, self.media)
        return chat

    def encode(self, encoder: ChatEncoder, raw: RawRow, sel: int) -> Encoded | Reject:
        item: Conversation | Encoded | Reject = normalize(raw, self.data_format, media=self.media is not None)
        if isinstance(item, Conversation) and item.media:
            item = encoder.media.encode(item, image_base(self.data_root, raw.file), raw.row)
        elif isinstance(item, Conversation):
            item = encoder.encode(item, raw.row)
        if isinstance(item, Reject):
            # row: index in the selection (what samples/source_row counts); file/file_row/line: the source
            item.row, item.line, item.file = sel, raw.line, raw.file
            item.file_row = raw.row if raw.file_row is None else raw.file_row
        assert not isinstance(item, Conversation)
        return item


def _worker(spec: RowEncoder, tasks: Any, results: Any, env: dict[str, str]) -> None:
    """A tokenizing process: chunks of (selection index, row) in, (index, sample or reject) out."""
    processes.child_setup(env)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: parallelism comes from the workers
    try:
        fault_point("tokenize_start")
        encoder = spec.build(tasks.recv())  # the main process's own tokenizer: never a second load from disk
        results.send((Message.ready, -1, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the main process, which raises it typed
        try:
            results.send((Message.error, -1, f"{type(exc).__name__}: {exc}"))
        except OSError:  # the main process is gone (killed while this worker started)
            pass
        return
    while True:
        try:
            task = tasks.recv()
        except (EOFError, OSError):  # the main process is gone
            return
        if task is None:
            return
        chunk_id, pairs = task
        try:
            out = []
            for sel, raw in pairs:
                fault_point("tokenize_row")
                out.append((sel, spec.encode(encoder, raw, sel)))
            results.send((Message.done, chunk_id, out))
        except (EOFError, OSError):
            return
        except BaseException as exc:  # noqa: BLE001
            results.send((Message.error, chunk_id, f"{type(exc).__name__}: {exc}"))
            return


class EncoderPool:
    """``n`` tokenizing processes fed over pipes (no named semaphores), results in submission order.

    The processes start in a background thread and each rebuilds the tokenizer (seconds for
    Qwen3's, mostly imports and unpickling), so the caller keeps tokenizing in its own process
    until ``ready()`` says the pool can take over.
    """

    def __init__(self, spec: RowEncoder, tokenizer: Any, n: int):
        self.finished = False
        self.tasks: list[Any] = []
        self.results: list[Any] = []
        self.procs: list[Any] = []
        self._lock = threading.Lock()  # procs/tasks/results grow in the starter thread
        self._closing = False
        self._boot_error: BaseException | None = None
        self._booted: set[int] = set()  # workers that reported their encoder built
        try:  # here, once for all workers, while nothing else uses the tokenizer
            payload = bytes(ForkingPickler.dumps(tokenizer))
        except Exception as exc:
            raise DataError(f"the tokenizer cannot be sent to worker processes ({type(exc).__name__}: {exc}); set "
                            "data.num_workers=0 to tokenize in the main process") from exc
        self._starter = threading.Thread(target=self._start, args=(spec, payload, n), daemon=True,
                                         name="dspark-tokenize-start")
        self._starter.start()

    def _start(self, spec: RowEncoder, payload: bytes, n: int) -> None:
        try:
            ctx = processes.context()
            env = dict(os.environ)
            for i in range(n):
                t_out, t_in = ctx.Pipe(duplex=False)
                r_out, r_in = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker, args=(spec, t_out, r_in, env), daemon=True,
                                name=f"dspark-tokenize-{i}")
                with self._lock:
                    if not self._closing:
                        processes.start(p)
                        self.tasks.append(t_in)
                        self.results.append(r_out)
                        self.procs.append(p)
                t_out.close()
                r_in.close()
                if self._closing:
                    t_in.close()
                    r_out.close()
                    return
            for t in list(self.tasks):  # after every start: the workers rebuild it in parallel
                if self._closing:  # close() kills the workers, so a send under way fails at once
                    return
                t.send_bytes(payload)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            self._boot_error = exc

    def _started(self) -> None:
        """Wait for the starter thread; a worker that dies meanwhile (the starter may be blocked on it) raises."""
        while self._starter.is_alive():
            self._starter.join(0.2)
            if self._starter.is_alive() and not all(p.is_alive() for p in list(self.procs)):
                self._kill()  # unblocks a send to a worker that is gone
                self._starter.join()
                raise self._died()
        if self._boot_error is not None:
            if isinstance(self._boot_error, (BrokenPipeError, ConnectionError, EOFError)):
                raise self._died() from self._boot_error
            raise DataError(f"tokenizing worker processes could not start ({type(self._boot_error).__name__}: "
                            f"{self._boot_error}); set data.num_workers=0 to tokenize in the main process"
                            ) from self._boot_error

    def _note(self, i: int, message: tuple[str, int, Any]) -> tuple[str, int, Any] | None:
        """Handle a worker's start-up message (ready or failed); any other message is returned."""
        kind, _chunk_id, payload = message
        if kind == Message.ready:
            self._booted.add(i)
            return None
        if kind == Message.error:
            raise DataError(f"tokenizing failed in a worker process: {payload}")
        return message

    def ready(self) -> bool:
        """Whether every worker has its encoder (never blocks); a worker that failed to start raises."""
        if self._starter.is_alive():
            return False
        self._started()
        for i, conn in enumerate(self.results):
            if i in self._booted:
                continue
            try:
                while i not in self._booted and conn.poll():
                    self._note(i, conn.recv())
            except (EOFError, OSError):
                raise self._died() from None
            if i not in self._booted and not self.procs[i].is_alive():
                raise self._died()
        return len(self._booted) == len(self.procs)

    def map(self, chunks: Iterator[list[tuple[int, RawRow]]]) -> Iterator[tuple[int, Encoded | Reject]]:
        """Encode every chunk; yield (selection index, item) in input order.

        A feeder thread sends the chunks (at most two per worker not yet consumed), so this
        thread never blocks on a full task pipe while a worker blocks on a full result pipe.
        """
        self._started()
        n = len(self.procs)
        room = threading.Semaphore(2 * n)
        stop = threading.Event()
        fed: dict[str, Any] = {"sent": 0, "done": False, "error": None}

        def feed() -> None:
            try:
                for i, chunk in enumerate(chunks):
                    while not room.acquire(timeout=0.2):
                        if stop.is_set():
                            return
                    if stop.is_set():
                        return
                    self.tasks[i % n].send((i, chunk))
                    fed["sent"] = i + 1
            except BaseException as exc:  # noqa: BLE001 - re-raised in the consuming thread
                fed["error"] = exc
            finally:
                fed["done"] = True

        feeder = threading.Thread(target=feed, name="dspark-tokenize-feeder", daemon=True)
        feeder.start()
        ready: dict[int, list[tuple[int, Encoded | Reject]]] = {}
        next_out = 0
        try:
            while True:
                while next_out in ready:
                    yield from ready.pop(next_out)
                    room.release()
                    next_out += 1
                if fed["done"]:
                    if fed["error"] is not None:
                        if isinstance(fed["error"], (BrokenPipeError, ConnectionError)):
                            raise self._died()
                        raise fed["error"]
                    if next_out >= fed["sent"]:
                        self.finished = True
                        return
                for conn in wait(self.results, timeout=0.2):
                    try:
                        message = self._note(self.results.index(conn), cast(Any, conn).recv())
                    except (EOFError, OSError):
                        raise self._died() from None
                    if message is not None:
                        ready[message[1]] = message[2]
                if not all(p.is_alive() for p in self.procs) and not any(c.poll() for c in self.results):
                    raise self._died()
        finally:
            stop.set()
            if not self.finished:  # stopped early: the feeder may be blocked on a worker that is blocked on us
                self._kill()
            feeder.join(5)

    def _kill(self) -> None:
        with self._lock:  # no process starts after this
            self._closing = True
        for p in self.procs:
            if p.is_alive():
                p.kill()  # SIGKILL: helper processes ignore SIGTERM (see processes.child_setup)
        for p in self.procs:
            p.join(5)

    def _died(self) -> DataError:
        """The error for a worker gone: the reason it reported before it stopped, if any."""
        for i, conn in enumerate(self.results):
            try:
                while conn.poll():
                    self._note(i, conn.recv())  # raises the worker's own error
            except (EOFError, OSError):
                continue
        return DataError("a tokenizing process died; re-run the same command (or set data.num_workers=0 to "
                         "tokenize in the main process)")

    def close(self) -> None:
        """Stop the workers: a clean stop after a finished map, else at once (they may be blocked on a pipe)."""
        for t in self.tasks if self.finished else ():
            try:
                t.send(None)
            except OSError:
                pass
        for p in self.procs if self.finished else ():
            p.join(10)
        self._kill()  # a starter still handing over the tokenizer then fails on a broken pipe
        self._starter.join()
        for c in (*self.tasks, *self.results):
            c.close()
