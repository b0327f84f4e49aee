"""The tiny image-text checkpoints: laid out as the hub ships them, loadable by transformers' own classes."""

import json

import pytest
import torch
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from dspark_precompute.write.target import tiny


@pytest.mark.parametrize("model_type", tiny.IMAGE_TEXT_TYPES)
def test_a_tiny_image_text_checkpoint_loads_as_transformers_own_image_text_model(tmp_path, model_type):
    built = tiny.save_image_text_checkpoint(model_type, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert {"text_config", "vision_config"} <= set(config)
    assert config["architectures"] == [type(built).__name__]
    assert type(built).__name__.endswith("ForConditionalGeneration")
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32).eval()
    want = built.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)  # every weight, bit for bit
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        a = loaded(input_ids=ids, output_hidden_states=True).hidden_states
        b = built(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(a) == len(b) == 5
    # Within fp32 rounding, not bit for bit: the loaded weights are views of the safetensors file, 24 bytes off a
    # 64-byte boundary, and on an AMD EPYC MKL's kernels round the MoE experts' products differently there
    # (the same weights copied to aligned memory give the built model's bits)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-5)


def test_the_tiny_chat_template_renders_an_image_part_as_the_vision_markers(tmp_path):
    tiny.save_image_text_checkpoint("qwen3_vl", tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "image", "image": "a.jpg"}, {"type": "text", "text": "what is it?"}]}], tokenize=False)
    assert text == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what is it?<|im_end|>\n"
    assert tok.convert_tokens_to_ids("<|image_pad|>") == json.loads(
        (tmp_path / "config.json").read_text())["image_token_id"]
    assert type(AutoImageProcessor.from_pretrained(tmp_path)).__name__ == "Qwen2VLImageProcessorPil"
