"""Which target layers to capture: the presets (NeMo AutoModel's default, servable) and validation.

Layer id ``i`` is the output of decoder layer ``i`` (HF ``output_hidden_states[i + 1]``),
``-1`` is the embedding output (``hidden_states[0]``) and ``N - 1`` is the post-final-norm
state, exactly as in NeMo AutoModel's ``precompute_dspark``.

``model.layer_preset`` picks the ids when ``model.layer_ids`` is null:

* ``nemo`` (default): NeMo AutoModel's formula, k ids spread over ``[1, N-1]`` (N-1 included);
* ``servable``: k ids spread over ``[1, N-3]``, never ``-1`` or ``N-1`` (states a serving
  engine such as SGLang cannot capture for the draft at inference time), as the DSpark
  paper's drafts use them: ``round(1 + i*(N-4)/(k-1))``, 36 layers and k=5 -> [1, 9, 17, 25, 33].
"""

from __future__ import annotations

from collections.abc import Sequence

from dspark_precompute.contract.vocab import LayerPreset

LAYER_PRESETS = tuple(p.value for p in LayerPreset)


def default_layer_ids(num_layers: int, draft_num_hidden_layers: int = 5) -> list[int]:
    """NeMo's default: k = draft layers clamped to [1, N-1], spread evenly over [1, N-1].

    >>> default_layer_ids(28, 5)
    [1, 8, 14, 20, 27]
    >>> default_layer_ids(36, 5)
    [1, 10, 18, 26, 35]
    """
    if num_layers < 2:
        raise ValueError(f"the target must have at least 2 decoder layers to pick draft inputs, got {num_layers}")
    k = min(max(int(draft_num_hidden_layers), 1), num_layers - 1)
    if k == 1:
        return [num_layers - 1]
    return sorted({round(1 + i * (num_layers - 2) / (k - 1)) for i in range(k)})


def servable_layer_ids(num_layers: int, draft_num_hidden_layers: int = 5) -> list[int]:
    """k = ``draft_num_hidden_layers`` ids spread evenly over ``[1, N-3]``; k = 1 gives ``[N-3]``.

    Never -1 (embeddings) or N-1 (the post-norm state). Raises ``ValueError`` (naming the
    fix) when the target has fewer than 4 layers or fewer than k ids in ``[1, N-3]``, the
    only cases where the rounded ids would collide: a selection is never silently shorter
    than the draft asks for.

    >>> servable_layer_ids(36, 5)
    [1, 9, 17, 25, 33]
    >>> servable_layer_ids(28, 3)
    [1, 13, 25]
    """
    n, k = int(num_layers), int(draft_num_hidden_layers)
    if n < 4:
        raise ValueError(
            f"model.layer_preset=servable takes layer ids from [1, N-3], which is empty for this target with "
            f"{n} layers (it needs at least 4); use model.layer_preset=nemo or give model.layer_ids")
    if k < 1:
        raise ValueError(f"model.draft_num_hidden_layers={k} must be >= 1")
    if k > n - 3:
        raise ValueError(
            f"model.layer_preset=servable takes layer ids from [1, N-3] = [1, {n - 3}] of this {n}-layer target: at "
            f"most {n - 3} distinct ids, but model.draft_num_hidden_layers={k}; set model.draft_num_hidden_layers "
            f"<= {n - 3}, or give model.layer_ids explicitly")
    if k == 1:
        return [n - 3]  # the deepest servable state, as NeMo's k=1 takes its deepest (N-1)
    ids = [round(1 + i * (n - 4) / (k - 1)) for i in range(k)]
    # spacing (N-4)/(k-1) >= 1 when k <= N-3, so the rounded ids are distinct and increasing
    assert len(set(ids)) == k and ids == sorted(ids), ids
    return ids


def preset_layer_ids(preset: str, num_layers: int, draft_num_hidden_layers: int = 5) -> list[int]:
    """The ids ``preset`` (``nemo`` or ``servable``) chooses for a target of ``num_layers`` layers."""
    if preset == "nemo":
        return default_layer_ids(num_layers, draft_num_hidden_layers)
    if preset == "servable":
        return servable_layer_ids(num_layers, draft_num_hidden_layers)
    raise ValueError(f"model.layer_preset={preset!r} is not one of {list(LAYER_PRESETS)}")


def layer_id_problems(layer_ids: Sequence[int], num_layers: int | None = None) -> list[str]:
    """Every reason why ``layer_ids`` is not a valid explicit selection (empty list: valid)."""
    problems: list[str] = []
    ids = list(layer_ids)
    if not ids:
        return ["model.layer_ids is empty: give at least one layer id, or null for the default selection"]
    if any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
        return [f"model.layer_ids={ids} must be integers"]
    if any(b <= a for a, b in zip(ids, ids[1:])):
        problems.append(f"model.layer_ids={ids} must be strictly increasing (sort them and drop duplicates)")
    if num_layers is not None:
        bad = [i for i in ids if not (i == -1 or 0 <= i <= num_layers - 1)]
        if bad:
            problems.append(
                f"model.layer_ids contains {bad}, outside {{-1}} U [0, {num_layers - 1}] for a target "
                f"with {num_layers} layers"
            )
    else:
        bad = [i for i in ids if i < -1]
        if bad:
            problems.append(f"model.layer_ids contains {bad}; ids must be -1 (embeddings) or >= 0")
    return problems


def resolve_layer_ids(
    layer_ids: Sequence[int] | None, num_layers: int, draft_num_hidden_layers: int = 5, preset: str = "nemo"
) -> list[int]:
    """Explicit ids after validation, or the ``preset``'s selection (NeMo's by default) when ``layer_ids`` is None."""
    if layer_ids is None:
        try:
            return preset_layer_ids(preset, num_layers, draft_num_hidden_layers)
        except ValueError as exc:
            from dspark_precompute.errors import ConfigError

            raise ConfigError([str(exc)]) from None
    problems = layer_id_problems(layer_ids, num_layers)
    if problems:
        from dspark_precompute.errors import ConfigError

        raise ConfigError(problems)
    return list(layer_ids)
