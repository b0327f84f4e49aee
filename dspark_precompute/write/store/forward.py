"""The forward loop: each unit's batches through the target, its states into a unit buffer, the unit to the writers.

A sample whose states hold NaN/Inf is dropped (its states zeroed, its id in the unit's commit
record) or stops the run, per ``data.on_nonfinite``. Every stop keeps what was finished: a first
SIGINT/SIGTERM, a peer's failure or an error here drops the unit in flight and lets the writers
finish and commit the units they already hold (then raises, a signal as
:class:`~dspark_precompute.errors.StoppedBySignal`). Only a second signal (or a writer that
failed itself) raises at once, leaving the submitted units to be rewritten on resume. Everything
the loop builds (hooks, writers, buffers, the transfer stream) is owned by one ``ExitStack``,
so a constructor that fails leaves nothing behind.

Under a sharded target every forward is a collective, so the ranks move in lockstep
(:class:`~dspark_precompute.write.parallel.distributed.Lockstep`): before each batch they agree
whether to go on; a rank whose units are done runs 1-token dummy forwards while another still
has batches; a signal, a bad batch, a full disk or any error on one rank stops every rank at that
step (each drops its unit in flight and lets its writers finish the units they hold). Under
lockstep a peer's failure is learned only at an agreement, never from its marker between units,
so no rank can leave before draining.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dspark_precompute import signals
from dspark_precompute.contract.commits import CommitRecord, TokenDigests
from dspark_precompute.contract.layout import Layout
from dspark_precompute.contract.vocab import StorageDtype
from dspark_precompute.errors import NonFiniteStatesError, RankFailedError, StoppedBySignal
from dspark_precompute.faults import fault_point
from dspark_precompute.progress import Progress
from dspark_precompute.tensors import torch_dtype
from dspark_precompute.write.parallel.distributed import ERROR, Agreement, Coordinator, Lockstep, Ranks
from dspark_precompute.write.plan.array_specs import ArraySpec
from dspark_precompute.write.plan.prepare import Plan
from dspark_precompute.write.samples.media import MediaInputs
from dspark_precompute.write.store.batching import batch_inputs, make_batches
from dspark_precompute.write.store.transfer import StateArray, UnitCheck, UnitTransfer, zero_samples
from dspark_precompute.write.store.window import POLL_S as WINDOW_POLL_S
from dspark_precompute.write.store.window import WindowGate
from dspark_precompute.write.store.writer import UnitWriter, resolve_writers
from dspark_precompute.write.target.capture import HiddenStateCapture

log = logging.getLogger(__name__)


def state_arrays(specs: list[ArraySpec]) -> list[StateArray]:
    """The hidden-state arrays of a run's specs, each with its cast (or fp8 quantization) and the state feeding it."""
    return [StateArray(s.name, int(s.source if s.source is not None else s.layer_id or 0),
                       None if s.scale else torch_dtype(str(s.storage)), s.storage == StorageDtype.bf16, s.scale,
                       int(s.group or 0))
            for s in specs if s.width and s.storage is not None]


@dataclass
class ForwardStats:
    """Seconds per stage of the forward loop (summed), for the manifest's ``timing``."""

    batch_s: float = 0.0
    forward_s: float = 0.0
    copy_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        return {"batch_s": self.batch_s, "forward_s": self.forward_s, "copy_s": self.copy_s, **self.extra}


