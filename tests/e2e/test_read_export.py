"""An export killed (SIGKILL) partway: the previous export stays whole, and the same command run again replaces it,
removing what the killed one left beside it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from test_export import files_of

TARGETS = ("nemo", "deepspec", "specforge", "speculators")


def dspark_cache(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dspark_precompute.cli.cache", *argv], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=600)


@pytest.mark.parametrize("to", TARGETS)
def test_a_killed_overwrite_keeps_the_previous_export_and_the_rerun_replaces_it(request, tmp_path, to):
    if to == "speculators":
        pytest.importorskip("datasets", reason='the speculators export writes a datasets folder: pip install -e '
                                               '".[interop]"')
    cache = request.getfixturevalue("both_states_run" if to == "speculators" else "default_run")[1].path
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    base = ["export", cache, "--to", to, "--shard-size", "4"]
    assert dspark_cache(*base[:2], str(out), *base[2:], "--layers", "1,3").returncode == 0
    previous = files_of(out)
    again = [*base[:2], str(out), *base[2:], "--overwrite"]
    killed = dspark_cache(*again, env={"DSPARK_FAULT": "export_sample=5"})  # SIGKILL after the fifth sample
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert files_of(out) == previous  # untouched, byte for byte
    left = [p.name for p in tmp_path.iterdir() if p.name != "out"]
    assert len(left) == 1 and left[0].startswith(".out.partial-")  # the killed export's staging directory
    rerun = dspark_cache(*again)
    assert rerun.returncode == 0 and "Traceback" not in rerun.stderr, rerun.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["out"]  # the staging directory of the killed export is gone
    assert dspark_cache(*base[:2], str(fresh), *base[2:]).returncode == 0
    assert comparable(out) == comparable(fresh)  # what an uninterrupted export writes, marker included


def comparable(root) -> dict[str, object]:
    """Every file's bytes; ``datasets``' state.json without its fingerprint (it hashes the scratch file's name)."""
    files: dict[str, object] = dict(files_of(root))
    if "state.json" in files:
        state = json.loads(files["state.json"])
        state.pop("_fingerprint")
        files["state.json"] = state
    return files
