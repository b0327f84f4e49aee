"""Data-parallel ranks: torchrun or SLURM (submitit) processes that share one cache.

Collectives (gloo, CPU objects only) are used during setup; with one copy of the target per
rank the forward loop itself needs none. A sharded target (``parallel.*``) makes every forward
a collective: :class:`Lockstep` keeps the ranks running the same number of forwards and agreeing
to stop together (on CUDA its weights move over NCCL; the flags stay on gloo).
Each rank writes only its own units (:func:`unit_share`; under tensor parallelism a group's
ranks forward the same units and only the group's first rank writes them); rank 0 allocates the
arrays, writes the manifest and marks it complete once every rank has reported done. With one
copy per rank, a rank that fails leaves a marker in the cache, so the others stop at their next
unit; under :class:`Lockstep` they learn it at the next agreement. A rank that dies outright
makes the final gloo barrier fail at once instead of hanging.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from dspark_precompute.contract.store import CacheStore
from dspark_precompute.errors import RankFailedError

log = logging.getLogger(__name__)
T = TypeVar("T")
from dspark_precompute.contract.spec import COORD  # noqa: E402


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    initialized_here: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    def gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def together(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on every rank; if it fails anywhere, raise on every rank."""
        try:
            result, err = fn(), None
        except Exception as exc:  # re-raised below, on this rank and the others
            result, err = None, exc
        if self.world == 1:
            if err is not None:
                raise err
            return result  # type: ignore[return-value]
        status = self.gather(None if err is None else f"{type(err).__name__}: {err}")
        failed = [(r, s) for r, s in enumerate(status) if s]
        if failed:
            if err is not None:
                raise err
            r, msg = failed[0]
            raise RankFailedError(f"rank {r} failed, so rank {self.rank} stops too: {msg}")
        return result  # type: ignore[return-value]

    def close(self, clean: bool = True) -> None:
        """Tear down the process group; after a clean run, all ranks first meet in a barrier.

        A rank that destroys its gloo group while a peer still talks to it can abort that
        peer's process ("terminate called without an active exception") at exit.
        """
        if self.initialized_here:
            import torch.distributed as dist

            if clean:
                try:
                    dist.barrier()
                except RuntimeError:  # a peer is gone: nothing to wait for
                    pass
            dist.destroy_process_group()
            self.initialized_here = False


