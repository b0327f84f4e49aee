"""dspark-precompute: run a frozen target LLM once, store its hidden states for draft training.

``python -m dspark_precompute`` runs the pipeline (Hydra); ``open_cache(path)`` reads a cache.
The package follows the cache contract: ``contract`` (what a cache is), ``write`` (config
-> target -> samples -> batches -> capture -> writers -> store), ``read`` (reader,
training, export, verify) and ``cli`` (the two commands).
"""

from typing import Any

__version__ = "0.2.0"


def __getattr__(name: str) -> Any:  # PEP 562: the reader (and torch) load on first use, not on import
    if name in ("CacheReader", "Cache", "open_cache"):
        from dspark_precompute.read import reader

        return getattr(reader, name)
    if name == "plot_cache":
        from dspark_precompute.read.plot import plot_cache

        return plot_cache
    raise AttributeError(f"module 'dspark_precompute' has no attribute {name!r}")


def run(cfg: Any, provenance: dict[str, Any] | None = None) -> Any:
    """Precompute the cache ``cfg`` describes (see :func:`dspark_precompute.write.run.run`).

    With ``cfg.dry_run`` it returns the plan instead (:func:`dspark_precompute.write.dryrun.dry_run`)
    and writes nothing. Logging is the caller's: configure it to see the run's progress lines.
    """
    from dspark_precompute.write.run import run as _run

    if getattr(cfg, "dry_run", False):
        from dspark_precompute.write.dryrun import dry_run

        return dry_run(cfg)
    return _run(cfg, provenance)


__all__ = ["Cache", "CacheReader", "open_cache", "plot_cache", "run", "__version__"]
