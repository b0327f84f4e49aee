#!/usr/bin/env python
"""Benchmark: the whole command at 10,000 and 100,000 rows side by side, and whether every cost grows at most linearly.

``python scripts/bench.py scale`` (or this file) writes ``N`` synthetic chat rows for each
``--rows`` size (the shared chat mix cycled, every copy made distinct by its row number woven
into its first user message, so every row is tokenized for real), then for each size:

* a fresh run of ``python -m dspark_precompute`` (``bench_tiny``: random Qwen3, hidden 64, with
  Qwen3's real tokenizer), in its own process group: wall time, its own tokenization time
  (the manifest's ``timing``), time to first commit (process start until the first
  ``commits/u*.json`` appears, watched from this process), peak memory of the whole process
  tree (psutil, every 0.1 s: PSS and the RSS sum);
* the files and directories of the finished cache (``os.walk``; the contract's
  ``inventory()`` next to it), and per TB of raw hidden states;
* a second fresh run killed with SIGKILL (the whole process group) once half of its units are
  committed, then the same command again: the resume's time to its first commit that did not
  exist before the kill;

then, alternating the sizes repeat by repeat (medians): ``open_cache`` time, 2,000 random
sample reads, ``dspark-cache verify``. Each cost's ratio between the largest and the smallest
size must stay within 1.1 x the ratio of their rows (10x rows: <= 11x); the resume's time to
its first new commit must be at most 25% of a fresh run's time to its first commit. With
``--fsync-repeats R`` it also runs ``R`` pairs of fresh runs of ``--fsync-rows`` rows with
``storage.fsync=true`` and ``false`` alternating (the cost of fsync end to end), and it always
prints the README's capacity example (1M samples of Qwen3-8B) through the dry run's own
arithmetic (``contract.spec.unit_tokens``, ``contract.layout.build_layout``,
``contract.inventory.inventory``).

The runs go through the command line (Hydra's run record included, as a user's run): a
``scripts/conf/model`` target is passed as its ``model.*`` values, since the command line's
override check composes without ``hydra.searchpath``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import (
    DEFAULT_DATA,
    PeakRSS,
    contention,
    cpu_model,
    cpu_pressure,
    logger,
    model_overrides,
    output_args,
    save,
    synthetic_rows,
)

GROWTH_SLACK = 1.1  # a cost may grow by at most 1.1 x the rows' ratio
RESUME_GOAL = 0.25  # a resume's first new commit within 25% of a fresh run's first commit
log = logger("scale")


# -- inputs --------------------------------------------------------------------------------------
def command(target: str, data: Path, seq: int, cache: Path, hydra_dir: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "dspark_precompute", *model_overrides(target), "data=jsonl", f"data.path={data}",
            f"seq_length={seq}", f"storage.path={cache}", "progress=false", f"hydra.run.dir={hydra_dir}", *extra]


# -- watching a run from outside ------------------------------------------------------------------
def commit_names(cache: Path) -> set[str]:
    try:
        return {n for n in os.listdir(cache / "commits") if n.startswith("u") and n.endswith(".json")}
    except (FileNotFoundError, NotADirectoryError):
        return set()


def num_units(cache: Path) -> int | None:
    try:
        return int(json.loads((cache / "manifest.json").read_text())["layout"]["num_units"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def watched(cmd: list[str], cache: Path, logfile: Path, before: set[str] | None = None, kill_at_half: bool = False,
            env: dict[str, str] | None = None, poll_s: float = 0.01) -> dict[str, Any]:
    """Run ``cmd`` in its own process group, watching ``cache/commits`` every ``poll_s``: its wall time, the
    time its first commit (its first one not in ``before``) appeared, its process tree's peak memory; with
    ``kill_at_half``, SIGKILL the group once half the units are committed."""
    before = set(before or ())
    out: dict[str, Any] = {"first_commit_s": None, "first_new_commit_s": None, "killed": False}
    with open(logfile, "w") as logf:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})}, cwd=cache.parent)
        units = None
        with PeakRSS(proc.pid) as mon:
            while True:
                rc = proc.poll()
                names = commit_names(cache)
                now = time.perf_counter() - t0
                if names and out["first_commit_s"] is None:
                    out["first_commit_s"] = now
                if names - before and out["first_new_commit_s"] is None:
                    out["first_new_commit_s"] = now
                if kill_at_half and rc is None:
                    units = units or num_units(cache)
                    if units and units >= 2 and math.ceil(units / 2) <= len(names) < units:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                        out.update(killed=True, commits_at_kill=sorted(commit_names(cache)), units=units)
                        rc = proc.returncode
                if rc is not None:
                    break
                time.sleep(poll_s)
        out.update(wall_s=time.perf_counter() - t0, rc=rc, peak_pss=mon.peak_pss, peak_rss=mon.peak_rss)
    if rc != 0 and not out["killed"]:
        raise RuntimeError(f"{' '.join(cmd)} failed ({rc}):\n{logfile.read_text()[-4000:]}")
    return out


# -- the cache it left --------------------------------------------------------------------------
def walk(path: Path) -> tuple[int, int]:
    files = dirs = 0
    for _, ds, fs in os.walk(path):
        files += len(fs)
        dirs += len(ds)
    return files, dirs


def cache_facts(cache: Path) -> dict[str, Any]:
    """Counts, layout, raw hidden bytes, the run's timing, and the entries against the contract's inventory."""
    from dspark_precompute import open_cache
    from dspark_precompute.contract.inventory import inventory
    from dspark_precompute.contract.spec import INPUT_IDS, LOSS_MASK

    m = json.loads((cache / "manifest.json").read_text())
    c = open_cache(cache)
    try:
        starts, stops = np.asarray(c.chunks.unit_start, dtype=np.int64), np.asarray(c.chunks.unit_stop, dtype=np.int64)
        ct = c.chunk_tokens
        slots = int((-(-(stops - starts) // ct) * ct).sum())  # written token slots: each unit rounded to chunks
        hidden_names = [n for n in c.chunks.metas if n not in (INPUT_IDS, LOSS_MASK) and "/" in n
                        and n.split("/")[0] in ("hidden_states", "hidden_scales")]
        metas = c.chunks.metas
        hidden_row = sum(metas[n].dtype.itemsize * int(np.prod(metas[n].shape[1:])) for n in hidden_names)
        token_arrays = 2 + len(hidden_names)
        fp8 = any(n.startswith("hidden_scales/") for n in hidden_names)
        samples = int(len(c.chunks.sample_start))
    finally:
        c.close()
    files, dirs = walk(cache)
    inv = inventory(token_arrays, int(m["layout"]["num_units"]), samples, fp8)
    raw_hidden = slots * hidden_row
    return {"samples": int(m["counts"]["samples"]), "tokens": int(m["counts"]["tokens"]),
            "units": int(m["layout"]["num_units"]), "unit_tokens": int(m["layout"]["unit_tokens"]),
            "chunk_tokens": int(m["layout"]["chunk_tokens"]), "token_arrays": token_arrays,
            "written_slots": slots, "raw_hidden_bytes": raw_hidden, "files": files, "directories": dirs,
            "entries": files + dirs, "entries_per_tb": (files + dirs) * 1e12 / max(1, raw_hidden),
            "inventory_files": inv.files, "inventory_directories": inv.directories,
            "bytes_on_disk": sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()),
            "timing": m.get("timing") or {}}


def read_costs(cache: Path, reads: int, seed: int) -> dict[str, float]:
    """``open_cache`` time, ``reads`` random single-sample reads, ``verify_cache`` (in this process: a new
    interpreter's start and imports would be a fixed cost that pulls the growth ratio towards 1)."""
    from dspark_precompute import open_cache
    from dspark_precompute.read.verify import verify_cache

    t0 = time.perf_counter()
    c = open_cache(cache)
    opened = time.perf_counter() - t0
    idx = np.random.default_rng(seed).integers(0, len(c), size=reads)
    t0 = time.perf_counter()
    for i in idx:
        c[int(i)]
    read_s = time.perf_counter() - t0
    c.close()
    t0 = time.perf_counter()
    report = verify_cache(cache)
    verify_s = time.perf_counter() - t0
    if not report.ok:
        raise RuntimeError(f"verify {cache} failed:\n{report.format()[-3000:]}")
    return {"open_s": opened, "reads_s": read_s, "verify_s": verify_s}


# -- the README's capacity example -----------------------------------------------------------------
def capacity_example(samples: int = 1_000_000, mean: int = 330, seq: int = 4096, hidden: int = 4096,
                     arrays: int = 5, seed: int = 0) -> dict[str, Any]:
    """Files of a cache of ``samples`` samples of Qwen3-8B (5 stored bf16 arrays of hidden 4096), by the dry run's
    arithmetic: every sample ``mean`` tokens, and lengths drawn from a log-normal with that mean (cut at ``seq``)."""
    from dspark_precompute.contract.inventory import inventory
    from dspark_precompute.contract.layout import build_layout
    from dspark_precompute.contract.spec import auto_chunk_tokens, unit_tokens
    from dspark_precompute.write.config.schema import StorageConfig

    row = 4 + 1 + arrays * hidden * 2  # ids int32, mask uint8, the hidden arrays bf16: what plan.py sums
    chunk = auto_chunk_tokens(hidden, 2)
    unit = unit_tokens(row, chunk, StorageConfig.unit_mib, seq)
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(0.0, 1.0, samples)
    spread = np.clip(np.rint(draws * (mean / draws.mean())), 1, seq).astype(np.int64)
    out: dict[str, Any] = {"samples": samples, "hidden": hidden, "hidden_arrays": arrays, "seq_length": seq,
                           "chunk_tokens": chunk, "unit_tokens": unit, "unit_mib": StorageConfig.unit_mib,
                           "bytes_per_token": row, "cases": {}}
    for name, lengths in (("every sample 330 tokens", np.full(samples, mean, dtype=np.int64)),
                          ("log-normal lengths, mean 330", spread)):
        layout = build_layout(lengths, chunk, unit)
        slots = int(sum(layout.unit_slots(u) for u in range(layout.num_units)))
        inv = inventory(2 + arrays, layout.num_units, samples, fp8=False)
        raw_hidden = slots * arrays * hidden * 2
        format1_chunks = -(-slots // chunk) * (2 + arrays)  # format 1: one file (and one directory) per chunk
        out["cases"][name] = {"tokens": int(lengths.sum()), "units": layout.num_units, "files": inv.files,
                              "directories": inv.directories, "entries": inv.entries,
                              "raw_hidden_bytes": raw_hidden, "entries_per_tb": inv.per_tb(raw_hidden),
                              "format1_chunk_files": format1_chunks}
    return out


# -- the run -----------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    """This bench's own ``machine`` record (its keys differ from the others': docs/benchmarks.md reads them)."""
    import platform

    return {"cores": os.cpu_count(), "cpu": cpu_model(), "python": platform.python_version(),
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "load_average_start": os.getloadavg()}


def one_size(n: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    data = work / f"rows-{n}.jsonl"
    synthetic_rows(args.data, n, data)
    fresh, again = work / f"fresh-{n}", work / f"resumed-{n}"
    for p in (fresh, again):
        shutil.rmtree(p, ignore_errors=True)
    out: dict[str, Any] = {"rows": n}
    p0 = cpu_pressure()
    log(f"{n:,} rows: fresh run")
    out["fresh"] = watched(command(args.target, data, args.seq, fresh, work / f"hydra-{n}", args.set), fresh,
                           work / f"fresh-{n}.log")
    out["cache"] = cache_facts(fresh)
    log(f"{n:,} rows: fresh {out['fresh']['wall_s']:.1f} s, first commit {out['fresh']['first_commit_s']:.1f} s, "
        f"{out['cache']['units']} units, {out['cache']['entries']:,} entries")
    if not args.no_resume:
        log(f"{n:,} rows: a second fresh run, killed once half its units are committed")
        cmd = command(args.target, data, args.seq, again, work / f"hydra-{n}-resumed", args.set)
        env = {"DSPARK_FAULT": "unit_submitted=1:sleep"} if args.pace else None
        out["killed"] = watched(cmd, again, work / f"killed-{n}.log", kill_at_half=True, env=env)
        if not out["killed"]["killed"]:
            raise RuntimeError(f"the run of {n} rows finished before half its units were committed; use more rows "
                               "(or --pace)")
        before = set(out["killed"]["commits_at_kill"])
        log(f"{n:,} rows: killed with {len(before)} of {out['killed']['units']} units committed; resuming")
        out["resumed"] = watched(cmd, again, work / f"resumed-{n}.log", before=before)
        m = json.loads((again / "manifest.json").read_text())
        out["resumed"]["timing"] = m.get("timing") or {}
        out["resumed"]["same_counts"] = m["counts"] == json.loads((fresh / "manifest.json").read_text())["counts"]
        if out["resumed"]["first_new_commit_s"] is None:
            raise RuntimeError(f"the resume of {n} rows committed no unit the killed run had not (it was killed after "
                               "its last commit?): use more rows (or --pace)")
        log(f"{n:,} rows: resume's first new commit {out['resumed']['first_new_commit_s']:.1f} s")
        if not args.keep:
            shutil.rmtree(again, ignore_errors=True)
    share = contention(p0, cpu_pressure())
    if share is not None:
        out["cpu_contention"] = share
    data.unlink(missing_ok=True)
    return out


def fsync_pairs(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``--fsync-repeats`` pairs of fresh runs, ``storage.fsync=true`` and ``false`` alternating which goes first."""
    data = work / f"fsync-rows-{args.fsync_rows}.jsonl"
    synthetic_rows(args.data, args.fsync_rows, data)
    runs: dict[str, list[dict[str, Any]]] = {"true": [], "false": []}
    for r in range(args.fsync_repeats):
        for f in (("true", "false") if r % 2 == 0 else ("false", "true")):
            cache = work / f"fsync-{f}"
            shutil.rmtree(cache, ignore_errors=True)
            res = watched(command(args.target, data, args.seq, cache, work / f"hydra-fsync-{f}",
                                  [*args.set, f"storage.fsync={f}"]), cache, work / f"fsync-{f}.log")
            res["timing"] = json.loads((cache / "manifest.json").read_text()).get("timing") or {}
            runs[f].append(res)
            log(f"fsync={f} repeat {r + 1}: wall {res['wall_s']:.1f} s, writers busy "
                f"{res['timing'].get('writer_busy_s', float('nan')):.2f} s, ids/masks stored in "
                f"{res['timing'].get('store_tokens_s', float('nan')):.2f} s")
            shutil.rmtree(cache, ignore_errors=True)
    data.unlink(missing_ok=True)

    def med(f: str, key: str) -> float:
        vals = [r[key] if key in r else r["timing"].get(key, float("nan")) for r in runs[f]]
        return float(statistics.median(vals))

    keys = ("wall_s", "first_commit_s", "forward_write_s", "writer_busy_s", "store_tokens_s")
    paired = {k: float(statistics.median((a[k] if k in a else a["timing"].get(k, float("nan")))
                                         / max(1e-9, b[k] if k in b else b["timing"].get(k, float("nan")))
                                         for a, b in zip(runs["true"], runs["false"]))) for k in keys}
    return {"rows": args.fsync_rows, "repeats": args.fsync_repeats, "runs": runs,
            "median": {f: {k: med(f, k) for k in keys} for f in runs}, "on_over_off_paired": paired}


def growth(sizes: list[dict[str, Any]], costs: dict[int, dict[str, float]]) -> list[dict[str, Any]]:
    """Each cost at every size, and its ratio between the largest and the smallest size against the rows' ratio."""
    a, b = sizes[0], sizes[-1]
    limit = GROWTH_SLACK * b["rows"] / a["rows"]
    rows = []

    def add(name: str, unit: str, get: Any, flat: bool = False) -> None:
        vals = [get(s) for s in sizes]
        ok = vals[0] is not None and vals[-1] is not None and vals[0] > 0
        ratio = vals[-1] / vals[0] if ok else float("nan")
        cap = GROWTH_SLACK if flat else limit  # a per-TB figure must not grow at all
        rows.append({"metric": name, "unit": unit, "values": vals, "ratio": ratio, "limit": cap,
                     "met": bool(ok and ratio <= cap)})

    add("wall time", "s", lambda s: s["fresh"]["wall_s"])
    add("tokenization (the run's own)", "s", lambda s: s["cache"]["timing"].get("tokenize_s"))
    add("time to first commit", "s", lambda s: s["fresh"]["first_commit_s"])
    if "resumed" in a:
        add("resume: time to first new commit", "s", lambda s: s["resumed"]["first_new_commit_s"])
    add("files + directories", "", lambda s: s["cache"]["entries"])
    add("entries per TB of raw hidden states", "", lambda s: s["cache"]["entries_per_tb"], flat=True)
    add("peak RSS, process tree (sum)", "MiB", lambda s: s["fresh"]["peak_rss"] / 2**20)
    add("peak PSS, process tree", "MiB", lambda s: s["fresh"]["peak_pss"] / 2**20)
    add("open_cache", "s", lambda s: costs[s["rows"]]["open_s"])
    add("random sample reads", "s", lambda s: costs[s["rows"]]["reads_s"])
    add("verify (in process)", "s", lambda s: costs[s["rows"]]["verify_s"])
    return rows


def markdown(res: dict[str, Any]) -> str:
    sizes = res["sizes"]
    head = " | ".join(f"{s['rows']:,} rows" for s in sizes)
    L = [f"Machine: {res['machine']['cores']} cores ({res['machine']['cpu']}), {res['machine']['date']}, load average "
         f"{' '.join(f'{x:.1f}' for x in res['machine']['load_average_start'])} at the start, "
         f"{' '.join(f'{x:.1f}' for x in res['load_average_end'])} at the end. Command: `{res['command']}`.", ""]
    if sizes:
        L.append("| | " + head + " |")
        L.append("|---|" + "---:|" * len(sizes))
        for key, label in (("samples", "samples"), ("tokens", "real tokens"), ("units", "units"),
                           ("raw_hidden_bytes", "raw hidden states")):
            vals = [s["cache"][key] for s in sizes]
            shown = [f"{v / 1e9:,.2f} GB" if key == "raw_hidden_bytes" else f"{v:,}" for v in vals]
            L.append(f"| {label} | " + " | ".join(shown) + " |")
        L.append("| CPU contention during the runs | " + " | ".join(
            f"{100 * s.get('cpu_contention', float('nan')):.0f}%" for s in sizes) + " |")
        L += ["", f"| cost | {head} | **ratio** | limit | |", "|---|" + "---:|" * len(sizes) + "---:|---:|---|"]
        for g in res["growth"]:
            unit = f" {g['unit']}" if g["unit"] else ""
            vals = " | ".join("-" if v is None else (f"{v:,.0f}{unit}" if v >= 100 else f"{v:,.2f}{unit}")
                              for v in g["values"])
            L.append(f"| {g['metric']} | {vals} | **{g['ratio']:.2f}x** | {g['limit']:.1f}x | "
                     f"{'met' if g['met'] else '**missed**'} |")
        if any("resumed" in s for s in sizes):
            L += ["", "| resume after SIGKILL | " + head + " |", "|---|" + "---:|" * len(sizes)]
            L.append("| units committed at the kill | " + " | ".join(
                f"{len(s['killed']['commits_at_kill'])} of {s['killed']['units']}" for s in sizes) + " |")
            L.append("| killed run: time to first commit | " + " | ".join(
                f"{s['killed']['first_commit_s']:.1f} s" for s in sizes) + " |")
            L.append("| resume: time to first new commit | " + " | ".join(
                f"{s['resumed']['first_new_commit_s']:.1f} s" for s in sizes) + " |")
            L.append("| resume: reading the stored ids and masks back | " + " | ".join(
                f"{s['resumed']['timing'].get('read_tokens_s', float('nan')):.2f} s" for s in sizes) + " |")
            L.append("| **resume first new commit / the killed run's first commit** | " + " | ".join(
                f"**{s['resume_over_fresh']:.0%}**" if s["resume_over_fresh"] is not None else "-" for s in sizes)
                + " |")
            L.append("| same counts as the fresh run | " + " | ".join(
                str(s["resumed"]["same_counts"]) for s in sizes) + " |")
    fs = res.get("fsync")
    if fs:
        L += ["", f"storage.fsync, {fs['rows']:,} rows, {fs['repeats']} pairs alternating (medians; ratio = each "
                  "pair's fsync=true over fsync=false, median):", "",
              "| | fsync=true | fsync=false | **true / false** (paired) |", "|---|---:|---:|---:|"]
        for k, label in (("wall_s", "wall time"), ("first_commit_s", "time to first commit"),
                         ("forward_write_s", "forward + write phase"), ("writer_busy_s", "writers busy"),
                         ("store_tokens_s", "ids and masks stored (before the first forward)")):
            L.append(f"| {label} | {fs['median']['true'][k]:.2f} s | {fs['median']['false'][k]:.2f} s | "
                     f"**{fs['on_over_off_paired'][k]:.3f}x** |")
    cap = res["capacity"]
    L += ["", f"Capacity example ({cap['samples']:,} samples, {cap['hidden_arrays']} bf16 arrays of hidden "
              f"{cap['hidden']}, seq_length {cap['seq_length']}): chunks of {cap['chunk_tokens']} tokens, units of "
              f"{cap['unit_tokens']:,} tokens (`unit_mib` {cap['unit_mib']}, {cap['bytes_per_token']:,} B per token).",
          "", "| lengths | real tokens | units | files | directories | **entries** | raw hidden states "
              "| **entries per TB** | format 1: chunk files |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c in cap["cases"].items():
        L.append(f"| {name} | {c['tokens']:,} | {c['units']:,} | {c['files']:,} | {c['directories']:,} "
                 f"| **{c['entries']:,}** | {c['raw_hidden_bytes'] / 1e12:.2f} TB | **{c['entries_per_tb']:,.0f}** "
                 f"| {c['format1_chunk_files']:,} |")
    return "\n".join(L) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.py scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="10000,100000", help="comma list of row counts, smallest first")
    p.add_argument("--target", default="bench_tiny", help="a scripts/conf/model group or a package model option")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="chat jsonl whose rows are cycled, or 'embedded'")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for every run")
    p.add_argument("--reads", type=int, default=2000, help="random single-sample reads per measurement")
    p.add_argument("--repeats", type=int, default=3, help="alternating repeats of open / reads / verify")
    p.add_argument("--no-resume", action="store_true", help="skip the kill-and-resume runs")
    p.add_argument("--fsync-rows", type=int, default=3000)
    p.add_argument("--fsync-repeats", type=int, default=0, help="pairs of fsync=true/false runs (0: none)")
    p.add_argument("--fsync-only", action="store_true", help="only the fsync pairs (and the capacity example)")
    # tiny row counts: the killed run sleeps 0.5 s after each unit (DSPARK_FAULT), so the kill lands mid-run
    p.add_argument("--pace", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep the caches (in --workdir)")
    output_args(p)
    args = p.parse_args(argv)
    args.rows = sorted(int(x) for x in args.rows.split(",") if x.strip())
    args.data = None if args.data == "embedded" else Path(args.data).expanduser().resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    own = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="dspark-scale-")) if own else args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"command": " ".join(["python", "scripts/bench.py", "scale", *(argv or sys.argv[1:])]),
                           "machine": machine(), "target": args.target, "seq_length": args.seq}
    try:
        res["capacity"] = capacity_example()
        if args.fsync_only:
            args.rows = []
        sizes = []
        for n in args.rows:
            sizes.append(one_size(n, args, work))
            if args.json:  # what is measured so far survives a failure later on
                args.json.write_text(json.dumps({**res, "partial_sizes": sizes}, indent=1, default=str) + "\n")
        costs: dict[int, list[dict[str, float]]] = {n: [] for n in args.rows}
        for r in range(args.repeats):  # side by side: the sizes alternate, so drifting load hits each alike
            for n in (args.rows if r % 2 == 0 else args.rows[::-1]):
                costs[n].append(read_costs(work / f"fresh-{n}", args.reads, seed=r))
                log(f"{n:,} rows, repeat {r + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in costs[n][-1].items()))
        med = {n: {k: float(statistics.median(x[k] for x in v)) for k in v[0]} for n, v in costs.items() if v}
        for s in sizes:
            s["read_costs"], s["read_costs_median"] = costs[s["rows"]], med[s["rows"]]
            if "resumed" in s:  # against the killed run's first commit: the same command, just before (paired)
                new, first = s["resumed"]["first_new_commit_s"], s["killed"]["first_commit_s"]
                s["resume_over_fresh"] = None if new is None or not first else new / first
                s["resume_goal_met"] = s["resume_over_fresh"] is not None and s["resume_over_fresh"] <= RESUME_GOAL
        res["sizes"] = sizes
        res["growth"] = growth(sizes, med) if len(sizes) > 1 else []
        if args.fsync_repeats:
            res["fsync"] = fsync_pairs(args, work)
    finally:
        if own and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    res["load_average_end"] = os.getloadavg()
    md = markdown(res)
    sys.stdout.write(md)
    save(args, res, md, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
