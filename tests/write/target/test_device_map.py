"""Targets larger than one GPU: ``model.device_map=auto`` (accelerate) and capture across devices.

This machine has no GPU, so the checks are: the device_map path loads a saved target
through accelerate (and gives the same cache as the plain path: tests/e2e/test_write_device_map.py);
capture is unchanged when accelerate's hooks wrap the layers (some offloaded to disk); and
every captured state comes back on the device of ``input_ids`` (where the pipeline's row
mask lives) even when a layer hands it over from elsewhere.
"""

from __future__ import annotations

import accelerate  # noqa: F401 - in the [test] extra: model.device_map=auto needs it, a missing one fails here
import torch

from dspark_precompute.write.config.schema import ModelConfig
from dspark_precompute.write.target.capture import HiddenStateCapture
from dspark_precompute.write.target.load import inspect_target, load_target, load_tokenizer

LAYERS = [-1, 0, 2, 3]  # embeddings, decoder layers, and the final post-norm output


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
