"""dspark-precompute: run a frozen target LLM once, store its hidden states for draft training.

``python -m dspark_precompute`` runs the pipeline (Hydra). The library API, the same steps
from a notebook, a script or a trainer::

    from dspark_precompute import build_dataloader, compose, open_cache, run

    cfg = compose(["seq_length=1024", "storage.path=/data/cache"])  # the command line's typed config
    result = run(cfg)                                                # RunResult (DryRunPlan for dry_run=true)
    loader = build_dataloader(result.path, max_tokens=16384)

The names load on first use (``import dspark_precompute`` alone imports neither torch nor
transformers); type checkers see the real objects. Library calls leave the process as they
found it: no logging handlers or levels, no signal handlers, no multiprocessing settings
(the command-line entry points set those for their own jobs).

The package follows the cache contract: ``contract`` (what a cache is), ``write`` (config
-> target -> samples -> batches -> capture -> writers -> store), ``read`` (reader,
training, export, verify) and ``cli`` (the two commands).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dspark_precompute.version import __version__

if TYPE_CHECKING:  # the real objects, for type checkers and IDEs; at run time __getattr__ imports them on use
    from dspark_precompute.read.plot import plot_cache
    from dspark_precompute.read.reader import Cache, CacheReader, open_cache
    from dspark_precompute.read.training import build_dataloader
    from dspark_precompute.write.config.compose import compose
    from dspark_precompute.write.config.schema import PrecomputeConfig
    from dspark_precompute.write.dryrun import DryRunPlan
    from dspark_precompute.write.run import RunResult

# public name -> the module that defines it (imported on first use, PEP 562)
_LAZY = {
    "Cache": "dspark_precompute.read.reader",
    "CacheReader": "dspark_precompute.read.reader",
    "open_cache": "dspark_precompute.read.reader",
    "plot_cache": "dspark_precompute.read.plot",
    "build_dataloader": "dspark_precompute.read.training",
    "compose": "dspark_precompute.write.config.compose",
    "PrecomputeConfig": "dspark_precompute.write.config.schema",
    "DryRunPlan": "dspark_precompute.write.dryrun",
    "RunResult": "dspark_precompute.write.run",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dspark_precompute' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def run(cfg: PrecomputeConfig) -> RunResult | DryRunPlan:
    """Precompute the cache ``cfg`` describes (see :func:`dspark_precompute.write.run.run`).

    With ``cfg.dry_run`` it returns the plan instead (:func:`dspark_precompute.write.dryrun.dry_run`)
    and writes nothing. Logging is the caller's: configure it (``logging.basicConfig(level="INFO")``)
    to see the run's progress lines; ``cfg.log_level`` applies to the command line only.
    """
    if cfg.dry_run:  # planning writes nothing, so it never goes through the run
        from dspark_precompute.write.dryrun import dry_run

        return dry_run(cfg)
    from dspark_precompute.write.run import run as _run

    return _run(cfg)


__all__ = ["Cache", "CacheReader", "DryRunPlan", "PrecomputeConfig", "RunResult", "build_dataloader", "compose",
           "open_cache", "plot_cache", "run", "__version__"]
