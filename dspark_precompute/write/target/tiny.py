"""The built-in random-weight targets: a tiny Qwen3 (or Qwen3-MoE, DeepSeek V4, GLM-5.2) and a byte-level tokenizer;
tiny image-text checkpoints (Qwen3.5/3.6, Qwen3-VL, MiniMax M3) saved as the hub ships them.

Used by the embedded default run, the tests and the benchmarks (no model hub here).
Everything is deterministic: the tokenizer has a fixed byte vocabulary and no merges,
and the weights come from a fixed seed, so the same config always gives the same target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dspark_precompute.write.config.schema import RandomTargetConfig

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>"]

# ChatML with Qwen3's habits: reasoning is rendered only for assistant turns after the
# last user message (so earlier turns are rewritten), tools go into the system turn.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n' }}{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'user' or m.role == 'system' %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content and loop.index0 > ns.last_user %}"
    "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- m.content }}"
    "{%- if m.tool_calls %}{%- for tc in m.tool_calls %}"
    "{{- '<tool_call>\\n' }}{{- {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson }}"
    "{{- '\\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>tool\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer() -> Any:
    """A byte-level BPE tokenizer without merges (one token per byte) plus ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    # transformers leaves the tokenizer's constructor unannotated
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )


def build_config(rc: RandomTargetConfig, vocab_size: int) -> Any:
    """The transformers config of the random target (``model.random.model_type`` picks the family)."""
    if rc.model_type != "qwen3":
        return _moe_config(rc, vocab_size)
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=int(rc.vocab_size or vocab_size),
        hidden_size=rc.hidden_size,
        intermediate_size=rc.intermediate_size,
        num_hidden_layers=rc.num_hidden_layers,
        num_attention_heads=rc.num_attention_heads,
        num_key_value_heads=rc.num_key_value_heads,
        head_dim=rc.head_dim,
        max_position_embeddings=32768,
        tie_word_embeddings=rc.tie_word_embeddings,
        rms_norm_eps=1e-6,
    )


