"""Crafted sizes, read in a child process with little address space: refused before any large allocation.

The e2e part of tests/read/test_damage.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

from helpers import chunk_span, rebind
from test_damage import edit_manifest, edit_meta, rewrite_table, with_crc


def test_crafted_sizes_are_refused_before_any_large_allocation(cache_copy, tmp_path):
    """Run in a child with 3 GiB of address space: an allocation the crafted values ask for would fail there."""
    big = tmp_path / "big"
    shutil.copytree(cache_copy, big)
    rewrite_table(big, "samples/length", lambda t: t.__setitem__(0, 2 ** 31 - 1))  # 256 GiB of hidden states
    wide = tmp_path / "wide"
    shutil.copytree(cache_copy, wide)
    edit_manifest(wide, lambda m: m.update(hidden_size=10 ** 12))  # a 1.36 PiB export row
    huge_chunks = tmp_path / "huge_chunks"
    shutil.copytree(cache_copy, huge_chunks)
    edit_manifest(huge_chunks, lambda m: m["layout"].update(chunk_tokens=2 ** 27, unit_tokens=2 ** 27,
                                                            num_units=1, total_token_slots=2 ** 27))
    for name in ("input_ids", "loss_mask", "hidden_states/layer_1", "hidden_states/layer_2",
                 "hidden_states/layer_3"):
        edit_meta(huge_chunks, name, lambda m: (m["chunk_grid"]["configuration"].update(
            chunk_shape=[2 ** 27, *m["shape"][1:]]), m["codecs"][0]["configuration"].update(
            chunk_shape=[2 ** 27, *m["shape"][1:]]), m.update(shape=[2 ** 27, *m["shape"][1:]])))
    # a chunk whose blosc header claims 2 GiB, with a valid crc32c
    header = tmp_path / "header"
    shutil.copytree(cache_copy, header)
    f, off, n = chunk_span(header, "hidden_states/layer_2", 0)
    blob = bytearray(f.read_bytes())
    body = blob[off:off + n - 4]
    body[4:8] = (2 ** 31 - 64).to_bytes(4, "little")
    blob[off:off + n] = with_crc(bytes(body))
    f.write_bytes(bytes(blob))
    rebind(header, "hidden_states/layer_2", 0)  # as its writer would have recorded it: the header is what is wrong
    code = r"""
import resource, sys, tracemalloc
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from dspark_precompute import open_cache
from dspark_precompute.read.export import export_nemo
tracemalloc.start()
for path in sys.argv[1:]:
    try:
        c = open_cache(path)
        victims = [i for i in range(len(c)) if c.starts()[i] < 256]
        for i in victims:
            c[i]
        export_nemo(c, path + "-nemo")
        print(path, "READ", flush=True)
    except Exception as exc:
        print(path, type(exc).__name__, type(exc).__mro__[1].__name__, flush=True)
print("peak", tracemalloc.get_traced_memory()[1])
"""
    proc = subprocess.run([sys.executable, "-c", code, str(big), str(wide), str(huge_chunks), str(header)],
                          capture_output=True, text=True, timeout=300)
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    for path in (big, wide, huge_chunks):
        assert lines.get(str(path)) == "CacheFormatError DsparkError", proc.stdout + proc.stderr[-3000:]
    assert lines.get(str(header)) == "CacheFormatError DsparkError", proc.stdout + proc.stderr[-3000:]
    assert int(lines["peak"]) < 64 << 20, lines  # far below any crafted size: nothing was sized by them
