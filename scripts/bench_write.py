#!/usr/bin/env python
"""Benchmark: how fast the writer turns unit buffers into a committed cache, per writer count and codec.

``python scripts/bench.py write-path --json out.json`` (or this file directly) feeds the tool's own
``UnitWriter`` unit buffers of bf16 activations shaped like a real target's (hidden 4096, five
arrays: four captured layers and the final norm; values drawn once, before any clock starts,
from a heavy-tailed per-channel distribution like a transformer's residual stream) as fast as it
takes them, and reports the sustained GB/s of raw hidden states from the first submit to the last
commit, for 1..N writer processes and each codec. Beside it, in the same run and on the same
chunks, the single-core encode speed of the codec alone (the codec limit: what one writer could
do if checksums, zarr and file writes cost nothing).

Repeats alternate writer counts and codecs (writers=1, 2, ..., then again) and medians are
reported, so a neighbour's load hits every configuration alike. JSON: ``results[codec][writers] =
{"gb_per_s": ...}``, ``codec_limit_gb_per_s[codec]``, and the ratios the goals name.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import emit_json, logger, output_args

from dspark_precompute.contract.commits import CommitRecord
from dspark_precompute.contract.layout import build_layout
from dspark_precompute.contract.spec import HIDDEN_GROUP
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.write.config.schema import StorageConfig
from dspark_precompute.write.parallel.processes import available_cores
from dspark_precompute.write.plan.array_specs import token_array_specs
from dspark_precompute.write.store.allocate import allocate
from dspark_precompute.write.store.writer import UnitWriter

log = logger("write-path")
CODECS = {  # name -> (compressor, level, shuffle)
    "blosc_zstd-1": ("blosc_zstd", 1, "byte"),
    "blosc_lz4-1": ("blosc_lz4", 1, "byte"),
    "zstd-1": ("zstd", 1, "byte"),
    "none": ("none", 0, "byte"),
}


def activations(tokens: int, hidden: int, seed: int = 0) -> np.ndarray:
    """bf16 bits of residual-stream-like values: per-channel scales spread over two decades, a few
    outlier channels 20-50x larger, Student-t tails within a channel (drawn once, not timed)."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.normal(0.0, 0.8, hidden)).astype(np.float32)
    outliers = rng.choice(hidden, max(1, hidden // 512), replace=False)
    scale[outliers] *= rng.uniform(20, 50, len(outliers))
    x = rng.standard_t(5, size=(tokens, hidden)).astype(np.float32) * scale
    bits = x.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even


def codec_limit(codec: str, chunk: np.ndarray, seconds: float) -> tuple[float, float]:
    """Single-core speed of the codec alone (no checksum, no zarr, no file) on one chunk, repeated:
    (GB per wall second, GB per CPU second)."""
    compressor, level, shuffle = CODECS[codec]
    if compressor == "none":
        return float("inf"), float("inf")
    import numcodecs
    from numcodecs import Blosc, Zstd

    if compressor == "zstd":
        enc: Any = Zstd(level=level)
    else:
        numcodecs.blosc.set_nthreads(1)
        enc = Blosc(cname=compressor.split("_", 1)[1], clevel=level, blocksize=1 << 20, typesize=2,
                    shuffle={"none": Blosc.NOSHUFFLE, "byte": Blosc.SHUFFLE, "bit": Blosc.BITSHUFFLE}[shuffle])
    buf = np.ascontiguousarray(chunk)
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        enc.encode(buf)
        n += 1
    return n * buf.nbytes / (time.perf_counter() - t0) / 1e9, n * buf.nbytes / (time.process_time() - c0) / 1e9


def write_once(workdir: Path, codec: str, writers: int, data: np.ndarray, units: int, chunk: int,
               unit_tokens: int, slots: int, fsync: bool = True) -> dict[str, float]:
    """One fresh cache of ``units`` full units written by ``writers`` processes; GB/s of hidden states."""
    compressor, level, shuffle = CODECS[codec]
    hidden = data.shape[1]
    specs = token_array_specs([2, 8, 14, 20], 24, hidden, "bf16")  # 4 layers + the final norm: 5 arrays
    lengths = np.full(units * (unit_tokens // 512), 512, dtype=np.int64)
    layout = build_layout(lengths, chunk, unit_tokens)
    path = workdir / f"{codec}-w{writers}"
    shutil.rmtree(path, ignore_errors=True)
    store = CacheStore(str(path))
    storage = StorageConfig(path=str(path), compressor=compressor, compression_level=level, shuffle=shuffle,
                            writer_slots=slots, fsync=fsync)
    allocate(store, specs, layout, storage, {"samples/start": layout.start, "samples/length": layout.length}, {})
    w = UnitWriter(store, specs, layout, storage, writers=writers)
    try:
        for s in range(len(w.slots)):  # fill every buffer once: the clock times the writer, not the feeding
            bufs = w.buffers(s)  # the hidden arrays only: ids and masks are written before the first forward
            for buf in bufs.values():
                buf[:] = data[:len(buf)]
        hidden_row = sum(s.row_bytes for s in specs if s.width)
        t0 = time.perf_counter()
        for u in range(layout.num_units):
            slot = w.acquire()
            n = int(layout.unit_stop[u] - layout.unit_start[u])
            w.submit(u, slot, n, CommitRecord(u, int(layout.unit_start[u]), int(layout.unit_stop[u]),
                                              len(layout.unit_order[u])))
        w.drain()
        wall = time.perf_counter() - t0
        cpu = sum(_cpu_seconds(p.pid) for p in w.procs)  # the writers' own CPU: robust to a busy machine
    finally:
        w.close()
    raw = layout.total_slots * hidden_row
    stored = sum(f.stat().st_size for f in (path / HIDDEN_GROUP).rglob("*") if f.is_file())
    shutil.rmtree(path, ignore_errors=True)
    return {"gb_per_s": raw / wall / 1e9, "wall_s": wall, "raw_bytes": raw, "ratio": raw / max(stored, 1),
            "writer_cpu_s": cpu, "gb_per_cpu_s": raw / max(cpu, 1e-9) / 1e9}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (/proc/PID/stat), 0 where /proc is not there."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.py write-path", description=__doc__.split("\n\n")[0])
    p.add_argument("--codecs", default="blosc_zstd-1,blosc_lz4-1,zstd-1,none", help=f"comma list of {list(CODECS)}")
    p.add_argument("--writers", default=None, help="comma list of writer counts (default 1..cores)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--gib", type=float, default=1.0, help="GiB of raw hidden states written per measurement")
    p.add_argument("--chunk-tokens", type=int, default=128, help="128 x 4096 bf16 = 1 MiB chunks, the default")
    p.add_argument("--unit-tokens", type=int, default=4096)
    p.add_argument("--slots", type=int, default=2, help="unit buffers in flight (storage.writer_slots)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--limit-seconds", type=float, default=2.0)
    p.add_argument("--workdir", type=Path, default=None,
                   help="where the caches go (default: a temp dir on /dev/shm, else /tmp); a disk's path to include it")
    p.add_argument("--fsync", choices=("on", "off", "both"), default="on",
                   help="storage.fsync of the writers; 'both' alternates on and off in the same run and reports what "
                        "fsync costs (give --workdir on a disk: fsync does nothing on tmpfs)")
    output_args(p, markdown=False)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    codecs = [c for c in args.codecs.split(",") if c]
    for c in codecs:
        if c not in CODECS:
            raise SystemExit(f"--codecs: {c!r} is not one of {list(CODECS)}")
    cores = available_cores()
    writers = [int(x) for x in args.writers.split(",")] if args.writers else list(range(1, max(cores, 2) + 1))
    hidden_row = 5 * args.hidden * 2
    units = max(1, round(args.gib * (1 << 30) / (args.unit_tokens * hidden_row)))
    data = activations(args.unit_tokens, args.hidden)
    own = args.workdir is None
    # tmpfs by default: this measures the host's CPU path (copies, compression, checksums, file writes);
    # a disk's own bandwidth is the user's to add (--workdir on it measures both)
    shm = Path("/dev/shm")
    base = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    workdir = Path(tempfile.mkdtemp(prefix="dspark-write-bench-", dir=base)) if own else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    fsyncs = {"on": [True], "off": [False], "both": [True, False]}[args.fsync]
    if args.fsync == "both" and own and base is not None:
        log("--fsync both on tmpfs measures nothing (fsync is a no-op there): pass --workdir on a disk")
    runs: dict[bool, dict[str, dict[int, list[dict[str, float]]]]] = {
        f: {c: {w: [] for w in writers} for c in codecs} for f in fsyncs}
    limits: dict[str, list[float]] = {c: [] for c in codecs}
    limits_cpu: dict[str, list[float]] = {c: [] for c in codecs}
    chunk = data[:args.chunk_tokens]
    try:
        for r in range(args.repeats):
            for c in codecs:
                wall_limit, cpu_limit = codec_limit(c, chunk, args.limit_seconds)
                limits[c].append(wall_limit)
                limits_cpu[c].append(cpu_limit)
                for w in (writers if r % 2 == 0 else writers[::-1]):
                    for f in (fsyncs if (r + w) % 2 == 0 else fsyncs[::-1]):  # alternate which goes first
                        res = write_once(workdir, c, w, data, units, args.chunk_tokens, args.unit_tokens, args.slots,
                                         fsync=f)
                        runs[f][c][w].append(res)
                        log(f"repeat {r} {c} writers={w} fsync={f}: {res['gb_per_s']:.3f} GB/s, "
                            f"{res['gb_per_cpu_s']:.3f} GB per writer CPU-s (ratio {res['ratio']:.2f}); "
                            f"codec limit {limits[c][-1]:.3f} GB/s")
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    def summarise(rs: dict[str, dict[int, list[dict[str, float]]]]) -> dict[str, dict[str, dict[str, Any]]]:
        return {c: {str(w): {"gb_per_s": statistics.median(x["gb_per_s"] for x in rs[c][w]),
                             "all_gb_per_s": [x["gb_per_s"] for x in rs[c][w]],
                             "gb_per_cpu_s": statistics.median(x["gb_per_cpu_s"] for x in rs[c][w]),
                             "compression_ratio": rs[c][w][0]["ratio"]} for w in writers} for c in codecs}

    results = summarise(runs[fsyncs[0]])  # fsync on unless --fsync off
    fsync_cost: dict[str, dict[str, Any]] = {}
    if len(fsyncs) == 2:  # each repeat's pair (same repeat, back to back), then the median
        for c in codecs:
            fsync_cost[c] = {}
            for w in writers:
                on, off = runs[True][c][w], runs[False][c][w]
                pairs = [b["gb_per_s"] / a["gb_per_s"] for a, b in zip(on, off)]
                fsync_cost[c][str(w)] = {
                    "fsync_on_gb_per_s": statistics.median(x["gb_per_s"] for x in on),
                    "fsync_off_gb_per_s": statistics.median(x["gb_per_s"] for x in off),
                    "off_over_on_paired": statistics.median(pairs), "off_over_on_per_repeat": pairs}
    limit = {c: statistics.median(limits[c]) for c in codecs}
    limit_cpu = {c: statistics.median(limits_cpu[c]) for c in codecs}
    ratios: dict[str, dict[str, float]] = {}
    for c in codecs:
        one = results[c]["1"]["gb_per_s"] if "1" in results[c] else None
        ratios[c] = {}
        if one:
            for w in writers:
                ratios[c][f"writers_{w}_vs_1"] = results[c][str(w)]["gb_per_s"] / one
            if np.isfinite(limit[c]):
                ratios[c]["one_writer_vs_codec_limit"] = one / limit[c]
                # the same per CPU second of the writer: what it costs beyond the codec, load or not
                ratios[c]["writer_cpu_vs_codec_limit_cpu"] = results[c]["1"]["gb_per_cpu_s"] / limit_cpu[c]
    out = {
        "command": " ".join(["python", *sys.argv]),
        "machine": {"cores": cores, "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
                    "workdir": str(workdir)},
        "shape": {"hidden": args.hidden, "arrays": 5, "dtype": "bf16", "chunk_tokens": args.chunk_tokens,
                  "unit_tokens": args.unit_tokens, "units": units, "raw_gib": units * args.unit_tokens * hidden_row
                  / (1 << 30), "writer_slots": args.slots},
        "repeats": args.repeats,
        "results": results,
        "codec_limit_gb_per_s": {c: (v if np.isfinite(v) else None) for c, v in limit.items()},
        "codec_limit_gb_per_cpu_s": {c: (v if np.isfinite(v) else None) for c, v in limit_cpu.items()},
        "ratios": ratios,
        "fsync": args.fsync,
        "fsync_cost": fsync_cost,
    }
    emit_json(args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
