"""What a hostile user tries on a run: foreign directories, kills of the whole group, signal
storms, full disks while allocating, colliding Hydra records, silent rejects, changed weights,
targets that cannot run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch
from helpers import REPO, assert_same_cache, compose, shm_left, shm_names, small

from dspark_precompute.errors import ConfigError, DataError, ForeignDirectoryError, IncompatibleCacheError
from dspark_precompute.write.config.schema import ModelConfig, ParallelConfig, RandomTargetConfig
from dspark_precompute.write.plan.prepare import prepare
from dspark_precompute.write.run import run
from dspark_precompute.write.target import tiny
from dspark_precompute.write.target.load import (
    fingerprint_files,
    fit_problem,
    inspect_target,
    load_tokenizer,
    safetensors_parameter_bytes,
    weight_bytes,
)

UNITS = ("storage.chunk_tokens=256", "storage.unit_tokens=1024", "data.max_samples=16")


def cli(tmp_path, overrides, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "dspark_precompute", *overrides], cwd=tmp_path,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def unit_committed(cache: Path) -> bool:
    """A unit's commit record exists (``commits/tokens.json``, the token digests, comes before any unit)."""
    return any((cache / "commits").glob("u*.json"))


def wait_for(predicate, timeout=120.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    run(compose(small(tmp, *UNITS, name="ref")))
    return str(tmp / "ref")


# -- overwrite never deletes what the tool did not write ------------------------------------------------

def foreign_dir(tmp_path: Path) -> Path:
    d = tmp_path / "home"
    (d / "photos").mkdir(parents=True)
    (d / "thesis.tex").write_text("\\documentclass{article}")
    (d / "photos" / "cat.jpg").write_bytes(b"\xff\xd8")
    return d


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_directory_of_someone_elses_files_is_refused_and_left_exactly_as_it_was(tmp_path, overwrite):
    d = foreign_dir(tmp_path)
    before = sorted(p.relative_to(d).as_posix() for p in d.rglob("*"))
    with pytest.raises(ForeignDirectoryError) as err:
        run(compose(small(tmp_path, f"storage.path={d}", f"overwrite={str(overwrite).lower()}")))
    assert "photos" in str(err.value) and "thesis.tex" in str(err.value)
    assert sorted(p.relative_to(d).as_posix() for p in d.rglob("*")) == before  # no .writer.lock either


def test_the_filesystem_root_is_refused_without_writing_a_lock_there(tmp_path):
    lock = Path("/.writer.lock")
    existed = lock.exists()
    try:
        with pytest.raises(ForeignDirectoryError):
            run(compose(small(tmp_path, "storage.path=/", "overwrite=true")))
        assert lock.exists() == existed
    finally:
        if lock.exists() and not existed:
            lock.unlink()


def test_overwrite_refuses_a_cache_that_also_holds_foreign_files(tmp_path, reference):
    import shutil

    c = tmp_path / "c"
    shutil.copytree(reference, c)
    (c / "notes.txt").write_text("mine")
    with pytest.raises(ForeignDirectoryError, match="notes.txt"):
        run(compose([*small(tmp_path, *UNITS, name="c"), "overwrite=true", "seq_length=128"]))
    assert (c / "notes.txt").read_text() == "mine"
    (c / "notes.txt").unlink()  # the foreign file stayed; everything else is the cache as it was, byte for byte
    assert_same_cache(reference, str(c))


def test_a_run_refused_after_taking_the_lock_leaves_no_directory_behind(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text("not json\n" * 5)
    target = tmp_path / "new" / "cache"
    with pytest.raises(DataError):
        run(compose(small(tmp_path, f"storage.path={target}", f"data.path={data}")))
    assert not (tmp_path / "new").exists()


# -- nothing left in /dev/shm ------------------------------------------------------------------------------

def test_killing_the_whole_process_group_leaves_nothing_in_dev_shm(tmp_path):
    import psutil

    before = shm_names()
    proc = cli(tmp_path, small(tmp_path, *UNITS, name="c"), env={"DSPARK_FAULT": "writer_array=1:sleep"},
               start_new_session=True)
    assert wait_for(lambda: unit_committed(tmp_path / "c"))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)

    def group_gone() -> bool:  # the writers and the helper server too: waited for, not a fixed sleep
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == proc.pid and p.status() != psutil.STATUS_ZOMBIE:
                    return False
            except (ProcessLookupError, psutil.Error):
                continue  # ended while being looked at
        return True
    assert wait_for(group_gone)
    assert shm_left(before) == set()


# -- signals -------------------------------------------------------------------------------------------------

@pytest.mark.slow  # moved out of the default lane to keep it under 10 minutes (CONTRIBUTING)
def test_two_sigterms_in_quick_succession_exit_143_with_one_line_and_the_cache_resumes(tmp_path, reference):
    overrides = small(tmp_path, *UNITS, name="c")
    proc = cli(tmp_path, overrides, env={"DSPARK_FAULT": "unit_submitted=1:sleep"})
    assert wait_for(lambda: unit_committed(tmp_path / "c"))  # inside the forward loop, a unit durable
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    assert [ln for ln in (out + err).splitlines() if "resume with the same command" in ln]
    again = cli(tmp_path, overrides)
    assert again.wait(timeout=300) == 0
    assert_same_cache(reference, str(tmp_path / "c"))


def test_two_sigterms_before_the_forward_loop_end_with_one_line_and_no_traceback(tmp_path):
    """The first stops the run at once and the process ends within milliseconds; the second may meet the
    interpreter's last moments, after its exit handlers, where Python has put the default action back: then
    the process ends by SIGTERM itself (-15 here, 143 in a shell), after the run's line (signals.exiting)."""
    proc = cli(tmp_path, small(tmp_path, *UNITS, name="c"), env={"DSPARK_FAULT": "unit_submitted=1:sleep"})
    assert wait_for(lambda: (tmp_path / "c" / "commits" / "tokens.json").exists())  # tokenized, nothing forwarded
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode in (143, -signal.SIGTERM), (out + err)[-2000:]
    assert "Traceback" not in out + err
    assert [ln for ln in (out + err).splitlines() if "resume with the same command" in ln]


def test_ctrl_c_while_tokenizing_exits_130_with_the_resume_line(tmp_path):
    ready = tmp_path / "tokenizing"  # written by the first row's fault point, which then waits for the signal
    proc = cli(tmp_path, small(tmp_path, name="c"), env={"DSPARK_FAULT": "tokenize_row=1:await",
                                                         "DSPARK_FAULT_READY": str(ready)})
    assert wait_for(ready.exists)
    assert ready.read_text() == "tokenize_row"  # it is tokenizing as the signal lands
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in out + err
    assert [ln for ln in (out + err).splitlines() if "stopped by SIGINT" in ln and "resume with the same command" in ln]


# Installed as sitecustomize in the command's interpreter: at the first audit event that matches $PAUSE_AT
# ("import:MODULE" as the import starts, "open:NAME" as a file whose path ends with NAME is opened,
# "finalizer:MODULE" as the import starts, inside an object's __del__, where Python swallows what a handler raises)
# it writes a line on $READY_FD and waits there for the test's signal, which then arrives inside that moment.
PAUSE_HOOK = """
import os, sys, time
_at, _fd = os.environ.pop("PAUSE_AT", ""), int(os.environ.pop("READY_FD", "-1"))  # helper processes: no pause
_kind, _, _name = _at.partition(":")
_fired = []

def _pause():
    os.write(_fd, (_at + "\\n").encode())
    os.close(_fd)
    time.sleep(120)  # the signal ends this sleep: the handler raises from inside the import, open or finalizer

class _Finalized:
    def __del__(self):
        _pause()

def _hook(event, args):
    event = "finalizer" if _kind == "finalizer" and event == "import" else event
    if _fired or event != _kind or not args:
        return
    what = args[0] if _kind != "open" else os.fsdecode(args[0]) if isinstance(args[0], (str, bytes)) else ""
    if what == _name if _kind != "open" else what.endswith(_name):
        _fired.append(event)
        if _kind == "finalizer":
            _Finalized()  # dropped at once: its __del__ pauses
        else:
            _pause()

if _kind:
    sys.addaudithook(_hook)
"""


def paused_command(tmp_path, argv, at):
    """Start ``argv`` (a Python command line) so that it stops at moment ``at`` until signalled; returns it once
    it is there (the readiness signal: a line on a pipe, never a sleep)."""
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir(exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(PAUSE_HOOK)
    r, w = os.pipe()
    env = {**os.environ, "PAUSE_AT": at, "READY_FD": str(w),
           "PYTHONPATH": os.pathsep.join([str(hook_dir), *filter(None, [os.environ.get("PYTHONPATH")])])}
    # SIGINT as a terminal gives it: a suite started in the background (`nohup pytest &`) hands its children
    # SIGINT ignored, and Python then installs no KeyboardInterrupt for it (the command would sleep on)
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, pass_fds=(w,),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(w)
    with os.fdopen(r, "rb") as ready:
        line = ready.readline()  # EOF instead if the command never got there
    assert line.decode().strip() == at, (at, proc.communicate(timeout=120))
    return proc


# The moments of a start-up, earliest first. The one before them, while the interpreter itself starts (about
# 50 ms on this 2-core VM, before dspark_precompute.cli runs), is Python's own: no line of ours (README, docs).
STARTUP = [
    ("import:dspark_precompute.cli.precompute", "before it started"),  # the command's module, before any handler
    ("import:hydra", "stopped by SIG"),  # the first heavy import, handlers in place
    ("import:numpy", "stopped by SIG"),
    ("open:config.yaml", "stopped by SIG"),  # composing the config (the overrides' preflight)
    ("import:torch", "stopped by SIG"),  # the job's imports, under Hydra's logging
    ("import:torch._meta_registrations", "stopped by SIG"),  # inside torch's import, its exit hooks registered
]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize(("at", "words"), STARTUP, ids=[at for at, _ in STARTUP])
def test_ctrl_c_before_the_run_starts_is_one_line_too(tmp_path, at, words, sig):
    if sig == signal.SIGTERM and at == STARTUP[0][0]:
        pytest.skip("before the handlers, SIGTERM's default action ends the process (143 in a shell), no line")
    proc = paused_command(tmp_path, [sys.executable, "-m", "dspark_precompute", *small(tmp_path, name="c")], at)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    lines = [ln for ln in (out + err).splitlines() if ln.strip()]
    assert proc.returncode == 128 + sig, err[-3000:]
    assert len(lines) == 1 and words in lines[0] and signal.Signals(sig).name in lines[0], lines
    assert not (tmp_path / "c").exists()  # stopped before it wrote anything


@pytest.mark.parametrize("module", ["hydra", "torch"])
def test_a_signal_that_lands_in_a_finalizer_still_stops_the_start_up_with_one_line(tmp_path, module):
    """Python swallows what a handler raises inside a finalizer ("Exception ignored in ..."); the stop is kept and
    raised at the next checkpoint, before anything is written, instead of a traceback and a run that goes on."""
    proc = paused_command(tmp_path, [sys.executable, "-m", "dspark_precompute", *small(tmp_path, name="c")],
                          f"finalizer:{module}")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    lines = [ln for ln in (out + err).splitlines() if ln.strip()]
    assert proc.returncode == 130, err[-3000:]
    assert len(lines) == 1 and "stopped by SIGINT" in lines[0], lines
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("at", ["import:dspark_precompute.cli.cache", "import:dspark_precompute.read.reader"])
def test_ctrl_c_while_the_cache_command_starts_is_one_line(tmp_path, at):
    """As the console script runs it (pyproject's [project.scripts] entry), with the handlers or before them."""
    module, _, function = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"][
        "dspark-cache"].partition(":")
    code = f"import sys; from {module} import {function}; sys.argv[0] = 'dspark-cache'; sys.exit({function}())"
    proc = paused_command(tmp_path, [sys.executable, "-c", code, "info", str(tmp_path / "none")], at)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    lines = [ln for ln in (out + err).splitlines() if ln.strip()]
    assert proc.returncode == 130, err[-3000:]
    assert len(lines) == 1 and "dspark-cache" in lines[0] and "stopped by SIGINT" in lines[0], lines


# -- a full disk while allocating ------------------------------------------------------------------------

@pytest.mark.slow  # moved out of the default lane to keep it under 10 minutes (CONTRIBUTING)
def test_a_full_disk_while_allocating_is_a_storage_write_error_and_the_rerun_completes(tmp_path, reference):
    overrides = small(tmp_path, *UNITS, name="c")
    proc = cli(tmp_path, overrides, env={"DSPARK_FAULT": "allocate=1:enospc"})
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-2000:]
    assert "Traceback" not in out + err and "No space left on device" in out + err
    assert "allocating the cache" in out + err
    again = cli(tmp_path, overrides)
    assert again.wait(timeout=300) == 0
    assert_same_cache(reference, str(tmp_path / "c"))


