"""Scale-pool stores at their rounding boundaries.

Every element a scale pool stores is ``y / s`` (a float32 division, rounded; SPEC.md "Dynamic
scales") rounded again to the format's grid: int8 and int4 at every ``k + 1/2``, FP8 at every
midpoint between neighbouring codes. The CUDA kernel stores most elements from the product with
the scale's reciprocal and divides only where it cannot prove the two round alike; these rows put
quotients a few ulps either side of (and on) every boundary of each format, for scales of many
sizes, and the stored bytes and scales must be the reference's (which divides) bit for bit, on
every backend this JAX has.
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest

import jax_dflash
from jax_dflash import reference
from jax_dflash.testing import assert_bits_equal, gpu_devices

HEAD_DIM = 128  # the CUDA kernel's group-of-lanes path (a multiple of 8, at most 256)
QMAX = {"int8": 127.0, "int4": 7.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
FORMATS = tuple(QMAX)


def _backends():
    names = ["cpu"]
    if gpu_devices():
        names.append("gpu")
    return names


def _boundaries(fmt):
    """The format's rounding boundaries in quotient units, both signs."""
    if fmt in ("int8", "int4"):
        q = int(QMAX[fmt])
        half = np.arange(-q, q, dtype=np.float64) + 0.5
    else:
        dtype = ml_dtypes.float8_e4m3fn if fmt == "float8_e4m3fn" else ml_dtypes.float8_e5m2
        codes = np.arange(0x00, 0x80, dtype=np.uint8).view(dtype).astype(np.float64)
        values = np.unique(codes[np.isfinite(codes) & (codes <= QMAX[fmt])])
        mid = (values[:-1] + values[1:]) / 2
        half = np.concatenate([-mid, mid])
    return half


def _rows(fmt, scale, rng):
    """Rows of HEAD_DIM float32 values: element 0 is qmax * scale (so the row's scale is
    `scale` when that product and its division are exact), the others sit on and a few ulps
    either side of the boundaries (in a random order)."""
    s = np.float32(scale)
    targets = (_boundaries(fmt) * np.float64(s)).astype(np.float32)
    near = [targets]
    for steps in (1, 2, 5):
        up, down = targets.copy(), targets.copy()
        for _ in range(steps):
            up = np.nextafter(up, np.float32(np.inf))
            down = np.nextafter(down, np.float32(-np.inf))
        near += [up, down]
    values = rng.permutation(np.concatenate(near))
    top = np.float32(QMAX[fmt]) * s
    values = np.clip(values, -top, top)
    per_row = HEAD_DIM - 1
    rows = -(-values.size // per_row)
    padded = np.concatenate([values, np.zeros(rows * per_row - values.size, np.float32)])
    body = padded.reshape(rows, per_row)
    return np.concatenate([np.full((rows, 1), top, np.float32), body], axis=1)


def _call(fmt, key, value):
    """A slot-mapping call writing rows key[t] / value[t] (one head, no rotation) at slot t."""
    tokens = key.shape[0]
    last = HEAD_DIM // 2 if fmt == "int4" else HEAD_DIM
    pool_dtype = {"int4": np.uint8, "int8": np.int8}.get(fmt) or getattr(ml_dtypes, fmt)
    pool = np.full((2, tokens, 1, 1, last), 0x55, np.uint8).view(pool_dtype)
    scale_pool = np.full((2, tokens, 1, 1), 3.0, np.float32)
    args = [
        key.reshape(tokens, 1, HEAD_DIM),
        value.reshape(tokens, 1, HEAD_DIM),
        pool,
        np.zeros((tokens, 0), np.float32),
        np.arange(tokens, dtype=np.int32),
    ]
    return args, dict(scale_pool=scale_pool)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("fmt", FORMATS)
def test_quotients_at_every_boundary_are_the_divisions(backend, fmt):
    rng = np.random.default_rng(FORMATS.index(fmt))
    # Scales of powers of two and of full mantissas, tiny (the reciprocal near the top of the
    # float range) to huge.
    scales = [2.0**-60, 1.0, 2.0**40, 1.7816460132598877, 3.0e-30, 0.1, 7.3e25]
    key = np.concatenate([_rows(fmt, s, rng) for s in scales])
    value = np.concatenate([_rows(fmt, s, rng) for s in reversed(scales)])
    value = value[rng.permutation(value.shape[0])][: key.shape[0]]
    args, kwargs = _call(fmt, key, value)
    want = reference.target_kv_cache_update_slots(*args, **kwargs)
    device = jax.devices(backend)[0]
    put = [jax.device_put(a, device) for a in args]
    pool, scale_pool = jax_dflash.target_kv_cache_update_slots(
        *put, scale_pool=jax.device_put(kwargs["scale_pool"], device)
    )
    assert_bits_equal(np.asarray(scale_pool), want[1])
    assert_bits_equal(np.asarray(pool), want[0])
    # The rows' scales are the chosen ones (so the quotients sit where intended) where
    # qmax * s / qmax is exact.
    got_scales = np.asarray(scale_pool)[0, :, 0, 0]
    rows_per_scale = key.shape[0] // len(scales)
    for i, s in enumerate(scales):
        chosen = np.float32(s)
        if np.float32(np.float32(QMAX[fmt]) * chosen) / np.float32(QMAX[fmt]) == chosen:
            assert got_scales[i * rows_per_scale] == chosen
