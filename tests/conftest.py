"""Fixtures shared by the suite (helpers live in helpers.py): the real Qwen3 tokenizer, one small cache."""

from __future__ import annotations

import tempfile

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