# -- the Hydra record belongs to the run that wrote the cache -------------------------------------------

def test_a_refused_run_sharing_hydras_output_dir_does_not_change_the_record_in_the_cache(tmp_path):
    out_dir = f"hydra.run.dir={tmp_path / 'same_dir'}"
    winner = cli(tmp_path, [*small(tmp_path, name="c"), out_dir], env={"DSPARK_FAULT": "unit_submitted=1:sleep"})
    assert wait_for(lambda: (tmp_path / "c" / "manifest.json").exists())
    loser = cli(tmp_path, [*small(tmp_path, name="c"), "data.max_samples=3", out_dir])
    _, lerr = loser.communicate(timeout=120)
    assert loser.returncode == 2
    assert "data.max_samples=3" in (tmp_path / "same_dir" / ".hydra" / "overrides.yaml").read_text()
    assert winner.wait(timeout=300) == 0
    record = (tmp_path / "c" / ".hydra" / "overrides.yaml").read_text()
    assert "data.max_samples=16" in record and "data.max_samples=3" not in record
    prov = json.loads((tmp_path / "c" / "manifest.json").read_text())["provenance"]
    assert "data.max_samples=16" in prov["overrides"]


def test_a_run_with_nothing_to_do_leaves_the_record_of_the_run_that_wrote_it(tmp_path):
    first = cli(tmp_path, small(tmp_path, name="c"))
    assert first.wait(timeout=300) == 0
    noop = cli(tmp_path, [*small(tmp_path, name="c"), "batch.max_tokens=2048"])
    assert noop.wait(timeout=300) == 0
    assert "batch.max_tokens=2048" not in (tmp_path / "c" / ".hydra" / "overrides.yaml").read_text()


