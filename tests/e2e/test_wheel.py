"""The wheel, built and installed outside the checkout, runs the default command from another directory.

The e2e part of tests/test_packaging.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

from helpers import CONF, REPO
from test_packaging import PKG


def _build_wheel(tmp: Path) -> Path:
    """Build from a copy of the sources, so the checkout gets no build/ or egg-info."""
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("dspark_precompute", "conf"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("dspark_precompute-*.whl")
    return wheel


def test_the_wheel_installed_outside_the_checkout_runs_the_default_command_from_another_directory(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    code = {f"dspark_precompute/{p.relative_to(PKG).as_posix()}" for p in PKG.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}
    assert code <= names, sorted(code - names)
    conf = {f"dspark_precompute/conf/{p.relative_to(CONF).as_posix()}" for p in CONF.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}
    assert "dspark_precompute/conf/config.yaml" in conf  # the checkout's top-level conf/ ...
    assert conf == {n for n in names if n.startswith("dspark_precompute/conf/")}  # ... is the wheel's, file for file

    # a fresh environment: its own site-packages first, this one's after it (torch and the other dependencies;
    # a directory a .pth names is not scanned for .pth files, so this checkout's editable hook stays out)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, timeout=300)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([str(python), "-c", "import dspark_precompute.write.config.compose as c; print(c.__file__); "
                            "print(c.CONF_DIR)"], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr[-3000:]
    module, conf_dir = where.stdout.split()
    assert Path(module).is_relative_to(site) and Path(conf_dir) == site / "dspark_precompute" / "conf"

    proc = subprocess.run([str(python), "-m", "dspark_precompute", f"storage.root={tmp_path / 'caches'}"],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (manifest,) = (tmp_path / "caches").rglob("manifest.json")
    assert manifest.parent.name.startswith("seq2048-") and "open_cache(" in proc.stdout + proc.stderr
