"""Helper processes (writers, tokenizers): where they start from, how they start, how many.

They come from the package's own fork server (:class:`HelperServer`): a fresh interpreter
(never a fork of a process that holds CUDA or torch threads) with numpy, zarr, the tokenizer
classes and our helper modules imported once, so each process forks from it in milliseconds;
they talk over pipes and shared memory without names, so a killed run leaves nothing in
/dev/shm. The server is private to the package: the caller's ``multiprocessing`` start
method and fork-server preload (the global forkserver's) are never touched.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from multiprocessing import forkserver, popen_forkserver, process, reduction, spawn, util
from multiprocessing.context import BaseContext, set_spawning_popen
from pathlib import Path
from typing import Any

# the tokenizer classes too (transformers 5 and 4 names; a missing one is skipped), not torch
PRELOAD = ["numpy", "zarr", "dspark_precompute.write.store.writer", "dspark_precompute.write.samples.encode",
           "transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast"]


def _close_fds(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


class _Popen(popen_forkserver.Popen):
    """multiprocessing's fork-server Popen, asking ``server`` for the fork instead of the module-wide server."""

    _fds: list[int]  # the descriptors handed to the child (set by popen_forkserver.Popen)

    def __init__(self, process_obj: Any, server: forkserver.ForkServer):
        self._server = server
        super().__init__(process_obj)

    def _launch(self, process_obj: Any) -> None:  # popen_forkserver.Popen._launch (3.11-3.13), with self._server
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = self._server.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)  # the child's sentinel of this process, as in multiprocessing
        self.finalizer = util.Finalize(self, _close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class HelperProcess(process.BaseProcess):
    """A process forked by a :class:`HelperServer` (in the child it is an ordinary fork-server process)."""

    _start_method = "forkserver"
    _helper_server: HelperServer | None = None

    def _Popen(self, process_obj: Any) -> _Popen:  # BaseProcess.start calls self._Popen(self)
        assert self._helper_server is not None, "a HelperProcess is made by HelperServer.Process"
        return _Popen(process_obj, self._helper_server._server)

    def __getstate__(self) -> dict[str, Any]:  # the server (a lock, the parent's fds) stays in the parent
        state = dict(self.__dict__)
        state.pop("_helper_server", None)
        return state


class HelperServer(BaseContext):
    """The package's own fork server and the multiprocessing context whose processes it forks.

    A private :class:`multiprocessing.forkserver.ForkServer` (not the module-wide one the
    ``forkserver`` start method uses), preloaded with :data:`PRELOAD`, started with the first
    process and kept for the next ones. ``close()`` (or leaving ``with``) stops it; a later
    process starts it again. Everything else of a multiprocessing context (``Pipe``, ``Lock``,
    ``SimpleQueue``, ...) works as for the ``forkserver`` start method.
    """

    _name = "forkserver"

    def __init__(self, preload: list[str] | None = None):
        self._server = forkserver.ForkServer()
        self._server.set_forkserver_preload(list(PRELOAD if preload is None else preload))
        self._lock = threading.Lock()

    def Process(self, group: Any = None, target: Any = None, name: str | None = None, args: Any = (),
                kwargs: Any = None, *, daemon: bool | None = None) -> HelperProcess:
        """A process this server forks (``multiprocessing.Process``'s arguments)."""
        proc = HelperProcess(group, target, name, args, kwargs or {}, daemon=daemon)
        proc._helper_server = self
        return proc

    def set_forkserver_preload(self, module_names: list[str]) -> None:
        """This server's preload (takes effect when it next starts), never the module-wide server's."""
        self._server.set_forkserver_preload(list(module_names))

    @property
    def pid(self) -> int | None:
        """The server process, while it runs."""
        server: Any = self._server  # ForkServer's state is private to multiprocessing (the same in 3.11-3.13)
        pid: int | None = server._forkserver_pid
        return pid

    def close(self, timeout: float = 10.0) -> None:
        """Stop the server. It exits once the helpers it forked have (they hold its "alive" pipe too);
        one still running after ``timeout`` seconds is left to finish, and the server is killed."""
        s: Any = self._server  # ForkServer's state is private to multiprocessing (the same in 3.11-3.13)
        with self._lock, s._lock:
            if s._forkserver_pid is None:
                return
            os.close(s._forkserver_alive_fd)
            deadline = time.monotonic() + timeout
            while not os.waitpid(s._forkserver_pid, os.WNOHANG)[0]:
                if time.monotonic() > deadline:
                    os.kill(s._forkserver_pid, signal.SIGKILL)
                    os.waitpid(s._forkserver_pid, 0)
                    break
                time.sleep(0.01)
            address = s._forkserver_address
            if address and not util.is_abstract_socket_namespace(address):
                try:
                    os.unlink(address)
                except FileNotFoundError:  # the server removed it
                    pass
            s._forkserver_pid = s._forkserver_alive_fd = s._forkserver_address = None

    def __enter__(self) -> HelperServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_SHARED: HelperServer | None = None
_SHARED_LOCK = threading.Lock()


def context() -> Any:
    """The multiprocessing context helper processes start from: the package's shared :class:`HelperServer`.

    One per process, kept across runs (its preload is paid once); :func:`shutdown` stops it.
    """
    global _SHARED
    if "forkserver" not in mp.get_all_start_methods():  # pragma: no cover - not Linux/macOS
        return mp.get_context("spawn")
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = HelperServer()
        return _SHARED


def shutdown() -> None:
    """Stop the shared helper server, if it runs (the next helper process starts it again)."""
    if _SHARED is not None:
        _SHARED.close()


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
    from dspark_precompute import faults, signals

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
