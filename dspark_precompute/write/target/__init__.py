"""Stage 3, the target model: finding and fingerprinting it, loading it (load.py), the tiny random target
(tiny.py) and the hooks that capture its hidden states (capture.py).
"""
