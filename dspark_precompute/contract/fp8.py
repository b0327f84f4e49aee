"""FP8 (e4m3) storage: the one definition of what a stored fp8 hidden state means.

``storage.dtype=fp8_e4m3`` stores each intermediate hidden-state array as OCP e4m3 bits
(``float8_e4m3fn``: 1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no infinities,
``0x7F``/``0xFF`` are NaN, largest finite 448) in a ``uint8`` array, with a float32 scale per
token and per group of ``g`` channels (``g`` = ``storage.fp8_group``, or the whole row when it
is null) in ``hidden_scales/<array>`` (shape ``[token, hidden / g]``, the same chunk rows).

Writing (``write/store/transfer.py``, on the device, in float32)::

    amax[t, k]  = max |x[t, k*g:(k+1)*g]|                      (x in the compute dtype, as float32)
    scale[t, k] = 1                       if amax == 0         (zero rows: dequantize to exact zeros)
                  max(amax / 448, 2^-126) otherwise            (float32 division; never 0, never subnormal)
    bits[t, c]  = e4m3_rne(clamp(x[t, c] / scale[t, c // g], -448, 448))

Reading (this module, numpy only, exact)::

    value[t, c] = float32(E4M3[bits[t, c]]) * scale[t, c // g]     (one float32 multiply)
    bf16[t, c]  = round_to_nearest_even_bf16(value[t, c])          (what a reader returns)

which is bit-for-bit what torch gives for ``(bits.view(torch.float8_e4m3fn).float() *
scale).bfloat16()``. Every scale must be finite and positive (a reader refuses a chunk that
holds another value with :class:`~dspark_precompute.errors.CacheFormatError`); unwritten rows
(the tail of a unit's last chunk, dropped samples) hold scale 1 and zero bits.
"""

from __future__ import annotations

import numpy as np

E4M3 = "fp8_e4m3"  # the storage dtype name (storage.dtype, storage.last_dtype, the manifest)
E4M3_LOGICAL = "float8_e4m3fn"  # the logical dtype attribute of its arrays
E4M3_MAX = 448.0
MIN_SCALE = 2.0 ** -126  # the smallest normal float32: a scale is never below it
ZERO_ROW_SCALE = 1.0  # the scale of an all-zero group (and of rows never written)
SCALE_DTYPE = np.dtype(np.float32)
E4M3_EPS = 2.0 ** -3  # one step at 1.0 (3 mantissa bits): rounding error is at most half of it, relative
E4M3_MIN_NORMAL = 2.0 ** -6


def _table() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn bit patterns (exact: every one is a float32)."""
    b = np.arange(256, dtype=np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * np.exp2(exp - 7.0))
    val = np.where((exp == 15) & (man == 7), np.nan, val) * sign
    return val.astype(np.float32)


E4M3_TO_FLOAT32 = _table()
E4M3_TO_FLOAT32.setflags(write=False)


def scale_columns(hidden_size: int, group: int | None) -> int:
    """Scales per token of one array: ``hidden / group`` (one when ``group`` is null: the whole row)."""
    return 1 if not group else hidden_size // int(group)


def is_nan_bits(bits: np.ndarray) -> np.ndarray:
    """Where e4m3fn bits are NaN (the format has no infinities)."""
    nan: np.ndarray = (np.asarray(bits) & 0x7F) == 0x7F
    return nan


def dequantize(bits: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """e4m3 bits ``[T, H]`` and their scales ``[T, G]`` -> float32 ``[T, H]`` (``value`` above)."""
    bits = np.asarray(bits)
    scale = np.asarray(scale, dtype=np.float32)
    t, h = bits.shape
    g = scale.shape[1]
    if scale.shape[0] != t or g < 1 or h % g:
        raise ValueError(f"scales of shape {scale.shape} do not fit fp8 bits of shape {bits.shape}")
    vals: np.ndarray = E4M3_TO_FLOAT32[bits]
    if g == 1:
        vals *= scale
    else:
        vals.reshape(t, g, h // g)[...] *= scale[:, :, None]
    return vals


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), rounding to nearest even as torch does; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    out = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return out


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32, exactly (bf16 is the top half of a float32)."""
    out: np.ndarray = (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)
    return out


def to_float32(stored: np.ndarray, storage_dtype: str, scale: np.ndarray | None = None) -> np.ndarray:
    """A stored hidden-state block as float32 values (fp8 needs its ``scale``)."""
    if storage_dtype == E4M3:
        if scale is None:
            raise ValueError("fp8 states need their scales to be read as numbers")
        return dequantize(stored, scale)
    if storage_dtype == "bf16":
        return bf16_bits_to_float32(stored)
    return np.asarray(stored, dtype=np.float32)


def dequantize_bf16_bits(bits: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """e4m3 bits and scales -> bf16 bit patterns of ``value`` (the reader's path: in place, no NaN pass).

    A NaN product (only from NaN bits, which the writer never stores) stays NaN: the quiet NaN
    ``0x7FC00000`` rounds to ``0x7FC0``; every scale is finite and positive (checked on decode).
    """
    vals = dequantize(bits, scale)
    u = vals.view(np.uint32)
    tmp = np.right_shift(u, np.uint32(16))
    np.bitwise_and(tmp, np.uint32(1), out=tmp)
    tmp += np.uint32(0x7FFF)
    u += tmp
    np.right_shift(u, np.uint32(16), out=u)
    out: np.ndarray = u.astype(np.uint16)
    return out


def convert(stored: np.ndarray, storage_dtype: str, to: str, scale: np.ndarray | None = None) -> np.ndarray:
    """A stored block in the disk form of storage dtype ``to`` (bf16 bits, fp16, fp32); a no-op when equal.

    fp8 -> bf16 is ``bf16(E4M3[bits] * scale)``: one float32 multiply, one rounding.
    """
    if storage_dtype == to and to != E4M3:
        return stored
    if storage_dtype == E4M3 and to == "bf16" and scale is not None:
        return dequantize_bf16_bits(stored, scale)
    values = to_float32(stored, storage_dtype, scale)
    if to == "bf16":
        return float32_to_bf16_bits(values)
    if to == "fp16":
        return values.astype(np.float16)
    if to == "fp32":
        return values
    raise ValueError(f"cannot convert stored states to {to!r}")


def scale_problem(scale: np.ndarray) -> str | None:
    """Why a block of stored scales cannot be used (a value that is not finite and positive), or None."""
    s = np.asarray(scale)
    ok = np.isfinite(s) & (s > 0)
    if ok.all():
        return None
    bad = np.argwhere(~ok)
    where = tuple(int(i) for i in bad[0])
    return (f"holds {len(bad)} scale(s) that are not finite and positive (first {float(s[where])!r} at row "
            f"{where[0]}" + (f", group {where[1]}" if len(where) > 1 else "") + "); fp8 states cannot be "
            "dequantized from it")
