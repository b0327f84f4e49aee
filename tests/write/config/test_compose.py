"""The typed configuration: every bad value is reported at once, before anything is created."""

from __future__ import annotations

import os

import pytest
from helpers import compose, small

from dspark_precompute.errors import ConfigError
from dspark_precompute.write.config.compose import from_dict
from dspark_precompute.write.config.schema import PrecomputeConfig
from dspark_precompute.write.plan.prepare import prepare


def test_from_dict_checks_types_and_values_together():
    with pytest.raises(ConfigError) as err:
        from_dict({"seq_length": "abc", "storage": {"dtype": "int4"}, "batch": {"max_tokens": None}})
    text = str(err.value)
    assert "seq_length='abc'" in text and "storage.dtype='int4'" in text and "batch.max_tokens" in text
    assert isinstance(from_dict({"seq_length": 512}), PrecomputeConfig)


def test_bad_paths_are_config_errors(tmp_path):
    for override in ("storage.path=''", "storage.root=''", "model.path=''", "data.path=''", "model.tokenizer=''"):
        with pytest.raises(ConfigError, match="is empty"):
            compose([override])


def test_what_this_machine_says_about_a_path_is_checked_by_the_run_not_while_composing(tmp_path, monkeypatch):
    """A path is composed as a value (a SLURM job is composed on a login node that may lack the compute nodes'
    paths); the run checks it where it runs, before weights load, every problem in one ConfigError."""
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    (tmp_path / "afile").write_text("x")
    host = [f"storage.path={loop}", f"model.path={tmp_path / 'afile'}", f"model.tokenizer={tmp_path / 'no-tok'}",
            f"data.path={tmp_path / 'missing.jsonl'}"]
    cfg = compose(host)  # composes: all four are well-formed values
    assert cfg.storage.path == str(loop) and cfg.data.path == str(tmp_path / "missing.jsonl")

    def boom(*a, **k):
        raise AssertionError("the tokenizer or weights were loaded although the paths were refused")
    monkeypatch.setattr("dspark_precompute.write.plan.prepare.load_tokenizer", boom)
    with pytest.raises(ConfigError) as err:
        prepare(cfg)
    text = str(err.value)
    assert "4 problem(s)" in text, text
    for words in (f"storage.path={str(loop)!r} cannot be resolved on this machine",
                  f"model.path={str(tmp_path / 'afile')!r} is a file on this machine",
                  f"model.tokenizer={str(tmp_path / 'no-tok')!r} does not exist on this machine",
                  f"data.path={str(tmp_path / 'missing.jsonl')!r} does not exist on this machine"):
        assert words in text, words


def test_a_random_target_smaller_than_its_tokenizer_is_refused_before_weights_load(tmp_path):
    with pytest.raises(ConfigError, match="model.random.vocab_size is 100 but the tokenizer has"):
        prepare(compose(small(tmp_path, "model.random.vocab_size=100")))


def test_random_target_settings_on_a_real_target_are_an_error(tmp_path):
    with pytest.raises(ConfigError, match="model.random"):
        compose(["model.path=Qwen/Qwen3-0.6B", "model.random.hidden_size=128"])
