"""The layout every cache follows, as properties over any lengths and sizes."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark_precompute.contract.layout import SampleIndex, build_layout


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(1, 3000), min_size=0, max_size=60), chunk=st.sampled_from([1, 7, 64, 512]),
       unit=st.integers(1, 6000), version=st.sampled_from([1, 2]))
def test_units_own_whole_chunks_and_their_samples_tile_them_longest_first(lengths, chunk, unit, version):
    lengths = np.asarray(lengths, dtype=np.int64)
    if version >= 2:  # as the plan sizes it: whole chunks, at least the longest sample
        unit = max(-(-3000 // chunk) * chunk, unit // chunk * chunk)
    lay = build_layout(lengths, chunk, unit, version)
    n = len(lengths)
    assert lay.num_units == len(lay.unit_order) and sum(len(o) for o in lay.unit_order) == n
    seen = np.concatenate(lay.unit_order) if n else np.zeros(0, dtype=np.int64)
    assert sorted(seen.tolist()) == list(range(n))  # every sample in exactly one unit
    # disk order: longest first, ties by sample index
    assert seen.tolist() == np.lexsort((np.arange(n), -lengths)).tolist()
    for u, members in enumerate(lay.unit_order):
        assert lay.unit_start[u] % chunk == 0  # units start on a chunk boundary: writers never share a chunk
        pos = int(lay.unit_start[u])
        for s in members:  # samples tile the unit: no gap, no overlap
            assert lay.start[s] == pos and lay.unit[s] == u
            pos += int(lengths[s])
        assert pos == lay.unit_stop[u]
        assert pos - lay.unit_start[u] <= unit or len(members) == 1  # within budget unless one long sample
        if u + 1 < lay.num_units:  # greedy: the next unit's first sample did not fit
            nxt = int(lay.unit_order[u + 1][0])
            assert pos - lay.unit_start[u] + lengths[nxt] > unit
            # format 2: one shard per unit, each at u x unit_tokens; format 1: packed after the last chunk
            assert lay.unit_start[u + 1] == ((u + 1) * unit if version >= 2 else -(-pos // chunk) * chunk)
    assert lay.total_slots % chunk == 0 and (lay.total_slots >= (lay.unit_stop[-1] if n else 0))
    if version >= 2 and n:  # the token axis ends with the last unit's last chunk (an edge shard)
        assert lay.total_slots == (lay.num_units - 1) * unit + -(-(int(lay.unit_stop[-1]) - (lay.num_units - 1)
                                                                      * unit) // chunk) * chunk


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 200), min_size=1, max_size=40), a=st.integers(0, 3000), w=st.integers(1, 400))
def test_the_sample_index_names_exactly_the_samples_touching_a_token_range(lengths, a, w):
    lengths = np.asarray(lengths, dtype=np.int64)
    lay = build_layout(lengths, 16, 256)
    got = SampleIndex(lay.start, lay.length).in_range(a, a + w)
    want = [s for s in range(len(lengths)) if lay.start[s] < a + w and lay.start[s] + lengths[s] > a]
    assert got.tolist() == want
