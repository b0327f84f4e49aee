"""The manifest's capture facts and run record: typed, checked, optional, and never in the identity."""

from __future__ import annotations

import json

import pytest
from helpers import tiny_manifest

from dspark_precompute.contract.manifest import (
    RUN_RECORD_FIELDS,
    Capture,
    Manifest,
    MaskPolicy,
    RunProvenance,
    manifest_problems,
)
from dspark_precompute.errors import CacheFormatError

CAPTURE = Capture(last_state="post_norm", final_norm_class="Qwen3RMSNorm", layer_preset="servable",
                  mask=MaskPolicy("nemo_prefix", "full_render_alignment", False, True),
                  target_weights_dtype="bfloat16", weights_fingerprint="ab" * 32, fingerprint_kind="full")
RECORD = RunProvenance(argv=["dspark-precompute", "seq_length=256"], overrides=["seq_length=256"],
                       versions={"torch": "2.13.0", "zarr": "3.1.6"}, hosts=["a", "b"], world_size=2)


def test_capture_and_provenance_are_written_and_read_back_typed():
    m = tiny_manifest(capture=CAPTURE, provenance=RECORD)
    data = json.loads(m.to_bytes())
    assert manifest_problems(data) == []
    assert data["capture"]["mask"]["rule"] == "nemo_prefix" and data["provenance"]["world_size"] == 2
    back = Manifest.parse(data)
    assert back == m and isinstance(back.capture, Capture) and isinstance(back.capture.mask, MaskPolicy)
    assert isinstance(back.provenance, RunProvenance) and back.provenance.hosts == ["a", "b"]


def test_a_manifest_written_before_these_fields_existed_still_opens():
    data = json.loads(tiny_manifest().to_bytes())
    assert "capture" not in data and "provenance" not in data
    data["provenance"] = {"argv": ["x"], "overrides": []}  # what 0.2.0 wrote
    back = Manifest.parse(data)
    assert back.capture is None and back.provenance == RunProvenance(argv=["x"], overrides=[])
    data["capture"] = {"final_norm_class": "LlamaRMSNorm"}  # a partial section: the rest is unknown
    assert Manifest.parse(data).capture == Capture(final_norm_class="LlamaRMSNorm")


@pytest.mark.parametrize("edit,words", [
    (lambda d: d["capture"].update(final_norm_class=3), "capture.final_norm_class = 3 (an integer) must be a string"),
    (lambda d: d["capture"]["mask"].update(mask_reasoning_content="no"),
     "capture.mask.mask_reasoning_content = 'no' (a string) must be true or false"),
    (lambda d: d["capture"].update(mask=[1]), "capture.mask = [1] (a list) must be an object"),
    (lambda d: d.update(capture="post-norm"), "capture = 'post-norm' (a string) must be an object"),
    (lambda d: d["provenance"].update(world_size=True), "provenance.world_size = True"),
    (lambda d: d["provenance"].update(world_size=0), "provenance.world_size = 0 is outside"),
    (lambda d: d["provenance"].update(argv="python -m x"), "provenance.argv = 'python -m x' (a string) must be a list"),
    (lambda d: d["provenance"].update(hosts=[1]), "provenance.hosts = [1] (a list) must be a list of strings"),
    (lambda d: d["provenance"].update(versions={"torch": 2}),
     "provenance.versions = {'torch': 2} (an object) must be an object of string -> string"),
])
def test_a_field_of_the_wrong_type_is_refused_naming_it(edit, words):
    data = json.loads(tiny_manifest(capture=CAPTURE, provenance=RECORD).to_bytes())
    edit(data)
    with pytest.raises(CacheFormatError) as err:
        Manifest.parse(data)
    assert words in str(err.value)


def test_the_run_record_is_not_part_of_what_two_runs_of_the_same_cache_must_agree_on_but_capture_is():
    a, b = tiny_manifest(capture=CAPTURE), tiny_manifest(capture=CAPTURE)
    a.mark_complete(provenance=RECORD)
    b.mark_complete(provenance={"argv": ["other"], "hosts": ["c"], "world_size": 8})
    assert "provenance" in RUN_RECORD_FIELDS and "capture" not in RUN_RECORD_FIELDS
    assert a.run_independent_json() == b.run_independent_json()
    assert isinstance(b.provenance, RunProvenance) and b.provenance.world_size == 8
    b.capture = Capture(**{**CAPTURE.__dict__, "final_norm_class": "LayerNorm"})
    assert a.run_independent_json() != b.run_independent_json()


def test_a_pickled_manifest_keeps_its_capture_facts_and_leaves_the_run_record_behind():
    import pickle

    m = tiny_manifest(capture=CAPTURE, provenance=RECORD)
    blob = pickle.dumps(m)
    back = pickle.loads(blob)
    assert back.capture == CAPTURE and back.provenance is None and m.provenance == RECORD
    assert b"zarr" not in blob  # what a DataLoader worker's dataset carries names no library handle
