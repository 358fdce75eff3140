"""int8 pools with static scales: ``q = clamp(round_half_even(y / s), -127, 127)`` (SPEC.md,
"int8 pools"), the same bits from the reference, the CPU kernel and (on a GPU) the CUDA kernel.

The broad parity runs (every path, both contracts, the fuzzer) take int8 as one more pool dtype;
here are the conversion's own edges, stated from the spec rather than from the reference."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest

import jax_dflash
from jax_dflash import reference
from jax_dflash.testing import assert_bits_equal, gpu_devices, make_paged_problem

BACKENDS = ["cpu"] + (["gpu"] if gpu_devices() else [])


def _one_token_problem(values, scale, delta_dtype=np.float32):
    """A paged call that writes ``values`` (one head, D = len(values), no rotation: R = 0) as the
    key and the value of token 0 into page 0, row 0, with per-tensor scale ``scale``."""
    d = len(values)
    k = np.asarray(values, np.float32).astype(delta_dtype).reshape(1, 1, d)
    pool = np.full((2, 2, 4, 1, d), 99, np.int8)
    rope = np.zeros((1, 0), np.float32)
    positions = np.zeros(1, np.int32)
    owners = np.zeros(1, np.int32)
    table = np.array([[[0], [2]]], np.int32)  # K page 0; V id 2 = N + 0: V page 0
    kwargs = dict(k_scale=np.float32(scale), v_scale=np.float32(scale))
    return (k, k, pool, rope, positions, owners, table), kwargs


def _written(backend, args, kwargs):
    device = jax.devices(backend)[0]
    out = jax_dflash.target_kv_cache_update_paged(
        *[jax.device_put(a, device) for a in args], **kwargs
    )
    out = np.asarray(out)
    want = reference.target_kv_cache_update_paged(*args, **kwargs)
    assert_bits_equal(out, want)
    assert np.array_equal(out[0, 0, 0, 0], out[1, 0, 0, 0]), "K and V rows differ"
    untouched = np.ones(out.shape, bool)
    untouched[0, 0, 0] = untouched[1, 0, 0] = False
    assert (out[untouched] == 99).all(), "a row not addressed changed"
    return out[0, 0, 0, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_round_half_to_even_and_clamp(backend):
    # y / s with s = 1: halves go to the even neighbour; past +-127 (and +-inf) clamp.
    values = [
        0.5,
        1.5,
        2.5,
        -0.5,
        -1.5,
        -2.5,
        126.5,
        127.5,
        128.0,
        1e30,
        -1e30,
        np.inf,
        -np.inf,
        3.0,
    ]
    got = _written(backend, *_one_token_problem(values, 1.0))
    want = [0, 2, 2, 0, -2, -2, 126, 127, 127, 127, -127, 127, -127, 3]
    assert got.tolist() == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_stores_zero_and_the_division_is_float32(backend):
    # 1 / 3 in float32 is not 0.333..., so y = 1 with s = 1/3 must be divided, not multiplied:
    # float32(1 / float32(1/3)) rounds to 3, and 100 / s to 300 -> clamped.
    third = np.float32(1) / np.float32(3)
    values = [np.nan, 1.0, -1.0, 42.0, 0.0, -0.0, 40.0, 41.0]
    got = _written(backend, *_one_token_problem(values, float(third)))
    q = np.asarray(values[1:], np.float32) / third  # float32 division, as the spec says
    want = [0, *np.rint(np.clip(q, -127, 127)).astype(int).tolist()]
    assert got.tolist() == want
    assert want[1:4] == [3, -3, 126]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_value_is_divided_by_the_scale_not_multiplied_by_its_reciprocal(backend):
    # Here y / s and y * (1 / s) round to different integers (found by search).
    s, y = np.float32(1.7816460132598877), np.float32(-106.0079345703125)
    assert np.rint(y / s) == -60 and np.rint(y * (np.float32(1) / s)) == -59
    got = _written(backend, *_one_token_problem([float(y), 0.0], float(s)))
    assert got.tolist() == [-60, 0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(4))
def test_values_at_every_rounding_jump(backend, seed):
    """Quotients within a few ulps of every k + 1/2 from -130 to 130 (where a kernel that
    multiplied by the reciprocal instead would round the other way), and far from them, for
    scales of every size: the stored bytes are the reference's, which divides."""
    rng = np.random.default_rng(seed)
    scale = np.float32(2.0 ** rng.uniform(-20, 20))
    halves = np.arange(-130, 131, dtype=np.float64) + 0.5
    offsets = np.array([-3e-6, -1e-7, 0.0, 1e-7, 3e-6, 0.2])
    q = (halves[:, None] + offsets[None, :]).reshape(-1)
    values = (q * np.float64(scale)).astype(np.float32)
    _written(backend, *_one_token_problem(values.tolist(), float(scale)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [0.0, -0.5, np.inf, np.nan])
def test_hostile_scales_are_applied_as_written(backend, scale):
    # s = 0: y / 0 is +-inf (clamped) or NaN for y = 0 (stored as 0); a negative s flips signs.
    values = [1.0, -2.0, 0.0, 3.0]
    got = _written(backend, *_one_token_problem(values, scale))
    with np.errstate(all="ignore"):
        q = np.asarray(values, np.float32) / np.float32(scale)
    want = np.rint(np.clip(np.nan_to_num(q, nan=0.0, posinf=127, neginf=-127), -127, 127))
    assert got.tolist() == want.astype(int).tolist()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("delta", [np.float16, ml_dtypes.bfloat16, np.float32], ids=str)
def test_fused_norms_rope_and_layers_into_an_int8_pool(backend, delta):
    problem = make_paged_problem(
        np.random.default_rng(3),
        layers=2,
        dtype=delta,
        pool_dtype=np.int8,
        k_norm=True,
        v_norm=True,
        scale_shape=(2, 2),
    )
    device = jax.devices(backend)[0]
    out = jax_dflash.target_kv_cache_update_paged(
        *[jax.device_put(a, device) for a in problem.args()], **problem.kwargs()
    )
    want = reference.target_kv_cache_update_paged(*problem.args(), **problem.kwargs())
    assert_bits_equal(np.asarray(out), want)
    assert (want != problem.past_key_value).any(), "writes nothing"


def test_an_int8_pool_needs_its_scales_and_is_a_tensorrt_pool():
    args, kwargs = _one_token_problem([1.0, 2.0], 1.0)
    with pytest.raises(ValueError, match="past_key_value: an int8 pool needs k_scale and v_scale"):
        jax_dflash.target_kv_cache_update_paged(*args)
    from jax_dflash.interop import onnx as dflash_onnx

    assert "int8" in dflash_onnx.TRT_POOL_DTYPES  # TensorRT's kINT8
