"""The frozen target: identity (before any weights load), tokenizer, model and capture.

Capture runs the decoder stack only (never the vocabulary projection) and collects the
chosen layers with forward hooks: id ``-1`` from the embedding output, ``0..N-2`` from
decoder layer outputs, and ``N-1`` from the model's final post-norm output.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dspark_precompute import tiny
from dspark_precompute.config import TINY, ModelConfig
from dspark_precompute.errors import TargetError

log = logging.getLogger(__name__)

_MULTIMODAL_KEYS = ("vision_config", "audio_config", "visual", "vision_tower")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass
class TargetInfo:
    """What is known about the target without loading its weights."""

    path: str
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    config_sha256: str
    weights_fingerprint: str
    local_dir: Path | None = None
    tied: bool = True  # lm_head shares the embedding matrix
    extra: dict[str, Any] = field(default_factory=dict)


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def fingerprint_files(files: list[Path], mode: str = "sampled") -> str:
    """sha256 over each weight file's name, size and bytes (all of them, or 18 spread samples).

    ``sampled`` reads the first and last MiB (the safetensors header and edges) and 16
    blocks of 64 KiB spread over the file: milliseconds for a 16 GB checkpoint, and a
    full fine-tune or a re-save changes it, but a change confined to a few tensors can
    fall between the samples. ``model.fingerprint=full`` hashes every byte.
    """
    h = hashlib.sha256()
    for f in sorted(files, key=lambda p: p.name):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if mode == "full" or size <= 4 << 20:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
                continue
            h.update(fh.read(1 << 20))
            for k in range(16):
                fh.seek((size * (k + 1)) // 18)
                h.update(fh.read(1 << 16))
            fh.seek(size - (1 << 20))
            h.update(fh.read())
    return h.hexdigest()


def _tiny_info(cfg: ModelConfig, tokenizer: Any) -> TargetInfo:
    config = tiny.build_config(cfg.random, len(tokenizer))
    cdict = config.to_dict()
    cdict.pop("transformers_version", None)
    return TargetInfo(
        path=TINY,
        model_type="qwen3",
        num_hidden_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        config_sha256=_sha256_json(cdict),
        # Deterministic from (config, seed, init recipe): the fingerprint names them.
        weights_fingerprint=_sha256_json({"config": cdict, "seed": cfg.random.seed, "init": "tiny-v1"}),
        tied=bool(config.tie_word_embeddings),
    )


def resolve_local_dir(path: str, revision: str | None = None) -> Path:
    """A local directory with the target's files; hub ids are fetched into the HF cache."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path, revision=revision, allow_patterns=[
            "*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]))
    except Exception as exc:
        raise TargetError(
            f"model.path={path!r}: not a local directory and the hub download failed ({exc}). "
            "Download the model first or point model.path at a local copy."
        ) from exc


def inspect_target(cfg: ModelConfig, tokenizer: Any) -> TargetInfo:
    """Read the target's config and fingerprint its weight files; raise on unsupported targets."""
    if cfg.path == TINY:
        return _tiny_info(cfg, tokenizer)
    local = resolve_local_dir(cfg.path, cfg.revision)
    config_file = local / "config.json"
    if not config_file.is_file():
        raise TargetError(f"model.path={cfg.path!r} has no config.json at {local}")
    cdict = json.loads(config_file.read_text())
    problems = []
    model_type = str(cdict.get("model_type", ""))
    if any(k in cdict for k in _MULTIMODAL_KEYS):
        problems.append(
            f"model.path={cfg.path!r} is a multimodal config ({model_type}); point model.path at a text-only "
            "checkpoint of the language model"
        )
    text = cdict.get("text_config", cdict)
    n_layers, hidden, vocab = text.get("num_hidden_layers"), text.get("hidden_size"), text.get("vocab_size")
    if not (isinstance(n_layers, int) and isinstance(hidden, int) and isinstance(vocab, int)):
        problems.append(
            f"model.path={cfg.path!r} (model_type={model_type!r}) is not a decoder-only LM config with "
            "num_hidden_layers, hidden_size and vocab_size; only causal LMs are supported"
        )
    if problems:
        raise TargetError("; ".join(problems))
    weights = [f for f in local.iterdir() if f.suffix in _WEIGHT_SUFFIXES]
    if not weights:
        raise TargetError(f"model.path={cfg.path!r} has no weight files (*.safetensors) in {local}")
    return TargetInfo(
        path=cfg.path,
        model_type=model_type,
        num_hidden_layers=n_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        config_sha256=hashlib.sha256(config_file.read_bytes()).hexdigest(),
        weights_fingerprint=fingerprint_files(weights, cfg.fingerprint),
        local_dir=local,
        tied=bool(text.get("tie_word_embeddings", cdict.get("tie_word_embeddings", True))),
    )


