"""Text rows through image-text checkpoints, and targets that need no attention flag.

The oracle is the checkpoint's own forward: ``AutoModelForImageTextToText`` (the whole
``*ForConditionalGeneration``, vision tower included) with ``output_hidden_states``, one row at a time.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import compose, small
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from dspark_precompute import open_cache
from dspark_precompute.errors import ConfigError
from dspark_precompute.write.config.schema import RandomTargetConfig
from dspark_precompute.write.run import run
from dspark_precompute.write.target import tiny

FEW = ("data.max_samples=6", "model.layer_ids=[-1,1,3]", "model.dtype=fp32")


def read_tensor_names(monkeypatch) -> list[str]:
    """The safetensors tensors transformers materializes (it reads one only when it indexes the lazy slice)."""
    import transformers.modeling_utils as mu

    seen: list[str] = []
    real = mu.safe_open

    class Slice:
        def __init__(self, name, sl):
            self.name, self.sl = name, sl

        def __getitem__(self, i):
            seen.append(self.name)
            return self.sl[i]

        def __getattr__(self, attr):
            return getattr(self.sl, attr)

    class File:
        def __init__(self, f):
            self.f = f

        def get_slice(self, name):
            return Slice(name, self.f.get_slice(name))

        def __getattr__(self, attr):
            return getattr(self.f, attr)

    monkeypatch.setattr(mu, "safe_open", lambda *a, **k: File(real(*a, **k)))
    return seen


_FULL: dict = {}


def full_forward_states(path, ids: torch.Tensor) -> tuple:
    """The whole checkpoint's own forward on one row (loaded once per checkpoint)."""
    if path not in _FULL:
        _FULL.clear()
        _FULL[path] = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return _FULL[path](input_ids=ids[None], output_hidden_states=True).hidden_states


@pytest.mark.parametrize("model_type", tiny.IMAGE_TEXT_TYPES)
def test_text_rows_through_an_image_text_checkpoint_equal_its_own_forward_and_the_vision_tower_is_not_read(
        tmp_path, monkeypatch, model_type):
    src = tmp_path / "src"
    tiny.save_image_text_checkpoint(model_type, src)
    seen = read_tensor_names(monkeypatch)
    cfg = compose(small(tmp_path, f"model.path={src}", "batch.max_samples=1", *FEW))
    result = run(cfg)
    assert seen and all("language_model." in n or n.startswith("lm_head.") for n in seen), \
        [n for n in seen if "language_model." not in n][:5]
    monkeypatch.undo()
    c = open_cache(cfg.storage.path)
    assert len(c) == result.samples > 0
    for i in range(len(c)):
        s = c[i]
        hs = full_forward_states(src, s["input_ids"])
        for j, lid in enumerate([-1, 1]):
            H = hs[0].shape[-1]
            assert torch.equal(s["target_hidden_states"][:, j * H:(j + 1) * H], hs[lid + 1][0].to(torch.bfloat16))
        assert torch.equal(s["target_last_hidden_states"], hs[-1][0].to(torch.bfloat16))
    part = json.loads((tmp_path / "cache" / "manifest.json").read_text())["capture"]["target_part"]
    assert part["loaded"] == "model.language_model"
    assert part["checkpoint_class"] == tiny.image_text_class(
        AutoModelForImageTextToText.from_pretrained(src).config).__name__
    vision = "model.vision_tower" if model_type == "minimax_m3_vl" else "model.visual"
    assert vision in part["skipped_modules"]
    assert part["skipped_bytes"] == _vision_bytes(src)


def _vision_bytes(src) -> int:
    """Stored bytes of every tensor outside the language model and lm_head (the safetensors header, read here)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if "language_model." not in name and not name.startswith("lm_head."):
                t = f.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * {"F32": 4, "BF16": 2, "F16": 2}[t.get_dtype()]
    return total


def test_the_fit_check_and_the_dry_run_count_the_language_model_only(tmp_path):
    from dspark_precompute.write.dryrun import dry_run

    src = tmp_path / "src"
    full = tiny.save_image_text_checkpoint("qwen3_vl", src)
    plan = dry_run(compose(small(tmp_path, f"model.path={src}", *FEW)))
    lm = sum(p.numel() for n, p in full.named_parameters() if not n.startswith("model.visual."))
    assert plan.parameters == lm < sum(p.numel() for p in full.parameters())
    assert plan.weight_bytes == lm * 4


def test_a_padded_batch_of_the_hybrid_qwen3_5_matches_single_rows_within_the_documented_tolerance(tmp_path):
    """Gated DeltaNet + attention, right-padded: not bit for bit, within 1e-5 in fp32 (docs/targets.md)."""
    src = tmp_path / "src"
    tiny.save_image_text_checkpoint("qwen3_5", src)
    one = compose(small(tmp_path, f"model.path={src}", "batch.max_samples=1", "storage.dtype=fp32", *FEW, name="one"))
    many = compose(small(tmp_path, f"model.path={src}", "batch.max_samples=6", "storage.dtype=fp32", *FEW,
                         name="many"))
    run(one)
    run(many)
    a, b = open_cache(one.storage.path), open_cache(many.storage.path)
    assert len(a) == len(b) > 0
    worst = 0.0
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"])
        worst = max(worst, float((x["target_last_hidden_states"].float() - y["target_last_hidden_states"].float())
                                 .abs().max()))
    assert worst <= 1e-5


def deepseek_v4_checkpoint(path):
    tok = tiny.build_tokenizer()
    rc = RandomTargetConfig(model_type="deepseek_v4", num_hidden_layers=2)
    model = tiny.build_target(rc, len(tok), attn_implementation="eager")
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return model


def test_a_deepseek_v4_checkpoint_runs_without_an_attention_flag_and_records_the_chosen_one(tmp_path):
    src = tmp_path / "src"
    deepseek_v4_checkpoint(src)
    cfg = compose(small(tmp_path, f"model.path={src}", "data.max_samples=4", "model.layer_ids=[0,1]",
                        "model.dtype=fp32", "batch.max_samples=1"))
    assert cfg.model.attn_implementation == "auto"
    run(cfg)
    m = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert m["capture"]["attn_implementation"] == "eager"
    assert m["identity"]["target"]["attn_implementation"] == "eager"
    oracle = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager").eval()
    c = open_cache(cfg.storage.path)
    assert len(c) > 0
    for i in range(len(c)):
        with torch.no_grad():
            want = oracle(input_ids=c[i]["input_ids"][None], output_hidden_states=True).hidden_states[-1][0]
        assert torch.equal(c[i]["target_last_hidden_states"], want.to(torch.bfloat16))


def test_an_attention_the_target_class_lacks_is_refused_before_its_weights_load(tmp_path, monkeypatch):
    from helpers import refuse_building_weights

    src = tmp_path / "src"
    deepseek_v4_checkpoint(src)
    refuse_building_weights(monkeypatch)
    with pytest.raises(ConfigError, match=r"DeepseekV4ForCausalLM has no sdpa attention .*\(it has eager\)"):
        run(compose(small(tmp_path, f"model.path={src}", "model.attn_implementation=sdpa")))


def test_a_qwen3_target_still_records_sdpa_so_earlier_caches_keep_their_identity(tmp_path):
    cfg = compose(small(tmp_path, "data.max_samples=2"))
    run(cfg)
    m = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert m["identity"]["target"]["attn_implementation"] == "sdpa" == m["capture"]["attn_implementation"]