class ForwardLoop:
    """Forwards units of one run's layout and hands them to the writers."""

    def __init__(self, plan: Plan, model: Any, ids: Mapping[int, np.ndarray], layout: Layout, device: torch.device,
                 tokens: TokenDigests | None = None, writes: bool = True):
        self.plan, self.model, self.ids, self.layout, self.device = plan, model, ids, layout, device
        self.tokens = tokens  # the token shards' digests as written, copied into each unit's commit record
        self.lengths = layout.length.astype(np.int64)
        self.stats = ForwardStats()
        self.fills = {s.name: s.fill for s in plan.specs if s.fill}
        self.hidden = state_arrays(plan.specs)
        self.lockstep = Lockstep(Ranks(), False)  # set by run(): a sharded target's ranks move together
        self.writes = writes  # False: a tensor-parallel rank whose group's first rank writes (it only forwards)
        self.gate: WindowGate | None = None  # storage.window_units: a unit starts only once it fits the window
        self.media: MediaInputs | None = None  # rows with images: their pixels go through the vision tower

    def run(self, todo: list[int], coord: Coordinator, lockstep: Lockstep | None = None) -> int:
        """Forward every unit in ``todo``; the number handed to the writers and committed."""
        cfg = self.plan.cfg
        if lockstep is not None:
            self.lockstep = lockstep
        if not self.writes:
            return self._follow(todo, coord)
        n_writers = resolve_writers(cfg.storage.writers)
        with ExitStack() as stack:
            capture = stack.enter_context(self._capture())
            writer = stack.enter_context(UnitWriter(self.plan.store, self.plan.specs, self.layout, cfg.storage, todo,
                                                    writers=n_writers, pin_memory=self.device.type == "cuda"))
            transfer = UnitTransfer(self.hidden, device=self.device)
            progress = Progress("precompute",
                                int(sum(self.layout.unit_stop[u] - self.layout.unit_start[u] for u in todo)),
                                int(sum(len(self.layout.unit_order[u]) for u in todo)), enabled=cfg.progress,
                                written="raw written")
            stack.callback(progress.close)
            if self.gate is not None:
                self.gate.progress = progress
            stop = signals.STATE
            self._each_unit(todo, coord, capture, lambda u: self._unit(u, capture, writer, transfer, progress),
                            writer)
            self._group_stopped(coord)
            if stop.signum is not None and len(writer.committed) < len(todo):
                raise StoppedBySignal(stop.signum)
            progress.update(bytes_total=writer.raw_bytes)
            self.stats.extra.update(writer_wait_s=writer.wait_s, writer_busy_s=writer.busy_s,
                                    writers=float(n_writers))
        return len(todo)

    def _unit(self, u: int, capture: HiddenStateCapture, writer: UnitWriter, transfer: UnitTransfer,
              progress: Progress) -> None:
        """One unit: its batches forwarded into a free buffer, checked, handed to the writers."""
        layout = self.layout
        step = (lambda: self._wait_step(capture)) if self.lockstep.enabled else None
        if self.gate is not None and not self.gate.wait(u, writer.drain, step):
            return  # a signal (or the group's stop) while waiting for the trainer: nothing of this unit was started
        slot = writer.acquire()
        bufs = writer.buffers(slot)
        transfer.start(bufs)
        base = int(layout.unit_start[u])
        order = layout.unit_order[u]
        for batch in self._batches(order):
            c0 = time.perf_counter()
            blens = self.lengths[batch]
            ids, _ = batch_inputs(self.ids, batch, self.lengths, self.plan.pad_id, self.device)
            if not self._go():
                transfer.finish()
                writer.release(slot)  # drop the unit in flight, keep the ones the writers hold
                return
            c1 = time.perf_counter()
            states, last = self._forward(capture, ids, self._pixels(batch, ids.shape[1]))
            c2 = time.perf_counter()
            transfer.add(batch, blens, ids.shape[1], states, last, int(layout.start[batch[0]]) - base)
            c3 = time.perf_counter()
            self.stats.batch_s += c1 - c0
            self.stats.forward_s += c2 - c1
            self.stats.copy_s += c3 - c2
            progress.update(samples=len(batch), tokens=int(blens.sum()), bytes_total=writer.raw_bytes)
            writer.poll()
        c4 = time.perf_counter()
        check = transfer.finish()  # on CUDA: the unit's copies are done
        self.stats.copy_s += time.perf_counter() - c4
        n_tok = int(layout.unit_stop[u] - layout.unit_start[u])
        record = CommitRecord(u, base, base + n_tok, len(order), socket.gethostname(),
                              shards=self.tokens.unit(u) if self.tokens is not None else {})
        if check.bad_samples:
            names = [a.name for a in self.hidden] + [a.scale for a in self.hidden if a.scale]
            self._drop_nonfinite(check, bufs, base, names, record)
        writer.submit(u, slot, n_tok, record)
        fault_point("unit_submitted")

    def _follow(self, todo: list[int], coord: Coordinator) -> int:
        """A tensor-parallel rank that does not write: the batches of its group's writer, in the same order (each
        forward is a collective of the group, and every rank of it holds the same full states), nothing stored."""
        def unit(u: int) -> None:
            for batch in self._batches(self.layout.unit_order[u]):
                ids, _ = batch_inputs(self.ids, batch, self.lengths, self.plan.pad_id, self.device)
                if not self._go():
                    return
                self._forward(capture, ids, self._pixels(batch, ids.shape[1]))

        with self._capture() as capture:
            self._each_unit(todo, coord, capture, unit)
            self._group_stopped(coord)
            if signals.STATE.signum is not None:
                raise StoppedBySignal(signals.STATE.signum)
        return 0

    def _each_unit(self, todo: list[int], coord: Coordinator, capture: HiddenStateCapture,
                   each: Callable[[int], None], writer: UnitWriter | None = None) -> None:
        """``each`` unit in order until a signal or the group's agreement stops them, then (lockstep) the dummy
        forwards and the writers' drain, all under :func:`signals.graceful`. A failure is told to the group and
        the units already submitted are committed (:meth:`_stop_on_error`) before it propagates."""
        stop, lockstep = signals.STATE, self.lockstep
        with signals.graceful():
            try:
                for u in todo:
                    if stop.signum is not None or lockstep.halt is not None:
                        break
                    fault_point("unit_start")
                    if not lockstep.enabled:
                        coord.check()  # one copy per rank: a peer's failure is read from its marker, between units
                    each(u)
                self._idle(capture, writer.drain if writer is not None else None)
            except BaseException as exc:
                self._stop_on_error(exc, coord, writer)
                raise
            if writer is not None:
                writer.drain()

    def _stop_on_error(self, exc: BaseException, coord: Coordinator, writer: UnitWriter | None) -> None:
        """Before ``exc`` propagates: tell the group (lockstep, between collectives), commit what the writers hold,
        then wait until every rank has drained. A second signal (``StoppedBySignal`` raised here) skips the
        drain: the user asked to stop now. A library call's Ctrl-C (``KeyboardInterrupt``, the caller's handlers)
        is its first stop and drains; a second Ctrl-C interrupts the drain."""
        told = False
        if self.lockstep.can_tell():
            coord.fail(f"{type(exc).__name__}: {exc}")  # the message the peers report
            told = self.lockstep.tell(exc.signum if isinstance(exc, StoppedBySignal) else ERROR)
        if writer is not None and not isinstance(exc, StoppedBySignal):
            writer.salvage()
        if told:
            self.lockstep.meet()

    def _go(self, has_work: bool = True) -> bool:
        """Whether to run the next forward: this rank's signal flag, or (lockstep) what every rank agreed."""
        return self.lockstep.go(has_work, signals.STATE.signum)

    def _capture(self) -> HiddenStateCapture:
        return HiddenStateCapture(self.model, self.plan.layer_ids,
                                  pre_norm=any(s.final == "pre_norm" for s in self.plan.specs),
                                  media=self.media is not None)

    def _batches(self, order: np.ndarray) -> list[np.ndarray]:
        """A unit's forward batches, in its order (each batch a run of it: its samples sit side by side on disk).

        Samples with images batch with the rest: each row's pixels, grids and image pads go in together
        (:meth:`MediaInputs.of_batch`), and the model gives each row its own multi-axis positions."""
        cfg = self.plan.cfg
        return make_batches(order, self.lengths, cfg.batch.max_tokens, cfg.batch.max_samples)

    def _pixels(self, batch: np.ndarray, width: int) -> dict[str, torch.Tensor] | None:
        """The image inputs of a batch (``width`` tokens a row) holding samples with images; None for text batches."""
        if self.media is None:
            return None
        return self.media.of_batch(batch, self.ids, width)

    def _forward(self, capture: HiddenStateCapture, ids: torch.Tensor,
                 pixels: dict[str, torch.Tensor] | None = None) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        with self.lockstep.collective():
            return capture(ids, media=pixels)

    def _idle(self, capture: HiddenStateCapture, settle: Callable[[], None] | None = None) -> None:
        """Lockstep: dummy 1-token forwards while another rank still has batches (their collectives need ours).

        While a peer waits for the trainer the group polls together; ``settle`` (this rank's writers' drain) runs
        once that starts, so the units this rank submitted are committed: the trainer may need them to release any
        unit."""
        if not self.lockstep.enabled or self.lockstep.halt is not None:
            return
        while True:
            agreed = self._group_step(capture, waiting=False)
            if agreed is None or not (agreed.busy or agreed.waiting):
                return
            if not agreed.busy and settle is not None:
                settle()
                settle = None

    def _wait_step(self, capture: HiddenStateCapture) -> bool:
        """Lockstep, this rank waiting for the trainer: one step of the group; False once the group stops."""
        return self._group_step(capture, waiting=True) is not None

    def _group_step(self, capture: HiddenStateCapture, waiting: bool) -> Agreement | None:
        """Lockstep without a batch of this rank's own: one agreement, then the dummy forward a busy peer's
        collectives need, or a pause while a rank waits for the trainer; None once the group stops."""
        agreed = self.lockstep.step(False, signals.STATE.signum, waiting=waiting)
        if agreed is not None and agreed.busy:
            self._forward(capture, self._dummy())
        elif agreed is not None and agreed.waiting:
            time.sleep(WINDOW_POLL_S)  # a rank waits for the trainer: the group polls with it
        return agreed

    def _dummy(self) -> torch.Tensor:
        return torch.full((1, 1), self.plan.pad_id, dtype=torch.long, device=self.device)

    def _group_stopped(self, coord: Coordinator) -> None:
        """Lockstep: raise on this rank what stopped the group (a peer's failure, or a signal), once all have met."""
        lockstep = self.lockstep
        if lockstep.halt is None or not lockstep.enabled:
            return
        failed = lockstep.failed()
        if not failed:
            lockstep.meet()
            raise StoppedBySignal(min(lockstep.halt.stops.values()))
        exc: BaseException
        try:
            coord.check()  # the failing rank's own message, when its marker is readable
            exc = RankFailedError(f"rank {failed[0]} failed, so rank {lockstep.ranks.rank} stops too "
                                  "(its committed units are kept; re-run the same command)")
        except RankFailedError as err:
            exc = err
        coord.fail(f"{type(exc).__name__}: {exc}")
        lockstep.meet()
        raise exc

    def _drop_nonfinite(self, check: UnitCheck, bufs: dict[str, np.ndarray], base: int, names: list[str],
                        record: CommitRecord) -> None:
        """Samples whose states are not finite: stop (``data.on_nonfinite=error``) or drop them from the cache.

        A dropped sample's states are zeroed (no Inf is ever stored) and its id goes into the
        unit's commit record; the run's end moves it from the samples to the rejects.
        """
        bad, layout, cfg = check.bad_samples, self.layout, self.plan.cfg
        if cfg.data.on_nonfinite == "error":
            s = min(bad)
            raise NonFiniteStatesError(
                f"sample {s} has non-finite hidden states ({', '.join(f'{k}: {v} values' for k, v in bad[s].items())})"
                f" and {len(bad) - 1} more sample(s) of unit {record.unit} too; a {cfg.model.dtype} forward "
                "overflowed or the target is broken. Use model.dtype=bf16 or fp32 instead of fp16, or pass "
                "data.on_nonfinite=reject to drop such samples (listed in rejects.jsonl); committed units are kept.")
        spans = [(int(layout.start[s]) - base, int(layout.start[s] + layout.length[s]) - base) for s in sorted(bad)]
        zero_samples(bufs, names, spans, self.fills)
        record.extra["dropped"] = [{"sample": s, "nonfinite": bad[s]} for s in sorted(bad)]
        log.warning("unit %d: %d sample(s) with non-finite hidden states dropped (%s)", record.unit, len(bad),
                    ", ".join(f"{k}={v}" for k, v in check.nonfinite.items()))
