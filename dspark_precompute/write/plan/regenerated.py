"""Regenerate, then capture: where the regenerated dataset goes and the capture config that reads it.

The regenerated JSONL lies beside the cache (``<cache path>.regenerated.jsonl``, or
``regenerate.output``), outside the cache directory, whose entries the format lists. The capture
reads it as ``data.path`` (its content hash enters the cache identity through ``data``) with the
selection already applied, into the cache path of the whole recipe (which the regeneration
settings choose: :func:`~dspark_precompute.write.plan.prepare.default_storage_path`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from dspark_precompute.contract.store import is_url
from dspark_precompute.errors import ConfigError, RegenerateError
from dspark_precompute.write.config.schema import DataFormat, PrecomputeConfig, RegenerateConfig
from dspark_precompute.write.plan.prepare import default_storage_path
from dspark_precompute.write.regenerate.stage import Regenerated, regenerate


def regenerated_path(cfg: PrecomputeConfig) -> Path:
    """``regenerate.output``, else ``<cache path>.regenerated.jsonl`` (a local cache path only)."""
    if cfg.regenerate.output is not None:
        return Path(cfg.regenerate.output).expanduser()
    cache = cfg.storage.path or default_storage_path(cfg)
    if is_url(cache):
        raise ConfigError([f"the cache goes to {cache}, an object store: give regenerate.output=PATH, a local "
                           "file for the regenerated dataset"])
    return Path(cache.rstrip("/") + ".regenerated.jsonl")


def capture_config(cfg: PrecomputeConfig, output: Path) -> PrecomputeConfig:
    """The capture of the regenerated rows: the same run, reading ``output`` whole, into the recipe's cache."""
    data = dataclasses.replace(cfg.data, path=str(output), format=DataFormat.messages, split="train",
                               shuffle_seed=None, max_samples=None)
    storage = dataclasses.replace(cfg.storage, path=cfg.storage.path or default_storage_path(cfg))
    return dataclasses.replace(cfg, data=data, storage=storage, regenerate=RegenerateConfig())


def regenerate_stage(cfg: PrecomputeConfig) -> tuple[Regenerated, PrecomputeConfig]:
    """Regenerate (resuming), then the capture config; RegenerateError when rows failed, so the cache is never
    made of a partial regeneration (the same command asks only those again)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(["regenerate=server runs in one process: run it first with regenerate.only=true, then "
                           "the torchrun/SLURM capture with the same overrides (the regeneration is then complete "
                           "and asks nothing)"])
    done = regenerate(cfg, regenerated_path(cfg))
    if done.failed:
        first = done.failed[0]
        raise RegenerateError(f"{len(done.failed)} of {done.counts.rows_in} row(s) got no answer from the servers "
                              f"(row {first['row']}: {first['message'][:300]}); the rest are kept. Run the same "
                              "command again to ask only those; the capture starts once every row is answered")
    return done, capture_config(cfg, done.output)
