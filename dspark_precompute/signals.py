"""SIGINT/SIGTERM: one clean line and exit status 128+signal, never a traceback.

Only the command-line entry points install these handlers (``dspark-precompute``'s job,
``dspark-cache``): a notebook or trainer calling the library keeps its own, and an
interrupted library run unwinds through ``finally`` blocks (writers stopped, lock released).
Under the commands, outside the forward loop a signal stops the run at once (nothing is
half-written: every file is written atomically and units commit last). Inside it
(:func:`graceful`), the first signal only sets a flag, so the loop drops the unit in flight,
lets the writer finish the units it already holds and stops; a second signal stops at once.

A signal whose handler raises inside a finalizer (an object's ``__del__``, a weakref callback, a
garbage collection that one of hydra's or torch's imports sets off) would be swallowed by Python,
printed as "Exception ignored in ...", and the command would run on to exit 0. While our handlers
are installed, :func:`_unraisable` keeps such a stop instead, silently, and :func:`checkpoint`
raises it: at every fault point, as the run enters the forward loop, after the command's imports
and when the job ends, so the promise holds: one line, 128+signal.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
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
    pending: StoppedBySignal | None = None  # a stop a finalizer swallowed, raised at the next checkpoint()


STATE = _State()


def _handler(signum: int, _frame: Any) -> None:
    if STATE.graceful and STATE.signum is None:
        STATE.signum = signum
        log.warning("received %s: finishing the units already handed to the writer, then stopping "
                    "(a second signal stops at once)", signal.Signals(signum).name)
        return
    STATE.signum = STATE.signum or signum
    raise StoppedBySignal(signum)


_previous_hook: list[Any] = []  # the unraisable hook ours replaced, while ours is in place


def _unraisable(unraisable: Any) -> None:
    """Keep a stop raised where Python cannot propagate it (a finalizer); anything else goes to the usual hook."""
    if isinstance(unraisable.exc_value, StoppedBySignal) and unraisable.object is not threading:
        # (raised in threading's own shutdown, the interpreter is exiting: no checkpoint is left; see exiting())
        STATE.pending = STATE.pending or unraisable.exc_value
        return
    (_previous_hook[0] if _previous_hook else sys.__unraisablehook__)(unraisable)


def checkpoint() -> None:
    """Raise the stop a finalizer swallowed, if any (cheap: one attribute read)."""
    if STATE.pending is not None:
        exc, STATE.pending = STATE.pending, None
        raise exc


def install() -> dict[int, Any]:
    """Route SIGINT/SIGTERM to :class:`StoppedBySignal`; returns the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    if sys.unraisablehook is not _unraisable:
        _previous_hook[:] = [sys.unraisablehook]
        sys.unraisablehook = _unraisable
    return {sig: signal.signal(sig, _handler) for sig in SIGNALS}


def restore(previous: dict[int, Any]) -> None:
    for sig, old in previous.items():
        signal.signal(sig, old)
    if previous and signal.getsignal(signal.SIGINT) is not _handler and sys.unraisablehook is _unraisable:
        sys.unraisablehook = _previous_hook[0] if _previous_hook else sys.__unraisablehook__
        _previous_hook.clear()


@contextmanager
def handled() -> Iterator[_State]:
    """Signals raise :class:`StoppedBySignal` for the duration (a command's job); the previous handlers after."""
    previous = install()
    checkpoint()
    STATE.signum = None
    try:
        yield STATE
        checkpoint()  # a stop swallowed during the job ends it as a stop, not as a success
    finally:
        restore(previous)


@contextmanager
def graceful() -> Iterator[_State]:
    """Inside: the first signal sets ``STATE.signum`` and returns; the loop checks it between batches.

    Without :func:`install` (a library call) the caller's handlers stay: Ctrl-C raises KeyboardInterrupt.
    A signal before this point already stopped the run, so a flag left from then is cleared (a stop a
    finalizer swallowed is raised here first).
    """
    checkpoint()
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