def init_ranks(cuda_collectives: bool = False) -> Ranks:
    """Ranks from torchrun's environment, or from SLURM/submitit's, else a single process.

    ``cuda_collectives`` (a sharded target on GPUs) adds NCCL for CUDA tensors beside gloo for CPU ones.
    """
    env = os.environ
    if "WORLD_SIZE" not in env and "SUBMITIT_EXECUTOR" in env:
        try:  # a submitit task (SLURM or local): export MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK
            import submitit
            from submitit.helpers import TorchDistributedEnvironment

            if submitit.JobEnvironment().num_tasks > 1:
                TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
        except Exception as exc:  # not fatal: run as one process
            log.warning("could not read the submitit task environment (%s); running as a single process", exc)
    world = int(env.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks()
    import torch.distributed as dist

    rank, local = int(env["RANK"]), int(env.get("LOCAL_RANK", "0"))
    here = False
    if not dist.is_initialized():
        # Long timeout: the end barrier waits for the slowest rank's last unit. A rank that dies
        # closes its sockets, which fails the collective at once, whatever the timeout.
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda_collectives else "gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(hours=48))
        here = True
    return Ranks(rank, world, local, here)


def assign_units(unit_tokens: np.ndarray, world: int) -> list[list[int]]:
    """Units per rank, balanced by token count (largest first onto the least loaded rank)."""
    load = [0] * world
    out: list[list[int]] = [[] for _ in range(world)]
    for u in sorted(range(len(unit_tokens)), key=lambda u: (-int(unit_tokens[u]), u)):
        r = min(range(world), key=lambda r: (load[r], r))
        out[r].append(u)
        load[r] += int(unit_tokens[u])
    return [sorted(x) for x in out]


def unit_share(todo: list[int], unit_tokens: np.ndarray, ranks: Ranks, tp: int = 1) -> tuple[list[int], bool]:
    """This rank's units of ``todo`` and whether it writes them.

    The ranks of a tensor-parallel group (``tp`` consecutive ranks) forward the same units, each
    forward a collective of the group, and every rank of it holds the same full states: only
    the group's first rank writes. ``unit_tokens`` is indexed by unit.
    """
    groups = assign_units(np.asarray(unit_tokens)[todo], ranks.world // tp)
    return [todo[i] for i in groups[ranks.rank // tp]], ranks.rank % tp == 0


class Coordinator:
    """Failure markers of one job under ``coord/<run_id>/`` in the cache (checked between units)."""

    def __init__(self, store: CacheStore, ranks: Ranks, run_id: str):
        self.store, self.ranks, self.run_id = store, ranks, run_id
        self.prefix = f"{COORD}/{run_id}"

    @staticmethod
    def new_run_id() -> str:
        return uuid.uuid4().hex[:12]

    def fail(self, message: str) -> None:
        if self.ranks.world > 1:
            self.store.write_bytes(f"{self.prefix}/failed-{self.ranks.rank}.json",
                                   json.dumps({"rank": self.ranks.rank, "error": message[-2000:]}).encode())

    def check(self) -> None:
        """Raise if another rank has failed (called between units)."""
        if self.ranks.world == 1:
            return
        for key in self.store.list_keys(self.prefix):
            if "/failed-" in key:
                info = json.loads(self.store.read_bytes(key))
                raise RankFailedError(f"rank {info['rank']} failed, so rank {self.ranks.rank} stops too: "
                                      f"{info['error'].splitlines()[-1] if info['error'] else ''}")

    def cleanup(self) -> None:
        self.store.delete(COORD)


# Lockstep stop codes: 0 goes on, a signal number (SIGINT, SIGTERM) stops as that signal, ERROR as a failure.
ERROR = 255


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed before one forward: each stopping rank's code, and whether any rank has work left."""

    stops: dict[int, int]
    busy: bool
    waiting: bool = False  # some rank waits for the trainer (storage.window_*): the group polls until it may go


class Lockstep:
    """Ranks whose forwards are collectives (a sharded target): one agreement before every forward.

    Each rank puts its stop code (0, a signal, :data:`ERROR`) in its slot and whether it still
    has a batch; one MAX all-reduce tells every rank the same answer at the same step, so all
    stop together, or a rank without batches runs a dummy forward while another still has one.

    It owns the stop protocol: :attr:`halt` is what the group agreed when it stopped, and
    :attr:`inside` says a collective (an agreement or a forward) is under way, during which a
    failing rank cannot tell its peers (they wait in that collective; its exit ends it for them).
    A rank that fails between collectives :meth:`tell` s the group, which then stops at that
    agreement; every rank drains its writers, then all :meth:`meet`. Disabled (one copy per
    rank, or one rank), it agrees with itself: :meth:`go` is only this rank's signal flag.
    """

    def __init__(self, ranks: Ranks, enabled: bool):
        self.ranks, self.enabled = ranks, enabled and ranks.world > 1
        self.halt: Agreement | None = None
        self.inside = False

    def agree(self, has_work: bool, code: int = 0, waiting: bool = False) -> Agreement:
        if not self.enabled:
            return Agreement({0: code} if code else {}, has_work, waiting)
        import torch
        import torch.distributed as dist

        flags = torch.zeros(self.ranks.world + 2, dtype=torch.int64)
        flags[self.ranks.rank] = code
        flags[-2] = int(has_work)
        flags[-1] = int(waiting)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        values = flags.tolist()
        return Agreement({r: int(c) for r, c in enumerate(values[:-2]) if c}, bool(values[-2]), bool(values[-1]))

    def step(self, has_work: bool, signum: int | None = None, waiting: bool = False) -> Agreement | None:
        """One agreement of the group (a stop is kept): what it agreed, or None once it stops."""
        if self.halt is not None:
            return None
        with self.collective():
            agreed = self.agree(has_work, signum or 0, waiting)
        if agreed.stops:
            self.halt = agreed
            return None
        return agreed

    def go(self, has_work: bool = True, signum: int | None = None) -> bool:
        """Whether to run the next forward: this rank's signal flag, or what every rank agreed (a stop is kept)."""
        if not self.enabled:
            return signum is None
        agreed = self.step(has_work, signum)
        return agreed is not None and agreed.busy

    @contextmanager
    def collective(self) -> Iterator[None]:
        """Mark a collective (a forward, an agreement) under way; an exception inside leaves the mark set."""
        self.inside = self.enabled
        yield
        self.inside = False

    def can_tell(self) -> bool:
        """Whether a failure here can still be told to the group: enabled, not stopped yet, between collectives."""
        return self.enabled and self.halt is None and not self.inside

    def tell(self, code: int) -> bool:
        """This rank stops with ``code``: the group agrees to stop at this step. False if a peer is gone too."""
        if not self.can_tell():
            return False
        try:
            self.halt = self.agree(False, code)
        except RuntimeError:  # a peer is gone as well: nothing to tell
            return False
        return True

    def meet(self) -> None:
        """After a stop: every rank waits here until all have drained their writers."""
        if self.enabled:
            try:
                self.agree(False)
            except RuntimeError:  # a peer is gone: nothing to wait for
                pass

    def failed(self) -> list[int]:
        """The ranks whose failure (not a signal) stopped the group."""
        return sorted(r for r, c in (self.halt.stops.items() if self.halt else ()) if c == ERROR)
