"""Reader throughput: our zarr cache vs the exported NeMo shards, measured in the same run.

    python scripts/bench_reader.py                      # builds a bench_mid cache + export under /tmp
    python scripts/bench_reader.py --cache PATH [--nemo OUT] [--repeats 5] [--random 200]

Reports, as medians of ``--repeats`` runs on a warm page cache:

* random access: samples/s reading ``--random`` seeded random samples (all layers + last),
  ours with no chunk reuse (``chunk_cache_bytes=0``, the worst case of a huge cache) and
  with the default chunk cache; NeMo the way ``CachedDSparkDataset`` reads
  (``safe_open(shard).get_slice(key)[row]`` for its five keys);
* sequential: every sample in index order, as MB/s of *useful* payload (real tokens:
  int64 ids + int64 mask + hidden states), the same bytes for both formats; NeMo also
  as raw MB/s including the padding it reads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
NEMO_KEYS = ("input_ids", "attention_mask", "loss_mask", "target_hidden_states", "target_last_hidden_states")


def build_cache(path: Path) -> None:
    cmd = [sys.executable, "-m", "dspark_precompute", "model=bench_mid", f"storage.path={path}", "progress=false",
           "log_level=WARNING", f"hydra.run.dir={path.parent / 'hydra'}"]  # Hydra's record stays out of the repo
    sys.stderr.write(f"building the benchmark cache: {' '.join(cmd)}\n")
    subprocess.run(cmd, cwd=REPO, check=True)


class Nemo:
    """NeMo's CachedDSparkDataset read path (handles kept open, one get_slice per key)."""

    def __init__(self, d: Path):
        from safetensors import safe_open

        m = json.loads((d / "manifest.json").read_text())
        self.n, self.shard_size = int(m["num_samples"]), int(m["shard_size"])
        shards = -(-self.n // self.shard_size)
        self.h = [safe_open(str(d / f"shard-{k:06d}.safetensors"), framework="pt") for k in range(shards)]

    def __getitem__(self, i: int):
        h = self.h[i // self.shard_size]
        return {k: h.get_slice(k)[i % self.shard_size] for k in NEMO_KEYS}


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", type=Path, default=Path("/tmp/dspark_bench/cache"))
    ap.add_argument("--nemo", type=Path, default=None, help="an export of --cache (default: made next to it)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--random", type=int, default=200, help="random samples per repeat")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from dspark_precompute import open_cache
    from dspark_precompute.read.export import export_nemo

    if not (args.cache / "manifest.json").exists():
        build_cache(args.cache)
    nemo_dir = args.nemo or args.cache.with_name(args.cache.name + "_nemo")
    if not (nemo_dir / "manifest.json").exists():
        t0 = time.perf_counter()
        r = export_nemo(args.cache, nemo_dir, overwrite=True)
        sys.stderr.write(f"exported {r.num_samples} samples ({r.bytes_written / 1e6:.0f} MB) in "
                         f"{time.perf_counter() - t0:.1f}s\n")
    c = open_cache(args.cache)
    n = len(c)
    lengths = c.lengths().astype(np.int64)
    itemsize = {"bf16": 2, "fp16": 2, "fp32": 4}[c.storage_dtype]
    per_token = 8 + 8 + (len(c.layer_ids) + 1) * c.hidden_size * itemsize  # ids, mask, hidden, last
    useful = int(lengths.sum()) * per_token
    S = c.seq_length
    nemo_raw = n * S * (3 * 8 + (len(c.layer_ids) + 1) * c.hidden_size * itemsize)
    rng = np.random.default_rng(args.seed)
    picks = rng.integers(0, n, size=args.random)
    nemo = Nemo(nemo_dir)

    def read_all(get, order):
        for i in order:
            get(int(i))

    cold = open_cache(args.cache, chunk_cache_bytes=0)
    results = {}
    for label, getter in (("ours (no chunk reuse)", cold.sample), ("ours (default chunk cache)", c.sample),
                          ("nemo shards", nemo.__getitem__)):
        read_all(getter, picks[:5])  # warm handles and the page cache
        results[(label, "random")] = args.random / median_time(lambda g=getter: read_all(g, picks), args.repeats)
    seq_ours = median_time(lambda: read_all(c.sample, range(n)), args.repeats)
    seq_nemo = median_time(lambda: read_all(nemo.__getitem__, range(n)), args.repeats)
    disk_order = np.argsort(c.starts(), kind="stable")
    seq_ours_disk = median_time(lambda: read_all(c.sample, disk_order), args.repeats)

    s = c.summary()
    nemo_bytes = sum(p.stat().st_size for p in nemo_dir.glob("shard-*.safetensors"))
    token_bytes = s["token_bytes_on_disk"]
    out = [
        f"cache {args.cache}: {n} samples, {int(lengths.sum()):,} tokens (mean {lengths.mean():.0f}, seq_length {S}), "
        f"layers {c.layer_ids} x {c.hidden_size}, {c.storage_dtype}",
        f"on disk: zarr token arrays {token_bytes / 1e6:.1f} MB vs NeMo shards {nemo_bytes / 1e6:.1f} MB "
        f"({nemo_bytes / token_bytes:.1f}x); useful payload {useful / 1e6:.1f} MB",
        f"medians of {args.repeats} repeats, warm page cache, {args.random} random samples per repeat",
        "",
        "| reader | random access (samples/s) | sequential (useful MB/s) | sequential (samples/s) |",
        "|---|---:|---:|---:|",
        f"| ours, no chunk reuse | {results[('ours (no chunk reuse)', 'random')]:.0f} | | |",
        f"| ours, default chunk cache | {results[('ours (default chunk cache)', 'random')]:.0f} | "
        f"{useful / seq_ours / 1e6:.0f} (index order), {useful / seq_ours_disk / 1e6:.0f} (disk order) | "
        f"{n / seq_ours:.0f} |",
        f"| NeMo shards (safetensors) | {results[('nemo shards', 'random')]:.0f} | {useful / seq_nemo / 1e6:.0f} "
        f"(raw incl. padding {nemo_raw / seq_nemo / 1e6:.0f}) | {n / seq_nemo:.0f} |",
    ]
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
