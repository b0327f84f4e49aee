"""fp16 and fp32 storage through whole runs.

The e2e part of tests/write/target/test_target.py.
"""

from __future__ import annotations

import torch
from helpers import compose, small

from dspark_precompute import open_cache
from dspark_precompute.write.run import run


def test_fp16_and_fp32_storage_keep_their_dtype(tmp_path):
    for dtype, torch_dtype in (("fp16", torch.float16), ("fp32", torch.float32)):
        cfg = compose(small(tmp_path, f"storage.dtype={dtype}", "data.max_samples=3", name=dtype))
        run(cfg)
        s = open_cache(cfg.storage.path)[0]
        assert s["target_hidden_states"].dtype == torch_dtype
        assert s["input_ids"].dtype == torch.int64 and s["loss_mask"].dtype == torch.int64
