"""Targets larger than one GPU: ``model.device_map=auto`` (accelerate) and capture across devices.

This machine has no GPU, so the checks are: the device_map path loads a saved target
through accelerate and gives the same cache as the plain path; capture is unchanged when
accelerate's hooks wrap the layers (some offloaded to disk); and every captured state
comes back on the device of ``input_ids`` (where the pipeline's row mask lives) even
when a layer hands it over from elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("accelerate")

from helpers import compose  # noqa: E402

from dspark_precompute import open_cache
from dspark_precompute.contract import spec as fmt  # noqa: E402
from dspark_precompute.write import tiny  # noqa: E402
from dspark_precompute.write.capture import HiddenStateCapture  # noqa: E402
from dspark_precompute.write.config import ModelConfig, RandomTargetConfig  # noqa: E402
from dspark_precompute.write.run import run  # noqa: E402
from dspark_precompute.write.target import inspect_target, load_target, load_tokenizer  # noqa: E402

LAYERS = [-1, 0, 2, 3]  # embeddings, decoder layers, and the final post-norm output


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory):
    """The tiny random Qwen3 and its tokenizer saved as a Hugging Face directory (safetensors)."""
    d = tmp_path_factory.mktemp("tiny_hf")
    tok = tiny.build_tokenizer()
    tiny.build_target(RandomTargetConfig(), len(tok)).save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    assert (d / "model.safetensors").is_file()
    return d


def _load(path, device_map=None):
    cfg = ModelConfig(path=str(path), device_map=device_map)
    tok = load_tokenizer(cfg)
    info = inspect_target(cfg, tok)
    return load_target(cfg, info, len(tok), torch.device("cpu"), torch.float32), tok


def _ids(tok, n=3, t=40):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tok), (n, t), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 25:] = 0  # padded rows, as the pipeline batches them
    attn[2, 10:] = 0
    return ids, attn


def _capture(model, ids, attn):
    cap = HiddenStateCapture(model, LAYERS)
    try:
        return cap(ids, attn)
    finally:
        cap.close()


def test_device_map_auto_loads_through_accelerate(saved_target, monkeypatch):
    from transformers import AutoModelForCausalLM

    seen = []
    real = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs.get("device_map"))
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    mapped, tok = _load(saved_target, "auto")
    plain, _ = _load(saved_target)
    assert seen == ["auto", None]
    assert not mapped.training and not any(p.requires_grad for p in mapped.parameters())
    assert {p.device.type for p in mapped.parameters()} == {"cpu"}  # nothing left on meta
    ids, attn = _ids(tok)
    (sa, la), (sb, lb) = _capture(mapped, ids, attn), _capture(plain, ids, attn)
    assert torch.equal(la, lb) and all(torch.equal(sa[k], sb[k]) for k in LAYERS)


def test_capture_is_unchanged_under_accelerate_hooks_with_layers_offloaded(saved_target, tmp_path):
    """A hand-made map (half the layers offloaded to disk) puts accelerate's hooks on every module."""
    from transformers import AutoModelForCausalLM

    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.layers.2": "cpu", "model.layers.3": "disk",
                  "model.norm": "cpu", "lm_head": "cpu"}
    hooked = AutoModelForCausalLM.from_pretrained(str(saved_target), device_map=device_map, dtype=torch.float32,
                                                  offload_folder=str(tmp_path / "offload")).eval()
    assert hasattr(hooked.model.layers[1], "_hf_hook")
    plain, tok = _load(saved_target)
    ids, attn = _ids(tok)
    (sa, la), (sb, lb) = _capture(hooked, ids, attn), _capture(plain, ids, attn)
    assert torch.equal(la, lb)
    for k in LAYERS:
        assert torch.equal(sa[k], sb[k]), k


class _Elsewhere(torch.Tensor):
    """A layer output standing for one on another GPU: ops treat it as a plain tensor, and only
    an explicit ``.to(device)`` turns it back into one (which is what moving it does)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def to(self, *args, **kwargs):
        return torch.Tensor.to(self.as_subclass(torch.Tensor), *args, **kwargs)


def test_capture_moves_every_state_to_the_input_device(saved_target):
    model, tok = _load(saved_target)
    ids, attn = _ids(tok)
    want_states, want_last = _capture(model, ids, attn)

    def elsewhere(_m, _i, out):
        if isinstance(out, tuple):
            return (out[0].as_subclass(_Elsewhere), *out[1:])
        return out.as_subclass(_Elsewhere)

    dec = model.model
    handles = [m.register_forward_hook(elsewhere) for m in (dec.embed_tokens, *dec.layers, dec.norm)]
    try:
        states, last = _capture(model, ids, attn)  # hooks registered first: capture sees _Elsewhere
    finally:
        for h in handles:
            h.remove()
    for k, t in [*states.items(), ("last", last)]:
        assert type(t) is torch.Tensor and t.device == ids.device, k
    rows = attn.bool().to(ids.device)
    for k in LAYERS:  # what the pipeline does next: select real tokens with the mask
        assert torch.equal(states[k][rows], want_states[k][rows]), k
    assert torch.equal(last, want_last) and states[3] is last


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.int16).astype(np.int32)


@pytest.mark.e2e
def test_a_device_map_auto_run_writes_the_same_cache(saved_target, tmp_path):
    common = [f"model.path={saved_target}", "seq_length=256", "batch.max_tokens=1024", "data.max_samples=8",
              "storage.chunk_tokens=128", "storage.unit_tokens=256", "progress=false", "log_level=WARNING"]
    plain = run(compose([*common, f"storage.path={tmp_path / 'plain'}"]))
    mapped = run(compose([*common, f"storage.path={tmp_path / 'mapped'}", "model.device_map=auto"]))
    a, b = open_cache(plain.path), open_cache(mapped.path)
    # device_map is not part of the identity
    assert a.manifest.to_json()["config_hash"] == b.manifest.to_json()["config_hash"]
    assert b.manifest.to_json()["config"]["model"]["device_map"] == "auto" and len(a) == len(b) > 0
    assert a.manifest.to_json()["layer_ids"] == b.manifest.to_json()["layer_ids"]
    assert plain.units_written == mapped.units_written > 1
    assert a.store.read_bytes(fmt.WEIGHTS) == b.store.read_bytes(fmt.WEIGHTS)
    for i in range(len(a)):
        ra, rb = a.read_raw(i), b.read_raw(i)
        assert np.array_equal(ra["input_ids"], rb["input_ids"]) and np.array_equal(ra["loss_mask"], rb["loss_mask"])
        for k in ("target_hidden_states", "target_last_hidden_states"):
            if a.storage_dtype == "bf16":  # exact, or one bf16 ulp apart at most
                assert np.abs(_bf16_bits(ra[k]) - _bf16_bits(rb[k])).max() <= 1, (i, k)
            else:
                assert np.array_equal(ra[k], rb[k]), (i, k)
