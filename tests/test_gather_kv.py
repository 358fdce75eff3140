"""The read side (``jax_dflash.gather_kv``): each sequence's K and V, read back through its page
table and dequantized, for every pool format."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_dflash
from jax_dflash import reference
from jax_dflash.testing import POOL_DTYPES, make_paged_problem


def _written(pool_dtype):
    problem = make_paged_problem(
        np.random.default_rng(11), dtype=np.float16, pool_dtype=pool_dtype, batch=2
    )
    pool = reference.target_kv_cache_update_paged(*problem.args(), **problem.kwargs())
    return problem, pool


def _dequantized(rows, scale):
    values = rows.astype(np.float32)
    if scale is None:
        return values
    return values * np.asarray(scale, np.float32).reshape(-1)[:, None]


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES, ids=str)
def test_every_written_row_reads_back_dequantized(pool_dtype):
    problem, pool = _written(pool_dtype)
    table = np.asarray(problem.kv_page_table)
    scales = {k: v for k, v in problem.kwargs().items() if k in ("k_scale", "v_scale")}
    keys, values = jax_dflash.gather_kv(pool, table, **scales)
    keys, values = np.asarray(keys), np.asarray(values)
    n, page = pool.shape[1], pool.shape[2]
    batch, _, pages = table.shape
    assert keys.shape == values.shape == (batch, pages * page, *pool.shape[3:])
    for b in range(batch):
        for i in range(pages):
            kp, vp = table[b, 0, i], table[b, 1, i] - n
            got_k = keys[b, i * page : (i + 1) * page]
            got_v = values[b, i * page : (i + 1) * page]
            if 0 <= kp < n:
                want = _dequantized(pool[0, kp], scales.get("k_scale"))
                np.testing.assert_array_equal(got_k, want)
            else:
                assert (got_k == 0).all()
            if 0 <= vp < n:
                want = _dequantized(pool[1, vp], scales.get("v_scale"))
                np.testing.assert_array_equal(got_v, want)
            else:
                assert (got_v == 0).all()


def test_int8_reads_back_within_half_a_step_of_the_value():
    """What a user wants to know of a quantized pool: a written value comes back within half a
    quantization step (|y| / 127 steps for int8 when nothing saturates)."""
    rng = np.random.default_rng(3)
    t, h, d, page = 6, 2, 16, 4
    v = rng.standard_normal((t, h, d)).astype(np.float32)
    scale = np.abs(v).max(axis=(0, 2)) / 127  # per head, nothing saturates
    pool = np.zeros((2, 4, page, h, d), np.int8)
    table = np.array([[[0, 1], [4 + 2, 4 + 3]]], np.int32)
    positions = np.arange(t, dtype=np.int32)
    owners = np.zeros(t, np.int32)
    rope = np.zeros((t, 0), np.float32)
    out = jax_dflash.target_kv_cache_update_paged(
        v, v, pool, rope, positions, owners, table, k_scale=scale, v_scale=scale
    )
    keys, values = jax_dflash.gather_kv(out, table, k_scale=scale, v_scale=scale)
    step = scale[None, :, None]
    assert np.all(np.abs(np.asarray(values)[0, :t] - v) <= step / 2 * (1 + 1e-6))
    np.testing.assert_array_equal(np.asarray(keys), np.asarray(values))


def test_reading_a_pool_needs_its_scales_exactly():
    problem, pool = _written(ml_dtypes.float8_e4m3fn)
    table = np.asarray(problem.kv_page_table)
    with pytest.raises(
        ValueError, match="k_scale, v_scale: a float8_e4m3fn pool is read with both"
    ):
        jax_dflash.gather_kv(pool, table)
    with pytest.raises(ValueError, match="with neither"):
        jax_dflash.gather_kv(pool.astype(np.float16), table, k_scale=1.0, v_scale=1.0)
    with pytest.raises(TypeError, match="kv_page_table: expected an int32 array"):
        jax_dflash.gather_kv(
            pool, table.astype(np.int64), k_scale=problem.k_scale, v_scale=problem.v_scale
        )
    got = jax_dflash.gather_kv(
        pool, table, k_scale=problem.k_scale, v_scale=problem.v_scale, dtype=jnp.bfloat16
    )
    assert got[0].dtype == jnp.bfloat16


def test_an_int4_pool_is_sent_to_the_reader_with_a_scale_pool():
    pool = np.zeros((2, 4, 4, 2, 8), np.uint8)
    table = np.array([[[0, 1], [4, 5]]], np.int32)
    with pytest.raises(ValueError, match=r"past_key_value: .* int4 .* use gather_kv_paged"):
        jax_dflash.gather_kv(pool, table)
