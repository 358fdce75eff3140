"""Eager (un-jitted) calls of both ops reuse one jitted callable per primitive and params, so a
repeated call neither retraces nor recompiles."""

from __future__ import annotations

import numpy as np

import jax_dflash
from conftest import assert_bits_equal, make_paged_problem, make_problem
from helpers.ops import expected
from jax_dflash import ops


def _calls(problem, op, times):
    outs = [op(*problem.args(), **problem.kwargs()) for _ in range(times)]
    for out in outs:
        assert_bits_equal(out, expected(problem))


def test_repeated_eager_calls_hit_the_cache():
    ops._jitted.cache_clear()
    slot = make_problem(np.random.default_rng(0))
    _calls(slot, jax_dflash.target_kv_cache_update, 4)
    info = ops._jitted.cache_info()
    assert (info.misses, info.hits) == (1, 3)
    (jitted,) = [
        ops._jitted(
            jax_dflash.target_kv_cache_update_p,
            (("k_norm", False), ("norm_eps", 1e-6), ("pages_per_slot", 2), ("v_norm", False)),
        )
    ]
    assert jitted._cache_size() == 1  # one trace and compilation for the four calls

    paged = make_paged_problem(np.random.default_rng(1), k_norm=True)
    _calls(paged, jax_dflash.target_kv_cache_update_paged, 3)
    info = ops._jitted.cache_info()
    assert (info.misses, info.hits) == (2, 3 + 1 + 2)  # the lookup above counted as a hit


def test_params_key_the_cache():
    """Different static params are different programs: each gets its own entry."""
    ops._jitted.cache_clear()
    problem = make_problem(np.random.default_rng(2), v_norm=True)
    jax_dflash.target_kv_cache_update(*problem.args(), **problem.kwargs())
    kwargs = dict(problem.kwargs(), norm_eps=1e-3)
    out = jax_dflash.target_kv_cache_update(*problem.args(), **kwargs)
    from jax_dflash import reference

    assert_bits_equal(out, reference.target_kv_cache_update(*problem.args(), **kwargs))
    assert ops._jitted.cache_info().misses == 2
    # norm_eps=1 and norm_eps=1.0 are one key: the value is normalised to a float.
    jax_dflash.target_kv_cache_update(*problem.args(), **dict(kwargs, norm_eps=1))
    jax_dflash.target_kv_cache_update(*problem.args(), **dict(kwargs, norm_eps=1.0))
    assert ops._jitted.cache_info().misses == 3


def test_eager_call_under_disable_jit():
    """Under jax.disable_jit the op still runs as its one compiled call (it has no other form)
    instead of recursing."""
    import jax

    problem = make_paged_problem(np.random.default_rng(3), pool_dtype="float8_e4m3fn")
    with jax.disable_jit():
        out = jax_dflash.target_kv_cache_update_paged(*problem.args(), **problem.kwargs())
        batched = jax.vmap(
            lambda k: jax_dflash.target_kv_cache_update_paged(
                k, *problem.args()[1:], **problem.kwargs()
            )
        )(np.stack([problem.k_delta] * 2))
    assert_bits_equal(out, expected(problem))
    assert_bits_equal(batched[1], expected(problem))
