"""Layer presets: NeMo's formula stays the default; ``servable`` never captures -1 or N-1."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import compose, small
from hypothesis import given
from hypothesis import strategies as st

from dspark_precompute.errors import ConfigError, IncompatibleCacheError
from dspark_precompute.write.config.layers import (
    default_layer_ids,
    preset_layer_ids,
    resolve_layer_ids,
    servable_layer_ids,
)
from dspark_precompute.write.config.schema import ModelConfig
from dspark_precompute.write.run import run


# the table, computed by hand from round(1 + i*(N-4)/(k-1)) (Python's round: half to even)
@pytest.mark.parametrize("n,k,expected", [
    (36, 5, [1, 9, 17, 25, 33]),   # Qwen3-8B: the layers the DSpark paper's drafts use
    (28, 5, [1, 7, 13, 19, 25]),   # Qwen3-0.6B: 1 + i*6
    (32, 5, [1, 8, 15, 22, 29]),   # 1 + i*7
    (40, 3, [1, 19, 37]),          # 1 + i*18
    (64, 4, [1, 21, 41, 61]),      # 1 + i*20
    (30, 4, [1, 10, 18, 27]),      # 1, 9.67, 18.33, 27
    (9, 3, [1, 4, 6]),             # 1, 3.5 -> 4 (half to even), 6
    (11, 5, [1, 3, 4, 6, 8]),      # 1, 2.75, 4.5 -> 4 (half to even), 6.25, 8
    (8, 5, [1, 2, 3, 4, 5]),       # k = N-3: every servable id
    (36, 1, [33]),                 # k = 1: the deepest servable state, N-3
    (4, 1, [1]),                   # the smallest target the preset serves
])
def test_the_servable_preset_spreads_k_ids_over_1_to_n_minus_3(n, k, expected):
    assert servable_layer_ids(n, k) == expected
    assert preset_layer_ids("servable", n, k) == expected


@given(st.integers(4, 300).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n - 3))))
def test_servable_ids_are_k_distinct_increasing_ids_inside_1_to_n_minus_3_and_never_minus_1_or_n_minus_1(nk):
    n, k = nk
    ids = servable_layer_ids(n, k)
    assert len(ids) == k and ids == sorted(set(ids))
    assert all(1 <= i <= n - 3 for i in ids) and -1 not in ids and n - 1 not in ids
    assert ids[-1] == n - 3 and (k == 1 or ids[0] == 1)


def test_the_nemo_preset_is_nemos_formula_unchanged():
    assert preset_layer_ids("nemo", 28, 5) == default_layer_ids(28, 5) == [1, 8, 14, 20, 27]
    assert resolve_layer_ids(None, 36, 5) == [1, 10, 18, 26, 35]  # the default preset


def test_a_servable_selection_that_cannot_be_made_is_a_clear_error_naming_the_fix():
    with pytest.raises(ValueError, match=r"empty for this target with 3 layers \(it needs at least 4\)"):
        servable_layer_ids(3, 1)
    with pytest.raises(ValueError, match=r"\[1, N-3\] = \[1, 3\] of this 6-layer target: at most 3 distinct "
                                         r"ids, but model.draft_num_hidden_layers=5; set model.draft_num_hidden_layers "
                                         r"<= 3"):
        servable_layer_ids(6, 5)
    with pytest.raises(ConfigError, match="model.layer_preset=servable"):
        resolve_layer_ids(None, 4, 5, "servable")


def test_the_preset_is_checked_with_the_config():
    assert any("model.layer_preset='sglang' is not one of ['nemo', 'servable']" in p
               for p in ModelConfig(layer_preset="sglang").problems())
    assert any("both choose the captured layers" in p
               for p in ModelConfig(layer_ids=[1, 2], layer_preset="servable").problems())
    assert ModelConfig(layer_preset="servable").problems() == []
    with pytest.raises(ConfigError, match=r"at most 1 distinct ids, but model.draft_num_hidden_layers=5") as err:
        run(compose(["model.layer_preset=servable", "storage.path=/nonexistent/never-created"]))
    assert len(err.value.problems) == 1  # one line, not an error inside an error
    assert not Path("/nonexistent/never-created").exists()


def test_resuming_with_another_layer_preset_is_refused_naming_it(default_run, no_weights):
    _, result = default_run
    overrides = small(Path(result.path).parent, "storage.chunk_tokens=256", "storage.unit_tokens=1024",
                      name=Path(result.path).name)
    with pytest.raises(IncompatibleCacheError) as err:
        run(compose([*overrides, "model.layer_preset=servable", "model.draft_num_hidden_layers=1"]))
    diffs = {k: (a, b) for k, a, b in err.value.differences}
    assert diffs["layer_preset"] == (None, "servable") and diffs["layer_ids"] == ([1, 2, 3], [1])
    assert "layer_preset: recorded None, requested 'servable'" in str(err.value)


def test_a_derived_storage_path_separates_presets_and_keeps_the_default_path():
    from dspark_precompute.write.plan.prepare import default_storage_path

    base = compose(["seq_length=256"])
    same = compose(["seq_length=256", "model.layer_preset=nemo"])
    other = compose(["seq_length=256", "model.layer_preset=servable"])
    assert default_storage_path(base) == default_storage_path(same) != default_storage_path(other)
