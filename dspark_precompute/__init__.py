"""dspark-precompute: run a frozen target LLM once, store its hidden states for draft training.

``python -m dspark_precompute`` runs the pipeline (Hydra); ``open_cache(path)`` reads a cache.
"""

__version__ = "0.1.0"



def __getattr__(name):  # PEP 562: the reader (and torch) load on first use, not on import
    if name in ("Cache", "open_cache"):
        from dspark_precompute import reader

        return getattr(reader, name)
    raise AttributeError(f"module 'dspark_precompute' has no attribute {name!r}")


def run(cfg):  # noqa: D103 - thin re-export, imports the heavy pipeline lazily
    from dspark_precompute.pipeline import run as _run

    return _run(cfg)


__all__ = ["Cache", "open_cache", "run", "__version__"]
