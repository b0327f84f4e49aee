"""Command line: ``python -m dspark_precompute [overrides]`` (also ``dspark-precompute``).

Thin Hydra entry point: compose ``conf/``, convert to the typed config, call ``run``.
Examples::

    python -m dspark_precompute                                   # embedded default, seconds on a CPU
    python -m dspark_precompute model=qwen3_0_6b data.path=/data/chat.jsonl seq_length=4096
    python -m dspark_precompute -m seq_length=1024,2048           # one cache per value
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from dspark_precompute.errors import DsparkError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
log = logging.getLogger("dspark_precompute")


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _app(dcfg: DictConfig) -> None:
    from dspark_precompute.config import from_dictconfig
    from dspark_precompute.pipeline import run

    try:
        result = run(from_dictconfig(dcfg))
    except DsparkError as exc:
        log.error("%s", exc)
        raise SystemExit(getattr(exc, "exit_code", 2)) from None
    if result.complete:
        _keep_hydra_record(result.path)


def _keep_hydra_record(cache_path: str) -> None:
    """Copy this job's .hydra/ (composed config, overrides) into the cache it wrote."""
    from hydra.core.hydra_config import HydraConfig

    from dspark_precompute.store import CacheStore

    try:
        hc = HydraConfig.get()
        record = Path(hc.runtime.output_dir) / (hc.output_subdir or "")
    except ValueError:
        return
    if not hc.output_subdir or not record.is_dir():
        return
    store = CacheStore(cache_path)
    for f in sorted(record.glob("*.yaml")):
        store.write_bytes(f".hydra/{f.name}", f.read_bytes())


def _rank() -> int:
    return int(os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or 0)


def main() -> None:
    if not CONF_DIR.is_dir():
        sys.exit(f"dspark-precompute: config directory {CONF_DIR} is missing; install the project with "
                 "`pip install -e .` from its checkout")
    if _rank() > 0 and "-m" not in sys.argv and "--multirun" not in sys.argv:
        # torchrun: every rank composes the same config, only rank 0 writes Hydra's output dir and log.
        sys.argv += ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=disabled",
                     "hydra/hydra_logging=disabled"]
    _app()


if __name__ == "__main__":
    main()
