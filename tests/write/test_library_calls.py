"""Library calls leave the process as they found it: logging, signal handlers, multiprocessing, sys.argv.

Only the command-line entry points set those (for their own jobs). A notebook or trainer that
calls ``run()`` keeps its own settings, and an interrupted library run still cleans up.
"""

from __future__ import annotations

import os
import signal
import sys

import psutil
import pytest
from helpers import small

from dspark_precompute.errors import ConfigError


def test_the_package_helper_server_is_its_own_and_closes(tmp_path):
    """Helper processes fork from a server the package owns, never multiprocessing's module-wide one."""
    from multiprocessing import forkserver

    from dspark_precompute.write.parallel import processes

    before = forkserver._forkserver._forkserver_pid, list(forkserver._forkserver._preload_modules)
    with processes.HelperServer(preload=["json"]) as server:
        out, into = server.Pipe(duplex=False)
        p = server.Process(target=os.write, args=(1, b""), daemon=True)  # any picklable callable
        p.start()
        p.join(60)
        assert p.exitcode == 0 and server.pid is not None
        pid = server.pid
        into.close(), out.close()
    assert server.pid is None and not psutil.pid_exists(pid)  # stopped and reaped
    assert (forkserver._forkserver._forkserver_pid, forkserver._forkserver._preload_modules) == before


def test_the_shared_helper_server_stops_on_shutdown_and_starts_again_with_the_next_helper():
    from dspark_precompute.write.parallel import processes

    ctx = processes.context()
    p = ctx.Process(target=os.write, args=(1, b""), daemon=True)
    processes.start(p)
    p.join(60)
    first = ctx.pid
    assert p.exitcode == 0 and first is not None
    processes.shutdown()
    assert processes.context() is ctx and ctx.pid is None and not psutil.pid_exists(first)
    p = ctx.Process(target=os.write, args=(1, b""), daemon=True)
    processes.start(p)
    p.join(60)
    assert p.exitcode == 0 and ctx.pid not in (None, first)


def test_a_fault_plan_with_an_unknown_action_is_refused_not_taken_for_a_kill(monkeypatch):
    from dspark_precompute import faults

    monkeypatch.setenv("DSPARK_FAULT", "unit_submitted=1:explode")
    with pytest.raises(ConfigError, match=r"'unit_submitted=1:explode' is not a fault.*'kill', 'raise', 'enospc'"):
        faults.reload()
    monkeypatch.delenv("DSPARK_FAULT")
    faults.reload()


def test_the_command_gives_hydra_its_extra_overrides_without_changing_the_callers_sys_argv(tmp_path, monkeypatch):
    """A torchrun rank > 0 adds overrides for Hydra; main() called in-process leaves sys.argv as it was."""
    import logging

    from dspark_precompute.cli import precompute

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RANK", "1")
    argv = ["dspark-precompute", *small(tmp_path, "dry_run=true")]
    mine = list(argv)
    monkeypatch.setattr(sys, "argv", mine)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    level = logging.getLogger("dspark_precompute").level
    try:
        precompute.main()
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        logging.getLogger("dspark_precompute").setLevel(level)
    assert sys.argv is mine and mine == argv
    # a rank > 0 still reports its warnings and errors: none of the package's loggers was disabled
    assert not [n for n, lg in logging.Logger.manager.loggerDict.items()
                if n.startswith("dspark_precompute") and isinstance(lg, logging.Logger) and lg.disabled]
