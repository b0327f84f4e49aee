"""What binding every shard to its place costs a reader: format 3 (this checkout) against format 2 (64995d8).

    python scripts/bench_binding.py                    # builds both caches under /tmp, 5 alternating repeats
    python scripts/bench_binding.py --repeats 7 --json binding.json

The same run (``scripts/conf/model/bench_read.yaml``: random Qwen3, hidden 1024, 3 captured
layers, Qwen3's tokenizer, over ``../shared/data/chat/mix.messages.jsonl`` at seq_length 1024)
is written twice: once by the release before format 3 (``--base``, its own code in a git
worktree on ``PYTHONPATH``, its own command line) and once by this checkout. Each measurement
is a fresh process running the code that wrote its cache, so each format is read by its own
reader: the page cache is warm (both caches are read once first), the two alternate repeat by
repeat (which goes first rotates) and the medians and the median of the paired ratios are
reported:

* ``open``: ``open_cache(path)`` then ``len``, ``--opens`` times in the process (the median);
* ``random``: ``--reads`` random single-sample reads ``c[i]`` of one open cache, every chunk
  decoded (``chunk_cache_bytes=0``: no reuse), the same indices for both.

Format 3's extra work is one small commit record per unit read on open (the shard digests) and,
per shard and chunk, a comparison of crc32c values the reader computes anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import benchlib
from benchlib import DEFAULT_DATA, REPO, log, model_overrides

BASE = "64995d8"  # main before format 3: format 2, no shard bound to its place

PROBE = r"""
import json, os, sys, time
import numpy as np
from dspark_precompute import open_cache
path, opens, reads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t = []
for _ in range(opens):
    t0 = time.perf_counter(); c = open_cache(path); len(c); t.append(time.perf_counter() - t0); c.close()
c = open_cache(path, chunk_cache_bytes=0)
idx = np.random.default_rng(0).integers(0, len(c), size=reads)
t0 = time.perf_counter()
for i in idx:
    c[int(i)]
r = time.perf_counter() - t0
print(json.dumps({"open_s": sorted(t)[len(t) // 2], "random_s": r, "format": c.manifest.format_version,
                  "samples": len(c)}))
"""


def build(tree: Path, path: Path, target: str, data: str, seq_length: int, rows: int | None) -> None:
    """The cache, written by the code in ``tree`` (its own ``python -m dspark_precompute``)."""
    if (path / "manifest.json").exists():
        return
    overrides = [*model_overrides(target), f"seq_length={seq_length}", f"storage.path={path}", "progress=false",
                 f"hydra.run.dir={path.parent / (path.name + '_hydra')}", "data=jsonl", f"data.path={data}"]
    if rows:
        overrides.append(f"data.max_samples={rows}")
    log(f"building {path} with {tree}")
    proc = subprocess.run([sys.executable, "-m", "dspark_precompute", *overrides], cwd=tree, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    if proc.returncode:
        raise SystemExit(f"building {path} failed:\n{proc.stderr[-3000:]}")


def probe(tree: Path, path: Path, opens: int, reads: int) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(path), str(opens), str(reads)], cwd=tree,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    if proc.returncode:
        raise SystemExit(f"reading {path} failed:\n{proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=BASE, help="the commit whose format 2 reader is the baseline")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dspark_bench_binding"))
    ap.add_argument("--target", default="bench_read")
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--seq-length", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--opens", type=int, default=9)
    ap.add_argument("--reads", type=int, default=1000)
    benchlib.output_args(ap, markdown=False)
    args = ap.parse_args()
    trees = {"format 2": benchlib.worktree(args.base), "format 3": REPO}
    caches = {name: args.dir / name.replace(" ", "") for name in trees}
    for name, tree in trees.items():
        build(tree, caches[name], args.target, args.data, args.seq_length, args.rows)
    for name, tree in trees.items():  # warm the page cache with both
        probe(tree, caches[name], 1, 50)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for rep in range(args.repeats):
        for name in benchlib.rotated(list(trees), rep):
            runs[name].append(probe(trees[name], caches[name], args.opens, args.reads))
            log(f"  {name}: open {runs[name][-1]['open_s'] * 1e3:.1f} ms, {args.reads} random reads "
                f"{runs[name][-1]['random_s']:.2f} s")
    out: dict[str, Any] = {"machine": benchlib.machine(), "base": args.base, "repeats": args.repeats,
                           "reads": args.reads, "opens": args.opens, "runs": runs}
    for key in ("open_s", "random_s"):
        out[key] = {name: statistics.median(r[key] for r in rs) for name, rs in runs.items()}
        out[f"{key}_ratio_paired"] = statistics.median(
            a[key] / b[key] for a, b in zip(runs["format 3"], runs["format 2"], strict=True))
    log(f"format 3 / format 2: open {out['open_s_ratio_paired']:.3f}, random reads {out['random_s_ratio_paired']:.3f}")
    benchlib.emit_json(args, out)


if __name__ == "__main__":
    main()
