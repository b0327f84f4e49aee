"""Stage 2, processes and ranks: the helper-process server (processes.py) and the torchrun ranks that split
the work (distributed.py).
"""
