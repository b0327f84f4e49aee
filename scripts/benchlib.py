"""What every bench script shares: paths, logging, the machine, timing, memory, configs, cache building, output.

One owner per helper, so that the scripts measure, log and report alike and import no other
script (``bench.py`` only dispatches to its sub-benchmarks). Nothing here is timed itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the package from this checkout, installed or not
    sys.path.insert(0, str(REPO))
BENCH_CONF = REPO / "scripts" / "conf"  # the benchmark targets (model=bench_tiny|bench_mid|...), beside the package's
DEFAULT_DATA = REPO.parent / "shared" / "data" / "chat" / "mix.messages.jsonl"


# -- logging -------------------------------------------------------------------------------------
def logger(tag: str = "", clock: bool = False) -> Callable[[str], None]:
    """A stderr logger whose lines start ``[tag]`` (``[tag HH:MM:SS]`` with ``clock``), bare without a tag."""

    def log(msg: str) -> None:
        head = " ".join(x for x in (tag, time.strftime("%H:%M:%S") if clock else "") if x)
        sys.stderr.write(f"[{head}] {msg}\n" if head else f"{msg}\n")
        sys.stderr.flush()

    return log


log = logger()


# -- the machine ---------------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ('?' where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def machine() -> dict[str, Any]:
    """The machine and library versions a result was measured with (the ``machine`` key of the JSON)."""
    import numcodecs
    import torch
    import transformers
    import zarr

    mem = "?"
    try:
        kb = int(next(ln for ln in Path("/proc/meminfo").read_text().splitlines()
                      if ln.startswith("MemTotal")).split()[1])
        mem = f"{kb / (1 << 20):.1f} GiB"
    except (OSError, StopIteration):
        pass
    return {"nproc": os.cpu_count(), "cpu": cpu_model(), "memory": mem, "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "zarr": zarr.__version__,
            "numcodecs": numcodecs.__version__, "transformers": transformers.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def cpu_pressure_total() -> int | None:
    """Total microseconds some task waited for a CPU (/proc/pressure/cpu, PSI 'some'); None without PSI."""
    try:
        return int(Path("/proc/pressure/cpu").read_text().splitlines()[0].rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return None


def cpu_pressure() -> tuple[float, int] | None:
    """(monotonic seconds, total microseconds some task waited for a CPU): a reading for ``contention``."""
    total = cpu_pressure_total()
    return None if total is None else (time.monotonic(), total)


def contention(a: tuple[float, int] | None, b: tuple[float, int] | None) -> float | None:
    """Share of the wall time between two readings during which some runnable task waited for a CPU."""
    if not a or not b or b[0] <= a[0]:
        return None
    return (b[1] - a[1]) / 1e6 / (b[0] - a[0])


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


# -- measuring -----------------------------------------------------------------------------------
def median(xs: Sequence[float]) -> float:
    """The median, NaN for no values (a method that did not run)."""
    return float(statistics.median(xs)) if xs else float("nan")


def rotated(items: Sequence[Any], rep: int) -> list[Any]:
    """``items`` started at repeat ``rep``'s place: alternating repeats, so drifting load hits each item alike."""
    k = rep % len(items)
    return [*items[k:], *items[:k]]


def dir_bytes(path: Path, exclude: tuple[str, ...] = ()) -> int:
    """Bytes of every file under ``path`` but those named in ``exclude``."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file() and p.name not in exclude)


def embedded_data() -> Path:
    """The package's demo chat set, for ``--data embedded`` where a script needs a file."""
    import dspark_precompute

    return Path(dspark_precompute.__file__).parent / "assets" / "embedded_chat.jsonl"


class PeakRSS:
    """Peak PSS of a process tree, sampled every ``interval`` seconds with psutil."""

    def __init__(self, pid: int, interval: float = 0.1):
        self.pid, self.interval = pid, interval
        self.peak_pss = 0
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._stop.is_set():
            pss = rss = 0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            for p in procs:
                try:
                    mi = p.memory_full_info()
                    pss += getattr(mi, "pss", mi.rss)
                    rss += mi.rss
                except psutil.Error:
                    pass
            self.peak_pss, self.peak_rss = max(self.peak_pss, pss), max(self.peak_rss, rss)
            self._stop.wait(self.interval)


# -- configuration -------------------------------------------------------------------------------
def compose(overrides: list[str]) -> Any:
    """The typed config for ``overrides``, composed by Hydra exactly as the CLI does (plus scripts/conf)."""
    from dspark_precompute.write.config.compose import compose as compose_config

    return compose_config([f"hydra.searchpath=[file://{BENCH_CONF}]", *overrides])


def tokenizer_override(model_group: str) -> list[str]:
    """scripts/conf/model/*.yaml give the tokenizer relative to the repo root: make it absolute."""
    from omegaconf import OmegaConf

    path = BENCH_CONF / "model" / f"{model_group}.yaml"
    if not path.exists():
        return []
    conf = OmegaConf.load(path)
    tok = conf.get("tokenizer")
    if not tok or Path(tok).is_absolute():
        return []
    return [f"model.tokenizer={(REPO / tok).resolve()}"]


def tool_overrides(model_group: str, data: Path | None, seq: int, rows: int | None, path: Path,
                   device: str = "auto", dtype: str = "auto", extra: list[str] | None = None) -> list[str]:
    """The overrides of one in-process tool run (``compose``'s input): ``data`` None is the embedded set."""
    out = [f"model={model_group}", *tokenizer_override(model_group)]
    out += ["data=jsonl", f"data.path={data}"] if data is not None else ["data=embedded"]
    if rows:
        out.append(f"data.max_samples={rows}")
    out += [f"seq_length={seq}", f"storage.path={path}", "overwrite=true", "progress=false", "log_level=WARNING",
            f"model.device={device}", f"model.dtype={dtype}"]
    if seq > 16384:
        out.append(f"batch.max_tokens={seq}")
    return out + list(extra or [])


