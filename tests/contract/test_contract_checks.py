"""The on-disk contract's checks, on their own: what the writer produces passes, every alteration is named."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_precompute.contract import arrays, layout, manifest, spec
from dspark_precompute.contract.manifest import Manifest


class fmt:  # noqa: N801 - the contract's functions under the names these tests were written with
    FORMAT_NAME, FORMAT_VERSION, hidden_arrays = spec.FORMAT_NAME, spec.FORMAT_VERSION, spec.hidden_arrays
    plan_layout = staticmethod(layout.build_layout)
    manifest_problems = staticmethod(manifest.manifest_problems)
    array_meta_problems = staticmethod(arrays.array_meta_problems)
    compressed_size_problem = staticmethod(arrays.compressed_size_problem)

    @staticmethod
    def table_problems(m, tables):
        return layout.table_problems(Manifest.parse(m), tables)

    @staticmethod
    def expected_arrays(m):
        return arrays.expected_arrays(Manifest.parse(m))


def tables_of(lengths, chunk_tokens: int, unit_tokens: int, untruncated=None, source_row=None):
    """The tables the writer stores for ``lengths`` (straight from ``plan_layout``) and a manifest for them."""
    lengths = np.asarray(lengths, dtype=np.int64)
    plan = fmt.plan_layout(lengths, chunk_tokens, unit_tokens)
    n = len(lengths)
    untruncated = lengths if untruncated is None else np.asarray(untruncated)
    tables = {
        "samples/start": plan.start, "samples/length": plan.length,
        "samples/source_row": np.arange(n, dtype=np.int64) if source_row is None else np.asarray(source_row),
        "samples/unit": plan.unit, "samples/untruncated_length": untruncated.astype(np.int32),
        "units/token_start": plan.unit_start, "units/token_stop": plan.unit_stop,
    }
    manifest = good_manifest()
    manifest["layout"] = {"chunk_tokens": chunk_tokens, "unit_tokens": unit_tokens, "num_units": plan.num_units,
                          "total_token_slots": plan.total_slots}
    manifest["counts"].update(samples=n, rows_in=n, rejected=0, tokens=int(lengths.sum()),
                              truncated_samples=int((untruncated > lengths).sum()), supervised_tokens=0)
    manifest["counts"]["rejected_by_reason"] = {}
    return manifest, tables


def good_manifest() -> dict:
    """A manifest the pipeline could write (tiny target: 4 layers of 64, layers [1, 2, 3], bf16)."""
    return {
        "format": fmt.FORMAT_NAME, "format_version": fmt.FORMAT_VERSION, "config_hash": "ab" * 32,
        "identity": {"target": {"path": "tiny"},
                     "data": {"path": "embedded", "split": "train", "shuffle_seed": None,
                              "mask_reasoning_content": False}},
        "target_model": "tiny", "target_model_type": "qwen3", "target_vocab_size": 300, "num_hidden_layers": 4,
        "hidden_size": 64, "layer_ids": [1, 2, 3], "target_hidden_dim": 192, "target_last_hidden_dim": 64,
        "seq_length": 256, "storage_dtype": "bf16", "bytes_per_token": 3 * 64 * 2 + 5, "pad_token_id": 256,
        "eos_token_id": None, "chat_template": "{{ x }}",
        "arrays": fmt.hidden_arrays([1, 2, 3], 4), "tied_embeddings": True,
        "layout": {"chunk_tokens": 256, "unit_tokens": 1024, "num_units": 4, "total_token_slots": 4096},
        "counts": {"rows_in": 16, "samples": 14, "rejected": 2, "rejected_by_reason": {"no_supervised_tokens": 2},
                   "tokens": 3501, "supervised_tokens": 2142, "truncated_samples": 12},
        "complete": True, "weights_sha256": "0" * 64, "tokens_stored": True,
    }


def test_a_manifest_the_pipeline_writes_has_no_problems():
    assert fmt.manifest_problems(good_manifest()) == []


def edit(path: str, value):
    def apply(m):
        *parents, last = path.split(".")
        d = m
        for k in parents:
            d = d[k]
        if value is KeyError:
            del d[last]
        else:
            d[last] = value
        return m
    return apply


BAD_MANIFESTS = [
    (edit("layout.chunk_tokens", 0), r"layout.chunk_tokens = 0 is outside \[1, "),
    (edit("layout.chunk_tokens", -256), r"layout.chunk_tokens = -256 is outside"),
    (edit("layout.chunk_tokens", 256.0), r"layout.chunk_tokens = 256.0 \(a float\) must be an integer"),
    (edit("layout.chunk_tokens", "256"), r"layout.chunk_tokens = '256' \(a string\) must be an integer"),
    (edit("layout.chunk_tokens", True), r"layout.chunk_tokens = True \(a boolean\) must be an integer"),
    (edit("layout.chunk_tokens", KeyError), r"manifest lacks 'layout.chunk_tokens'"),
    (edit("layout.total_token_slots", 3585), r"total_token_slots = 3585 does not end in the last of"),
    (edit("layout.total_token_slots", 2048), r"total_token_slots = 2048 does not end in the last of"),
    (edit("tokens_stored", KeyError), r"manifest lacks 'tokens_stored'"),
    (edit("tokens_stored", 1), r"tokens_stored = 1 \(an integer\) must be true or false"),
    (edit("hidden_size", 10 ** 12), r"hidden_size = 1000000000000 is outside \[1, 131072\]"),
    (edit("hidden_size", "64"), r"hidden_size = '64' \(a string\)"),
    (edit("seq_length", 0), r"seq_length = 0 is outside \[1, "),
    (edit("seq_length", None), r"seq_length = None \(null\) must be an integer"),
    (edit("num_hidden_layers", KeyError), r"manifest lacks 'num_hidden_layers'"),
    (edit("chat_template", KeyError), r"manifest lacks 'chat_template'"),
    (edit("target_vocab_size", 0), r"target_vocab_size = 0 is outside \[1, "),
    (edit("storage_dtype", "bf17"), r"storage_dtype = 'bf17' is unknown"),
    (edit("layer_ids", [1, True]), r"layer_ids = \[1, True\] \(a list\) must be a list of integers"),
    (edit("layer_ids", [3, 1]), r"layer_ids = \[3, 1\] must be strictly increasing"),
    (edit("layer_ids", [1, 2, 4]), r"must lie in \[-1, num_hidden_layers - 1 = 3\]"),
    (edit("arrays.1", "input_ids"), r"arrays\['1'\] = 'input_ids' is not an array under hidden_states/"),
    (edit("arrays.1", "../../etc"), r"arrays\['1'\] = '../../etc' is not an array under hidden_states/"),
    (edit("arrays.1", "hidden_states/../../etc"), r"is not an array under hidden_states/"),
    (edit("arrays.1", "hidden_states/layer_2"), r"arrays\['1'\] = 'hidden_states/layer_2', but the naming rule gives "
                                                r"'hidden_states/layer_1'"),
    (edit("arrays.last", "hidden_states/final_norm"), r"arrays\['last'\] = 'hidden_states/final_norm', but the naming "
                                                      r"rule gives 'hidden_states/layer_3'"),
    (edit("counts.samples", -1), r"counts.samples = -1 is outside \[0, "),
    (edit("counts.rows_in", 17), r"counts.rows_in = 17, but samples \+ rejected = 16"),
    (edit("counts.rejected_by_reason", {"no_supervised_tokens": 1}), r"rejected_by_reason sums to 1, counts.rejected "
                                                                     r"is 2"),
    (edit("layout.num_units", 15), r"counts.samples = 14 does not fit layout.num_units = 15"),
    (edit("complete", "yes"), r"complete = 'yes' \(a string\) must be true or false"),
    (edit("weights_sha256", "xyz"), r"weights_sha256 = 'xyz' \(a string\) must be 64 lowercase hex digits"),
    (edit("bytes_per_token", 5), r"bytes_per_token = 5 disagrees with the fields it is derived from, which give 389"),
    (edit("identity.data", "embedded"), r"identity.data = 'embedded' \(a string\) must be an object"),
]


@pytest.mark.parametrize("mutate,problem", BAD_MANIFESTS)
def test_every_wrong_manifest_field_is_named_with_its_value(mutate, problem):
    problems = fmt.manifest_problems(mutate(copy.deepcopy(good_manifest())))
    assert any(__import__("re").search(problem, p) for p in problems), problems


def test_a_manifest_that_is_not_an_object_is_one_problem_not_a_crash():
    for value in ([1, 2], "manifest", 42, None, 1.5, True):
        (p,) = fmt.manifest_problems(value)
        assert p.startswith("manifest.json is not a JSON object")


def test_every_problem_is_reported_at_once():
    m = good_manifest()
    m["layout"]["chunk_tokens"] = 0
    m["hidden_size"] = "64"
    m["seq_length"] = -1
    problems = fmt.manifest_problems(m)
    assert sum(k in p for p in problems for k in ("chunk_tokens", "hidden_size", "seq_length")) == 3, problems


def test_sizes_that_would_make_a_reader_allocate_absurdly_are_refused():
    m = good_manifest()
    m["layout"]["chunk_tokens"] = 1 << 24  # 2 GiB chunks at hidden 64 bf16
    m["layout"]["unit_tokens"] = 1 << 24
    m["layout"]["total_token_slots"] = 1 << 24
    m["layout"]["num_units"] = 1
    assert any("more than a reader decodes at once" in p for p in fmt.manifest_problems(m))
    m = good_manifest()
    m["seq_length"], m["hidden_size"] = 1 << 24, 1 << 17  # one padded sample of several TiB
    m["target_hidden_dim"], m["target_last_hidden_dim"], m["bytes_per_token"] = 3 << 17, 1 << 17, 3 * 2 * (1 << 17) + 5
    assert any("more than a reader allocates for one sample" in p for p in fmt.manifest_problems(m))


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=60), chunk=st.sampled_from([1, 7, 64, 256]),
       units=st.integers(1, 6))
def test_the_tables_of_any_planned_layout_pass_and_any_swap_of_two_samples_is_caught(lengths, chunk, units):
    unit_tokens = max(chunk, -(-300 // chunk) * chunk) * units
    m, tables = tables_of(lengths, chunk, unit_tokens)
    m["seq_length"] = 300
    assert fmt.manifest_problems(m) == []
    assert fmt.table_problems(m, tables) == []
    if len(lengths) > 1:
        bad = {k: v.copy() for k, v in tables.items()}
        s = bad["samples/start"]
        s[0], s[-1] = s[-1], s[0]  # a rewrite with a valid checksum: two samples trade places
        assert fmt.table_problems(m, bad), (lengths, chunk, unit_tokens)


def test_swapping_the_starts_of_two_equal_length_samples_is_caught_by_the_layout_order():
    m, tables = tables_of([5, 9, 5, 5, 3], 4, 64)
    s = tables["samples/start"]
    s[0], s[2] = s[2], s[0]  # same length: no gap, no overlap, only the order gives it away
    (p,) = fmt.table_problems(m, tables)
    assert "samples/start: the disk order is not the layout of the recorded lengths" in p
    assert "sample 2 (length 5) where the layout puts sample 0 (length 5)" in p


TABLE_EDITS = [
    ("samples/length", lambda t: t.__setitem__(0, 2 ** 31 - 1), r"samples/length: 1 sample\(s\) outside \[1, "
                                                                r"seq_length=300\]: sample 0 has length 2147483647"),
    ("samples/length", lambda t: t.__setitem__(1, 0), r"sample 1 has length 0"),
    ("samples/untruncated_length", lambda t: t.__setitem__(2, 1), r"samples/untruncated_length: .* sample 2 has 1 < "
                                                                  r"length"),
    ("samples/unit", lambda t: t.__setitem__(3, 99), r"samples/unit: 1 sample\(s\) name no unit .* sample 3 has "
                                                     r"unit 99"),
    ("samples/source_row", lambda t: t.__setitem__(4, 0), r"samples/source_row: .* out of order"),
    ("units/token_start", lambda t: t.__setitem__(1, t[1] + 1), r"not starting on a chunk boundary"),
    ("units/token_stop", lambda t: t.__setitem__(0, t[0] - 1), r"does not end at units/token_stop|gap"),
    ("samples/start", lambda t: t.__setitem__(0, t[0] + 1), r"gap\(s\) or overlap\(s\)|does not start at"),
    ("samples/unit", lambda t: t.__setitem__(len(t) - 1, 0), r"units are not in token order|hold no sample"),
]


@pytest.mark.parametrize("name,mutate,problem", TABLE_EDITS)
def test_every_table_edit_is_named(name, mutate, problem):
    import re

    lengths = [30, 250, 7, 7, 120, 64, 300, 1, 99]
    m, tables = tables_of(lengths, 16, 320)
    m["seq_length"] = 300
    assert fmt.table_problems(m, tables) == []
    mutate(tables[name])
    problems = fmt.table_problems(m, tables)
    assert any(re.search(problem, p) for p in problems), problems


def test_a_layout_packed_otherwise_than_plan_layout_is_caught():
    m, tables = tables_of([10, 10, 10, 10], 10, 20)  # units {0,1} {2,3}
    assert fmt.table_problems(m, tables) == []
    # the same samples packed one per unit: tiled, chunk-aligned, in order, but not the layout's packing
    tables.update({"samples/unit": np.arange(4, dtype=np.int32), "samples/start": np.arange(4) * 20,
                   "units/token_start": np.arange(4) * 20, "units/token_stop": np.arange(4) * 20 + 10})
    m["layout"].update(num_units=4, total_token_slots=70)
    problems = fmt.table_problems(m, tables)
    assert any("a unit stops although the next sample fits" in p for p in problems), problems


def test_counts_that_disagree_with_the_tables_are_named():
    m, tables = tables_of([5, 6, 7], 4, 32, untruncated=[5, 9, 7])
    m["counts"]["tokens"] += 1
    m["counts"]["truncated_samples"] = 0
    assert fmt.table_problems(m, tables) == ["manifest counts.tokens = 19, the tables give 18",
                                            "manifest counts.truncated_samples = 0, the tables give 1"]


def test_table_lengths_must_match_the_counts_and_the_unit_count():
    m, tables = tables_of([5, 6, 7], 4, 32)
    tables["samples/unit"] = tables["samples/unit"][:2]
    tables["units/token_stop"] = np.zeros(5, dtype=np.int64)
    assert fmt.table_problems(m, tables) == ["table samples/unit has 2 rows, manifest counts.samples is 3",
                                            "table units/token_stop has 5 rows, manifest layout.num_units is 1"]


INNER = [{"name": "bytes", "configuration": {"endian": "little"}},
         {"name": "blosc", "configuration": {"cname": "zstd", "clevel": 1, "shuffle": "shuffle", "typesize": 2,
                                             "blocksize": 1 << 20}},
         {"name": "crc32c"}]


def sharded(inner=INNER, chunk=(256, 64), index=None, location="end"):
    return [{"name": "sharding_indexed", "configuration": {
        "chunk_shape": list(chunk), "codecs": inner, "index_location": location,
        "index_codecs": index or [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]}}]


def meta_json(**over):
    """A format 2 hidden array's zarr.json as the writer makes it: one shard per unit of inner chunks."""
    meta = {"zarr_format": 3, "node_type": "array", "shape": [4096, 64], "data_type": "uint16",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1024, 64]}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}}, "fill_value": 0,
            "codecs": sharded(), "attributes": {"logical_dtype": "bfloat16", "layer_id": 1},
            "storage_transformers": []}
    meta.update(over)
    return meta


