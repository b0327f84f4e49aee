#!/usr/bin/env python
"""Benchmark: peak disk of a cache written through a window against the full cache, and the trainer's speed while
the producer runs.

``python scripts/bench_window.py`` writes ``--rows`` synthetic chat rows (benchlib's ``synthetic_rows``), then:

* the full cache: ``python -m dspark_precompute`` (``bench_tiny``: random Qwen3, hidden 64, with Qwen3's real
  tokenizer; ``--seq`` tokens, short rows to keep it quick) with ``storage.unit_tokens=--unit-tokens``;
* the same command with ``storage.window_units=--window`` and, at the same time, a trainer in this process
  (``build_dataloader(path, stream=True, batch_size=--batch)``, ``state_dict()`` after every batch, as a
  trainer checkpointing each step would).

Both runs' disk use is sampled every 0.05 s by a thread of this process (every file under the cache, and the
hidden-state shards alone); the peak is compared with ``(window + 1)`` times the full cache's largest unit of
hidden states on disk (the goal). The trainer's throughput is its samples and tokens per second of its own
time (waits for the producer taken out) and of the wall time (bounded by the producer).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchlib import (
    DEFAULT_DATA,
    load_average,
    logger,
    machine,
    md_table,
    median,
    model_overrides,
    output_args,
    rotated,
    save,
    synthetic_rows,
)

log = logger("window")


class DiskPeak:
    """The peak bytes under a cache (all files, and the hidden-state shards alone), sampled in a thread."""

    def __init__(self, path: Path, every_s: float = 0.05):
        self.path, self.every_s = path, every_s
        self.total = self.hidden = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> tuple[int, int]:
        total = hidden = 0
        for root, _dirs, files in os.walk(self.path):
            for f in files:
                try:
                    n = os.stat(os.path.join(root, f)).st_size
                except FileNotFoundError:  # deleted by a release while we walk
                    continue
                total += n
                hidden += n if "hidden_states" in root and f.startswith("c.") else 0
        return total, hidden

    def _run(self) -> None:
        while not self._stop.is_set():
            t, h = self.sample()
            self.total, self.hidden = max(self.total, t), max(self.hidden, h)
            time.sleep(self.every_s)

    def __enter__(self) -> DiskPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        t, h = self.sample()
        self.total, self.hidden = max(self.total, t), max(self.hidden, h)


def command(args: argparse.Namespace, data: Path, cache: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "dspark_precompute", *model_overrides(args.target), "data=jsonl",
            f"data.path={data}", f"seq_length={args.seq}", f"storage.path={cache}", "progress=false",
            f"storage.unit_tokens={args.unit_tokens}", "storage.chunk_tokens=4096", f"hydra.run.dir={cache}.hydra",
            *args.set, *extra]


def full_run(args: argparse.Namespace, data: Path, work: Path, rep: int = 0) -> dict[str, Any]:
    cache = work / f"full-r{rep}"
    t0 = time.perf_counter()
    with DiskPeak(cache) as peak:
        subprocess.run(command(args, data, cache, []), check=True)
    m = json.loads((cache / "manifest.json").read_text())
    units = sorted((cache / "hidden_states").rglob("c.*"))
    per_unit: dict[str, int] = {}
    for f in units:
        u = f.name.split(".")[1]
        per_unit[u] = per_unit.get(u, 0) + f.stat().st_size
    return {"wall_s": time.perf_counter() - t0, "peak_bytes": peak.total, "peak_hidden_bytes": peak.hidden,
            "num_units": m["layout"]["num_units"], "samples": m["counts"]["samples"],
            "tokens": m["counts"]["tokens"], "largest_unit_bytes": max(per_unit.values()),
            "mean_unit_bytes": sum(per_unit.values()) / len(per_unit)}


def window_run(args: argparse.Namespace, data: Path, work: Path, step_s: float, rep: int = 0) -> dict[str, Any]:
    from dspark_precompute.read.training import build_dataloader

    cache = work / f"win-{step_s}-r{rep}"
    t0 = time.perf_counter()
    with DiskPeak(cache) as peak:
        producer = subprocess.Popen(command(args, data, cache, [f"storage.window_units={args.window}",
                                                                "log_level=INFO"]),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            loader = build_dataloader(str(cache), stream=True, batch_size=args.batch, seed=0, poll_s=0.02,
                                      wait_timeout_s=600)
            samples = tokens = 0
            t_train = time.perf_counter()
            for b in loader:
                samples += len(b["input_ids"])
                tokens += int(b["attention_mask"].sum())
                loader.state_dict()
                if step_s:
                    time.sleep(step_s)  # a training step (simulated: this trainer is slower than the producer)
            train_wall = time.perf_counter() - t_train
            loader.close()
            out, _ = producer.communicate(timeout=600)
        finally:
            producer.kill()
    if producer.returncode != 0:
        raise SystemExit(f"the windowed producer failed:\n{out[-4000:]}")
    waits = out.count("waits until the trainer releases unit")
    own = max(1e-9, train_wall - loader.wait_s - step_s * -(-samples // args.batch))
    return {"step_s": step_s, "wall_s": time.perf_counter() - t0, "peak_bytes": peak.total,
            "peak_hidden_bytes": peak.hidden, "trainer_samples": samples, "trainer_tokens": tokens,
            "trainer_wall_s": train_wall,
            "trainer_wait_s": loader.wait_s, "trainer_tokens_per_s_own": tokens / own,
            "trainer_tokens_per_s_wall": tokens / train_wall, "producer_waits_logged": waits}


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each numeric field's median over the repeats (the others as the first run has them)."""
    out: dict[str, Any] = {}
    for k, v in runs[0].items():
        m = median([r[k] for r in runs]) if isinstance(v, int | float) else v
        out[k] = round(m) if isinstance(v, int) else m  # counts stay counts
    return out


