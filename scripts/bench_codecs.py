#!/usr/bin/env python
"""Compression ratio and codec speed of each storage setting on the same captured states.

The dry run's size estimates (``write/dryrun.py`` COMPRESSION_RATIOS) and the default codec
come from here. Two caches of the same rows are written uncompressed (random Qwen3
``bench_mid``, hidden 512, 12 layers, 3 captured layers, the first 48 rows of the shared chat
mix at seq 512): one in fp32 (its states cast to bf16, fp16 and fp32) and one in fp8_e4m3
(its bits and float32 scales). Every array is then re-encoded chunk by chunk, in the chunks
the writer would use (``auto_chunk_tokens``), with the writer's own chain
(``contract.arrays.chunk_encoder``) under each compressor and shuffle, on one core. Reported per
setting and kind: the ratio (raw / stored bytes, crc32c included), and for bf16 the encode and
decode speed (raw GB/s, median of 3).

Usage::

    python scripts/bench_codecs.py                 # about a minute on 2 CPU cores
    python scripts/bench_codecs.py --json codecs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import benchlib
import numpy as np
from benchlib import DEFAULT_DATA, log

SETTINGS = [("blosc_lz4hc", "byte"), ("blosc_lz4hc", "bit"), ("blosc_lz4hc", "none"), ("blosc_zstd", "byte"),
            ("blosc_zstd", "bit"), ("blosc_zstd", "none"), ("blosc_lz4", "byte"), ("blosc_lz4", "bit"),
            ("blosc_lz4", "none"), ("zstd", "none")]


def arrays(cache: Path, dtype: str) -> dict[str, np.ndarray]:
    """Every token array of ``cache`` over its real token slots, as stored, keyed by kind."""
    from dspark_precompute import open_cache

    c = open_cache(cache)
    spans = c.chunks.unit_spans()
    out: dict[str, list[np.ndarray]] = {}
    for name in c.chunks.token_arrays:
        kind = name if name in ("input_ids", "loss_mask") else "fp8_scale" if "scale" in name else dtype
        if name == "position_ids":
            continue
        for a, b in spans:
            out.setdefault(kind, []).append(c.chunks.read([name], a, b)[name])
    c.close()
    return {k: np.concatenate(v) for k, v in out.items()}


def measure(data: np.ndarray, compressor: str, shuffle: str, level: int, timed: bool) -> dict[str, float]:
    import numcodecs

    from dspark_precompute.contract.arrays import chunk_encoder, codec_chain
    from dspark_precompute.contract.spec import auto_chunk_tokens

    width = int(np.prod(data.shape[1:], dtype=np.int64)) if data.ndim > 1 else 1
    ct = auto_chunk_tokens(max(1, width), data.dtype.itemsize)
    pieces = [np.ascontiguousarray(data[i:i + ct]) for i in range(0, len(data), ct)]
    encode = chunk_encoder(compressor, level, shuffle, data.dtype.itemsize)
    times, stored = [], []
    for _ in range(3 if timed else 1):
        t = time.perf_counter()
        stored = [encode(p) for p in pieces]
        times.append(time.perf_counter() - t)
    raw = sum(p.nbytes for p in pieces)
    out = {"ratio": raw / sum(len(memoryview(body).cast("B")) + len(crc) for body, crc in stored),
           "chunk_tokens": ct}
    if timed:
        spec = codec_chain(compressor, level, shuffle, data.dtype.itemsize)[0].to_dict()
        codec = numcodecs.Blosc() if spec["name"] == "blosc" else numcodecs.Zstd()
        buf = np.empty(pieces[0].nbytes, dtype=np.uint8)
        dec = []
        for _ in range(3):
            t = time.perf_counter()
            for body, _crc in stored:
                codec.decode(body, out=buf[:len(buf)])
            dec.append(time.perf_counter() - t)
        out["encode_GBps"] = raw / statistics.median(times) / 1e9
        out["decode_GBps"] = raw / statistics.median(dec) / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="bench_mid")
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--seq-length", type=int, default=512)
    ap.add_argument("--level", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    import numcodecs.blosc

    numcodecs.blosc.use_threads = False  # one core, as a DataLoader worker decodes
    tmp = Path(tempfile.mkdtemp(prefix="dspark-codecs-"))
    layers = ["model.layer_ids=[1,6,11]"] if args.target == "bench_mid" else []
    kinds: dict[str, np.ndarray] = {}
    for dtype in ("fp32", "fp8_e4m3"):
        path = tmp / dtype
        benchlib.build_cache(path, args.target, str(DEFAULT_DATA), args.seq_length, args.rows,
                             extra=[f"storage.dtype={dtype}", "storage.last_dtype=" + dtype if dtype == "fp32" else
                                    "storage.last_dtype=fp8_e4m3", "storage.compressor=none", *layers])
        kinds.update(arrays(path, dtype))
    f32 = kinds.pop("fp32")
    from dspark_precompute.contract.fp8 import float32_to_bf16_bits

    kinds.update({"bf16": float32_to_bf16_bits(f32), "fp16": f32.astype(np.float16), "fp32": f32})
    results = []
    for compressor, shuffle in SETTINGS:
        row: dict[str, object] = {"compressor": compressor, "shuffle": shuffle}
        for kind, data in kinds.items():
            if kind in ("fp8_e4m3",) and shuffle == "byte":
                continue  # the writer gives fp8 bits storage.fp8_shuffle (byte shuffle does nothing to one byte)
            got = measure(data, compressor, shuffle, args.level, timed=kind == "bf16")
            row[kind] = round(got["ratio"], 2)
            if kind == "bf16":
                row.update(bf16_chunk_tokens=got["chunk_tokens"], encode_GBps=round(got["encode_GBps"], 2),
                           decode_GBps=round(got["decode_GBps"], 2))
        results.append(row)
        log(json.dumps(row))
    sys.stdout.write("| compressor | shuffle | bf16 | fp16 | fp32 | input_ids | loss_mask | fp8_e4m3 | fp8 scale | "
                     "bf16 encode GB/s | bf16 decode GB/s |\n|---|---|" + "---:|" * 9 + "\n")
    for r in results:
        sys.stdout.write(f"| {r['compressor']} | {r['shuffle']} | " + " | ".join(
            str(r.get(k, "")) for k in ("bf16", "fp16", "fp32", "input_ids", "loss_mask", "fp8_e4m3", "fp8_scale",
                                        "encode_GBps", "decode_GBps")) + " |\n")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
