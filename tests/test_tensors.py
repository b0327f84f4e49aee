"""The one torch-facing dtype helper both sides use (``dspark_precompute.tensors``)."""

from __future__ import annotations

import torch

from dspark_precompute.contract.vocab import StorageDtype
from dspark_precompute.tensors import torch_dtype


def test_each_storage_dtype_comes_back_as_the_torch_dtype_of_what_readers_return():
    """fp8 is dequantized to bf16 (README, storage): its tensors are bfloat16, the rest keep their own dtype."""
    want = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8_e4m3": torch.bfloat16}
    assert {d.value: torch_dtype(d) for d in StorageDtype} == want
    assert all(torch_dtype(d).itemsize == StorageDtype(d).output.disk.itemsize for d in StorageDtype)
