"""FP8 in the contract: numpy decodes e4m3 exactly as torch does, and the manifest names every fp8 array's scales."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from helpers import tiny_manifest

from dspark_precompute.contract.arrays import expected_arrays
from dspark_precompute.contract.fp8 import (
    E4M3_TO_FLOAT32,
    convert,
    dequantize,
    float32_to_bf16_bits,
    scale_problem,
)
from dspark_precompute.contract.manifest import Manifest, manifest_problems


def torch_bits(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.float8_e4m3fn)


def test_the_decode_table_is_torchs_value_of_every_e4m3_bit_pattern():
    want = torch_bits(np.arange(256, dtype=np.uint8)).float().numpy()
    assert np.array_equal(np.isnan(E4M3_TO_FLOAT32), np.isnan(want))
    assert np.isnan(E4M3_TO_FLOAT32[[0x7F, 0xFF]]).all() and np.isnan(E4M3_TO_FLOAT32).sum() == 2
    finite = ~np.isnan(want)
    assert np.array_equal(E4M3_TO_FLOAT32[finite].view(np.uint32), want[finite].view(np.uint32))  # -0.0 included
    assert E4M3_TO_FLOAT32[0x7E] == 448.0 and E4M3_TO_FLOAT32[0x01] == 2.0 ** -9


@pytest.mark.parametrize("cols", [1, 4, 32])
def test_dequantizing_to_bf16_is_bit_identical_to_torchs_float8_times_scale(cols):
    rng = np.random.default_rng(cols)
    bits = rng.integers(0, 256, size=(64, 128), dtype=np.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0  # NaN is never stored
    scale = np.exp2(rng.uniform(-20, 20, size=(64, cols))).astype(np.float32) * rng.uniform(1, 2, (64, cols)).astype(
        np.float32)
    got = convert(bits, "fp8_e4m3", "bf16", scale)
    group = 128 // cols
    want = (torch_bits(bits).float() * torch.from_numpy(scale).repeat_interleave(group, dim=1)).bfloat16()
    assert got.dtype == np.uint16 and np.array_equal(got.view(np.int16), want.view(torch.int16).numpy())
    assert np.array_equal(dequantize(bits, scale), (torch_bits(bits).float() * torch.from_numpy(scale)
                                                    .repeat_interleave(group, dim=1)).numpy())


def test_float32_to_bf16_rounds_to_nearest_even_like_torch_including_ties_and_specials():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10_000).astype(np.float32) * np.float32(1e3),
                        np.asarray([0.0, -0.0, np.inf, -np.inf, 1e-40, -1e-45, 3.4e38, 1.0 + 2 ** -8,
                                    1.0 + 3 * 2 ** -8], dtype=np.float32)])  # ties round to even
    want = torch.from_numpy(x).bfloat16().view(torch.int16).numpy()
    assert np.array_equal(float32_to_bf16_bits(x).view(np.int16), want)
    nan = float32_to_bf16_bits(np.asarray([np.nan], dtype=np.float32))
    assert np.isnan(torch.from_numpy(nan.view(np.int16)).view(torch.bfloat16).float().numpy()).all()


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), -0.0])
def test_a_scale_that_is_not_finite_and_positive_is_named_with_its_row(bad):
    scale = np.ones((8, 4), dtype=np.float32)
    scale[5, 2] = bad
    problem = scale_problem(scale)
    assert problem is not None and "row 5, group 2" in problem
    assert scale_problem(np.full((3, 1), 2.0 ** -126, dtype=np.float32)) is None


def fp8_manifest(**kw) -> Manifest:
    return tiny_manifest(storage_dtype="fp8_e4m3", last_dtype="bf16", fp8_group=16, **kw)


def test_an_fp8_manifest_names_each_arrays_storage_and_scale_array_and_reads_back_equal():
    m = fp8_manifest()
    data = json.loads(m.to_bytes())
    assert manifest_problems(data) == [] and Manifest.parse(data) == m
    assert data["hidden_storage"]["hidden_states/layer_1"] == {
        "dtype": "fp8_e4m3", "disk_dtype": "uint8", "logical_dtype": "float8_e4m3fn",
        "scale_array": "hidden_scales/layer_1", "scale_dtype": "float32", "scale_columns": 4, "channels_per_scale": 16}
    assert data["hidden_storage"]["hidden_states/layer_3"]["dtype"] == "bf16"  # the post-norm state (N-1)
    assert data["bytes_per_token"] == 2 * (64 + 4 * 4) + 64 * 2 + 5
    want = expected_arrays(m)
    assert want["hidden_scales/layer_2"].shape == (1024, 4) and want["hidden_scales/layer_2"].positive
    assert "hidden_scales/layer_3" not in want and want["hidden_states/layer_1"].dtype == np.uint8
    assert m.output_dtype == m.last_output_dtype == "bf16"


@pytest.mark.parametrize(("edit", "pattern"), [
    (lambda d: d.update(fp8_group=24), r"fp8_group = 24 does not divide hidden_size = 64"),
    (lambda d: d.update(fp8_group=0), r"fp8_group = 0 is outside"),
    (lambda d: d.update(storage_dtype="bf16", last_dtype=None), r"fp8_group = 16 but no array is stored as fp8"),
    (lambda d: d.update(last_dtype="fp4"), r"last_dtype = 'fp4' is unknown"),
    (lambda d: d["hidden_storage"]["hidden_states/layer_2"].update(dtype="bf16"), r"hidden_storage = .* disagrees"),
    (lambda d: d.update(bytes_per_token=389), r"bytes_per_token = 389 disagrees with the fields it is derived from, "
                                              r"which give 293"),
])
def test_an_edited_fp8_manifest_is_refused_naming_the_field(edit, pattern):
    data = json.loads(fp8_manifest().to_bytes())
    edit(data)
    problems = manifest_problems(data)
    assert any(re.search(pattern, p) for p in problems), problems
