"""Fixtures shared by the suite (helpers live in helpers.py): the real Qwen3 tokenizer, one small cache."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest
from helpers import QWEN3_TOKENIZER, compose, small


@pytest.fixture(scope="session", autouse=True)
def _subprocess_tmpdir(tmp_path_factory):
    """Commands the tests start (and SIGKILL) keep their temporaries (multiprocessing's pymp-*, torchrun's
    torchelastic_*) under pytest's own rotated base directory, not in /tmp; this process's tempdir is unchanged."""
    tempfile.gettempdir()  # fixed for this process before TMPDIR changes
    mp = pytest.MonkeyPatch()
    mp.setenv("TMPDIR", str(tmp_path_factory.mktemp("subprocess_tmp")))
    yield
    mp.undo()


@pytest.fixture
def qwen3_tokenizer():
    if not (QWEN3_TOKENIZER / "vocab.json").exists():
        pytest.skip(f"real Qwen3 tokenizer fixture not present at {QWEN3_TOKENIZER}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(QWEN3_TOKENIZER))


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """One small run shared by the read-only tests (tiny target, 16 rows, seq_length 256)."""
    from dspark_precompute.write.run import run

    tmp = tmp_path_factory.mktemp("default_run")
    cfg = compose(small(tmp, "storage.chunk_tokens=256", "storage.unit_tokens=1024"))
    return cfg, run(cfg)


@pytest.fixture(scope="session")
def fp8_run(tmp_path_factory):
    """The default run's samples stored as fp8 (a scale per 16 channels, the post-norm state kept bf16)."""
    from dspark_precompute.write.run import run

    tmp = tmp_path_factory.mktemp("fp8_run")
    cfg = compose(small(tmp, "storage.chunk_tokens=256", "storage.unit_tokens=1024", "storage.dtype=fp8_e4m3",
                        "storage.fp8_group=16"))
    return cfg, run(cfg)


@pytest.fixture
def cache_copy(default_run, tmp_path):
    """A private copy of the shared small cache, safe to damage."""
    import shutil

    _, result = default_run
    dst = tmp_path / "copy"
    shutil.copytree(result.path, dst)
    return dst


@pytest.fixture(scope="session")
def both_states_run(tmp_path_factory):
    """The default run storing the final state before the final norm too (``capture.last_state=both``)."""
    from dspark_precompute.write.run import run

    tmp = tmp_path_factory.mktemp("both_states_run")
    cfg = compose(small(tmp, "storage.chunk_tokens=256", "storage.unit_tokens=1024", "capture.last_state=both"))
    return cfg, run(cfg)


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory):
    """The tiny random Qwen3 and its tokenizer saved as a Hugging Face directory (safetensors)."""
    from dspark_precompute.write.config.schema import RandomTargetConfig
    from dspark_precompute.write.target import tiny

    d = tmp_path_factory.mktemp("tiny_hf")
    tok = tiny.build_tokenizer()
    tiny.build_target(RandomTargetConfig(), len(tok)).save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    assert (d / "model.safetensors").is_file()
    return d


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if anything tries to load target weights."""
    def boom(*a, **k):
        raise AssertionError("weights were loaded before the refusal")
    monkeypatch.setattr("dspark_precompute.write.run.load_target", boom)


def _mount_tmpfs(where: Path, options: str) -> None:
    """A tmpfs on ``where``; the test skips (saying why) where this machine does not allow it (not root)."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True,
                              text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("no mount command here: a tmpfs (a full or read-only disk) cannot be made")
    if proc.returncode != 0:
        pytest.skip(f"mounting a tmpfs ({options}) needs root or CAP_SYS_ADMIN: {proc.stderr.strip()}")


def _unmount(where: Path) -> None:
    """Unmount; a mount a failed test left busy (a file still open) is detached lazily, never left mounted."""
    if subprocess.run(["umount", str(where)], capture_output=True, timeout=60).returncode != 0:
        subprocess.run(["umount", "-l", str(where)], check=True, capture_output=True, timeout=60)


@pytest.fixture
def tiny_disk(tmp_path):
    """A real 200 KiB file system (a tmpfs) to fill: writes past it fail with ENOSPC, as on a full disk."""
    d = tmp_path / "tiny_disk"
    _mount_tmpfs(d, "size=200k")
    try:
        yield d
    finally:
        _unmount(d)


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory no write reaches: a read-only tmpfs (as root, whom file modes do not stop), else mode 0o555."""
    d = tmp_path / "read_only"
    if os.geteuid() != 0:
        d.mkdir()
        d.chmod(0o555)
        try:
            yield d
        finally:
            d.chmod(0o755)
        return
    _mount_tmpfs(d, "ro,size=64k")
    try:
        yield d
    finally:
        _unmount(d)


@pytest.fixture
def read_only_view(tmp_path):
    """``view(src)``: ``src`` seen through a read-only bind mount (root only: file modes do not stop root)."""
    mounted: list[Path] = []

    def view(src: Path) -> Path:
        d = tmp_path / f"read_only_view{len(mounted)}"
        d.mkdir()
        proc = subprocess.run(["mount", "--bind", str(src), str(d)], capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            pytest.skip(f"a read-only bind mount needs root or CAP_SYS_ADMIN: {proc.stderr.strip()}")
        mounted.append(d)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(d)], check=True, capture_output=True, timeout=60)
        return d

    try:
        yield view
    finally:
        for d in mounted:
            _unmount(d)
