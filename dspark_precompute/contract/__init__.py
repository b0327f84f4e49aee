"""The on-disk contract: what a cache is, independent of how it is written or read.

``spec`` (names, dtypes, limits), ``manifest`` (the typed manifest and its checks),
``layout`` (where samples lie; table checks), ``arrays`` (array metadata, codec chain),
``chunks`` (reading and decoding chunk bytes), ``commits`` (unit commit records),
``store`` (local directory or object store) and ``lock`` (one writer at a time). Nothing
here imports torch, transformers, or the write or read side (a test enforces it).
"""
