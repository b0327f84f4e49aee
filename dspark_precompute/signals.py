"""SIGINT/SIGTERM: one clean line and exit status 128+signal, never a traceback.

Only the command-line entry points install these handlers (``dspark-precompute``'s job,
``dspark-cache``): a notebook or trainer calling the library keeps its own, and an
interrupted library run unwinds through ``finally`` blocks (writers stopped, lock released).
Under the commands, outside the forward loop a signal stops the run at once (nothing is
half-written: every file is written atomically and units commit last). Inside it
(:func:`graceful`), the first signal only sets a flag, so the loop drops the unit in flight,
lets the writer finish the units it already holds and stops; a second signal stops at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dspark_precompute.errors import StoppedBySignal

log = logging.getLogger(__name__)
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _State:
    graceful = False
    signum: int | None = None


STATE = _State()


def _handler(signum: int, _frame: Any) -> None:
    if STATE.graceful and STATE.signum is None:
        STATE.signum = signum
        log.warning("received %s: finishing the units already handed to the writer, then stopping "
                    "(a second signal stops at once)", signal.Signals(signum).name)
        return
    STATE.signum = STATE.signum or signum
    raise StoppedBySignal(signum)


def install() -> dict[int, Any]:
    """Route SIGINT/SIGTERM to :class:`StoppedBySignal`; returns the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _handler) for sig in SIGNALS}


def restore(previous: dict[int, Any]) -> None:
    for sig, old in previous.items():
        signal.signal(sig, old)


@contextmanager
def handled() -> Iterator[_State]:
    """Signals raise :class:`StoppedBySignal` for the duration (a command's job); the previous handlers after."""
    previous = install()
    STATE.signum = None
    try:
        yield STATE
    finally:
        restore(previous)


@contextmanager
def graceful() -> Iterator[_State]:
    """Inside: the first signal sets ``STATE.signum`` and returns; the loop checks it between batches.

    Without :func:`install` (a library call) the caller's handlers stay: Ctrl-C raises KeyboardInterrupt.
    A signal before this point already stopped the run, so a flag left from then is cleared.
    """
    STATE.signum = None
    STATE.graceful = True
    try:
        yield STATE
    finally:
        STATE.graceful = False


def exiting() -> None:
    """The command is over and the interpreter is shutting down: a signal now ends the process at once.

    Raising here would print a traceback from whatever shutdown is running (thread pools joining
    their threads); the run has already stopped and released its lock. In the interpreter's last
    milliseconds, after its exit handlers, Python puts the default action back on every signal it
    handled: a signal arriving then ends the process by that action (a parent sees -15 where it would
    see 143; a shell shows 143 for both), still with no traceback and after the run's one line.
    Ignoring the signals there instead would also ignore them during earlier exit handlers (a hung
    log flush could then not be stopped), so this stays.
    """
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            signal.signal(sig, _exit_now)


def _exit_now(signum: int, _frame: Any) -> None:
    os._exit(128 + signum)


def ignore() -> None:
    """For helper processes (writers, tokenizers): the parent decides when the run stops."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
