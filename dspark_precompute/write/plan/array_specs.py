"""The token-axis arrays a run writes: names, dtypes, widths, where their values come from, their codecs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark_precompute.contract.fp8 import SCALE_DTYPE, ZERO_ROW_SCALE, scale_columns
from dspark_precompute.contract.spec import (
    INPUT_IDS,
    LAST,
    LOSS_MASK,
    POSITION_DTYPE,
    POSITION_IDS,
    PRE_NORM,
    array_layer_id,
    final_state,
    hidden_arrays,
    scale_array,
)
from dspark_precompute.contract.vocab import Compressor, LastState, Shuffle, StorageDtype
from dspark_precompute.write.config.schema import StorageConfig


@dataclass(frozen=True)
class ArraySpec:
    """One token-axis array: its name, on-disk dtype and row width (None for 1-D), and what feeds it."""

    name: str
    dtype: str
    width: int | None = None
    logical_dtype: str | None = None
    layer_id: int | None = None  # the array's layer_id attribute (N-1 for both final states)
    storage: StorageDtype | None = None  # a hidden array's storage dtype
    scale: str | None = None  # an fp8 array's scale array
    scale_of: str | None = None  # a scale array's fp8 array
    group: int | None = None  # fp8: channels per scale
    fill: float = 0  # the value of slots no sample writes (scales: 1, so every stored scale is positive)
    final: str | None = None  # final_norm / pre_norm arrays: their final_state attribute
    source: int | None = None  # the captured state that fills it: a layer id, N-1 post-norm, N pre-norm
    first: bool = False  # written with input_ids and loss_mask before the first forward (position_ids)

    @property
    def row_bytes(self) -> int:
        return np.dtype(self.dtype).itemsize * (self.width or 1)

    @property
    def hidden(self) -> bool:
        """A hidden-state (or scale) array: written per unit after the forward, not before it."""
        return self.width is not None and not self.first


def token_array_specs(layer_ids: list[int], num_layers: int, hidden: int, storage_dtype: str,
                      last_dtype: str | None = None, fp8_group: int | None = None,
                      last_state: str = LastState.post_norm) -> list[ArraySpec]:
    """Every token-axis array: ids, mask, one per hidden array (the final states' in ``last_dtype``), and a
    float32 scale array after each fp8 one."""
    state = LastState(last_state)
    names = hidden_arrays(layer_ids, num_layers, post_norm=state.post, pre_norm=state.pre)
    finals = {names.get(LAST), names.get(PRE_NORM)}
    specs = [ArraySpec(INPUT_IDS, "int32"), ArraySpec(LOSS_MASK, "uint8")]
    for name in dict.fromkeys(names.values()):
        sd = StorageDtype((last_dtype or storage_dtype) if name in finals else storage_dtype)
        lid = array_layer_id(name, names, num_layers)
        source = num_layers if name == names.get(PRE_NORM) else lid
        group = fp8_group or hidden if sd.is_fp8 else None
        specs.append(ArraySpec(name, sd.disk.name, hidden, sd.logical, lid, sd, scale_array(name) if sd.is_fp8
                               else None, group=group, final=final_state(name, names), source=source))
        if sd.is_fp8:
            specs.append(ArraySpec(scale_array(name), SCALE_DTYPE.name, scale_columns(hidden, fp8_group),
                                   SCALE_DTYPE.name, scale_of=name, group=group, fill=ZERO_ROW_SCALE))
    return specs


def position_spec(axes: int) -> ArraySpec:
    """``position_ids``: a multi-axis rotary model's positions of an image cache (int32 [token, axes])."""
    return ArraySpec(POSITION_IDS, np.dtype(POSITION_DTYPE).name, axes, first=True)


def array_codec(storage: StorageConfig, spec: ArraySpec) -> tuple[Compressor, int, Shuffle, int]:
    """(compressor, level, shuffle, typesize) of one array: what it is allocated with and its chunks encoded with."""
    shuffle = storage.fp8_shuffle if spec.storage is not None and spec.storage.is_fp8 else storage.shuffle
    return Compressor(storage.compressor), int(storage.compression_level), Shuffle(shuffle), \
        np.dtype(spec.dtype).itemsize
