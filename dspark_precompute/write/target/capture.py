"""Capture: run the decoder stack once per batch and keep the chosen layers' hidden states.

Never the vocabulary projection. Forward hooks collect id ``-1`` from the embedding
output and ``0..N-2`` from decoder layer outputs; ``N-1`` is the decoder's own post-norm
output (HF ``output_hidden_states[-1]``). With ``pre_norm`` the last decoder layer's own
output (before the final norm) is kept too, under key ``N``.

A target with hyper-connections (DeepSeek V4, ``hc_mult`` residual streams) emits
``[B, T, hc_mult, H]`` from every decoder layer; such a state is reduced to ``[B, T, H]`` by
the mean over its streams, NeMo AutoModel's rule (its final ``hc_head`` is trained for the
last layer only, and the post-norm state is already collapsed by it). The manifest records
the rule (``capture.stream_reduction``). Under a sharded layout every forward is a
collective, run under ``no_grad`` (FSDP2 refuses ``inference_mode`` when a mesh dimension
has size 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dspark_precompute.errors import TargetError
from dspark_precompute.write.target.sharding import full_tensor, is_sharded

# capture.stream_reduction of a target whose layers emit several residual streams
STREAM_MEAN = "mean"


def decoder_of(model: Any) -> Any:
    """The base decoder (embeddings, layers, final norm) under a CausalLM."""
    for cand in (getattr(model, "model", None), model.get_decoder() if hasattr(model, "get_decoder") else None):
        if cand is not None and hasattr(cand, "layers") and hasattr(cand, "embed_tokens"):
            return cand
    raise TargetError(f"{type(model).__name__} has no decoder with .layers and .embed_tokens to capture from")


class HiddenStateCapture:
    """Runs the decoder once per batch and returns the chosen layers' hidden states."""

    def __init__(self, model: Any, layer_ids: list[int], pre_norm: bool = False, media: bool = False):
        self.model = model
        self.media = media  # rows with images: the whole image-text model runs, state -1 is layer 0's input
        self.decoder = decoder_of(model)
        self.num_layers = len(self.decoder.layers)
        self.layer_ids = list(layer_ids)
        self.keys = self.layer_ids + ([self.num_layers] if pre_norm else [])
        self._store: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []
        self._grad_off = torch.no_grad if is_sharded(model) else torch.inference_mode
        try:
            for lid in self.keys:
                if lid == self.num_layers - 1:
                    continue  # the post-norm output of the decoder itself
                if lid == -1 and media:  # the embeddings with the vision features merged in (HF hidden_states[0])
                    self._handles.append(self.decoder.layers[0].register_forward_pre_hook(self._pre_hook(lid),
                                                                                          with_kwargs=True))
                    continue
                module = self.decoder.embed_tokens if lid == -1 else self.decoder.layers[min(lid, self.num_layers - 1)]
                self._handles.append(module.register_forward_hook(self._hook(lid)))
        except BaseException:
            self.close()
            raise

    def _hook(self, lid: int) -> Callable[[Any, tuple[Any, ...], Any], None]:
        def fn(_module: Any, _inputs: tuple[Any, ...], output: Any) -> None:
            state = output[0] if isinstance(output, tuple) else output
            self._store[lid] = reduce_streams(state)
        return fn

    def _pre_hook(self, lid: int) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], None]:
        def fn(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            state = args[0] if args else kwargs["hidden_states"]
            self._store[lid] = reduce_streams(state)
        return fn

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 media: dict[str, torch.Tensor] | None = None) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """States of one batch; ``media``: a row's image inputs (``pixel_values``, ``image_grid_thw``, ...), run
        through the whole image-text model (the vision tower's features replace the image pads' embeddings)."""
        with self._grad_off():
            return self._forward(input_ids, attention_mask, media)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 media: dict[str, torch.Tensor] | None = None) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        self._store = {}
        if media is not None:
            device = input_ids.device
            inputs = {k: v.to(device) for k, v in media.items()}
            out = self.model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **inputs)
        else:
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        last = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        # Under device_map the layers (so their outputs) sit on several devices: bring every
        # state to the device of input_ids, where the caller's masks and buffers live.
        device = input_ids.device
        last = last.to(device)
        states = {lid: (last if lid == self.num_layers - 1 else self._store[lid].to(device))
                  for lid in self.keys}
        self._store = {}
        return states, last

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> HiddenStateCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reduce_streams(state: torch.Tensor) -> torch.Tensor:
    """A layer's ``[B, T, streams, H]`` hyper-connection output as ``[B, T, H]`` (their mean); others unchanged."""
    return state.mean(dim=2) if state.dim() == 4 else state


def stream_reduction(config: Any) -> str | None:
    """``capture.stream_reduction`` for a target config: the rule for several residual streams, else None."""
    text = getattr(config, "text_config", None) or config
    streams = getattr(text, "hc_mult", None)
    return STREAM_MEAN if isinstance(streams, int) and streams > 1 else None


def export_weights(model: Any) -> dict[str, torch.Tensor]:
    """``embed_tokens.weight`` and ``lm_head.weight`` (the latter omitted when tied), whole.

    A sharded weight is all-gathered: a collective, so under ``parallel.*`` every rank calls this.
    """
    emb_param = model.get_input_embeddings().weight
    out = {"embed_tokens.weight": full_tensor(emb_param.detach())}
    head = model.get_output_embeddings()
    tied = head is None or head.weight is emb_param or bool(getattr(model.config, "tie_word_embeddings", False))
    if not tied:
        out["lm_head.weight"] = full_tensor(head.weight.detach())
    return out