# -- rejects are loud ------------------------------------------------------------------------------------------

def test_a_run_that_rejects_most_rows_warns_with_counts_per_reason_and_the_fix(tmp_path, caplog):
    caplog.set_level("INFO", logger="dspark_precompute")
    result = run(compose(small(tmp_path, "seq_length=24", "batch.max_tokens=1024")))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert result.rejected > 0.1 * (result.rejected + result.samples)
    assert any("no_supervised_tokens=" in w and "raise seq_length" in w and "%" in w for w in warnings), warnings


# -- changed weights are caught by default ---------------------------------------------------------------

@pytest.fixture(scope="module")
def big_target(tmp_path_factory):
    """A saved random Qwen3 whose single weight file is over 20 MB."""
    d = tmp_path_factory.mktemp("target20mb")
    tok = tiny.build_tokenizer()
    rc = RandomTargetConfig(hidden_size=256, num_hidden_layers=2, intermediate_size=4096)
    tiny.build_target(rc, len(tok)).save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    assert (d / "model.safetensors").stat().st_size > 20e6
    return d


def flip_middle_value(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.seek(size // 2 + 300_000)  # between two of the sampled fingerprint's blocks
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0x01]))


def test_one_changed_value_in_the_middle_of_the_weights_refuses_a_complete_and_a_partial_cache(
        tmp_path, big_target):
    import shutil

    target = tmp_path / "target"
    shutil.copytree(big_target, target)
    overrides = small(tmp_path, f"model.path={target}", "data.max_samples=4", *UNITS[:2], name="c")
    assert run(compose(overrides)).complete
    weights = target / "model.safetensors"
    sampled_before = fingerprint_files([weights], "sampled")
    flip_middle_value(weights)
    assert fingerprint_files([weights], "sampled") == sampled_before  # why sampled is only an opt-in
    with pytest.raises(IncompatibleCacheError, match="weights_fingerprint"):
        run(compose(overrides))
    partial = json.loads((tmp_path / "c" / "manifest.json").read_text())
    partial["complete"] = False
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(partial))
    with pytest.raises(IncompatibleCacheError, match="weights_fingerprint"):
        run(compose(overrides))