def _moe_config(rc: RandomTargetConfig, vocab_size: int) -> Any:
    """A tiny MoE config of ``rc.model_type``: 2 of ``rc.num_experts`` routed experts per token."""
    from transformers import AutoConfig

    common: dict[str, Any] = dict(
        vocab_size=int(rc.vocab_size or vocab_size), hidden_size=rc.hidden_size,
        num_hidden_layers=rc.num_hidden_layers, num_attention_heads=rc.num_attention_heads,
        num_key_value_heads=rc.num_key_value_heads, head_dim=rc.head_dim, tie_word_embeddings=rc.tie_word_embeddings,
        max_position_embeddings=32768, num_experts_per_tok=2, moe_intermediate_size=max(1, rc.intermediate_size // 4))
    half = max(1, rc.head_dim // 2)
    extra: dict[str, dict[str, Any]] = {
        "qwen3_moe": dict(intermediate_size=rc.intermediate_size, num_experts=rc.num_experts, decoder_sparse_step=1),
        # hyper-connections (4 residual streams), compressed sparse attention, hash-routed MoE
        "deepseek_v4": dict(n_routed_experts=rc.num_experts, n_shared_experts=1, q_lora_rank=2 * rc.head_dim,
                            o_lora_rank=2 * rc.head_dim, o_groups=2, index_n_heads=2, index_head_dim=rc.head_dim,
                            index_topk=8, sliding_window=16, num_key_value_heads=1, hc_mult=4, hc_sinkhorn_iters=3),
        # DeepSeek sparse attention (MLA + indexer), one dense layer first, then MoE
        "glm_moe_dsa": dict(intermediate_size=rc.intermediate_size, n_routed_experts=rc.num_experts,
                            kv_lora_rank=rc.head_dim, q_lora_rank=2 * rc.head_dim, qk_rope_head_dim=half,
                            qk_nope_head_dim=half, v_head_dim=rc.head_dim, index_topk=8, index_head_dim=rc.head_dim,
                            index_n_heads=2, first_k_dense_replace=1, num_key_value_heads=rc.num_attention_heads),
    }
    return AutoConfig.for_model(rc.model_type, **{**common, **extra[rc.model_type]})


def causal_lm_class(config: Any) -> Any:
    """The CausalLM class transformers maps ``config`` to (Qwen3ForCausalLM for a Qwen3Config, ...)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def build_target(rc: RandomTargetConfig, vocab_size: int, dtype: torch.dtype = torch.float32) -> Any:
    """The CausalLM with seeded random weights (identical on every machine with this torch)."""
    config = build_config(rc, vocab_size)
    cls = causal_lm_class(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rc.seed)
        model = cls(config)
        # The default init (std 0.02) makes a random net nearly constant; a wider spread
        # keeps activations varied so tests compare meaningful numbers.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5 if "embed" not in name else 1.0)
    out: Any = model  # transformers types .to() in a way mypy misreads
    return out.to(dtype).eval()


# ---- image-text checkpoints, saved the way the hub ships them ------------------------------------

# Qwen's vision markers (Qwen2-VL .. Qwen3.6); MiniMax M3 uses its own strings
QWEN_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
MINIMAX_VISION_TOKENS = ["]<]start of image[>[", "]<]end of image[>[", "]<]image[>[", "]<]video[>["]

# The ChatML template above, with OpenAI content parts: a text part is its text, an image
# (video) part is the family's start/pad/end markers (the processor expands the pad).
_PARTS = (
    "{%- macro render(content) %}{%- if content is string %}{{- content }}{%- else %}"
    "{%- for part in content %}"
    "{%- if part.type == 'text' %}{{- part.text }}"
    "{%- elif part.type in ('image', 'image_url') %}{{- '" "__START__" "__IMAGE__" "__END__" "' }}"
    "{%- elif part.type in ('video', 'video_url') %}{{- '" "__START__" "__VIDEO__" "__END__" "' }}"
    "{%- endif %}{%- endfor %}{%- endif %}{%- endmacro %}"
)


def image_text_chat_template(vision_tokens: list[str]) -> str:
    """The tiny chat template taking string content or content parts with images and videos."""
    start, end, image, video = vision_tokens
    head = (_PARTS.replace("__START__", start).replace("__END__", end)
            .replace("__IMAGE__", image).replace("__VIDEO__", video))
    body = CHAT_TEMPLATE.replace("messages[0].content", "render(messages[0].content)") \
        .replace("m.content + '<|im_end|>", "render(m.content) + '<|im_end|>").replace("{{- m.content }}",
                                                                                       "{{- render(m.content) }}")
    return head + body


def build_image_text_tokenizer(vision_tokens: list[str]) -> Any:
    """The byte-level tokenizer with the family's vision markers as special tokens."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(vision_tokens)})
    tok.chat_template = image_text_chat_template(vision_tokens)
    return tok


# The families transformers defines as image-text-to-text with a language model inside, tiny:
# text part as the text targets above (64 wide, 4 layers), a 2-block vision tower.
IMAGE_TEXT_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe", "minimax_m3_vl")


def _image_text_parts(model_type: str, ids: dict[str, int], vocab: int) -> dict[str, Any]:
    """``text_config``, ``vision_config`` and top-level keys of a tiny ``model_type`` checkpoint."""
    text: dict[str, Any] = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                                max_position_embeddings=4096, tie_word_embeddings=False)
    vision: dict[str, Any] = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
                                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                                  num_position_embeddings=64)
    top: dict[str, Any] = dict(image_token_id=ids["image"], video_token_id=ids["video"],
                               vision_start_token_id=ids["start"], vision_end_token_id=ids["end"],
                               tie_word_embeddings=False)
    moe = dict(num_experts_per_tok=2, moe_intermediate_size=32)
    if model_type.startswith("qwen3_5"):  # Gated DeltaNet and attention, 3:1
        text.update(layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
                    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4)
        if model_type == "qwen3_5_moe":
            text.update(moe, num_experts=8, shared_expert_intermediate_size=32)
            text.pop("intermediate_size")
    elif model_type.startswith("qwen3_vl"):
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [2, 3, 3],
                                   "mrope_interleaved": True}
        vision["deepstack_visual_indexes"] = [0]
        if model_type == "qwen3_vl_moe":
            text.update(moe, num_local_experts=8, decoder_sparse_step=1)
    else:  # minimax_m3_vl: MoE with block-sparse indexed attention, a ViT with a patch-merge projector
        text.update(moe, num_local_experts=8, dense_intermediate_size=128, shared_intermediate_size=32,
                    rotary_dim=8, index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=2,
                    mlp_layer_types=["dense"] + ["sparse"] * 3, bos_token_id=None, eos_token_id=None)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      image_size=224, patch_size=14, temporal_patch_size=2, spatial_merge_size=2)
        top = dict(image_token_index=ids["image"], video_token_index=ids["video"], projector_hidden_size=64,
                   tie_word_embeddings=False)
    return {"text_config": text, "vision_config": vision, **top}


