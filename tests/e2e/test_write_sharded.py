"""Sharded targets (parallel.fsdp / parallel.ep) under torchrun + gloo: caches bit-identical to one copy.

Each torchrun run is as small as a run can be (2 layers, seq_length 128, a dozen rows) because
this machine has 2 cores; 4-rank layouts, the kill matrix and every model type are ``slow``.

Module: ``write/target/sharding.py`` (the layouts, their checks and the sharded load).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers import assert_same_cache, compose
from test_s3 import bucket, s3_endpoint  # noqa: F401 - fixtures
from test_write_distributed import torchrun, torchrun_cmd, units_per_rank

from dspark_precompute.write.run import run

BASE = ("seq_length=128", "batch.max_tokens=256", "data.max_samples=12", "progress=false", "log_level=INFO",
        "model.dtype=bf16", "model.random.num_hidden_layers=2", "storage.chunk_tokens=128", "storage.unit_tokens=256")


def overrides(tmp_path: Path, name: str, *extra: str) -> list[str]:
    keys = {x.split("=", 1)[0] for x in extra}
    checkpoint = "model.path" in keys  # the random target's shape does not apply
    return [f"storage.path={tmp_path / name}", *(b for b in BASE if b.split("=", 1)[0] not in keys
                                                 and not (checkpoint and b.startswith("model.random."))), *extra]


def one_copy(tmp_path: Path, *extra: str) -> str:
    """The reference: one process, one whole copy of the same target."""
    run(compose(overrides(tmp_path, "one", *extra)))
    return str(tmp_path / "one")


def sharded(tmp_path: Path, n: int, name: str, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return torchrun(tmp_path, n, overrides(tmp_path, name, *extra), env=env)


def held_fraction(proc: subprocess.CompletedProcess) -> float:
    """Rank 0's share of the parameter bytes, as it logs it after loading."""
    m = re.search(r"rank 0 holds (\d+) of (\d+) parameter bytes", proc.stdout + proc.stderr)
    assert m, (proc.stdout + proc.stderr)[-3000:]
    return int(m.group(1)) / int(m.group(2))


