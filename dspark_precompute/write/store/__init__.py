"""Stage 7, from forward to durable bytes: batching, the forward loop (forward.py), device-to-host transfer,
unit buffers, the writer processes (writer.py), allocation and the progress bar.
"""
