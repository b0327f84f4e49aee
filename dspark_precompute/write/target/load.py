"""The frozen target: its identity and fit (before any weights load), tokenizer and model.

Everything that reads only small files (config.json, safetensors headers, weight hashes)
runs first, so a target this tool cannot run is refused before its weights load.
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

from dspark_precompute.errors import TargetError
from dspark_precompute.write.config.schema import TINY, ModelConfig, ParallelConfig
from dspark_precompute.write.target import sharding, tiny

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
            tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, sort_keys=True))
            os.replace(tmp, cache_file)
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
    "minimax_m3_vl": "MiniMax M3 is a multimodal (vision-language) checkpoint: this tool captures text-only "
                     "causal LMs; train its draft online with NeMo AutoModel's DSpark recipe",
    "kimi_k3": f"Kimi K3 (multimodal MoE): {_ROUTE_DISTRIBUTED}",
}
UNSUPPORTED_ARCHITECTURES = {
    "DeepseekV41ForCausalLM": "deepseek_v41", "MiniMaxM3SparseForConditionalGeneration": "minimax_m3_vl",
    "KimiK3ForCausalLM": "kimi_k3", "KimiK3ForConditionalGeneration": "kimi_k3",
}


def _causal_lm_problem(cfg: ModelConfig, cdict: dict[str, Any], model_type: str) -> str | None:
    """Why transformers cannot load this config as a plain causal LM here, or None."""
    archs = [a for a in cdict.get("architectures") or [] if isinstance(a, str)]
    known = UNSUPPORTED_TARGETS.get(model_type) or next(
        (UNSUPPORTED_TARGETS[UNSUPPORTED_ARCHITECTURES[a]] for a in archs if a in UNSUPPORTED_ARCHITECTURES), None)
    if known:
        return f"model.path={cfg.path!r} ({model_type or archs}): {known}"
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return None
    auto_map = cdict.get("auto_map") or {}
    if "AutoModelForCausalLM" in auto_map:
        if cfg.trust_remote_code:
            return None
        return (f"model.path={cfg.path!r} (model_type={model_type!r}) is a causal LM only through code shipped "
                "with the checkpoint (auto_map); that code would run in this process. Read it, then pass "
                "model.trust_remote_code=true if you trust it")
    import transformers

    return (f"model.path={cfg.path!r}: transformers {transformers.__version__} cannot load model_type "
            f"{model_type!r} as a causal LM (AutoModelForCausalLM); use a decoder-only text model, or a "
            "transformers version that supports it")


def safetensors_numel_by_dtype(files: list[Path]) -> dict[str, int]:
    """Elements per safetensors dtype (``BF16``, ``F32``, ...) over ``files``, from their headers alone."""
    out: dict[str, int] = {}
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if not 0 < n <= 100 << 20:
                raise TargetError(f"{f} is not a safetensors file (header length {n})")
            try:
                header = json.loads(fh.read(n))
            except ValueError as exc:
                raise TargetError(f"{f} has a corrupt safetensors header ({exc})") from None
        for name, t in header.items():
            if name == "__metadata__" or not isinstance(t, dict):
                continue
            numel = 1
            for d in t.get("shape", []):
                numel *= int(d)
            kind = str(t.get("dtype", ""))
            out[kind] = out.get(kind, 0) + numel
    return out


def safetensors_parameter_bytes(files: list[Path], dtype_itemsize: int) -> int:
    """Bytes the weights take at the compute dtype, from the safetensors headers alone (no tensor read).

    Floating tensors are cast to the compute dtype on load; others keep their stored size.
    """
    sizes = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
             "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
    return sum(numel * (dtype_itemsize if kind.startswith(("F", "BF")) else sizes.get(kind, 4))
               for kind, numel in safetensors_numel_by_dtype(files).items())


def parameter_count(cfg: ModelConfig, info: TargetInfo) -> int:
    """The target's parameters (elements of every stored tensor; a meta-device build for ``tiny``)."""
    if info.weight_files:
        return sum(safetensors_numel_by_dtype(info.weight_files).values())
    return _tiny_numel(cfg, info)


def _tiny_numel(cfg: ModelConfig, info: TargetInfo) -> int:
    """Parameters of the built-in random target (a meta-device build: no memory, no init)."""
    config = tiny.build_config(cfg.random, info.vocab_size)
    with torch.device("meta"):
        model = tiny.causal_lm_class(config)(config)
    return sum(p.numel() for p in model.parameters())


