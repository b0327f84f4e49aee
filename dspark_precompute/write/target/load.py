"""The frozen target: its identity and fit (before any weights load), tokenizer and model.

Everything that reads only small files (config.json, safetensors headers, weight hashes)
runs first, so a target this tool cannot run is refused before its weights load.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dspark_precompute.contract.store import write_atomically
from dspark_precompute.errors import TargetError
from dspark_precompute.write.config.schema import TINY, ModelConfig, ParallelConfig
from dspark_precompute.write.target import sharding, tiny
from dspark_precompute.write.target.image_text import (
    LANGUAGE_MODEL,
    ImageTextPart,
    checkpoint_class,
    image_text_class_name,
    language_model_class,
    part_of,
)

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
    weight_files: list[Path] = field(default_factory=list)
    model_class: str | None = None  # the class transformers builds (None: the checkpoint's own code)
    attn_implementation: str | None = None  # the one it runs with (model.attn_implementation=auto: chosen here)
    part: ImageTextPart | None = None  # an image-text checkpoint: only its language model is loaded
    skipped_bytes: int | None = None  # stored bytes of the image-text tensors left unread (None: no weight files)

    def loads(self, tensor: str) -> bool:
        """Whether the checkpoint's tensor named ``tensor`` is read when the target loads."""
        return self.part is None or self.part.loads(tensor)

    def load_vision(self) -> None:
        """Rows with images: load the whole image-text checkpoint (its vision tower runs on their pixels)."""
        if self.part is None or self.part.vision:
            return
        self.part = self.part.with_vision()
        if self.weight_files:
            self.skipped_bytes = safetensors_parameter_bytes(self.weight_files, None, lambda t: not self.loads(t))

    def capture_part(self) -> dict[str, Any] | None:
        """``capture.target_part``: what of an image-text checkpoint was loaded; None for a causal LM."""
        return None if self.part is None else self.part.record(self.skipped_bytes)


def _sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


HASH_CACHE_ENV = "DSPARK_CACHE_DIR"


