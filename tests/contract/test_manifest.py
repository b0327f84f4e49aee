"""The typed manifest: what is written is what is read, and every identity change is named."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import tiny_manifest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_precompute.contract.layout import build_layout
from dspark_precompute.contract.manifest import (
    FIELDS,
    RUN_RECORD_FIELDS,
    Counts,
    Manifest,
    ManifestLayout,
    config_hash,
    fields_markdown,
    manifest_problems,
)
from dspark_precompute.contract.spec import hidden_arrays
from dspark_precompute.contract.vocab import StorageDtype
from dspark_precompute.errors import CacheFormatError


@st.composite
def manifests(draw) -> Manifest:
    """Manifests a run could write (format 2, or format 1 as 0.2 wrote it): layout from real lengths, counts that
    add up."""
    version = draw(st.sampled_from([1, 2]))
    n_layers = draw(st.integers(2, 40))
    ids = sorted(draw(st.sets(st.integers(-1, n_layers - 1), min_size=1, max_size=6)))
    hidden = draw(st.sampled_from([8, 64, 1024, 4096]))
    seq = draw(st.integers(1, 4096))
    lengths = np.asarray(draw(st.lists(st.integers(1, seq), min_size=1, max_size=40)), dtype=np.int64)
    chunk = draw(st.sampled_from([1, 16, 512]))
    # as the plan sizes it: whole chunks, at least seq_length (a unit always holds its longest sample)
    unit_tokens = max(-(-seq // chunk) * chunk, draw(st.integers(1, 8192)) // chunk * chunk)
    layout = build_layout(lengths, chunk, unit_tokens, version)
    rejected = draw(st.integers(0, 5))
    supervised = draw(st.integers(0, int(lengths.sum())))
    truncated = draw(st.integers(0, len(lengths)))
    return Manifest(
        config_hash="ab" * 32, identity={"target": {"path": "tiny"}, "data": {
            "path": "embedded", "split": "train", "shuffle_seed": None, "mask_reasoning_content": False}},
        target_model="tiny", target_model_type="qwen3", target_vocab_size=draw(st.integers(1, 200_000)),
        num_hidden_layers=n_layers, hidden_size=hidden, layer_ids=ids, seq_length=seq,
        storage_dtype=draw(st.sampled_from([str(d) for d in StorageDtype])), chat_template="{{ x }}",
        arrays=hidden_arrays(ids, n_layers, pre_norm=version >= 2 and draw(st.booleans())),
        layout=ManifestLayout(layout.chunk_tokens, layout.unit_tokens, layout.num_units, layout.total_slots),
        counts=Counts(rows_in=len(lengths) + rejected, samples=len(lengths), rejected=rejected,
                      tokens=int(lengths.sum()), supervised_tokens=supervised, truncated_samples=truncated,
                      rejected_by_reason={"no_supervised_tokens": rejected} if rejected else {}),
        complete=draw(st.booleans()), config={"seq_length": seq},
        weights_sha256=draw(st.one_of(st.none(), st.just("0" * 64))), format_version=version,
        tokens_stored=version >= 2 and draw(st.booleans()),
    )


@settings(max_examples=150, deadline=None)
@given(manifests())
def test_any_manifest_a_run_writes_passes_its_checks_and_reads_back_equal(m):
    data = json.loads(m.to_bytes())
    assert manifest_problems(data) == []
    back = Manifest.parse(data)
    assert back == m
    assert back.to_json() == m.to_json()
    assert data["bytes_per_token"] == m.bytes_per_token and data["target_hidden_dim"] == m.target_hidden_dim


def test_every_changed_identity_field_is_named_with_both_values():
    m = Manifest.parse(json.loads(tiny_manifest(complete=False).to_bytes()))
    changed = json.loads(json.dumps(m.identity))
    changed["data"]["split"] = "train[:10]"
    changed["target"]["weights_fingerprint"] = "new"
    assert m.differences(changed) == [("data.split", "train", "train[:10]"),
                                      ("target.weights_fingerprint", None, "new")]
    assert config_hash(m.identity) != config_hash(changed)


def test_the_run_record_fields_are_the_only_difference_between_two_runs_of_the_same_cache():
    a = tiny_manifest(complete=False)
    b = Manifest.parse(json.loads(a.to_bytes()))
    b.mark_complete(timing={"wall_s": 1.0}, weights_sha256="0" * 64, provenance={"argv": ["x"]})
    a.mark_complete(timing={"wall_s": 2.0}, weights_sha256="0" * 64, provenance={"argv": ["y"]})
    assert a.run_independent_json() == b.run_independent_json()
    assert set(RUN_RECORD_FIELDS) >= {"timing", "provenance", "completed_at"}
    b.mark_incomplete()
    assert not b.complete and b.completed_at is None and "completed_at" not in b.to_json()


@pytest.mark.parametrize("edit,words", [
    (lambda d: d["layout"].update(chunk_tokens=0), "layout.chunk_tokens"),
    (lambda d: d.update(hidden_size=True), "hidden_size"),
    (lambda d: d["counts"].update(rows_in=999), "counts.rows_in"),
    (lambda d: d.__setitem__("arrays", {"1": "../../etc"}), "arrays"),
])
def test_parse_refuses_a_bad_field_naming_it(edit, words):
    data = json.loads(tiny_manifest(complete=False).to_bytes())
    edit(data)
    with pytest.raises(CacheFormatError, match=words.replace(".", r"\.")):
        Manifest.parse(data)


def test_every_field_of_the_typed_manifest_is_a_row_of_the_schema_table():
    import dataclasses

    keys = {f.key for f in FIELDS}
    for record, prefix in ((Manifest, ""), (ManifestLayout, "layout."), (Counts, "counts.")):
        for f in dataclasses.fields(record):
            if f.name not in ("layout", "counts"):
                assert prefix + f.name in keys, f"{prefix}{f.name} is written but not in FIELDS"
    written = json.loads(tiny_manifest(complete=False).to_bytes())
    assert set(written) <= {f.key for f in FIELDS if "." not in f.key}
    table = fields_markdown()
    assert all(f"`{f.key}`" in table for f in FIELDS) and "| `tokens_stored` | true or false | yes | 2 |" in table


def test_a_format_2_manifest_needs_tokens_stored_and_a_format_1_manifest_does_not():
    data = json.loads(tiny_manifest(complete=False).to_bytes())
    del data["tokens_stored"]
    assert manifest_problems(data) == ["manifest lacks 'tokens_stored'"]
    v1 = json.loads(tiny_manifest(complete=False).to_bytes())
    v1.update(format_version=1, layout={"chunk_tokens": 256, "unit_tokens": 1024, "num_units": 1,
                                        "total_token_slots": 512})
    del v1["tokens_stored"]
    assert manifest_problems(v1) == []


@pytest.mark.parametrize("version,layout,words", [
    (2, {"total_token_slots": 1280}, "does not end in the last of layout.num_units = 1 shards"),
    (2, {"unit_tokens": 1000}, "not a multiple of layout.chunk_tokens"),
    (1, {"total_token_slots": 500}, "not a multiple of layout.chunk_tokens"),
    (3, {"total_token_slots": 1280}, "does not end in the last of layout.num_units = 1 shards"),
    (4, {}, "format_version 4 is not supported"),
])
def test_the_layout_rules_follow_the_format_version(version, layout, words):
    data = json.loads(tiny_manifest(complete=False).to_bytes())
    data["format_version"] = version
    data["layout"].update(layout)
    assert any(words in p for p in manifest_problems(data)), manifest_problems(data)


def test_each_storage_dtypes_names_come_from_one_table_and_invert_back_to_it():
    """storage name -> logical (torch's) name -> storage name is the identity for every member, and each name
    is what its own library calls the dtype: numpy for the disk dtype, torch for the logical one, the
    safetensors writer for the code of the output."""
    import safetensors.torch
    import torch

    assert len(StorageDtype) == 4
    for d in StorageDtype:
        assert StorageDtype.from_logical(d.logical) is d and StorageDtype(d.value) is d
        assert getattr(torch, d.logical).itemsize == d.disk.itemsize
        blob = safetensors.torch.save({"x": torch.zeros(1, dtype=getattr(torch, d.torch_name))})
        header = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
        assert header["x"]["dtype"] == d.safetensors
    assert {d.disk.name for d in StorageDtype} == {"uint16", "float16", "float32", "uint8"}
    assert StorageDtype.from_logical("float64") is None and StorageDtype.from_logical("fp32") is None