def inspect_target(cfg: ModelConfig, tokenizer: Any, fingerprint: bool = True) -> TargetInfo:
    """Read the target's config and fingerprint its weight files; raise on targets this tool cannot run.

    Everything here reads small files only (config, safetensors headers) plus the weight
    hashes, so an unsupported target is refused before any weights load. ``fingerprint=False``
    (a dry run) skips the hashes: nothing is read beyond the headers and nothing is remembered.
    """
    if cfg.path == TINY:
        return _tiny_info(cfg, tokenizer)
    local = resolve_local_dir(cfg.path, cfg.revision)
    config_file = local / "config.json"
    if not config_file.is_file():
        raise TargetError(f"model.path={cfg.path!r} has no config.json at {local}")
    try:
        cdict = json.loads(config_file.read_text())
    except ValueError as exc:
        raise TargetError(f"{config_file} is not valid JSON ({exc})") from None
    if not isinstance(cdict, dict):
        raise TargetError(f"{config_file} is not a JSON object")
    problems = []
    model_type = str(cdict.get("model_type", ""))
    if any(k in cdict for k in _MULTIMODAL_KEYS):
        problems.append(
            f"model.path={cfg.path!r} is a multimodal config ({model_type}); point model.path at a text-only "
            "checkpoint of the language model"
        )
    else:
        problem = _causal_lm_problem(cfg, cdict, model_type)
        if problem:
            problems.append(problem)
    text = cdict.get("text_config", cdict)
    n_layers, hidden, vocab = text.get("num_hidden_layers"), text.get("hidden_size"), text.get("vocab_size")
    if not (isinstance(n_layers, int) and isinstance(hidden, int) and isinstance(vocab, int)):
        problems.append(
            f"model.path={cfg.path!r} (model_type={model_type!r}) is not a decoder-only LM config with "
            "num_hidden_layers, hidden_size and vocab_size; only causal LMs are supported"
        )
    if problems:
        raise TargetError("; ".join(problems))
    weights = sorted(f for f in local.iterdir() if f.suffix == ".safetensors")
    if not weights:
        pickled = sorted(f.name for f in local.iterdir() if f.suffix in _WEIGHT_SUFFIXES)
        if pickled:
            raise TargetError(
                f"model.path={cfg.path!r} has only pickled weights ({', '.join(pickled[:3])}); this tool loads "
                "safetensors only, because unpickling runs code. Convert the checkpoint to safetensors "
                "(model.save_pretrained(dir, safe_serialization=True) in a trusted environment)")
        raise TargetError(f"model.path={cfg.path!r} has no weight files (*.safetensors) in {local}")
    return TargetInfo(
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


def weight_bytes(cfg: ModelConfig, info: TargetInfo, dtype: torch.dtype) -> int:
    """What the target's parameters take in memory at ``dtype`` (headers or a meta-device build)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if info.weight_files:
        return safetensors_parameter_bytes(info.weight_files, itemsize)
    return _tiny_numel(cfg, info) * itemsize


def rank_weight_bytes(total: int, par: ParallelConfig) -> int:
    """What one rank holds of ``total`` weight bytes under ``par``: 1/(fsdp x tp) of them (experts included)."""
    return -(-total // par.group)


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
    need = rank_weight_bytes(whole, par)
    mem = memory if memory is not None else available_memory(device)
    gib = 1 << 30
    dname = str(dtype).replace("torch.", "")
    what = (f"model.path={cfg.path!r} needs {need / gib:.1f} GiB of weights in {dname} per rank"
            + (f" (1/{par.group} of {whole / gib:.1f} GiB)" if par.group > 1 else ""))
    if cfg.device_map:
        room = mem.get("all_gpus", 0) + mem["host"]
        if need > room:
            return (f"{what}, more than this node's GPUs and host memory together ({room / gib:.1f} GiB); "
                    f"{shard_hint(whole, mem.get('device', mem['host']))}")
        return None
    if device.type == "cuda":
        if need <= mem["device"]:
            return None
        return f"{what} but {device} has {mem['device'] / gib:.1f} GiB; {shard_hint(whole, mem['device'])}"
    if need > mem["host"]:
        return (f"{what} but only {mem['host'] / gib:.1f} GiB of host memory is available; run it on GPUs "
                f"(model.device=cuda), free memory, or {shard_hint(whole, mem['host'])}")
    return None


def shard_hint(whole: int, room: int, headroom: float = 0.8) -> str:
    """The smallest FSDP layout whose share of ``whole`` bytes fits in ``headroom`` of ``room`` (one GPU's memory)."""
    ranks = 1
    while rank_weight_bytes(whole, ParallelConfig(fsdp=ranks)) > headroom * room and ranks < 1 << 16:
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
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.path == TINY and not par.sharded:
        built = tiny.build_target(cfg.random, vocab_size, dtype)
        if cfg.random.model_type == "qwen3":  # the built model as it is (what every earlier tiny cache holds)
            return built.to(device)
        return sharding.load_tiny_sharded(built, kwargs, None, 1).to(device)
    if par.sharded:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            if cfg.path == TINY:
                model: Any = sharding.load_tiny_sharded(tiny.build_target(cfg.random, vocab_size, dtype), kwargs, par,
                                                   world)
            else:
                model = sharding.load_sharded(str(info.local_dir or cfg.path), kwargs, par, world)
        except Exception as exc:
            raise TargetError(f"cannot load the target from {cfg.path!r} sharded as parallel.fsdp={par.fsdp} "
                              f"parallel.ep={par.ep} parallel.tp={par.tp}: {exc}") from exc
        sharding.check_loaded(model, rank)
        sharding.warm_up(model)
        return model
    from transformers import AutoModelForCausalLM

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
