"""The built-in random-weight target: a tiny Qwen3 (or Qwen3-MoE, DeepSeek V4, GLM-5.2) and a byte-level tokenizer.

Used by the embedded default run, the tests and the benchmarks (no model hub here).
Everything is deterministic: the tokenizer has a fixed byte vocabulary and no merges,
and the weights come from a fixed seed, so the same config always gives the same target.
"""

from __future__ import annotations

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
