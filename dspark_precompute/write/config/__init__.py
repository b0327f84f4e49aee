"""Stage 1, the run's configuration: the typed schema (schema.py), layer presets (layers.py) and the Hydra
composition (compose.py). Validated before anything heavy loads.
"""