def test_the_writers_array_metadata_parses_and_names_its_shards():
    want = fmt.expected_arrays(good_manifest())["hidden_states/layer_1"]
    meta, problems = fmt.array_meta_problems("hidden_states/layer_1", meta_json(), want)
    assert problems == [] and meta.compressor == "blosc" and meta.chunks == (256, 64) and meta.shard_chunks == 4
    assert meta.object_key(9) == "hidden_states/layer_1/c.2.0" and meta.chunk_nbytes == 256 * 64 * 2
    assert meta.num_chunks == 16


def test_a_format_1_array_reads_as_one_object_per_chunk():
    m = good_manifest()
    m.update(format_version=1, layout={**m["layout"], "total_token_slots": 3584})
    del m["tokens_stored"]
    want = fmt.expected_arrays(m)["hidden_states/layer_1"]
    v1 = meta_json(shape=[3584, 64], chunk_grid={"name": "regular", "configuration": {"chunk_shape": [256, 64]}},
                   chunk_key_encoding={"name": "default", "configuration": {"separator": "/"}}, codecs=INNER)
    meta, problems = fmt.array_meta_problems("hidden_states/layer_1", v1, want)
    assert problems == [] and not meta.sharded and meta.object_key(3) == "hidden_states/layer_1/c/3/0"
    _, problems = fmt.array_meta_problems("hidden_states/layer_1", meta_json(), want)
    assert problems  # a format 1 manifest does not describe sharded arrays


