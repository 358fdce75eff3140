"""Shared fixtures: backends, random update problems."""

from __future__ import annotations

import dataclasses

import jax
import ml_dtypes
import numpy as np
import pytest

DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))


def gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def _backend_param(name):
    if name == "gpu":
        return pytest.param(
            name,
            marks=pytest.mark.skipif(
                not gpu_devices(), reason="no GPU backend in this JAX: the CUDA suite runs on the H200"
            ),
        )
    return name


BACKENDS = [_backend_param("cpu"), _backend_param("gpu")]


@pytest.fixture(params=BACKENDS)
def backend(request):  # a plain string: safe to share across hypothesis examples
    return request.param


def device_of(backend):
    return jax.devices(backend)[0]


@dataclasses.dataclass
class Problem:
    """One random update: the six operands (NumPy) and pages_per_slot."""

    k_delta: np.ndarray
    v_delta: np.ndarray
    past_key_value: np.ndarray
    rope_cos_sin: np.ndarray
    delta_start_positions: np.ndarray
    delta_lengths: np.ndarray
    pages_per_slot: int

    def args(self):
        return (self.k_delta, self.v_delta, self.past_key_value, self.rope_cos_sin,
                self.delta_start_positions, self.delta_lengths)


def make_problem(
    rng: np.random.Generator,
    *,
    batch=2, delta_len=4, heads=2, head_dim=16, rotary_dim=None, page_size=4, pages_per_slot=2,
    max_batch=None, rope_batch=1, rope_seq_len=None, dtype=np.float16, layers=None,
    hostile=True, rope_per_layer=False, positions_per_layer=False,
) -> Problem:
    """Random values everywhere (never zeros); positions include padding, pass-through past S,
    drops past the slot and negative starts when ``hostile``."""
    dtype = np.dtype(dtype)
    rotary_dim = head_dim - head_dim % 2 if rotary_dim is None else rotary_dim
    max_batch = batch if max_batch is None else max_batch
    capacity = page_size * pages_per_slot
    rope_seq_len = capacity if rope_seq_len is None else rope_seq_len
    lead = () if layers is None else (layers,)

    def normal(shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    delta_shape = (*lead, batch, delta_len, heads, head_dim)
    pool = normal((*lead, 2, max_batch * pages_per_slot, page_size, heads, head_dim))
    rope_lead = lead if rope_per_layer else ()
    rope = rng.uniform(-1, 1, (*rope_lead, rope_batch, rope_seq_len, rotary_dim)).astype(np.float32)
    pos_shape = (*(lead if positions_per_layer else ()), batch)
    if hostile:
        starts = rng.integers(-delta_len - 1, capacity + 2, pos_shape).astype(np.int32)
        lengths = rng.integers(-1, delta_len + 3, pos_shape).astype(np.int32)
    else:
        starts = rng.integers(0, max(capacity - delta_len, 0) + 1, pos_shape).astype(np.int32)
        lengths = np.full(pos_shape, delta_len, np.int32)
    return Problem(normal(delta_shape), normal(delta_shape), pool, rope, starts, lengths,
                   pages_per_slot)


def assert_bits_equal(actual, expected):
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    a = actual.view(np.uint8).reshape(*actual.shape, -1)
    e = expected.view(np.uint8).reshape(*expected.shape, -1)
    mismatched = np.any(a != e, axis=-1)
    if mismatched.any():
        idx = np.argwhere(mismatched)
        first = tuple(idx[0])
        raise AssertionError(
            f"{len(idx)} of {actual.size} elements differ bitwise; first at {first}: "
            f"{actual[first]!r} != {expected[first]!r}"
        )
