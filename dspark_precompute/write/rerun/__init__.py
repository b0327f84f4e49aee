"""Stage 8, verify's checks that rerun the target on stored samples: recompute (and its shared toolkit), the
teacher check and the precision check.
"""