def spread(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    """The range over the repeats of what the table gives as medians (peaks and the trainer's speed)."""
    if args.repeats < 2:
        return ""
    mb, lines = 1e6, []
    for step in (0.0, args.step_s):
        rs = runs[str(step)]
        peak = sorted(r["peak_hidden_bytes"] / mb for r in rs)
        wall = sorted(r["trainer_tokens_per_s_wall"] for r in rs)
        lines.append(f"step {step} s: peak hidden-state shards {peak[0]:.1f}-{peak[-1]:.1f} MB, trainer "
                     f"{wall[0]:,.0f}-{wall[-1]:,.0f} tokens/s of wall time")
    return (f"\n\nMedians of {args.repeats} repeats, the three runs alternating in order; ranges: "
            + "; ".join(lines) + ".")


def markdown(r: dict[str, Any]) -> str:
    f, wins, a = r["full"], r["windows"], r["args"]
    goal = (a["window"] + 1) * f["largest_unit_bytes"]
    mb = 1e6
    head = ["", "full cache", *(f"window of {a['window']}, trainer step {w['step_s']} s" for w in wins)]
    rows = [["peak disk, whole cache", f"{f['peak_bytes'] / mb:,.1f} MB", *(f"{w['peak_bytes'] / mb:,.1f} MB"
                                                                          for w in wins)],
            ["peak disk, hidden-state shards", f"{f['peak_hidden_bytes'] / mb:,.1f} MB",
             *(f"{w['peak_hidden_bytes'] / mb:,.1f} MB ({w['peak_hidden_bytes'] / goal:.2f} of the goal)"
               for w in wins)],
            ["wall time", f"{f['wall_s']:.0f} s", *(f"{w['wall_s']:.0f} s" for w in wins)],
            ["producer waited for the trainer (log lines)", "-", *(str(w["producer_waits_logged"]) for w in wins)],
            ["trainer tokens/s, its own time (waits and steps out)", "-",
             *(f"{w['trainer_tokens_per_s_own']:,.0f}" for w in wins)],
            ["trainer tokens/s, wall time", "-", *(f"{w['trainer_tokens_per_s_wall']:,.0f}" for w in wins)],
            ["trainer seconds waiting for the producer", "-",
             *(f"{w['trainer_wait_s']:.0f} of {w['trainer_wall_s']:.0f}" for w in wins)]]
    out = "\n".join(md_table(head, rows))
    ok = all(w["peak_hidden_bytes"] <= goal for w in wins)
    return out + (f"\n\n{f['num_units']} units, {f['samples']:,} samples, {f['tokens']:,} tokens; largest unit "
                  f"{f['largest_unit_bytes'] / mb:.1f} MB of hidden states on disk (mean "
                  f"{f['mean_unit_bytes'] / mb:.1f} MB). Goal: peak hidden-state shards <= (window + 1) x largest "
                  f"unit = {goal / mb:.1f} MB: **{'met' if ok else 'missed'}**.")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--seq", type=int, default=128, help="seq_length (short rows keep it quick)")
    p.add_argument("--unit-tokens", type=int, default=65_536)
    p.add_argument("--window", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--step-s", type=float, default=0.1, help="the slow trainer's simulated step (second window run)")
    p.add_argument("--target", default="bench_tiny")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA if DEFAULT_DATA.exists() else None)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--set", nargs="*", default=[], help="more overrides of both runs (e.g. model.tokenizer=...)")
    p.add_argument("--repeats", type=int, default=1, help="repeats of the three runs, alternating their order")
    output_args(p)
    args = p.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-window-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "rows.jsonl"
    synthetic_rows(args.data, args.rows, data)
    load0 = load_average()
    cases = ["full", 0.0, args.step_s]
    runs: dict[str, list[dict[str, Any]]] = {str(c): [] for c in cases}
    for rep in range(args.repeats):
        for case in rotated(cases, rep):  # alternating order: a drifting load hits every case alike
            if case == "full":
                log(f"repeat {rep + 1}: full cache of {args.rows} rows")
                runs["full"].append(full_run(args, data, work, rep))
            else:
                log(f"repeat {rep + 1}: window of {args.window} units, trainer beside it (step {case} s)")
                runs[str(case)].append(window_run(args, data, work, float(case), rep))
    full = medians(runs["full"])
    wins = [medians(runs[str(step)]) for step in (0.0, args.step_s)]
    results = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(),
               "load_average": [load0, load_average()], "args": {k: str(v) if isinstance(v, Path) else v
                                                               for k, v in vars(args).items()},
               "full": full, "windows": wins, "runs": runs}
    md = markdown(results) + spread(runs, args)
    print(md)
    save(args, results, md)


if __name__ == "__main__":
    main()
