"""The Hydra config groups of ``python -m dspark_precompute``, installed as ``dspark_precompute.conf``.

This file makes the directory a regular package, so that both a wheel (which maps this
top-level ``conf/`` to ``dspark_precompute/conf``) and an editable install (whose import
hook points ``dspark_precompute.conf`` here) can locate it through the import system.
"""
