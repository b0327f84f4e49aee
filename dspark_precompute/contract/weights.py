"""``target_weights.safetensors``: what its tensors must be for the manifest beside it.

The embedding (and an untied ``lm_head``) a draft trains against; checked on open and by ``verify``,
without reading a tensor's bytes.
"""

from __future__ import annotations

from dspark_precompute.contract.manifest import Manifest
from dspark_precompute.contract.spec import WEIGHTS


def weights_problems(shapes: dict[str, tuple[int, ...]], m: Manifest,
                     metadata: dict[str, str] | None = None) -> list[str]:
    """What is wrong with the weights file's tensors (names and shapes) for this manifest."""
    problems = []
    want = (m.target_vocab_size, m.hidden_size)
    if "embed_tokens.weight" not in shapes:
        problems.append(f"{WEIGHTS} has no embed_tokens.weight (keys {sorted(shapes)})")
    for k, shape in shapes.items():
        if k in ("embed_tokens.weight", "lm_head.weight") and tuple(shape) != want:
            problems.append(f"{WEIGHTS}: {k} has shape {list(shape)}, expected [target_vocab_size, hidden_size] "
                            f"= {list(want)}")
    tied = (metadata or {}).get("tied")
    if tied is not None and (tied == "true") != ("lm_head.weight" not in shapes):
        problems.append(f"{WEIGHTS}: metadata tied={tied} but lm_head.weight is "
                        f"{'absent' if 'lm_head.weight' not in shapes else 'present'}")
    return problems
