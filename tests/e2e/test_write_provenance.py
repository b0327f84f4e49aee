"""The run record of a command: its argv and Hydra overrides, exactly.

The e2e part of tests/write/plan/test_provenance.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import REPO, small

from dspark_precompute import open_cache


def test_the_command_line_and_hydra_overrides_are_recorded_exactly(tmp_path):
    args = small(tmp_path, "data.max_samples=3")
    proc = subprocess.run([sys.executable, "-m", "dspark_precompute", *args, f"hydra.run.dir={tmp_path / 'hy'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    prov = json.loads((tmp_path / "cache" / "manifest.json").read_text())["provenance"]
    assert prov["argv"][1:] == [*args, f"hydra.run.dir={tmp_path / 'hy'}"]
    assert prov["overrides"] == args  # Hydra's task overrides: its own hydra.* settings are not among them
    assert open_cache(str(tmp_path / "cache")).summary()["argv"] == prov["argv"]
