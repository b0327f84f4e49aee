"""Stage 6, everything decided before weights load: the plan (prepare.py), the arrays a run writes
(array_specs.py), provenance and the cache identity (provenance.py), and what a resume finds (resume.py).
"""