def test_fsdp2_writes_a_cache_bit_identical_to_one_copy_and_each_rank_holds_half_the_weights(tmp_path):
    ref = one_copy(tmp_path)
    proc = sharded(tmp_path, 2, "fsdp2", "parallel.fsdp=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_cache(ref, str(tmp_path / "fsdp2"), layout=True)
    assert held_fraction(proc) <= 1 / 2 + 0.05
    m = json.loads((tmp_path / "fsdp2" / "manifest.json").read_text())
    assert m["provenance"]["parallel"] == {"fsdp": 2, "ep": 1, "tp": 1}
    assert m["config"]["parallel"]["fsdp"] == 2
    assert "parallel" not in json.loads((tmp_path / "one" / "manifest.json").read_text())["provenance"]


def test_a_fault_on_one_rank_stops_both_at_the_next_forward_keeps_every_submitted_unit_and_resumes_bit_identical(
        tmp_path):
    ref = one_copy(tmp_path)
    share = units_per_rank(tmp_path / "one", 2)  # unit_share: no tensor parallelism, so one group per rank
    proc = sharded(tmp_path, 2, "fsdp2", "parallel.fsdp=2", env={"DSPARK_FAULT": "unit_submitted=1:raise@1"})
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "injected fault" in out
    # rank 0 stopped on the agreed flag (not a broken socket, nor torchrun's SIGTERM) and said why
    marker, = (tmp_path / "fsdp2" / "coord").glob("*/failed-0.json")
    assert "rank 1 failed, so rank 0 stops too" in json.loads(marker.read_text())["error"]
    # Under lockstep a peer's failure is learned at an agreement only, where every rank drains its writers: the
    # unit rank 1 had handed to its writers when it failed is committed, whatever the timing.
    committed = {int(p.stem[1:]) for p in (tmp_path / "fsdp2" / "commits").glob("u*.json")}
    assert share[1][0] in committed, (committed, share)
    resumed = run(compose(overrides(tmp_path, "fsdp2")))  # one copy finishes what the sharded run began
    assert resumed.complete and resumed.resumed_units == len(committed)
    assert_same_cache(ref, str(tmp_path / "fsdp2"))


@pytest.mark.slow  # the default lane's 10 minutes; its image-text sibling under fsdp=2 ep=2 is slow too
def test_an_expert_parallel_moe_writes_a_cache_bit_identical_to_one_copy(tmp_path):
    moe = ("model.random.model_type=qwen3_moe",)
    ref = one_copy(tmp_path, *moe)
    proc = sharded(tmp_path, 2, "ep2", *moe, "parallel.fsdp=2", "parallel.ep=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_cache(ref, str(tmp_path / "ep2"), layout=True)
    assert held_fraction(proc) <= 1 / 2 + 0.05


def test_a_layout_that_does_not_fit_the_ranks_or_the_target_is_refused_before_weights_load(tmp_path, monkeypatch):
    from dspark_precompute.errors import ConfigError

    monkeypatch.setattr("dspark_precompute.write.run.load_target", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ConfigError, match="must divide the world size 1"):
        run(compose(overrides(tmp_path, "c", "parallel.fsdp=2")))
    with pytest.raises(ConfigError, match="ships no expert-parallel plan for model_type 'qwen3'"):
        run(compose(overrides(tmp_path, "c", "parallel.fsdp=2", "parallel.ep=2")))
    with pytest.raises(ConfigError, match="does not divide the target's 6 routed experts"):
        run(compose(overrides(tmp_path, "c", "model.random.model_type=qwen3_moe", "model.random.num_experts=6",
                              "parallel.fsdp=4", "parallel.ep=4")))
    with pytest.raises(ConfigError, match="must divide the target's 2 key/value heads"):
        run(compose(overrides(tmp_path, "c", "parallel.tp=4")))


# ---- slow: 4 ranks, kills, every model type ----

@pytest.mark.slow
@pytest.mark.parametrize("layout", [("parallel.fsdp=4",), ("parallel.fsdp=4", "parallel.ep=4"),
                                    ("parallel.fsdp=4", "parallel.ep=2")])
def test_four_rank_layouts_are_bit_identical_to_one_copy(tmp_path, layout):
    moe = ("model.random.model_type=qwen3_moe",) if any("ep" in x for x in layout) else ()
    ref = one_copy(tmp_path, *moe)
    proc = sharded(tmp_path, 4, "four", *moe, *layout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_cache(ref, str(tmp_path / "four"), layout=True)
    assert held_fraction(proc) <= 1 / 4 + 0.05


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["deepseek_v4", "glm_moe_dsa"])
def test_deepseek_v4_and_glm_5_2_under_fsdp_and_ep_match_their_one_copy_run(tmp_path, model_type):
    kind = (f"model.random.model_type={model_type}",)
    ref = one_copy(tmp_path, *kind)
    proc = sharded(tmp_path, 2, "sharded", *kind, "parallel.fsdp=2", "parallel.ep=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_cache(ref, str(tmp_path / "sharded"), layout=True)
    capture = json.loads((tmp_path / "one" / "manifest.json").read_text())["capture"]
    assert capture["stream_reduction"] == ("mean" if model_type == "deepseek_v4" else None)


@pytest.mark.slow
def test_a_sigkilled_rank_then_the_same_command_then_another_layout_give_a_bit_identical_cache(tmp_path):
    moe = ("model.random.model_type=qwen3_moe", "data.max_samples=32")  # units enough for two kills
    proc = sharded(tmp_path, 2, "s", *moe, "parallel.fsdp=2", "parallel.ep=2",
                   env={"DSPARK_FAULT": "unit_submitted=2", "DSPARK_FAULT_RANK": "1"})
    assert proc.returncode != 0
    proc = sharded(tmp_path, 2, "s", *moe, "parallel.fsdp=2", "parallel.ep=2",
                   env={"DSPARK_FAULT": "unit_submitted=1", "DSPARK_FAULT_RANK": "0"})
    assert proc.returncode != 0
    proc = sharded(tmp_path, 4, "s", *moe, "parallel.fsdp=4", "parallel.ep=2")  # another layout finishes it
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_cache(one_copy(tmp_path, *moe), str(tmp_path / "s"), layout=True)


def _killed_at_random_moments(tmp_path: Path, name: str, extra: tuple[str, ...], rng, commits_at: tuple[int, ...],
                              n: int = 2) -> list[int]:
    """Start the sharded run again and again; each time, once ``k`` units are committed and a random delay more
    has passed, SIGKILL torchrun and every rank and writer with it (its process group, as a scheduler's kill
    does). The exit codes, the last run's included (it is left to finish)."""
    import signal
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    commits = tmp_path / name / "commits"
    codes = []
    for k in (*commits_at, None):
        cmd = torchrun_cmd(n, "-m", "dspark_precompute", *overrides(tmp_path, name, *extra))
        with open(tmp_path / f"{name}.log", "a") as log:
            proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=log, stderr=log, env=env, start_new_session=True)
            if k is not None:
                while proc.poll() is None and len(list(commits.glob("u*.json"))) < k:
                    time.sleep(0.05)  # polling the readiness signal (the k-th commit record), not a wait for it
                time.sleep(rng.uniform(0.0, 1.0))  # then a random moment: forwarding, writing, committing
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            codes.append(proc.wait(timeout=600))
    return codes


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_a_sharded_run_sigkilled_whole_at_random_moments_then_resumed_equals_one_copy(tmp_path, seed):
    """Not at named fault points: whatever the ranks and their writers were doing when the job died."""
    import random

    from dspark_precompute.read.verify import verify_cache

    moe = ("model.random.model_type=qwen3_moe", "data.max_samples=32", "parallel.fsdp=2", "parallel.ep=2")
    codes = _killed_at_random_moments(tmp_path, "s", moe, random.Random(seed), commits_at=(1, 3, 5))
    assert codes[-1] == 0 and -9 in codes[:-1], (codes, (tmp_path / "s.log").read_text()[-4000:])
    assert_same_cache(one_copy(tmp_path, *moe[:2]), str(tmp_path / "s"), layout=True)
    assert verify_cache(str(tmp_path / "s")).ok


@pytest.mark.slow
def test_sigterm_on_one_rank_stops_every_rank_with_the_interrupted_error_and_the_cache_resumes(tmp_path):
    """The signal reaches rank 1 only (not through torchrun); the agreed flag stops rank 0 as well."""
    proc = sharded(tmp_path, 2, "t", "parallel.fsdp=2", env={"DSPARK_FAULT": "unit_submitted=1:term",
                                                             "DSPARK_FAULT_RANK": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count("stopped by SIGTERM") >= 2, out[-4000:]  # both ranks, each with the typed message
    assert run(compose(overrides(tmp_path, "t"))).complete
    assert_same_cache(one_copy(tmp_path), str(tmp_path / "t"))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_ranks_run_the_same_batches_the_first_writes_and_its_values_are_close_not_identical(
        tmp_path, world):
    """tp=2 on 2 ranks (one group) and on 4 (two groups, each its own units): each rank holds half of every layer;
    the values differ from one copy's (reductions in another order), so tp is in the identity and a run without
    it refuses to resume the cache."""
    import numpy as np

    from dspark_precompute import open_cache
    from dspark_precompute.errors import IncompatibleCacheError

    fp32 = ("model.dtype=fp32", "storage.dtype=fp32")
    ref = one_copy(tmp_path, *fp32, "data.max_samples=24")
    proc = sharded(tmp_path, world, "tp2", *fp32, "parallel.tp=2", "data.max_samples=24")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert held_fraction(proc) <= 1 / 2 + 0.05
    m = json.loads((tmp_path / "tp2" / "manifest.json").read_text())
    assert m["identity"]["tensor_parallel"] == 2 and m["provenance"]["parallel"] == {"fsdp": 1, "ep": 1, "tp": 2}
    assert "tensor_parallel" not in json.loads((tmp_path / "one" / "manifest.json").read_text())["identity"]
    assert m["counts"] == json.loads((tmp_path / "one" / "manifest.json").read_text())["counts"]
    a, b = open_cache(ref), open_cache(str(tmp_path / "tp2"))
    assert len(a) == len(b) > 0
    worst = 0.0
    for i in range(len(a)):
        x, y = a.sample(i, as_numpy=True), b.sample(i, as_numpy=True)
        assert np.array_equal(x["input_ids"], y["input_ids"]) and np.array_equal(x["loss_mask"], y["loss_mask"])
        for k in ("target_hidden_states", "target_last_hidden_states"):
            worst = max(worst, float(np.abs(x[k] - y[k]).max() / max(1e-6, float(np.abs(x[k]).max()))))
    assert worst < 1e-4, worst  # fp32: the same function, summed in another order
    with pytest.raises(IncompatibleCacheError, match="tensor_parallel"):
        run(compose(overrides(tmp_path, "tp2", *fp32, "data.max_samples=24")))


@pytest.mark.slow
def test_a_tensor_parallel_run_killed_then_resumed_on_more_ranks_equals_one_never_killed(tmp_path):
    """A unit's values under tp=2 do not depend on which group computes it: the resumed cache is bit-identical."""
    tp = ("parallel.tp=2", "data.max_samples=32")
    ref = sharded(tmp_path, 2, "ref", *tp)
    assert ref.returncode == 0, ref.stderr[-4000:]
    killed = sharded(tmp_path, 2, "k", *tp, env={"DSPARK_FAULT": "unit_submitted=2", "DSPARK_FAULT_RANK": "0"})
    assert killed.returncode != 0
    assert any((tmp_path / "k" / "commits").glob("u*.json")) and not json.loads(
        (tmp_path / "k" / "manifest.json").read_text())["complete"]
    resumed = sharded(tmp_path, 4, "k", *tp)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert_same_cache(str(tmp_path / "ref"), str(tmp_path / "k"), layout=True)


# ---- image-text checkpoints: their language model, sharded as a text model is ----

def image_text_checkpoint(tmp_path: Path, model_type: str) -> str:
    from dspark_precompute.write.target import tiny

    src = tmp_path / "src"
    tiny.save_image_text_checkpoint(model_type, src, dtype=__import__("torch").bfloat16)
    return f"model.path={src}"


@pytest.mark.slow  # the default lane's 10 minutes (649 s in .ci/run on 2026-12-07 with it)
def test_an_image_text_moe_under_fsdp_and_ep_matches_its_one_copy_run_and_holds_half_the_language_model(tmp_path):
    path = image_text_checkpoint(tmp_path, "qwen3_5_moe")
    ref = one_copy(tmp_path, path)
    proc = sharded(tmp_path, 2, "ep2", path, "parallel.fsdp=2", "parallel.ep=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_cache(ref, str(tmp_path / "ep2"), layout=True)
    assert held_fraction(proc) <= 1 / 2 + 0.05
    part = json.loads((tmp_path / "ep2" / "manifest.json").read_text())["capture"]["target_part"]
    assert part["skipped_modules"] == ["model.visual"] and part["skipped_bytes"] > 0


@pytest.mark.slow
def test_qwen3_vl_under_fsdp_matches_its_one_copy_run(tmp_path):
    path = image_text_checkpoint(tmp_path, "qwen3_vl")
    ref = one_copy(tmp_path, path)
    proc = sharded(tmp_path, 2, "sharded", path, "parallel.fsdp=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_cache(ref, str(tmp_path / "sharded"), layout=True)
    assert held_fraction(proc) <= 1 / 2 + 0.05


def test_image_text_layouts_transformers_cannot_shard_are_refused_before_weights_load(tmp_path, monkeypatch):
    """Qwen3-VL-MoE and MiniMax M3 fail or compute other values sharded in transformers 5.24; TP shards nothing."""
    from dspark_precompute.errors import ConfigError

    monkeypatch.setattr("dspark_precompute.write.run.load_target", lambda *a, **k: pytest.fail("weights loaded"))
    for model_type, layout, words in (("qwen3_vl_moe", "parallel.ep=2", "size mismatch"),
                                      ("minimax_m3_vl", "parallel.ep=1", "other values than one copy"),
                                      ("qwen3_vl", "parallel.tp=2", "no tensor-parallel plan")):
        path = image_text_checkpoint(tmp_path / model_type, model_type)
        with pytest.raises(ConfigError, match=words):
            run(compose(overrides(tmp_path, "c", path, "parallel.fsdp=2", layout)))


# ---- rows with images, sharded: the vision tower held whole on every rank ----

def image_rows_run(tmp_path: Path, model_type: str) -> list[str]:
    """Overrides of a run over a tiny image-text checkpoint and nine rows (both image forms and text rows, units
    of 256 tokens: some hold images, some do not)."""
    from test_media import image_rows, write_images

    path = image_text_checkpoint(tmp_path, model_type)
    rows = image_rows(tmp_path, write_images(tmp_path / "imgs"))
    return [path, f"data.path={rows}", "data.max_samples=null", "model.dtype=fp32", "seq_length=256",
            "batch.max_tokens=1024", "storage.chunk_tokens=64", "storage.unit_tokens=256"]


def images_by_step(cache: str, world: int) -> list[list[bool]]:
    """For each rank of a fresh run, whether each unit it forwards (in order) holds a sample with images."""
    from dspark_precompute.read.reader import CacheReader

    reader = CacheReader(cache)
    with_images = set(reader.units()[reader.image_rows()].tolist())
    return [[u in with_images for u in share] for share in units_per_rank(Path(cache), world)]


def test_rows_with_images_under_fsdp2_killed_on_one_rank_then_resumed_equal_the_one_copy_cache(tmp_path):
    """At some step one rank forwards images while its peer forwards text: their collectives must still pair (the
    vision tower is held whole, so only the language model's run as collectives)."""
    extra = image_rows_run(tmp_path, "qwen3_vl")
    ref = one_copy(tmp_path, *extra)
    steps = images_by_step(ref, 2)
    assert any(a != b for a, b in zip(*steps, strict=False)), steps  # a step with images on one rank only
    proc = sharded(tmp_path, 2, "fsdp2", *extra, "parallel.fsdp=2",
                   env={"DSPARK_FAULT": "unit_submitted=1", "DSPARK_FAULT_RANK": "1"})  # rank 1 killed
    assert proc.returncode != 0
    proc = sharded(tmp_path, 2, "fsdp2", *extra, "parallel.fsdp=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_cache(ref, str(tmp_path / "fsdp2"), layout=True)
    out = proc.stdout + proc.stderr
    assert re.search(r"rank 0 holds the vision modules \(model\.visual\) whole: [1-9]\d* parameter bytes", out), out
    part = json.loads((tmp_path / "fsdp2" / "manifest.json").read_text())["capture"]["target_part"]
    assert part["loaded"] == "model" and part["skipped_modules"] == []


HOLD_SCRIPT = """
import datetime, torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from dspark_precompute.errors import TargetError
from dspark_precompute.write.target.sharding import hold_whole

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a missing peer fails, never hangs
torch.manual_seed(0)

class Top(nn.Module):  # an image-text model's shape: model.visual beside model.language_model, and lm_head
    def __init__(self):
        super().__init__()
        vision = nn.Module()
        vision.blocks, vision.merger = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)]), nn.Linear(8, 4)
        self.model = nn.Module()
        self.model.visual, self.model.language_model, self.lm_head = vision, nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.lm_head(self.model.language_model(x))

model = Top

mesh = init_device_mesh("cpu", (2,))
m = model()
whole = {k: v.clone() for k, v in m.model.visual.state_dict().items()}
for block in m.model.visual.blocks:  # a layout that shards the vision blocks as FSDP units of their own
    fully_shard(block, mesh=mesh)
fully_shard(m.model.language_model, mesh=mesh)
fully_shard(m, mesh=mesh)
m(torch.zeros(1, 4))  # the warm-up through the root: the root's own group (the merger, lm_head) stays gathered
hold_whole(m, ("model.visual",), dist.get_rank())
got = dict(m.model.visual.named_parameters())
assert not any(hasattr(p, "to_local") for p in got.values()) and all(torch.equal(got[k], whole[k]) for k in whole)
if dist.get_rank() == 0:  # only rank 0 has images: its vision forwards must be local (rank 1 joins none)
    for _ in range(2):
        m.model.visual.merger(m.model.visual.blocks[1](m.model.visual.blocks[0](torch.randn(3, 8))))
dist.barrier()
bad = model()
bad.model.visual.merger.weight = nn.Parameter(distribute_tensor(bad.model.visual.merger.weight, mesh, [Shard(0)]))
try:
    hold_whole(bad, ("model.visual",), dist.get_rank())
except TargetError as exc:
    assert "model.visual.merger.weight stays sharded" in str(exc), exc
    open(f"held.{dist.get_rank()}", "w").close()  # a file per rank: two ranks' prints to one pipe interleave
dist.barrier()  # as Ranks.close does: a rank that tears down gloo while its peer still talks aborts that peer
dist.destroy_process_group()
"""


def test_vision_modules_sharded_as_units_of_their_own_are_held_whole_so_one_rank_forwards_them_alone(tmp_path):
    """A layout with FSDP units inside the vision tower: held, rank 0 runs them twice while rank 1 runs nothing
    (without the hold rank 0's all-gathers would wait for a peer that never joins); a parameter that stays a
    sharded DTensor is refused, naming it."""
    script = tmp_path / "hold.py"
    script.write_text(HOLD_SCRIPT)
    cmd = torchrun_cmd(2, str(script))
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(p.name for p in tmp_path.glob("held.*")) == ["held.0", "held.1"], proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("model_type,layout", [("qwen3_5_moe", ("parallel.fsdp=2", "parallel.ep=2")),
                                               ("qwen3_5", ("parallel.fsdp=2",))])
def test_rows_with_images_through_qwen3_5_checkpoints_sharded_equal_their_one_copy_cache(tmp_path, model_type,
                                                                                        layout):
    extra = image_rows_run(tmp_path, model_type)
    ref = one_copy(tmp_path, *extra)
    proc = sharded(tmp_path, 2, "sharded", *extra, *layout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert_same_cache(ref, str(tmp_path / "sharded"), layout=True)


def _one_copy_deliveries(ref) -> Counter:
    """What a trainer should receive from a cache of the same rows: each sample's ids and state sums, once."""
    return Counter((tuple(ref[i]["input_ids"].tolist()), float(ref[i]["target_hidden_states"].double().sum()),
                    float(ref[i]["target_last_hidden_states"].double().sum())) for i in range(len(ref)))


def _stream_beside_an_fsdp2_producer(tmp_path, path: str, run_args: list[str]) -> tuple[Counter, str, int]:
    """A torchrun producer (2 ranks, ``run_args``) and, in this process, a streaming trainer on ``path``: what the
    trainer received, the producer's output and its exit code."""
    from test_write_distributed import torchrun_cmd

    from dspark_precompute.read.training import build_dataloader

    cmd = torchrun_cmd(2, "-m", "dspark_precompute", *run_args)
    producer = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        loader = build_dataloader(path, stream=True, batch_size=1, release="delivery", poll_s=0.05,
                                  wait_timeout_s=300)
        got: Counter = Counter()
        for b in loader:
            m = b["attention_mask"][0].bool()
            got[(tuple(b["input_ids"][0][m].tolist()), float(b["target_hidden_states"][0][m].double().sum()),
                 float(b["target_last_hidden_states"][0][m].double().sum()))] += 1
        out, _ = producer.communicate(timeout=300)
    finally:
        producer.kill()
    return got, out, int(producer.returncode)


def test_fsdp2_writes_through_a_window_in_lockstep_while_a_trainer_reads_and_delivers_the_one_copy_cache(tmp_path):
    """Both ranks wait for the trainer together (an agreement per poll, dummy forwards for a busy peer): the window
    holds, the trainer receives every sample of the one-copy cache once, and every unit is released."""
    from dspark_precompute.contract.store import CacheStore
    from dspark_precompute.contract.window import released_units
    from dspark_precompute.read.reader import open_cache

    ref = open_cache(one_copy(tmp_path))
    want = _one_copy_deliveries(ref)
    path = tmp_path / "w"
    got, out, rc = _stream_beside_an_fsdp2_producer(
        tmp_path, str(path), overrides(tmp_path, "w", "parallel.fsdp=2", "storage.window_units=1"))
    assert rc == 0, out[-4000:]
    assert "waits until the trainer releases unit" in out  # the window held the ranks back
    assert len(want) > 0 and got == want
    n = ref.num_units
    assert n >= 3 and released_units(CacheStore(str(path)), n) == set(range(n))


@pytest.mark.slow  # the local-disk window under fsdp=2 and the bucket stream stay in the default lane (10 minutes)
def test_fsdp2_writes_through_a_window_into_a_bucket_while_a_trainer_reads_it_and_delivers_the_one_copy_cache(
        tmp_path, bucket):  # noqa: F811 - test_s3's fixture
    """storage=s3 under a sharded target: both ranks wait on the window's records in the bucket, the trainer reads
    the units from it as they commit and releases each, and what it receives is the one-copy cache, once each."""
    from dspark_precompute.contract.store import CacheStore
    from dspark_precompute.contract.window import released_units
    from dspark_precompute.read.reader import open_cache
    from dspark_precompute.read.verify import verify_cache

    ref = open_cache(one_copy(tmp_path))
    want = _one_copy_deliveries(ref)
    url = f"s3://{bucket}/w"
    got, out, rc = _stream_beside_an_fsdp2_producer(
        tmp_path, url, ["storage=s3", f"storage.path={url}",
                        *overrides(tmp_path, "w", "parallel.fsdp=2", "storage.window_units=1")[1:]])  # [0]: local
    assert rc == 0, out[-4000:]
    assert "waits until the trainer releases unit" in out  # the window held the ranks back
    assert len(want) > 0 and got == want
    store = CacheStore(url)
    n = ref.num_units
    assert n >= 3 and released_units(store, n) == set(range(n))
    assert [k for k in store.file_keys(["hidden_states"]) if "/c." in k] == []  # each unit deleted once consumed
    assert verify_cache(url).ok and not (tmp_path / "w").exists()


@pytest.mark.slow  # 36 s on the loaded 2-core VM; its sibling without kills runs in the default lane
def test_fsdp2_into_a_bucket_through_a_window_with_the_producer_and_trainer_each_killed_delivers_every_sample(
        tmp_path, bucket):  # noqa: F811 - test_s3's fixture
    """The producer's rank 1 SIGKILLed at its second unit (torchrun ends the group) and started again; the trainer
    SIGKILLed mid-batch and after a release, resuming from its checkpoint: every sample of the one-copy cache is
    received ``PASSES`` times, every unit released and deleted from the bucket."""
    from test_read_stream import PASSES, TRAIN, _expected, _supervise, delivered, deliveries_differ
    from test_write_distributed import torchrun_cmd

    from dspark_precompute.contract.store import CacheStore
    from dspark_precompute.contract.window import released_units
    from dspark_precompute.read.verify import verify_cache

    ref = one_copy(tmp_path)
    url, ckpt = f"s3://{bucket}/w", tmp_path / "ckpt.json"
    produce = torchrun_cmd(2, "-m", "dspark_precompute", "storage=s3", f"storage.path={url}",
                           *overrides(tmp_path, "w", "parallel.fsdp=2", "storage.window_units=2")[1:])
    train = [sys.executable, "-c", TRAIN, url, str(ckpt), str(PASSES)]
    faults = {"producer": ["unit_submitted=2@1", None], "trainer": ["stream_batch=5", "window_release=2", None]}
    codes = _supervise({"producer": [produce], "trainer": [train]}, faults, tmp_path)
    logs = {k: (tmp_path / f"{k}.log").read_text() for k in codes}
    assert codes["producer"][-1] == 0 and len(codes["producer"]) == 2, logs["producer"][-4000:]
    assert codes["trainer"] == [-9, -9, 0], logs["trainer"][-4000:]
    seen = json.loads(ckpt.read_text())["seen"]
    got, want = delivered(seen), _expected(ref)
    assert len(want) > 0 and got == want, deliveries_differ(got, want, seen, ref)
    store = CacheStore(url)
    n = json.loads(store.read_bytes("manifest.json"))["layout"]["num_units"]
    assert n >= 3 and released_units(store, n) == set(range(n))
    assert [k for k in store.file_keys(["hidden_states"]) if "/c." in k] == []
    assert verify_cache(url).ok