def model_overrides(target: str) -> list[str]:
    """Command-line overrides for a target: a ``scripts/conf/model`` group as its values, else ``model=<target>``.

    The command line's override check composes without ``hydra.searchpath``, so a bench group travels as values."""
    from omegaconf import OmegaConf

    path = BENCH_CONF / "model" / f"{target}.yaml"
    if not path.exists():
        return [f"model={target}"]
    conf = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert isinstance(conf, dict)
    path = conf.pop("path", "tiny")
    out = ["model=tiny"] if path == "tiny" else ["model=hf", f"model.path={path}"]

    def flat(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                flat(f"{prefix}.{k}", v)
        elif isinstance(value, list):
            out.append(f"{prefix}=[{','.join(str(v) for v in value)}]")
        elif prefix == "model.tokenizer" and value and not Path(str(value)).is_absolute():
            out.append(f"{prefix}={(REPO / str(value)).resolve()}")
        else:
            out.append(f"{prefix}={'null' if value is None else value}")

    for key, value in conf.items():
        flat(f"model.{key}", value)
    return out


def build_cache(path: Path, target: str, data: str, seq_length: int, rows: int | None,
                extra: Iterable[str] = (), overwrite: bool = True) -> None:
    """The cache a bench reads, written in this process by the tool (``data`` 'embedded': the demo set)."""
    from dspark_precompute.write.run import run

    overrides = tool_overrides(target, None if data == "embedded" else Path(data), seq_length, rows, path)
    if not overwrite:
        overrides = [o for o in overrides if o != "overwrite=true"]
    overrides += list(extra)
    log(f"building the benchmark cache: {' '.join(overrides)}")
    run(compose(overrides))


def worktree(rev: str) -> Path:
    """A detached git worktree of ``rev`` under the temp directory, made once (an older release's code, to run
    beside this one with ``PYTHONPATH``); SystemExit when this is not a git checkout holding ``rev``."""
    import shutil
    import subprocess
    import tempfile

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *a], check=True, capture_output=True, text=True).stdout.strip()

    try:
        full = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    except (FileNotFoundError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"{rev} is not a commit of a git checkout at {REPO} ({exc}): this comparison runs an older "
                         "release's code, which needs the repository with its history") from None
    tree = Path(tempfile.gettempdir()) / f"dspark-precompute-{full[:12]}"
    if not (tree / "dspark_precompute" / "__init__.py").exists():
        shutil.rmtree(tree, ignore_errors=True)
        try:
            git("worktree", "prune")  # a worktree of an emptied temp directory is still registered
            git("worktree", "add", "--detach", str(tree), full)
        except subprocess.CalledProcessError as exc:
            raise SystemExit(f"could not check out {full[:12]} into {tree}: {exc.stderr or exc}") from None
    link = tree / "dspark_precompute" / "conf"
    if (tree / "conf").is_dir() and not link.exists():  # else this checkout's editable install lends it *our* conf/
        link.symlink_to(Path("..") / "conf")
    return tree


# -- output --------------------------------------------------------------------------------------
def output_args(p: argparse.ArgumentParser, markdown: bool = True) -> None:
    """``--json`` (and ``--markdown``): where the results go besides stdout."""
    p.add_argument("--json", type=Path, default=None, help="write all results as JSON here")
    if markdown:
        p.add_argument("--markdown", type=Path, default=None, help="write the tables as markdown here")


def save(args: argparse.Namespace, results: Any, md: str | None = None, indent: int = 2) -> None:
    """Write ``results`` to ``args.json`` and ``md`` to ``args.markdown``, each where given."""
    if getattr(args, "json", None):
        args.json.write_text(json.dumps(results, indent=indent, default=str) + "\n")
    if md is not None and getattr(args, "markdown", None):
        args.markdown.write_text(md)


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]], rule: Sequence[str] | str = "---",
             spaced_rule: bool = False) -> list[str]:
    """A markdown table's lines: the header, the rule (``rule`` per column, or one for all), the rows."""
    def line(cells: Iterable[Any]) -> str:
        return "| " + " | ".join(str(c) for c in cells) + " |"

    rules = [rule] * len(header) if isinstance(rule, str) else list(rule)
    return [line(header), line(rules) if spaced_rule else "|" + "|".join(rules) + "|", *(line(r) for r in rows)]


def emit_json(args: argparse.Namespace, results: Any) -> None:
    """The JSON-only benches' output: ``results`` on stdout, and to ``args.json`` where given."""
    text = json.dumps(results, indent=2, default=str)
    if getattr(args, "json", None):
        args.json.write_text(text + "\n")
    sys.stdout.write(text + "\n")


def synthetic_rows(src: Path | None, n: int, dst: Path) -> int:
    """``n`` rows: the chat rows of ``src`` cycled, each copy distinct (its row number in its first user message)."""
    if src is None:
        src = embedded_data()
    rows = [json.loads(ln) for ln in src.read_text(encoding="utf-8").splitlines() if ln.strip()]
    with open(dst, "w", encoding="utf-8") as fh:
        for k in range(n):
            row = json.loads(json.dumps(rows[k % len(rows)]))
            for m in row.get("messages", []):
                if m.get("role") == "user" and isinstance(m.get("content"), str):
                    m["content"] = f"(request {k:,} of {n:,}) {m['content']}"
                    break
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    return n
