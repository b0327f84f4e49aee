"""Sharded targets: the ``parallel`` layout, its checks before any weights load, and the loading through transformers.

The weights are spread by transformers' own ``DistributedConfig`` (FSDP2, expert and tensor
parallel: ``from_pretrained(..., distributed_config=...)``, accelerate installed), never by a
sharder of ours. Under FSDP every weight is all-gathered for its layer's compute, so the
arithmetic, and every stored value, is that of one copy; the ranks only have to meet in each
forward (:class:`~dspark_precompute.write.parallel.distributed.Lockstep` keeps them together).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import torch

from dspark_precompute.errors import TargetError
from dspark_precompute.write.config.schema import ParallelConfig

log = logging.getLogger(__name__)

_EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
INSTALL = "pip install 'dspark-precompute[distributed]'"


def shape_facts(cdict: dict[str, Any]) -> dict[str, int]:
    """What the layout checks need from a config.json (text part): KV heads and routed experts."""
    text = cdict.get("text_config", cdict)
    out = {}
    kv = text.get("num_key_value_heads", text.get("num_attention_heads"))
    if isinstance(kv, int):
        out["num_key_value_heads"] = kv
    experts = next((text[k] for k in _EXPERT_KEYS if isinstance(text.get(k), int)), None)
    if experts:
        out["num_experts"] = int(experts)
    if isinstance(cdict.get("text_config"), dict) and "vision_config" in cdict:
        out["image_text"] = 1
    return out


# Image-text families whose language model transformers 5.24 does not load correctly under a DistributedConfig
# (measured on the tiny checkpoints, 2 gloo ranks, 2026-12-06): refused before the weights load.
SHARDING_LIMITS = {
    "qwen3_vl_moe": "transformers 5.24 fails to load its experts sharded (the checkpoint's transposed "
                    "experts.down_proj meets a shard of the wrong shape: 'size mismatch')",
    "minimax_m3_vl": "transformers 5.24 loads its language model sharded with other values than one copy (states "
                     "off by about 1.0 from the second layer on)",
}


def ships_plan(model_type: str, kind: str) -> bool:
    """Whether transformers' config class of ``model_type`` (or of its ``text_config``: an image-text checkpoint,
    whose language model is what loads) ships a ``base_model_{kind}_plan`` (ep, tp)."""
    from transformers import CONFIG_MAPPING

    try:
        cls = CONFIG_MAPPING[model_type]
    except KeyError:
        return False
    text = (getattr(cls, "sub_configs", None) or {}).get("text_config")
    return any(bool(getattr(c, f"base_model_{kind}_plan", None)) for c in (cls, text) if c is not None)


def layout_problems(par: ParallelConfig, model_type: str, facts: dict[str, int], world: int) -> list[str]:
    """Why ``par`` cannot shard this target over ``world`` ranks (read from config.json alone), each with the route."""
    if not par.sharded:
        return []
    out = []
    if model_type in SHARDING_LIMITS:
        out.append(f"parallel.fsdp={par.fsdp} parallel.ep={par.ep} parallel.tp={par.tp}: {model_type}: "
                   f"{SHARDING_LIMITS[model_type]}; run one copy per rank (parallel.fsdp=1 parallel.ep=1 "
                   "parallel.tp=1, model.device_map=auto for a target larger than one GPU)")
    if par.tp > 1 and facts.get("image_text"):
        out.append(f"parallel.tp={par.tp}: transformers 5.24 applies no tensor-parallel plan to the language model "
                   "inside an image-text checkpoint (each rank would hold nearly all of it); use parallel.fsdp, "
                   "which shards it and keeps one copy's values")
    if world % par.group:
        out.append(f"parallel.fsdp x parallel.tp = {par.group} must divide the world size {world}: start "
                   f"{par.group} x k ranks (torchrun --nproc-per-node {par.group}, or srun --ntasks), or lower "
                   "parallel.fsdp")
    if par.ep > 1:
        experts = facts.get("num_experts")
        if not ships_plan(model_type, "ep"):
            out.append(f"parallel.ep={par.ep}: transformers ships no expert-parallel plan for model_type "
                       f"{model_type!r}; run it with parallel.ep=1 (FSDP alone shards the experts too)")
        elif experts and experts % par.ep:
            out.append(f"parallel.ep={par.ep} does not divide the target's {experts} routed experts; choose an ep "
                       f"that divides {experts}")
    if par.tp > 1:
        kv = facts.get("num_key_value_heads")
        if not ships_plan(model_type, "tp"):
            out.append(f"parallel.tp={par.tp}: transformers ships no tensor-parallel plan for model_type "
                       f"{model_type!r}; use parallel.fsdp instead (bit-identical, too)")
        elif kv is not None and (par.tp > kv or kv % par.tp):
            out.append(f"parallel.tp={par.tp} must divide the target's {kv} key/value heads (each TP rank needs "
                       f"whole heads); use parallel.tp<={kv}, or parallel.fsdp, which has no such limit")
    try:
        import accelerate  # noqa: F401  (transformers' distributed loading needs it)
    except ImportError:
        out.append(f"parallel.* shards the target through transformers, which needs accelerate: {INSTALL}")
    return out


def distributed_config(par: ParallelConfig, world: int) -> Any:
    """transformers' ``DistributedConfig`` for ``par`` on ``world`` ranks (the groups replicated world/group times)."""
    from transformers import DistributedConfig

    return DistributedConfig(fsdp_size=par.fsdp, tp_size=par.tp, ep_size=par.ep,
                             dp_replicate_size=world // par.group)


def load_sharded(source: str, kwargs: dict[str, Any], par: ParallelConfig | None, world: int,
                 cls: Any | None = None) -> Any:
    """``cls.from_pretrained`` (default ``AutoModelForCausalLM``; the language model of an image-text checkpoint)
    with the layout's DistributedConfig (each rank reads and keeps its shards only); ``par=None``: one whole copy,
    loaded the same way."""
    from transformers import AutoModelForCausalLM

    if par is not None:
        kwargs = {**kwargs, "distributed_config": distributed_config(par, world)}
    model: Any = (cls or AutoModelForCausalLM).from_pretrained(source, **kwargs)
    return model.eval().requires_grad_(False)


def warm_up(model: Any) -> None:
    """One 1-token forward through the root module (every rank together).

    FSDP2 refuses a forward of a sub-module (the decoder, as the capture runs it) before the
    root has run once ("FSDP requires a single root module"). After it the root's own
    parameters (embedding, final norm, lm_head) stay gathered on every rank.
    """
    device = next(model.parameters()).device
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)


