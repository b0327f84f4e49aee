"""Which target layers to capture: NeMo AutoModel's default selection and its validation.

Layer id ``i`` is the output of decoder layer ``i`` (HF ``output_hidden_states[i + 1]``),
``-1`` is the embedding output (``hidden_states[0]``) and ``N - 1`` is the post-final-norm
state, exactly as in NeMo AutoModel's ``precompute_dspark``.
"""

from __future__ import annotations

from collections.abc import Sequence


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
    layer_ids: Sequence[int] | None, num_layers: int, draft_num_hidden_layers: int = 5
) -> list[int]:
    """Explicit ids after validation, or NeMo's default selection when ``layer_ids`` is None."""
    if layer_ids is None:
        return default_layer_ids(num_layers, draft_num_hidden_layers)
    problems = layer_id_problems(layer_ids, num_layers)
    if problems:
        from dspark_precompute.errors import ConfigError

        raise ConfigError(problems)
    return list(layer_ids)
