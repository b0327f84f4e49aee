#!/usr/bin/env python
"""Benchmark: the tool's tokenization (``tokenize``) in one process vs ``data.num_workers`` processes.

``python scripts/bench.py tokenize --json out.json`` builds a JSONL of the shared chat mix
repeated ``--factor`` times (so the pool has rows past the first 2,000 that are always
tokenized in-process), plans a run with Qwen3's real tokenizer and template, and times the
run's own tokenization with ``data.num_workers=0`` and with each count in ``--workers``,
alternating, medians reported. The results must be identical (checked: every sample's ids
and mask, every reject).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import REPO, emit_json, logger, output_args

SHARED = REPO.parent / "shared" / "data"
log = logger("tokenize")


def make_data(src: Path, factor: int, out: Path) -> int:
    lines = [ln for ln in src.read_text(encoding="utf-8").splitlines() if ln.strip()]
    out.write_text("\n".join(lines * factor) + "\n", encoding="utf-8")
    return len(lines) * factor


def run_once(data: Path, workers: int, tokenizer: Path, seq: int) -> tuple[float, Any]:
    from dspark_precompute.write.config.compose import compose
    from dspark_precompute.write.plan.prepare import prepare
    from dspark_precompute.write.samples.tokenize import tokenize

    cfg = compose(["data=jsonl", f"data.path={data}", f"model.tokenizer={tokenizer}", f"seq_length={seq}",
                   f"data.num_workers={workers}", "progress=false", "log_level=WARNING",
                   f"storage.path={data.parent / 'unused-cache'}"])
    plan = prepare(cfg)
    t0 = time.perf_counter()
    tok = tokenize(plan.encoding, plan.cfg.data)
    return time.perf_counter() - t0, tok


def same(a: Any, b: Any) -> bool:
    if len(a.lengths) != len(b.lengths) or [r.row for r in a.rejects] != [r.row for r in b.rejects]:
        return False
    return all(np.array_equal(a.encoded[i].input_ids, b.encoded[i].input_ids)
               and np.array_equal(a.encoded[i].loss_mask, b.encoded[i].loss_mask) for i in range(len(a.lengths)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.py tokenize", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=SHARED / "chat" / "mix.messages.jsonl")
    p.add_argument("--tokenizer", type=Path, default=SHARED / "tokenizers" / "qwen3")
    p.add_argument("--factor", type=int, default=4, help="copies of the data file (4 x 1,349 rows for the mix)")
    p.add_argument("--workers", default=None, help="comma list of worker counts (default: the cores)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    output_args(p, markdown=False)
    args = p.parse_args(argv)
    from dspark_precompute.write.parallel.processes import available_cores

    counts = [int(x) for x in args.workers.split(",")] if args.workers else [max(2, available_cores())]
    with tempfile.TemporaryDirectory(prefix="dspark-tok-bench-") as tmp:
        data = Path(tmp) / "data.jsonl"
        rows = make_data(args.data, args.factor, data)
        walls: dict[int, list[float]] = {n: [] for n in [0, *counts]}
        reference = None
        for r in range(args.repeats):
            for n in ([0, *counts] if r % 2 == 0 else [*counts, 0]):
                wall, tok = run_once(data, n, args.tokenizer, args.seq)
                if reference is None:
                    reference = tok
                elif not same(reference, tok):
                    raise SystemExit(f"data.num_workers={n} gave other samples than data.num_workers=0")
                walls[n].append(wall)
                log(f"repeat {r} workers={n}: {wall:.2f} s ({rows / wall:,.0f} rows/s)")
    med = {n: statistics.median(v) for n, v in walls.items()}
    out = {"command": " ".join(["python", *sys.argv]), "rows": rows, "seq_length": args.seq,
           "machine": {"cores": available_cores(), "load_average": os.getloadavg()},
           "wall_s": {str(n): v for n, v in med.items()}, "all_wall_s": {str(n): v for n, v in walls.items()},
           "rows_per_s": {str(n): rows / v for n, v in med.items()},
           "speedup_vs_one_process": {str(n): med[0] / med[n] for n in counts}, "identical": True}
    emit_json(args, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