def test_weight_hashes_are_remembered_and_redone_when_a_file_changes(tmp_path, big_target, monkeypatch):
    import shutil

    import dspark_precompute.write.target.load as target_mod

    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path / "hashes"))
    weights = tmp_path / "model.safetensors"
    shutil.copy(big_target / "model.safetensors", weights)
    calls = []
    real = target_mod.sha256_file
    monkeypatch.setattr(target_mod, "sha256_file", lambda f, *a: calls.append(f) or real(f, *a))
    first = fingerprint_files([weights])
    assert fingerprint_files([weights]) == first and len(calls) == 1  # read once, then remembered
    stat = weights.stat()
    flip_middle_value(weights)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and mtime: ctime still moves
    assert fingerprint_files([weights]) != first and len(calls) == 2


# -- targets this tool cannot run are refused before any weights load ----------------------------------

def model_dir(tmp_path: Path, name: str, config: dict, files=("model.safetensors",)) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    for f in files:
        (d / f).write_bytes(b"\0" * 16)
    return d


QWEN_DIMS = {"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 300}


@pytest.mark.parametrize("config,words", [
    ({"model_type": "deepseek_v41", **QWEN_DIMS}, "distributed"),
    ({"model_type": "kimi_k3", "architectures": ["KimiK3ForCausalLM"], **QWEN_DIMS}, "Kimi K3"),
    # an audio-text model: no image-text class with a language model inside (image-text ones run: test_image_text)
    ({"model_type": "qwen2_audio", "audio_config": {}, "text_config": QWEN_DIMS}, "maps to no image-text class"),
    ({"model_type": "my_custom_lm", "auto_map": {"AutoModelForCausalLM": "modeling.MyLM"}, **QWEN_DIMS},
     "model.trust_remote_code=true"),
    ({"model_type": "t5", **QWEN_DIMS}, "cannot load model_type 't5' as a causal LM"),
])
def test_targets_that_cannot_run_here_are_refused_naming_the_route(tmp_path, monkeypatch, config, words):
    monkeypatch.setattr("dspark_precompute.write.run.load_target", lambda *a, **k: pytest.fail("weights loaded"))
    monkeypatch.setattr("dspark_precompute.write.plan.prepare.load_tokenizer", lambda cfg: tiny.build_tokenizer())
    d = model_dir(tmp_path, "t", config)
    with pytest.raises(ConfigError, match=words):
        run(compose(small(tmp_path, f"model.path={d}")))


def test_a_checkpoint_with_only_pickled_weights_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("dspark_precompute.write.plan.prepare.load_tokenizer", lambda cfg: tiny.build_tokenizer())
    d = model_dir(tmp_path, "t", {"model_type": "qwen3", **QWEN_DIMS}, files=("pytorch_model.bin",))
    with pytest.raises(ConfigError, match="only pickled weights"):
        prepare(compose(small(tmp_path, f"model.path={d}")))


def test_weights_that_do_not_fit_in_memory_are_refused_before_loading(tmp_path, big_target, monkeypatch):
    cfg = ModelConfig(path=str(big_target))
    info = inspect_target(cfg, load_tokenizer(cfg))
    need = weight_bytes(cfg, info, torch.float32)
    model = tiny.build_target(RandomTargetConfig(hidden_size=256, num_hidden_layers=2, intermediate_size=4096),
                              len(load_tokenizer(cfg)))
    assert need == sum(p.numel() for p in model.parameters()) * 4  # headers count what loads (tied: once)
    assert safetensors_parameter_bytes(info.weight_files, 2) == need // 2
    assert fit_problem(cfg, info, torch.device("cpu"), torch.float32, {"host": need * 2}) is None
    assert "GiB of host memory" in fit_problem(cfg, info, torch.device("cpu"), torch.float32, {"host": need // 2})
    # bf16 weights are need // 2: a GPU of need // 4 holds them over 4 ranks (1/4 <= 80% of its memory)
    gpu = fit_problem(cfg, info, torch.device("cuda", 0), torch.bfloat16,
                      {"host": 1 << 40, "device": need // 4, "all_gpus": need})
    assert "parallel.fsdp=4" in gpu and "docs/scaling.md" in gpu
    assert fit_problem(cfg, info, torch.device("cuda", 0), torch.bfloat16,
                       {"host": 1 << 40, "device": need // 4}, par=ParallelConfig(fsdp=4)) is None
    gpu = fit_problem(cfg, info, torch.device("cuda", 0), torch.bfloat16,
                      {"host": 1 << 40, "device": need // 64, "all_gpus": need // 8})
    assert "parallel.fsdp=64" in gpu and "(8 nodes of 8 GPUs)" in gpu
    assert "per rank (1/2 of" in fit_problem(cfg, info, torch.device("cuda", 0), torch.bfloat16,
                                            {"host": 1 << 40, "device": need // 8}, par=ParallelConfig(fsdp=2))
    monkeypatch.setattr("dspark_precompute.write.target.load._host_available", lambda: need // 3)
    monkeypatch.setattr("dspark_precompute.write.run.load_target", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ConfigError, match="host memory"):
        run(compose(small(tmp_path, f"model.path={big_target}")))


def test_nested_text_configs_keep_working(tmp_path):
    d = model_dir(tmp_path, "t", {"model_type": "qwen3", "text_config": QWEN_DIMS})
    info = inspect_target(ModelConfig(path=str(d)), tiny.build_tokenizer())
    assert (info.num_hidden_layers, info.hidden_size, info.vocab_size) == (2, 8, 300)


def test_the_built_in_target_counts_its_weights_without_building_them():
    cfg = ModelConfig()
    tok = tiny.build_tokenizer()
    info = inspect_target(cfg, tok)
    model = tiny.build_target(cfg.random, len(tok))
    assert weight_bytes(cfg, info, torch.float32) == sum(p.numel() for p in model.parameters()) * 4


# -- verify --recompute never runs code a cache points at ----------------------------------------------

EVIL_TOKENIZER = '''
from pathlib import Path
Path({marker!r}).write_text("ran")
from transformers import PreTrainedTokenizerFast


class EvilTokenizer(PreTrainedTokenizerFast):
    pass
'''


def evil_tokenizer(d: Path, marker: Path) -> Path:
    tok = tiny.build_tokenizer()
    tok.save_pretrained(d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": [None, "evil.EvilTokenizer"]}
    cfg["tokenizer_class"] = "EvilTokenizer"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "evil.py").write_text(EVIL_TOKENIZER.format(marker=str(marker)))
    return d


@pytest.mark.parametrize("inside", [True, False])
def test_verify_recompute_never_runs_code_a_crafted_manifest_points_at(tmp_path, reference, inside):
    import shutil

    from dspark_precompute.cli.cache import main as cache_cli

    c = tmp_path / "c"
    shutil.copytree(reference, c)
    marker = tmp_path / "marker"
    tok_dir = evil_tokenizer((c if inside else tmp_path) / "tok", marker)
    m = json.loads((c / "manifest.json").read_text())
    m["config"]["model"]["tokenizer"] = str(tok_dir)
    m["config"]["model"]["trust_remote_code"] = True
    (c / "manifest.json").write_text(json.dumps(m))
    code = cache_cli(["verify", str(c), "--recompute", "1"])
    assert code == 1 and not marker.exists()
    # the user's own flag is what allows a checkpoint's code, and never for files inside the cache
    if inside:
        assert cache_cli(["verify", str(c), "--recompute", "1", "--trust-remote-code"]) == 1
        assert not marker.exists()
