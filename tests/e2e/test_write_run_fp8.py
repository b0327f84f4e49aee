"""fp8 caches end to end: verify --precision, a non-finite sample dropped, an all-fp8 cache verified and exported.

The e2e part of tests/write/test_run_fp8.py.
"""

from __future__ import annotations

import json

import numpy as np
import torch
import zarr
from helpers import compose, poison_second_batch, small
from test_run_fp8 import FP8

from dspark_precompute import open_cache
from dspark_precompute.cli.cache import main
from dspark_precompute.write.run import run


def test_verify_precision_reports_each_arrays_error_and_the_teachers_agreement(fp8_run, capsys):
    _, result = fp8_run
    assert main(["verify", result.path, "--precision", "300", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["precision"]
    assert p["positions"] == 300 and p["reference"] == "recompute in float32"
    errs = {a["layer"]: a for a in p["arrays"]}
    assert set(errs) == {"layer 1", "layer 2", "layer 3 (post-norm)"}
    for k in ("layer 1", "layer 2"):
        assert errs[k]["dtype"] == "fp8_e4m3" and 0.005 < errs[k]["rel_rms"] <= 0.05
        assert errs[k]["worst_token_rel"] >= errs[k]["rel_rms"] * 0.5 and errs[k]["worst_sample"] >= 0
    assert errs["layer 3 (post-norm)"]["dtype"] == "bf16" and errs["layer 3 (post-norm)"]["rel_rms"] < 0.005
    assert p["last_top1_agreement"] == 1.0 and p["last_tv_mean"] < 1e-3
    # a bound below what fp8 costs fails, naming the array
    assert main(["verify", result.path, "--precision", "100", "--precision-max-rel-rms", "0.001"]) == 1
    assert "hidden_states/layer_1" in capsys.readouterr().out


def test_an_fp8_sample_with_inf_is_dropped_and_its_slots_hold_zero_bits_and_scale_one(tmp_path, monkeypatch):
    from dspark_precompute.read.verify import verify_cache

    poison_second_batch(monkeypatch)
    result = run(compose(small(tmp_path, *FP8)))
    c = open_cache(result.path)
    (dropped,) = c.manifest.dropped_samples
    assert c.manifest.nonfinite_values == {"hidden_states/layer_1": 1}
    g = zarr.open_group(result.path, mode="r")
    a, n = int(g["samples/start"][dropped]), int(g["samples/length"][dropped])
    assert not g["hidden_states/layer_1"][a:a + n].any() and (g["hidden_scales/layer_1"][a:a + n] == 1).all()
    assert (g["hidden_scales/layer_2"][a:a + n] == 1).all()
    assert all(bool(s["target_hidden_states"].float().isfinite().all()) for s in c)
    assert verify_cache(result.path).ok


def test_an_all_fp8_cache_with_one_scale_per_token_verifies_exports_and_keeps_the_teacher(tmp_path, capsys):
    from dspark_precompute.read.export import export_nemo

    result = run(compose(small(tmp_path, "storage.dtype=fp8_e4m3", "storage.last_dtype=fp8_e4m3")))
    c = open_cache(result.path)
    raw = c.read_fp8(0)
    assert raw["layer_ids"] == [1, 2, 3] and raw["target_last_hidden_scales"].shape[1] == 1
    assert c[0]["target_last_hidden_states"].dtype == torch.bfloat16 and c.output_dtype == "bf16"
    assert main(["verify", result.path, "--precision", "200", "--teacher", "100", "--recompute", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["recompute_exact"] == 1 and report["precision"]["last_top1_agreement"] >= 0.95
    assert all(a["rel_rms"] <= 0.05 for a in report["precision"]["arrays"])
    assert export_nemo(result.path, tmp_path / "nemo").num_samples == len(c)
    assert np.isfinite(c.sample(0, as_numpy=True)["target_last_hidden_states"]).all()
