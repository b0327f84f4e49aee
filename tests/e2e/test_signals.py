"""Signals at the edges of a command: a signal during interpreter shutdown ends the process without a traceback."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

SHUTDOWN_UNDER_SIGNAL = """
import os, signal, threading, time
from concurrent.futures import ThreadPoolExecutor
from dspark_precompute import signals

signals.install()
pool = ThreadPoolExecutor(1)
pool.submit(time.sleep, 0.5)  # joined by concurrent.futures' exit hook while the interpreter shuts down
threading.Timer(0.2, os.kill, (os.getpid(), {sig})).start()
{before_exit}
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_interpreter_shuts_down_exits_128_plus_signal_without_a_traceback(sig):
    code = SHUTDOWN_UNDER_SIGNAL.format(sig=int(sig), before_exit="signals.exiting()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + sig, proc.stderr
    assert "Traceback" not in proc.stderr


def test_without_the_exit_handler_the_same_signal_prints_a_traceback():
    """The oracle for the test above: the hole it closes is real (Python prints 'Exception ignored')."""
    code = SHUTDOWN_UNDER_SIGNAL.format(sig=int(signal.SIGTERM), before_exit="")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "StoppedBySignal" in proc.stderr


def test_the_cache_command_exits_with_mains_status_and_arms_the_shutdown_handler(tmp_path):
    code = ("import signal, sys\n"
            "from dspark_precompute.cli import cache\n"
            "from dspark_precompute import signals\n"
            f"sys.argv = ['dspark-cache', 'info', {str(tmp_path / 'none')!r}]\n"
            "try:\n"
            "    cache.console()\n"
            "except SystemExit as e:\n"
            "    assert signal.getsignal(signal.SIGINT) is signals._exit_now, signal.getsignal(signal.SIGINT)\n"
            "    raise\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "no manifest.json" in proc.stderr and "Traceback" not in proc.stderr


def test_a_stop_that_a_finalizer_swallows_is_kept_silently_and_raised_at_the_next_checkpoint(capsys):
    import gc

    from dspark_precompute import signals
    from dspark_precompute.errors import StoppedBySignal

    class Finalized:
        def __del__(self):
            raise StoppedBySignal(signal.SIGINT)  # what the handler raises when the signal lands in a finalizer

    previous = signals.install()
    try:
        Finalized()
        gc.collect()
        assert isinstance(signals.STATE.pending, StoppedBySignal)
        with pytest.raises(StoppedBySignal):
            signals.checkpoint()
        signals.checkpoint()  # raised once
    finally:
        signals.restore(previous)
        signals.STATE.pending = None
    assert sys.unraisablehook is sys.__unraisablehook__ or sys.unraisablehook is not signals._unraisable
    assert "Exception ignored" not in capsys.readouterr().err
