"""What the manifest records about how a cache was made (``capture``) and by what (``provenance``).

``capture`` (:class:`~dspark_precompute.contract.manifest.Capture`) says what the stored
values are: the last state taken after the final norm and that norm's class (from the
loaded model), the layer preset, the mask rule and options, the checkpoint's weight dtype
and its fingerprint. ``provenance`` (:class:`~dspark_precompute.contract.manifest.RunProvenance`)
says which command, software and hosts wrote it; it is a run record, never hashed.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import metadata
from typing import Any

from dspark_precompute.contract.commits import CommitRecord
from dspark_precompute.contract.manifest import Capture, MaskPolicy, RunProvenance
from dspark_precompute.contract.store import CacheStore
from dspark_precompute.contract.vocab import LastState
from dspark_precompute.version import __version__
from dspark_precompute.write.config.schema import TINY, DataConfig, ModelConfig, ParallelConfig
from dspark_precompute.write.samples.chat import GENERATION_RE, SPAN_RULES
from dspark_precompute.write.target.capture import decoder_of, stream_reduction
from dspark_precompute.write.target.load import TargetInfo, safetensors_numel_by_dtype

# safetensors dtype -> torch's name for it
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
VERSIONED = ("torch", "transformers", "zarr", "numcodecs")
_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f")


def mask_policy(template: str, data: DataConfig) -> MaskPolicy:
    """The rule :class:`~dspark_precompute.write.samples.chat.ChatEncoder` applies with this template, and the
    options."""
    if (span := SPAN_RULES.get(str(data.mask_rule))) is not None:
        return MaskPolicy(rule=str(data.mask_rule), fallback=None,
                          mask_reasoning_content=bool(data.mask_reasoning_content),
                          mask_generation_prompt=bool(data.mask_generation_prompt),
                          default_system_prompt=span.system_prompt, min_supervised_tokens=span.min_supervised)
    generation = bool(GENERATION_RE.search(template))
    return MaskPolicy(rule="generation_template" if generation else "nemo_prefix",
                      fallback=None if generation else "full_render_alignment",
                      mask_reasoning_content=bool(data.mask_reasoning_content),
                      mask_generation_prompt=bool(data.mask_generation_prompt))


def weights_dtype(model: ModelConfig, info: TargetInfo) -> str | None:
    """The checkpoint's floating dtype: the one most parameters have in the safetensors headers, else config.json's.

    The built-in tiny target is initialised in float32 (then cast to the compute dtype).
    """
    if model.path == TINY:
        return "float32"
    if info.weight_files:
        counts = {k: v for k, v in safetensors_numel_by_dtype(info.weight_files, info.loads).items()
                  if k in _SAFETENSORS_DTYPES}
        if counts:
            return _SAFETENSORS_DTYPES[max(sorted(counts), key=lambda k: counts[k])]
    if info.local_dir is not None:
        try:
            cdict = json.loads((info.local_dir / "config.json").read_text())
        except (OSError, ValueError):
            return None
        text = cdict.get("text_config", cdict) if isinstance(cdict, dict) else {}
        value = text.get("dtype") or text.get("torch_dtype") or cdict.get("dtype") or cdict.get("torch_dtype")
        return str(value) if value else None
    return None


def plan_capture(model: ModelConfig, data: DataConfig, template: str, info: TargetInfo,
                 fingerprint_kind: str, last_state: str = LastState.post_norm) -> Capture:
    """Everything in ``capture`` that is known before weights load (the norm's class comes with the model)."""
    return Capture(
        last_state=str(LastState(last_state)),
        final_norm_class=None,
        layer_preset="explicit" if model.layer_ids is not None else model.layer_preset,
        mask=mask_policy(template, data),
        target_weights_dtype=weights_dtype(model, info),
        weights_fingerprint=info.weights_fingerprint or None,
        fingerprint_kind=fingerprint_kind,
        attn_implementation=info.attn_implementation,
        target_part=info.capture_part(),
    )


def final_norm_of(model: Any) -> Any | None:
    """The decoder's final norm module (whose output is the stored ``last`` state), or None when unnamed."""
    decoder = decoder_of(model)
    for name in _NORM_NAMES:
        module = getattr(decoder, name, None)
        if module is not None and callable(module):
            return module
    return None


def model_class_name(module: Any) -> str:
    """The model's own class of ``module``: FSDP2 wraps each sharded module in a class of its own (``FSDPX(X)``)."""
    name = type(module).__name__
    if name.startswith("FSDP") and any(c.__name__ == name[4:] for c in type(module).__mro__):
        return name[4:]
    return name


def with_loaded_model(capture: Capture | None, model: Any) -> Capture | None:
    """``capture`` with the final norm's class and the streams' reduction taken from the loaded target."""
    if capture is None:
        return None
    norm = final_norm_of(model)
    config = getattr(model, "config", None)
    attn = getattr(config, "_attn_implementation", None) or capture.attn_implementation
    return dataclasses.replace(capture, final_norm_class=model_class_name(norm) if norm is not None else None,
                               stream_reduction=stream_reduction(config), attn_implementation=attn)


def versions() -> dict[str, str]:
    """Versions of the libraries that decide the stored values and their format, and of this tool."""
    out = {"dspark_precompute": __version__}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def run_record(provenance: dict[str, Any], hosts: list[str], world_size: int, store: CacheStore | None = None,
               earlier_units: set[int] | frozenset[int] = frozenset(),
               parallel: ParallelConfig | None = None) -> RunProvenance:
    """The run record of the run that finishes a cache.

    ``provenance`` is the entry point's (``argv``, ``overrides``; its Hydra ``files`` go to
    ``.hydra/``). ``hosts`` are this run's ranks' hosts; the commit records of
    ``earlier_units`` (units an interrupted run committed) add the hosts that wrote those.
    """
    seen = set(hosts)
    if store is not None:
        for u in sorted(earlier_units):
            record = CommitRecord.read(store, u)
            if record is not None and record.host:
                seen.add(record.host)
    argv, overrides = provenance.get("argv"), provenance.get("overrides")
    return RunProvenance(argv=[str(a) for a in argv] if isinstance(argv, list) else None,
                         overrides=[str(o) for o in overrides] if isinstance(overrides, list) else None,
                         versions=versions(), hosts=sorted(seen), world_size=int(world_size),
                         regeneration=provenance.get("regeneration"),
                         parallel=({"fsdp": parallel.fsdp, "ep": parallel.ep, "tp": parallel.tp}
                                   if parallel is not None and parallel.sharded else None))
