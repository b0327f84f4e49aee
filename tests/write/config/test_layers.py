import pytest

from dspark_precompute.errors import ConfigError
from dspark_precompute.write.config.layers import default_layer_ids, layer_id_problems, resolve_layer_ids


@pytest.mark.parametrize("n,k,expected", [
    (28, 5, [1, 8, 14, 20, 27]),
    (36, 5, [1, 10, 18, 26, 35]),
    (4, 5, [1, 2, 3]),          # k clamped to N-1
    (8, 1, [7]),                # k = 1 -> the last layer only
    (8, 0, [7]),                # k clamped up to 1
    (2, 5, [1]),
    (12, 3, [1, 6, 11]),
    (10, 4, [1, 4, 6, 9]),      # round(3.666)=4, round(6.333)=6
])
def test_default_layer_ids_follow_nemos_formula(n, k, expected):
    assert default_layer_ids(n, k) == expected


def test_default_layer_ids_use_round_half_to_even():
    # N=6, k=3: 1 + i*4/2 -> 1, 3, 5 ; N=7, k=5: 1 + i*5/4 -> 1, 2.25, 3.5, 4.75, 6 -> 1,2,4,5,6
    assert default_layer_ids(7, 5) == [1, 2, 4, 5, 6]
    assert default_layer_ids(6, 3) == [1, 3, 5]


def test_a_target_with_fewer_than_two_layers_is_an_error():
    with pytest.raises(ValueError, match="at least 2"):
        default_layer_ids(1, 5)


def test_explicit_ids_must_be_nonempty_increasing_and_in_range():
    assert layer_id_problems([-1, 0, 3], 4) == []
    assert "empty" in layer_id_problems([], 4)[0]
    assert any("strictly increasing" in p for p in layer_id_problems([3, 1], 4))
    assert any("strictly increasing" in p for p in layer_id_problems([1, 1], 4))
    assert any("outside" in p for p in layer_id_problems([0, 4], 4))
    assert any("outside" in p for p in layer_id_problems([-2, 1], 4))
    both = layer_id_problems([5, 2], 4)
    assert len(both) == 2  # every problem at once


def test_resolve_layer_ids_raises_a_config_error_for_bad_ids():
    assert resolve_layer_ids(None, 28, 5) == [1, 8, 14, 20, 27]
    with pytest.raises(ConfigError, match="model.layer_ids"):
        resolve_layer_ids([0, 99], 28)
