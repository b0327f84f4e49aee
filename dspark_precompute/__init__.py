"""dspark-precompute: run a frozen target LLM once, store its hidden states for draft training.

``python -m dspark_precompute`` runs the pipeline (Hydra); ``open_cache(path)`` reads a cache.
"""

__version__ = "0.1.0"

from dspark_precompute.reader import Cache, open_cache  # noqa: E402


def run(cfg):  # noqa: D103 - thin re-export, imports the heavy pipeline lazily
    from dspark_precompute.pipeline import run as _run

    return _run(cfg)


__all__ = ["Cache", "open_cache", "run", "__version__"]