@pytest.mark.parametrize("over,problem", [
    ({"codecs": sharded([INNER[0], {"name": "gzip"}, {"name": "crc32c"}])},
     "uses codec 'gzip', which this tool never writes"),
    ({"codecs": sharded([INNER[0], {"name": "no-such-codec"}, {"name": "crc32c"}])}, "uses codec 'no-such-codec'"),
    ({"codecs": sharded([{"name": "transpose", "configuration": {"order": [1, 0]}}, INNER[0], {"name": "crc32c"}])},
     "uses codec 'transpose'"),
    ({"codecs": sharded([INNER[0], {"name": "zstd"}])}, "has codec chain bytes -> zstd"),
    ({"codecs": sharded([{"name": "bytes", "configuration": {"endian": "big"}}, {"name": "crc32c"}])},
     "'big'-endian"),
    ({"codecs": INNER}, "format 2 stores token arrays with the single codec 'sharding_indexed'"),
    ({"codecs": sharded(chunk=(512, 64))}, "has inner chunk shape [512, 64], the manifest implies [256, 64]"),
    ({"codecs": sharded(index=[{"name": "bytes"}])}, "has shard index codecs"),
    ({"codecs": sharded(location="start")}, "has its shard index at the 'start'"),
    ({"chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}}},
     "format 2 writes zarr's 'default' encoding with separator '.'"),
    ({"data_type": "float32"}, "has data_type 'float32', the manifest implies 'uint16'"),
    ({"shape": [4096, 65]}, "has shape [4096, 65], the manifest implies [4096, 64] (layout.total_token_slots x "
                            "hidden_size)"),
    ({"chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1 << 27, 64]}}},
     "has shard shape [134217728, 64], the manifest implies [1024, 64]"),
    ({"attributes": {"logical_dtype": "bfloat16", "layer_id": 2}},
     "has attribute layer_id=2, the manifest implies 1: the array holds another layer"),
    ({"storage_transformers": [{"name": "x"}]}, "has storage transformers"),
])
def test_array_metadata_the_writer_never_writes_is_refused_naming_array_and_field(over, problem):
    want = fmt.expected_arrays(good_manifest())["hidden_states/layer_1"]
    meta, problems = fmt.array_meta_problems("hidden_states/layer_1", meta_json(**over), want)
    assert meta is None and any(problem in p and "'hidden_states/layer_1'" in p for p in problems), problems


def test_codec_headers_must_declare_exactly_the_chunk_size():
    from numcodecs import Blosc, Zstd

    data = np.arange(4096, dtype=np.uint16).tobytes()
    for codec, name in ((Blosc(cname="zstd", clevel=1, shuffle=1), "blosc"), (Zstd(level=3), "zstd")):
        body = codec.encode(data)
        assert fmt.compressed_size_problem(name, body, len(data)) is None
        assert "declaring 8,192 decompressed bytes, a chunk of this array is 16,384" in \
            fmt.compressed_size_problem(name, body, 2 * len(data))
    assert fmt.compressed_size_problem(None, data, len(data)) is None
    assert fmt.compressed_size_problem(None, data[:-1], len(data)) == \
        "holds 8,191 bytes, a chunk of this array is 8,192"
    assert fmt.compressed_size_problem("zstd", b"not zstd at all", 10) == "has no zstd frame header with a content size"