def hash_cache_path() -> Path:
    """Per-user file remembering each weight file's sha256 (``$DSPARK_CACHE_DIR`` or ``~/.cache``)."""
    root = os.environ.get(HASH_CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / \
        "dspark_precompute"
    return Path(root) / "weight_hashes.json"


def _file_key(f: Path) -> tuple[str, dict[str, int]]:
    st = f.stat()
    # ctime cannot be set by a user (mtime can, with touch -d): a rewrite always changes it
    return str(f.resolve()), {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
                              "ino": st.st_ino}


def sha256_file(f: Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for chunk in iter(lambda: fh.read(block), b""):
            h.update(chunk)
    return h.hexdigest()


def file_sha256s(files: list[Path]) -> dict[Path, str]:
    """sha256 of every byte of each file, remembered per user keyed on (path, size, mtime, ctime, inode).

    A 16 GB checkpoint is read once (about 1 GB/s here); later runs stat it and reuse the
    hash. Any rewrite of a file changes its ctime, so a changed byte is never missed.
    """
    cache_file = hash_cache_path()
    try:
        known = json.loads(cache_file.read_text())
        known = known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        known = {}
    out: dict[Path, str] = {}
    changed = False
    for f in files:
        key, stat = _file_key(f)
        entry = known.get(key)
        if isinstance(entry, dict) and all(entry.get(k) == v for k, v in stat.items()) and \
                isinstance(entry.get("sha256"), str):
            out[f] = entry["sha256"]
            continue
        log.info("hashing %s (%.1f GB) for the cache identity; remembered in %s", f, stat["size"] / 1e9, cache_file)
        digest = sha256_file(f)
        if _file_key(f)[1] != stat:  # rewritten while we read it: the hash may mix two versions
            raise TargetError(f"{f} changed while it was being hashed; wait until it is written completely")
        out[f] = digest
        known[key] = {**stat, "sha256": digest}
        changed = True
    if changed:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(cache_file, [json.dumps(known, sort_keys=True).encode()],
                             tmp=cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp"), fsync=False)
        except OSError as exc:  # a read-only home: hash again next time, nothing else is lost
            log.warning("could not remember weight hashes in %s (%s); they will be recomputed next run",
                        cache_file, exc)
    return out


def fingerprint_files(files: list[Path], mode: str = "full") -> str:
    """Identity of the weight files: name, size and a hash of their bytes.

    ``full`` (the default) hashes every byte (remembered per user, see :func:`file_sha256s`).
    ``sampled`` reads the first and last MiB and 16 blocks of 64 KiB spread over each file:
    milliseconds for a 16 GB checkpoint, but a change confined to a few tensors can fall
    between the samples.
    """
    h = hashlib.sha256()
    full = file_sha256s(files) if mode == "full" else {}
    for f in sorted(files, key=lambda p: p.name):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        if mode == "full":
            h.update(full[f].encode())
            continue
        with open(f, "rb") as fh:
            if size <= 4 << 20:
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
    cls = tiny.causal_lm_class(config)
    return TargetInfo(
        path=TINY,
        model_type=cfg.random.model_type,
        num_hidden_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        config_sha256=_sha256_json(cdict),
        # Deterministic from (config, seed, init recipe): the fingerprint names them.
        weights_fingerprint=_sha256_json({"config": cdict, "seed": cfg.random.seed, "init": "tiny-v1"}),
        tied=bool(config.tie_word_embeddings),
        extra=sharding.shape_facts(cdict),
        model_class=cls.__name__, attn_implementation=choose_attention(cfg.attn_implementation, cls),
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


# Targets a plain single-process ``AutoModelForCausalLM`` cannot run, with the route to take
# (NeMo AutoModel's precompute refuses the same ones before loading).
_ROUTE_DISTRIBUTED = ("transformers (this version) does not define it, so it cannot be loaded or sharded here; "
                      "train its draft online with NeMo AutoModel's distributed DSpark recipe, or precompute with "
                      "NeMo's distributed precompute entry point")
# DeepSeek V4 (deepseek_v4) and GLM-5.2 (glm_moe_dsa) are transformers causal LMs: sharded by parallel.*.
UNSUPPORTED_TARGETS = {
    "deepseek_v41": f"DeepSeek V4.1 (MoE, native DSpark module): {_ROUTE_DISTRIBUTED}",
    "kimi_k3": f"Kimi K3 (multimodal MoE): {_ROUTE_DISTRIBUTED}",
}
UNSUPPORTED_ARCHITECTURES = {
    "DeepseekV41ForCausalLM": "deepseek_v41",
    "KimiK3ForCausalLM": "kimi_k3", "KimiK3ForConditionalGeneration": "kimi_k3",
}


def _causal_lm_problem(cfg: ModelConfig, cdict: dict[str, Any], model_type: str) -> str | None:
    """Why transformers cannot load this config as a plain causal LM here, or None."""
    archs = [a for a in cdict.get("architectures") or [] if isinstance(a, str)]
    known = UNSUPPORTED_TARGETS.get(model_type) or next(
        (UNSUPPORTED_TARGETS[UNSUPPORTED_ARCHITECTURES[a]] for a in archs if a in UNSUPPORTED_ARCHITECTURES), None)
    if known:
        return f"model.path={cfg.path!r} ({model_type or archs}): {known}"
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if any(k in cdict for k in _MULTIMODAL_KEYS):
        if image_text_class_name(cdict):
            return None
        return (f"model.path={cfg.path!r} is a multimodal config ({model_type}) that transformers "
                f"{transformers.__version__} maps to no image-text class with a language model inside; point "
                "model.path at a text-only checkpoint of its language model")
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    auto_map = cdict.get("auto_map") or {}
    if "AutoModelForCausalLM" in auto_map:
        if cfg.trust_remote_code:
            return None
        return (f"model.path={cfg.path!r} (model_type={model_type!r}) is a causal LM only through code shipped "
                "with the checkpoint (auto_map); that code would run in this process. Read it, then pass "
                "model.trust_remote_code=true if you trust it")
    return (f"model.path={cfg.path!r}: transformers {transformers.__version__} cannot load model_type "
            f"{model_type!r} as a causal LM (AutoModelForCausalLM); use a decoder-only text model, or a "
            "transformers version that supports it")


_SAFETENSORS_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
                      "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _safetensors_header(f: Path) -> dict[str, Any]:
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if not 0 < n <= 100 << 20:
            raise TargetError(f"{f} is not a safetensors file (header length {n})")
        try:
            header = json.loads(fh.read(n))
        except ValueError as exc:
            raise TargetError(f"{f} has a corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise TargetError(f"{f} has a corrupt safetensors header (not a JSON object)")
    return header


def safetensors_names(files: list[Path]) -> list[str]:
    """The tensor names of ``files``, from their headers alone."""
    return [name for f in files for name in _safetensors_header(f) if name != "__metadata__"]


def safetensors_numel_by_dtype(files: list[Path], keep: Callable[[str], bool] | None = None) -> dict[str, int]:
    """Elements per safetensors dtype (``BF16``, ``F32``, ...) over ``files`` (the tensors ``keep`` names), from
    their headers alone."""
    out: dict[str, int] = {}
    for f in files:
        header = _safetensors_header(f)
        for name, t in header.items():
            if name == "__metadata__" or not isinstance(t, dict) or (keep is not None and not keep(name)):
                continue
            numel = 1
            for d in t.get("shape", []):
                numel *= int(d)
            kind = str(t.get("dtype", ""))
            out[kind] = out.get(kind, 0) + numel
    return out


def safetensors_parameter_bytes(files: list[Path], dtype_itemsize: int | None,
                                keep: Callable[[str], bool] | None = None) -> int:
    """Bytes the weights (those ``keep`` names) take at the compute dtype, from the safetensors headers alone.

    Floating tensors are cast to the compute dtype on load; others keep their stored size.
    ``dtype_itemsize=None``: every tensor at its stored size.
    """
    return sum(numel * (dtype_itemsize if dtype_itemsize and kind.startswith(("F", "BF"))
                        else _SAFETENSORS_SIZES.get(kind, 4))
               for kind, numel in safetensors_numel_by_dtype(files, keep).items())


def parameter_count(cfg: ModelConfig, info: TargetInfo) -> int:
    """The target's parameters (elements of every stored tensor; a meta-device build for ``tiny``)."""
    if info.weight_files:
        return sum(safetensors_numel_by_dtype(info.weight_files, info.loads).values())
    return _meta_numel(cfg, info)


def _meta_numel(cfg: ModelConfig, info: TargetInfo) -> int:
    """Parameters of what would load (a meta-device build: no memory, no init): the built-in random target, or a
    checkpoint's class from its config.json alone (no weight files here: a dry run before the download)."""
    if cfg.path == TINY:
        config = tiny.build_config(cfg.random, info.vocab_size)
        cls = tiny.causal_lm_class(config)
    else:
        config = _transformers_config(cfg, info)
        cls = target_class(info)
    with torch.device("meta"):
        if cls is None:  # the checkpoint's own code (model.trust_remote_code=true, checked before)
            from transformers import AutoModelForCausalLM

            # transformers leaves from_config unannotated
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)  # type: ignore[no-untyped-call]
        else:
            model = cls(config)
    return sum(p.numel() for p in model.parameters())


def _transformers_config(cfg: ModelConfig, info: TargetInfo) -> Any:
    """transformers' config of a checkpoint directory (config.json alone)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(info.local_dir or cfg.path), trust_remote_code=cfg.trust_remote_code)
    except Exception as exc:
        raise TargetError(f"transformers cannot read the config of model.path={cfg.path!r}: {exc}") from exc


ATTN_AUTO = "auto"
# model.attn_implementation -> the class flag transformers checks before it dispatches to it
_ATTN_FLAGS = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
               "flash_attention_3": "_supports_flash_attn", "flex_attention": "_supports_flex_attn"}


def target_class(info: TargetInfo) -> Any | None:
    """The class a checkpoint loads as: its causal LM, the language-model-only class of an image-text checkpoint,
    or None (a class only the checkpoint's own code defines)."""
    if info.part is not None:
        if info.part.vision:
            return checkpoint_class(info.part.checkpoint_class)
        return language_model_class(info.part.checkpoint_class)
    if info.model_class is None:
        return None
    import transformers

    return getattr(transformers, info.model_class)


def choose_attention(requested: str | None, cls: Any | None) -> str | None:
    """The attention implementation the target runs with, decided from the class's own flags before weights load.

    ``auto``: sdpa where transformers has it for ``cls``, else eager (DeepSeek V4 in 5.24). An explicit choice is
    kept, and refused when ``cls`` lacks it. ``None`` (and ``auto`` on a checkpoint's own code): transformers'
    own default.
    """
    if cls is None:
        return None if requested == ATTN_AUTO else requested
    if requested == ATTN_AUTO:
        return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    flag = _ATTN_FLAGS.get(str(requested))
    if flag is not None and not getattr(cls, flag, False):
        import transformers

        has = ["eager", *(k for k, f in _ATTN_FLAGS.items() if getattr(cls, f, False))]
        raise TargetError(f"model.attn_implementation={requested!r}: {cls.__name__} has no {requested} attention in "
                          f"transformers {transformers.__version__} (it has {', '.join(has)}); pass one of those, or "
                          "model.attn_implementation=auto to let this tool choose")
    return requested


def inspect_target(cfg: ModelConfig, tokenizer: Any, fingerprint: bool = True) -> TargetInfo:
    """Read the target's config and fingerprint its weight files; raise on targets this tool cannot run.

    Everything here reads small files only (config, safetensors headers) plus the weight
    hashes, so an unsupported target is refused before any weights load. ``fingerprint=False``
    (a dry run) skips the hashes: nothing is read beyond the headers and nothing is remembered,
    and a directory with config.json but no weight files yet is planned from the config alone
    (its fingerprint is then not computed; a real run refuses it).
    """
    if cfg.path == TINY:
        return _tiny_info(cfg, tokenizer)
    local = resolve_local_dir(cfg.path, cfg.revision)
    config_file = local / "config.json"
    cdict = _read_config_json(cfg, local)
    model_type = str(cdict.get("model_type", ""))
    problems = [p for p in [_causal_lm_problem(cfg, cdict, model_type)] if p]
    text = cdict.get("text_config", cdict)
    n_layers, hidden, vocab = text.get("num_hidden_layers"), text.get("hidden_size"), text.get("vocab_size")
    if not (isinstance(n_layers, int) and isinstance(hidden, int) and isinstance(vocab, int)):
        problems.append(
            f"model.path={cfg.path!r} (model_type={model_type!r}) is not a decoder-only LM config with "
            "num_hidden_layers, hidden_size and vocab_size; only causal LMs are supported"
        )
    if problems:
        raise TargetError("; ".join(problems))
    weights = _weight_files(cfg, local, required=fingerprint)
    info = TargetInfo(
        path=cfg.path,
        model_type=model_type,
        num_hidden_layers=n_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        config_sha256=hashlib.sha256(config_file.read_bytes()).hexdigest(),
        weights_fingerprint=fingerprint_files(weights, cfg.fingerprint) if fingerprint else "",
        local_dir=local,
        tied=bool(text.get("tie_word_embeddings", cdict.get("tie_word_embeddings", True))),
        weight_files=weights, extra=sharding.shape_facts(cdict),
    )
    _resolve_class(cfg, cdict, info)
    return info


def _read_config_json(cfg: ModelConfig, local: Path) -> dict[str, Any]:
    config_file = local / "config.json"
    if not config_file.is_file():
        raise TargetError(f"model.path={cfg.path!r} has no config.json at {local}")
    try:
        cdict = json.loads(config_file.read_text())
    except ValueError as exc:
        raise TargetError(f"{config_file} is not valid JSON ({exc})") from None
    if not isinstance(cdict, dict):
        raise TargetError(f"{config_file} is not a JSON object")
    return cdict


def _weight_files(cfg: ModelConfig, local: Path, required: bool) -> list[Path]:
    """The safetensors files; none is an error for a real run (``required``), a plan from config.json for a dry run."""
    weights = sorted(f for f in local.iterdir() if f.suffix == ".safetensors")
    if weights:
        return weights
    pickled = sorted(f.name for f in local.iterdir() if f.suffix in _WEIGHT_SUFFIXES)
    if pickled:
        raise TargetError(
            f"model.path={cfg.path!r} has only pickled weights ({', '.join(pickled[:3])}); this tool loads "
            "safetensors only, because unpickling runs code. Convert the checkpoint to safetensors "
            "(model.save_pretrained(dir, safe_serialization=True) in a trusted environment)")
    if required:
        raise TargetError(f"model.path={cfg.path!r} has no weight files (*.safetensors) in {local}; download them "
                          "first (dry_run=true plans the run from config.json and the tokenizer alone)")
    log.info("model.path=%r has no weight files yet: planning from config.json alone (weights fingerprint not "
             "computed)", cfg.path)
    return []


def _resolve_class(cfg: ModelConfig, cdict: dict[str, Any], info: TargetInfo) -> None:
    """The class the checkpoint loads as, what of an image-text checkpoint is left out, and the attention choice."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = image_text_class_name(cdict)
    if name is not None:
        part = part_of(name, _transformers_config(cfg, info))
        nested = any(LANGUAGE_MODEL in t.split(".")[:-1] for t in safetensors_names(info.weight_files))
        info.part = dataclasses.replace(part, nested=nested or not info.weight_files)
        info.model_class = name
        if info.weight_files:
            info.skipped_bytes = safetensors_parameter_bytes(info.weight_files, None,
                                                             lambda t: not info.loads(t))
    elif "AutoModelForCausalLM" not in (cdict.get("auto_map") or {}):
        info.model_class = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(info.model_type)
    info.attn_implementation = choose_attention(cfg.attn_implementation, target_class(info))


def weight_bytes(cfg: ModelConfig, info: TargetInfo, dtype: torch.dtype) -> int:
    """What the target's parameters take in memory at ``dtype`` (headers or a meta-device build)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if info.weight_files:
        return safetensors_parameter_bytes(info.weight_files, itemsize, info.loads)
    return _meta_numel(cfg, info) * itemsize


def rank_weight_bytes(total: int, par: ParallelConfig, whole: int = 0) -> int:
    """What one rank holds of ``total`` weight bytes under ``par``: 1/(fsdp x tp) of them (experts included), and
    ``whole`` of them (a vision tower every rank holds whole: :func:`sharding.hold_whole`) entire."""
    return -(-(total - whole) // par.group) + whole


def vision_bytes(info: TargetInfo, dtype: torch.dtype) -> int:
    """What the loaded modules outside the language model (vision tower, projector) take at ``dtype``; 0 for a
    causal LM or a text-only load. Under ``parallel.*`` every rank holds them whole."""
    if info.part is None or not info.part.vision or not info.weight_files:
        return 0
    part, itemsize = info.part, torch.empty((), dtype=dtype).element_size()
    return safetensors_parameter_bytes(info.weight_files, itemsize,
                                       lambda t: part.loads(t) and not part.in_language_model(t))


def available_memory(device: torch.device) -> dict[str, int]:
    """Bytes this rank may use: the chosen GPU, every visible GPU, and host RAM available now."""
    out = {"host": _host_available()}
    if device.type == "cuda":
        out["device"] = int(torch.cuda.get_device_properties(device.index or 0).total_memory)
        out["all_gpus"] = sum(int(torch.cuda.get_device_properties(i).total_memory)
                              for i in range(torch.cuda.device_count()))
    return out


def _host_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def fit_problem(cfg: ModelConfig, info: TargetInfo, device: torch.device, dtype: torch.dtype,
                memory: dict[str, int] | None = None, par: ParallelConfig | None = None) -> str | None:
    """Why this rank's share of the target's weights cannot fit where it would load them, or None.

    Only the weights are counted (activations of one batch come on top), so a refusal here is
    certain, not a guess. Under ``parallel.*`` a rank holds 1/(fsdp x tp) of them.
    """
    par = par or ParallelConfig()
    whole = weight_bytes(cfg, info, dtype)
    vision = vision_bytes(info, dtype)
    need = rank_weight_bytes(whole, par, vision)
    mem = memory if memory is not None else available_memory(device)
    gib = 1 << 30
    dname = str(dtype).replace("torch.", "")
    what = (f"model.path={cfg.path!r} needs {need / gib:.1f} GiB of weights in {dname} per rank"
            + (f" (1/{par.group} of {(whole - vision) / gib:.1f} GiB" if par.group > 1 else "")
            + (f", and the vision tower's {vision / gib:.1f} GiB whole" if par.group > 1 and vision else "")
            + (")" if par.group > 1 else ""))
    hint = shard_hint(whole, mem.get("device", mem["host"]), vision=vision)
    if cfg.device_map:
        room = mem.get("all_gpus", 0) + mem["host"]
        if need > room:
            return f"{what}, more than this node's GPUs and host memory together ({room / gib:.1f} GiB); {hint}"
        return None
    if device.type == "cuda":
        if need <= mem["device"]:
            return None
        return f"{what} but {device} has {mem['device'] / gib:.1f} GiB; {hint}"
    if need > mem["host"]:
        return (f"{what} but only {mem['host'] / gib:.1f} GiB of host memory is available; run it on GPUs "
                f"(model.device=cuda), free memory, or {shard_hint(whole, mem['host'], vision=vision)}")
    return None


def shard_hint(whole: int, room: int, headroom: float = 0.8, vision: int = 0) -> str:
    """The smallest FSDP layout whose share of ``whole`` bytes (``vision`` of them held whole on every rank) fits in
    ``headroom`` of ``room`` (one GPU's memory)."""
    ranks = 1
    while rank_weight_bytes(whole, ParallelConfig(fsdp=ranks), vision) > headroom * room and ranks < 1 << 16:
        ranks *= 2
    nodes = "" if ranks <= 8 else f" ({-(-ranks // 8)} nodes of 8 GPUs)"
    return (f"shard it over {ranks} GPUs{nodes}: parallel.fsdp={ranks} (add parallel.ep=<a divisor of the routed "
            "experts> for an MoE) under torchrun or SLURM, one rank per GPU; "
            f"{sharding.INSTALL}; see docs/scaling.md")


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
                dtype: torch.dtype, par: ParallelConfig | None = None, world: int = 1, rank: int = 0) -> Any:
    """The CausalLM in eval mode with gradients off (its lm_head is kept only for export).

    The one seam through which a target loads: one copy on ``device``, or under a sharded
    ``par`` (every rank calls this together) transformers' DistributedConfig layout.
    """
    par = par or ParallelConfig()
    # safetensors only: a pickled .bin checkpoint would run arbitrary code on load.
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": cfg.trust_remote_code, "use_safetensors": True}
    if info.attn_implementation:
        kwargs["attn_implementation"] = info.attn_implementation
    if not info.weight_files and cfg.path != TINY:
        raise TargetError(f"model.path={cfg.path!r} has no weight files (*.safetensors) in {info.local_dir}")
    if info.part is not None and info.part.vision:
        log.info("loading the whole of %s (vision tower included: the selected rows hold images)",
                 info.part.checkpoint_class)
    elif info.part is not None:
        log.info("loading the language model of %s (model.%s); left unread: %s (%s bytes)",
                 info.part.checkpoint_class, LANGUAGE_MODEL, ", ".join(info.part.skipped_modules),
                 f"{info.skipped_bytes:,}" if info.skipped_bytes is not None else "?")
    if cfg.path == TINY and not par.sharded:
        built = tiny.build_target(cfg.random, vocab_size, dtype, info.attn_implementation)
        if cfg.random.model_type == "qwen3":  # the built model as it is (what every earlier tiny cache holds)
            return built.to(device)
        return sharding.load_tiny_sharded(built, kwargs, None, 1).to(device)
    if par.sharded:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            if cfg.path == TINY:
                model: Any = sharding.load_tiny_sharded(
                    tiny.build_target(cfg.random, vocab_size, dtype, info.attn_implementation), kwargs, par, world)
            else:
                model = sharding.load_sharded(str(info.local_dir or cfg.path), kwargs, par, world,
                                              target_class(info))
        except Exception as exc:
            raise TargetError(f"cannot load the target from {cfg.path!r} sharded as parallel.fsdp={par.fsdp} "
                              f"parallel.ep={par.ep} parallel.tp={par.tp}: {exc}") from exc
        sharding.check_loaded(model, rank)
        sharding.warm_up(model)
        if info.part is not None and info.part.vision:
            sharding.hold_whole(model, info.part.outside(), rank)
        return model
    from transformers import AutoModelForCausalLM

    if cfg.device_map:
        kwargs["device_map"] = cfg.device_map
    cls: Any = AutoModelForCausalLM if info.part is None else target_class(info)
    try:
        model = cls.from_pretrained(str(info.local_dir or cfg.path), **kwargs)
    except Exception as exc:
        raise TargetError(f"cannot load the target from {cfg.path!r}: {exc}") from exc
    if not cfg.device_map:
        model = model.to(device)
    model.eval().requires_grad_(False)
    return model
