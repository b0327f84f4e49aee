"""Data-parallel ranks: torchrun or SLURM (submitit) processes that share one cache.

Collectives (gloo, CPU objects only) are used during setup; the forward loop itself
needs none. Every rank writes only its own units; rank 0 allocates the arrays, writes
the manifest and marks it complete once every rank has reported done. A rank that fails
leaves a marker in the cache, so the others stop after their current unit, and a rank that
dies outright makes the final gloo barrier fail at once instead of hanging.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import uuid
from collections.abc import Callable
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


def init_ranks() -> Ranks:
    """Ranks from torchrun's environment, or from SLURM/submitit's, else a single process."""
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
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(hours=48))
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