def build_image_text_config(model_type: str, tokenizer: Any) -> Any:
    """The transformers config of a tiny image-text ``model_type`` whose vision ids are ``tokenizer``'s."""
    from transformers import AutoConfig

    if model_type not in IMAGE_TEXT_TYPES:
        raise ValueError(f"no tiny image-text builder for {model_type!r}; one of {IMAGE_TEXT_TYPES}")
    marks = MINIMAX_VISION_TOKENS if model_type == "minimax_m3_vl" else QWEN_VISION_TOKENS
    ids = dict(zip(("start", "end", "image", "video"), tokenizer.convert_tokens_to_ids(marks), strict=True))
    return AutoConfig.for_model(model_type, **_image_text_parts(model_type, ids, len(tokenizer)))


def image_text_class(config: Any) -> Any:
    """The ``*ForConditionalGeneration`` class transformers maps an image-text ``config`` to."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]


def _processor_files(model_type: str, tokenizer: Any) -> dict[str, dict[str, Any]]:
    """preprocessor_config.json, video_preprocessor_config.json and processor_config.json, as the hub has them."""
    name = "MiniMaxM3VL" if model_type == "minimax_m3_vl" else "Qwen3VL"  # Qwen3.5 ships Qwen3-VL's processor
    patch = 14 if model_type == "minimax_m3_vl" else 16
    image = {"image_processor_type": "MiniMaxM3VLImageProcessor" if model_type == "minimax_m3_vl"
             else "Qwen2VLImageProcessor", "patch_size": patch, "temporal_patch_size": 2, "merge_size": 2,
             "size": {"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32},
             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_rescale": True,
             "rescale_factor": 1 / 255, "do_normalize": True, "do_resize": True, "do_convert_rgb": True}
    video = {**image, "video_processor_type": f"{name}VideoProcessor", "fps": 2, "min_frames": 2,
             "max_frames": 8}
    video.pop("image_processor_type")
    processor = {"processor_class": f"{name}Processor"}
    return {"preprocessor_config.json": image, "video_preprocessor_config.json": video,
            "processor_config.json": processor}


def save_image_text_checkpoint(model_type: str, directory: Path, seed: int = 0,
                               dtype: torch.dtype = torch.float32) -> Any:
    """A tiny random ``model_type`` image-text checkpoint in ``directory``, laid out as the hub ships it.

    ``*ForConditionalGeneration`` weights with the vision tower (safetensors), config.json with
    ``text_config``/``vision_config``, the tokenizer with the vision markers, the chat template
    (``chat_template.jinja``, for the tokenizer and the processor) and the processor's configs.
    Returns the built model (the oracle for tests). ``AutoImageProcessor`` loads the PIL image
    processor without torchvision; ``AutoProcessor`` also builds the video processor, which needs it.
    """
    import json

    tokenizer = build_image_text_tokenizer(MINIMAX_VISION_TOKENS if model_type == "minimax_m3_vl"
                                           else QWEN_VISION_TOKENS)
    config = build_image_text_config(model_type, tokenizer)
    config.architectures = [image_text_class(config).__name__]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = image_text_class(config)(config)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5 if "embed_tokens" not in pname else 1.0)
    out: Any = model
    out = out.to(dtype).eval()
    directory.mkdir(parents=True, exist_ok=True)
    out.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    for fname, body in _processor_files(model_type, tokenizer).items():
        (directory / fname).write_text(json.dumps(body, indent=2) + "\n")
    return out