def load_tokenizer(cfg: ModelConfig) -> Any:
    """The tokenizer of model.tokenizer, else of model.path (the byte-level one for tiny)."""
    source = cfg.tokenizer
    if source is None and cfg.path == TINY:
        return tiny.build_tokenizer()
    from transformers import AutoTokenizer

    source = source or cfg.path
    if cfg.trust_remote_code:
        log.warning("model.trust_remote_code=true: code from %s will run in this process", source)
    try:
        return AutoTokenizer.from_pretrained(source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except Exception as exc:
        raise TargetError(f"cannot load the tokenizer from {source!r}: {exc}") from exc


def tokenizer_sha256(tokenizer: Any) -> str:
    """Content hash of the tokenizer (its full serialized form plus special tokens)."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # slow tokenizer: the vocabulary is its identity
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps({k: str(v) for k, v in tokenizer.special_tokens_map.items()}, sort_keys=True).encode())
    return h.hexdigest()


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_compute_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]


def load_target(cfg: ModelConfig, info: TargetInfo, vocab_size: int, device: torch.device,
                dtype: torch.dtype) -> Any:
    """The CausalLM in eval mode with gradients off (its lm_head is kept only for export)."""
    if cfg.path == TINY:
        return tiny.build_target(cfg.random, vocab_size, dtype).to(device)
    from transformers import AutoModelForCausalLM

    # safetensors only: a pickled .bin checkpoint would run arbitrary code on load.
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": cfg.trust_remote_code, "use_safetensors": True}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.device_map:
        kwargs["device_map"] = cfg.device_map
    try:
        model = AutoModelForCausalLM.from_pretrained(str(info.local_dir or cfg.path), **kwargs)
    except Exception as exc:
        raise TargetError(f"cannot load the target from {cfg.path!r}: {exc}") from exc
    if not cfg.device_map:
        model = model.to(device)
    model.eval().requires_grad_(False)
    return model


def decoder_of(model: Any) -> Any:
    """The base decoder (embeddings, layers, final norm) under a CausalLM."""
    for cand in (getattr(model, "model", None), model.get_decoder() if hasattr(model, "get_decoder") else None):
        if cand is not None and hasattr(cand, "layers") and hasattr(cand, "embed_tokens"):
            return cand
    raise TargetError(f"{type(model).__name__} has no decoder with .layers and .embed_tokens to capture from")


class HiddenStateCapture:
    """Runs the decoder once per batch and returns the chosen layers' hidden states."""

    def __init__(self, model: Any, layer_ids: list[int]):
        self.model = model
        self.decoder = decoder_of(model)
        self.num_layers = len(self.decoder.layers)
        self.layer_ids = list(layer_ids)
        self._store: dict[int, torch.Tensor] = {}
        self._handles = []
        for lid in self.layer_ids:
            if lid == self.num_layers - 1:
                continue  # the post-norm output of the decoder itself
            module = self.decoder.embed_tokens if lid == -1 else self.decoder.layers[lid]
            self._handles.append(module.register_forward_hook(self._hook(lid)))

    def _hook(self, lid: int):
        def fn(_module, _inputs, output):
            self._store[lid] = output[0] if isinstance(output, tuple) else output
        return fn

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
                 ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        self._store = {}
        out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        last = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        # Under device_map the layers (so their outputs) sit on several devices: bring every
        # state to the device of input_ids, where the caller's masks and buffers live.
        device = input_ids.device
        last = last.to(device)
        states = {lid: (last if lid == self.num_layers - 1 else self._store[lid].to(device))
                  for lid in self.layer_ids}
        self._store = {}
        return states, last

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def export_weights(model: Any) -> dict[str, torch.Tensor]:
    """``embed_tokens.weight`` and ``lm_head.weight`` (the latter omitted when tied)."""
    emb = model.get_input_embeddings().weight.detach()
    out = {"embed_tokens.weight": emb}
    head = model.get_output_embeddings()
    if head is not None and head.weight.data_ptr() != emb.data_ptr():
        out["lm_head.weight"] = head.weight.detach()
    return out


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
