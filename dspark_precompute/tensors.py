"""The torch side of the contract's dtype vocabulary: one owner for both sides.

The contract names a storage dtype's torch dtype (``StorageDtype.torch_name``) without importing
torch; this leaf turns the name into the dtype, so the write side (casts, weights) and the read
side (returned tensors, batch buffers) share one helper without importing each other.
"""

from __future__ import annotations

import torch

from dspark_precompute.contract.vocab import StorageDtype


def torch_dtype(d: str) -> torch.dtype:
    """The torch dtype a storage dtype's output is (bf16, fp16, fp32; fp8 is dequantized to bf16)."""
    return getattr(torch, StorageDtype(d).torch_name)  # type: ignore[no-any-return]
