"""Helper processes (writers, tokenizers): where they start from, how they start, how many.

They come from one fork server: a fresh interpreter (never a fork of a process that holds
CUDA or torch threads) with numpy, zarr, the tokenizer classes and our helper modules imported
once, so each process forks from it in milliseconds; they talk over pipes and shared
memory without names, so a killed run leaves nothing in /dev/shm.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from pathlib import Path
from typing import Any

# the tokenizer classes too (transformers 5 and 4 names; a missing one is skipped), not torch
PRELOAD = ["numpy", "zarr", "dspark_precompute.write.writer", "dspark_precompute.write.encode",
           "transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast"]


def context() -> Any:
    """The multiprocessing context helper processes start from (a fork server where there is one)."""
    if "forkserver" not in mp.get_all_start_methods():  # pragma: no cover - not Linux/macOS
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start(proc: Any) -> None:
    """Start ``proc``, also under a script read from stdin.

    multiprocessing re-runs the parent's ``__main__`` file in the child; for ``python -``
    that "file" is ``<stdin>``, which does not exist, and the child would die before it starts.
    """
    main = sys.modules.get("__main__")
    name = getattr(main, "__file__", None)
    if main is None or not isinstance(name, str) or Path(name).exists():
        proc.start()
        return
    del main.__file__
    try:
        proc.start()
    finally:
        main.__file__ = name


def child_setup(env: dict[str, str]) -> None:
    """First thing in a helper process: the run's environment, no signal handling, no named semaphores."""
    from dspark_precompute import faults
    from dspark_precompute.write import signals

    # forked from a server that may predate this run: take the run's environment (storage
    # credentials and endpoints, fault injection) as the main process has it now
    os.environ.clear()
    os.environ.update(env)
    faults.reload()
    # Ctrl-C / scancel reach the whole process group: the main process decides when to stop,
    # a helper finishes the work it was given (the None sentinel, or orphan detection).
    signals.ignore()
    # numcodecs' blosc takes a multiprocessing.Lock of the default context on first use; in a
    # spawned child that is a named semaphore, which a SIGKILL of the group would leave in
    # /dev/shm. Helpers start no processes: the fork context unlinks its semaphores at once.
    mp.set_start_method("fork", force=True)


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, else the machine's), shared by the local ranks."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, cores // max(1, local_world))
