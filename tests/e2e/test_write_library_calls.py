"""run() as a library call in a caller's own process.

Its settings left alone, an interrupt raised to it, faults planned at first use.

The e2e part of tests/write/test_library_calls.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest
from helpers import compose, shm_left, shm_names, small

from dspark_precompute.contract.lock import WriterLock

CALLER = textwrap.dedent("""
    import json, logging, multiprocessing as mp, signal, sys
    from multiprocessing import forkserver

    # the caller's own settings, as a notebook or a trainer would have them
    mp.set_start_method("spawn")
    mp.set_forkserver_preload(["json"])
    pkg = logging.getLogger("dspark_precompute")
    pkg.setLevel(logging.ERROR)

    def mine(signum, frame):
        pass
    signal.signal(signal.SIGINT, mine)
    signal.signal(signal.SIGTERM, mine)

    import dspark_precompute
    import dspark_precompute.write.run as run_module
    from dspark_precompute.write.config.compose import compose

    during = set()
    real = run_module.fault_point
    def spy(name):  # every fault point of the forward loop: whose handlers are in effect right now?
        during.add((signal.getsignal(signal.SIGINT) is mine, signal.getsignal(signal.SIGTERM) is mine))
        real(name)
    run_module.fault_point = spy

    overrides = json.loads(sys.argv[1])
    result = dspark_precompute.run(compose(overrides + ["log_level=DEBUG"]))
    plan = dspark_precompute.run(compose(overrides + ["dry_run=true", "log_level=DEBUG"]))
    print(json.dumps({
        "complete": result.complete, "planned_samples": plan.samples,
        "handlers_during_run": sorted(during),
        "handlers_after": [signal.getsignal(signal.SIGINT) is mine, signal.getsignal(signal.SIGTERM) is mine],
        "level": pkg.level, "package_handlers": len(pkg.handlers), "root_handlers": len(logging.getLogger().handlers),
        "start_method": mp.get_start_method(), "preload": forkserver._forkserver._preload_modules,
        "global_forkserver_started": forkserver._forkserver._forkserver_pid is not None,
    }))
""")


def test_a_library_run_leaves_the_callers_logging_signal_handlers_and_multiprocessing_settings_alone(tmp_path):
    proc = subprocess.run([sys.executable, "-c", CALLER, json.dumps(small(tmp_path, "data.max_samples=8"))],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["complete"] and seen["planned_samples"] > 0
    assert seen["handlers_during_run"] == [[True, True]]  # the caller's SIGINT and SIGTERM handlers, throughout
    assert seen["handlers_after"] == [True, True]
    assert seen["level"] == 40 and seen["package_handlers"] == 0 and seen["root_handlers"] == 0  # ERROR, none added
    assert seen["start_method"] == "spawn" and seen["preload"] == ["json"]
    assert not seen["global_forkserver_started"]  # the writers came from the package's own server


@pytest.mark.parametrize("how", ["ctrl_c", "exception"])
def test_an_interrupted_library_run_raises_to_the_caller_and_leaves_no_lock_helper_process_or_shared_memory(
        tmp_path, monkeypatch, how):
    from dspark_precompute.write import run as run_module
    from dspark_precompute.write.parallel import processes
    from dspark_precompute.write.store import forward

    cfg = compose(small(tmp_path, "storage.chunk_tokens=256", "storage.unit_tokens=512"))
    handlers = []

    def interrupt(name):
        if name != "unit_submitted":
            return
        handlers.append(signal.getsignal(signal.SIGINT))
        if how == "ctrl_c":
            signal.raise_signal(signal.SIGINT)  # a real Ctrl-C, under the caller's (Python's default) handler
        raise RuntimeError("the caller's code failed")
    monkeypatch.setattr(forward, "fault_point", interrupt)  # the forward loop's unit_submitted point
    shm = shm_names()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt if how == "ctrl_c" else RuntimeError):
            run_module.run(cfg)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert handlers == [signal.default_int_handler]  # the library never replaced it
    lock = WriterLock(cfg.storage.path).acquire()  # released: another writer may take the cache
    lock.release()
    server = processes.context().pid
    assert server is not None and psutil.Process(server).children() == []  # every writer process has exited
    assert shm_left(shm) == set()
    monkeypatch.undo()
    assert run_module.run(cfg).complete  # and the cache resumes


def test_the_fault_plan_is_read_at_the_first_fault_point_not_at_import():
    code = textwrap.dedent("""
        import os
        from dspark_precompute import faults  # reads nothing
        os.environ["DSPARK_FAULT"] = "somewhere=2:raise"
        faults.fault_point("somewhere")
        try:
            faults.fault_point("somewhere")
        except RuntimeError as exc:
            print(exc)
    """)
    ok = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                        env={**os.environ, "DSPARK_FAULT": ""})
    assert ok.returncode == 0 and "injected fault at somewhere (hit 2)" in ok.stdout, ok.stderr[-3000:]
    bad = subprocess.run([sys.executable, "-c", "import dspark_precompute.write.run\n"
                          "from dspark_precompute import faults\nfaults.fault_point('x')"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "DSPARK_FAULT": "x=two"})
    assert "DSPARK_FAULT='x=two': 'x=two' is not a fault; write point=N[:action]" in bad.stderr
    assert 'File "<string>", line 3' in bad.stderr  # raised at the fault point, the import went through
