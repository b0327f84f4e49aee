"""The language model of an image-text checkpoint (Qwen3.5/3.6, Qwen3-VL, MiniMax M3, ...), for text rows.

Such a checkpoint ships only as a ``*ForConditionalGeneration``: a vision tower (and its
projector) beside a language model under ``model.language_model``, and ``lm_head``. For text
rows the vision tower never runs, so it is not built and its tensors are not read: the
checkpoint's own class is loaded with every sibling of ``model.language_model`` removed before
the weights load, and their tensors are left unread (transformers reads a safetensors tensor
only when a module takes it). What runs is then exactly the checkpoint's own language model,
its forward equal to the full checkpoint's on text input. The fit check and the per-rank bytes
count the loaded tensors only; the manifest's ``capture.target_part`` says what was left out.

When the selected rows hold images the whole checkpoint loads (:meth:`ImageTextPart.with_vision`):
the vision tower's features replace the image pads' embeddings, so its bytes count in the fit check.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from dspark_precompute.errors import TargetError

LANGUAGE_MODEL = "language_model"
_KEEP_TOP = ("model", "lm_head")


@dataclass(frozen=True)
class ImageTextPart:
    """What is loaded of an image-text checkpoint, decided from its config alone."""

    checkpoint_class: str  # e.g. Qwen3VLForConditionalGeneration
    skipped_modules: tuple[str, ...]  # module paths not built (model.visual, ...)
    ignored_patterns: tuple[str, ...]  # the class's own unexpected-key patterns (^mtp.*: the MTP head)
    nested: bool = True  # the checkpoint names its language model's tensors ``...language_model...``
    vision: bool = False  # rows with images: the whole checkpoint loads (vision tower and projector too)
    vision_modules: tuple[str, ...] = ()  # with vision: the modules a text-only load leaves out (model.visual, ...)

    def with_vision(self) -> ImageTextPart:
        """The part loaded for rows with images: every module (the class's ignored keys, an MTP head, stay unread)."""
        return dataclasses.replace(self, skipped_modules=(), vision=True, vision_modules=self.skipped_modules)

    def outside(self) -> tuple[str, ...]:
        """The modules beside the language model and lm_head (the vision tower, its projector), loaded or not."""
        return self.vision_modules if self.vision else self.skipped_modules

    def loads(self, tensor: str) -> bool:
        """Whether the checkpoint's tensor ``tensor`` is read (with vision: all but the class's ignored keys)."""
        if self.vision:
            return not any(re.search(p, tensor) for p in self.ignored_patterns)
        return self.in_language_model(tensor)

    def in_language_model(self, tensor: str) -> bool:
        """Whether the checkpoint's tensor ``tensor`` belongs to the language model (``lm_head`` included).

        A checkpoint that names its language model (``model.language_model.*``, MiniMax M3's
        ``language_model.*``) has those and ``lm_head``; the rest (vision tower, projector, patch
        merger, MTP head) is outside it. An older flat layout (``model.layers.*`` beside
        ``visual.*``) holds all but the modules outside and the class's ignored keys.
        """
        parts = tensor.split(".")
        if self.nested:
            return LANGUAGE_MODEL in parts[:-1] or parts[0] == "lm_head"
        leaves = {m.rsplit(".", 1)[-1] for m in self.outside()}
        if any(p in leaves for p in parts[:-1]):
            return False
        return not any(re.search(p, tensor) for p in self.ignored_patterns)

    def record(self, skipped_bytes: int | None) -> dict[str, Any]:
        """``capture.target_part``: the part loaded, its class, the modules and bytes left out."""
        loaded = "model" if self.vision else f"model.{LANGUAGE_MODEL}"
        return {"loaded": loaded, "checkpoint_class": self.checkpoint_class,
                "skipped_modules": list(self.skipped_modules), "skipped_bytes": skipped_bytes}


def image_text_class_name(cdict: dict[str, Any]) -> str | None:
    """The ``*ForConditionalGeneration`` transformers maps this config.json to, or None (not image-text here)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if not isinstance(cdict.get("text_config"), dict):
        return None
    name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(str(cdict.get("model_type", "")))
    return str(name) if name else None


def checkpoint_class(name: str) -> Any:
    """transformers' class named ``name`` (importing it; no code of the checkpoint's)."""
    import transformers

    return getattr(transformers, name)


def part_of(name: str, config: Any) -> ImageTextPart:
    """What :func:`language_model_class` keeps of ``name``, from a meta-device build of it (no memory, no init)."""
    import torch

    cls = checkpoint_class(name)
    with torch.device("meta"):
        model = cls(config)
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, LANGUAGE_MODEL):
        raise TargetError(f"{name} has no model.{LANGUAGE_MODEL} to load alone; this tool captures the language "
                          "model of image-text checkpoints laid out as transformers' own classes are")
    skipped = [f"model.{n}" for n, _ in inner.named_children() if n != LANGUAGE_MODEL]
    skipped += [n for n, _ in model.named_children() if n not in _KEEP_TOP]
    ignored = tuple(str(p) for p in (getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or ()))
    return ImageTextPart(checkpoint_class=name, skipped_modules=tuple(skipped), ignored_patterns=ignored)


@cache
def language_model_class(name: str) -> Any:
    """``name``'s class with every module but ``model.language_model`` and ``lm_head`` removed on construction.

    Its weights load through transformers' own ``from_pretrained`` (conversion mappings and the
    sharded layouts included); the removed modules' tensors are unexpected keys it never reads.
    The class keeps its name, so transformers' mappings keyed on it still apply.
    """
    cls = checkpoint_class(name)

    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        cls.__init__(self, config, *args, **kwargs)
        for child, _ in list(self.model.named_children()):
            if child != LANGUAGE_MODEL:
                self.model._modules[child] = None
        for child, _ in list(self.named_children()):
            if child not in _KEEP_TOP:
                self._modules[child] = None

    ignored = list(getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or [])
    ns = {"__init__": __init__, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
          "_keys_to_ignore_on_load_unexpected": [*ignored, rf"^model\.(?!{LANGUAGE_MODEL}\.)"]}
    return type(cls.__name__, (cls,), ns)