def hold_whole(model: Any, modules: tuple[str, ...], rank: int) -> None:
    """Keep ``modules`` (an image-text model's vision tower and projector) gathered whole on every rank, for good.

    Only batches with images run them, and each rank forwards its own batches: were their weights
    gathered per forward, a rank with images would all-gather while its peers (text rows, or
    the 1-token forward of a rank that is done) do not, and the ranks' collectives would pair
    wrongly. Held whole, the vision forward is local, and every forward's collectives are the
    language model's alone, the same on every rank. Every rank calls this together (an
    all-gather per FSDP module inside them, in the same order). They are counted whole in the
    fit (:func:`~dspark_precompute.write.target.load.vision_bytes`).
    """
    from torch.distributed.fsdp import FSDPModule

    held = gathered = 0
    for path in modules:
        try:
            root = model.get_submodule(path)
        except AttributeError:
            continue  # a module the class built under another name: nothing of it to hold
        for m in root.modules():
            if isinstance(m, FSDPModule):
                m.set_reshard_after_forward(False, recurse=False)
                m.unshard()
                gathered += 1
        for name, p in root.named_parameters():
            if hasattr(p, "to_local"):
                raise TargetError(f"{path}.{name} stays sharded after it was gathered, so rows with images cannot "
                                  "run sharded here; run one copy per rank (parallel.fsdp=1 parallel.ep=1 "
                                  "parallel.tp=1)")
            held += p.numel() * p.element_size()
    log.info("rank %d holds the vision modules (%s) whole: %d parameter bytes (%d FSDP module(s) of theirs "
             "gathered here; the rest is the root's, gathered by the warm-up forward, which never reshards it)",
             rank, ", ".join(modules), held, gathered)


def load_tiny_sharded(model: Any, kwargs: dict[str, Any], par: ParallelConfig | None, world: int) -> Any:
    """The built-in random target saved to a private temporary directory, then loaded as a checkpoint.

    Sharded (``par``), or one copy of a family whose modules ``from_pretrained`` keeps in float32
    (DeepSeek V4's ``hc_head`` and final norm), so that one copy and a sharded run compute alike.
    Its buffers are the built model's: the tiny target is cast to the compute dtype as a whole
    (rotary ``inv_freq`` included), which ``from_pretrained`` would keep in float32.
    """
    from safetensors.torch import save_model

    # not save_pretrained: under torch.distributed it coordinates the ranks' writes (collectives this
    # rank's private copy must not join)
    kwargs = {**kwargs, "attn_implementation": model.config._attn_implementation}  # the one-copy build's own
    with tempfile.TemporaryDirectory(prefix="dspark-tiny-") as tmp:
        model.config.to_json_file(str(Path(tmp) / "config.json"))
        save_model(model, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        loaded = load_sharded(tmp, kwargs, par, world)
    for name, buf in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        module = loaded.get_submodule(owner)
        if isinstance(getattr(module, leaf, None), torch.Tensor):
            setattr(module, leaf, buf.to(getattr(module, leaf).device))
    return loaded


def is_sharded(model: Any) -> bool:
    """Whether ``model`` was loaded with a distributed layout (its forwards are collectives)."""
    dc = getattr(getattr(model, "config", None), "distributed_config", None)
    return dc is not None and (dc.tp_size > 1 or dc.dp_size > 1 or dc.ep_size > 1)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole: a sharded DTensor is all-gathered (a collective: every rank of the mesh must call it)."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def local_parameter_bytes(model: Any) -> tuple[int, int]:
    """(bytes of the parameters this rank holds, bytes of the whole parameters)."""
    mine = whole = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        mine += local.numel() * local.element_size()
        whole += p.numel() * p.element_size()
    return mine, whole


def check_loaded(model: Any, rank: int) -> None:
    """Log what this rank holds; a target transformers did not shard is refused (it would run as one copy each)."""
    if not is_sharded(model):
        raise TargetError(f"{type(model).__name__} was not sharded by transformers' DistributedConfig; set "
                          "parallel.fsdp=1 parallel.ep=1 parallel.tp=1 to run one copy per rank")
    mine, whole = local_parameter_bytes(model)
    log.info("rank %d holds %d of %d parameter bytes (%.3f)", rank, mine, whole, mine / max(1, whole))
