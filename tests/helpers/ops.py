"""Running the op on a problem and computing what it must give: shared by the op test modules."""

from __future__ import annotations

import functools
import importlib

import jax
import numpy as np
import pytest

import jax_dflash
from jax_dflash import reference
from jax_dflash.testing import DELTA_DTYPES, PagedProblem, Problem, assert_bits_equal

# Each addressing form's (JAX op, NumPy reference).
FORM_OPS = {
    "slot": (jax_dflash.target_kv_cache_update, reference.target_kv_cache_update),
    "paged": (jax_dflash.target_kv_cache_update_paged, reference.target_kv_cache_update_paged),
    "slot_mapping": (
        jax_dflash.target_kv_cache_update_slots,
        reference.target_kv_cache_update_slots,
    ),
}
FORMS = tuple(FORM_OPS)


def device_of(backend: str):
    return jax.devices(backend)[0]


def _split_kwargs(problem):
    """(static keywords, names of the array keywords, the arrays) of a problem's kwargs()."""
    kwargs = problem.kwargs()
    names = tuple(sorted(k for k, v in kwargs.items() if isinstance(v, np.ndarray)))
    static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))
    return static, names, [kwargs[n] for n in names]


@functools.cache
def _jitted(paged, static, array_names, donate):
    op = jax_dflash.target_kv_cache_update_paged if paged else jax_dflash.target_kv_cache_update
    base = 7 if paged else 6

    def fn(*operands):
        extras = dict(zip(array_names, operands[base:]))
        return op(*operands[:base], **dict(static), **extras)

    return jax.jit(fn, donate_argnums=(2,) if donate else ())


def jitted_op(problem: Problem | PagedProblem, donate: bool = True):
    """``(jitted function, its operands)`` for a problem: the extras travel as operands."""
    static, names, arrays = _split_kwargs(problem)
    return (
        _jitted(isinstance(problem, PagedProblem), static, names, donate),
        [*problem.args(), *arrays],
    )


def run_op(problem: Problem | PagedProblem, backend: str, donate: bool = True):
    device = device_of(backend)
    fn, operands = jitted_op(problem, donate)
    out = fn(*[jax.device_put(a, device) for a in operands])
    assert out.devices() == {device}
    return np.asarray(out)


def expected(problem: Problem | PagedProblem):
    if isinstance(problem, PagedProblem):
        return reference.target_kv_cache_update_paged(*problem.args(), **problem.kwargs())
    return reference.target_kv_cache_update(*problem.args(), **problem.kwargs())


def with_special_rows(args, rng):
    """args with some (token, head) rows of both deltas made special: all zeros, one NaN, one
    +inf or -inf, and tiny values whose scale is subnormal (SPEC.md "Dynamic scales")."""
    k, v = (np.array(a) for a in args[:2])
    for delta in (k, v):
        rows = delta.reshape(-1, delta.shape[-1])
        picks = rng.choice(len(rows), size=min(len(rows), 4), replace=False)
        specials = [0.0, np.nan, rng.choice([np.inf, -np.inf]), 1e-40]
        for row, special in zip(picks, specials):
            if special == 0.0 or special == 1e-40:
                rows[row] = np.float32(special) * rng.choice([-1, 1], size=rows.shape[-1])
            else:
                rows[row, rng.integers(rows.shape[-1])] = special
    return [k, v, *args[2:]]


def run_with_scale_pool(form, args, kwargs, backend="cpu"):
    """``(pool, scale_pool)`` on the host after the op of ``form`` on ``backend``."""
    device = jax.devices(backend)[0]
    put = [jax.device_put(a, device) for a in args]
    extra = dict(kwargs, scale_pool=jax.device_put(kwargs["scale_pool"], device))
    pool, scales = FORM_OPS[form][0](*put, **extra)
    return np.asarray(pool), np.asarray(scales)


def assert_cuda_scale_pool_call_matches_the_reference(form, problem):
    """Three calls ``problem(rng, delta_dtype) -> (args, kwargs)`` with a scale pool, each delta
    dtype once, special rows mixed in (with_special_rows): the CUDA op's pool and scale pool
    are the reference's, bit for bit."""
    for seed in range(3):
        args, kwargs = problem(np.random.default_rng(seed), DELTA_DTYPES[seed % 3])
        args = with_special_rows(args, np.random.default_rng(100 + seed))
        pool, scales = run_with_scale_pool(form, args, kwargs, backend="gpu")
        want = FORM_OPS[form][1](*args, **kwargs)
        assert_bits_equal(pool, want[0])
        assert_bits_equal(scales, want[1])


def cuda_extension():
    """jax_dflash._dflash_cuda, or the test skips, saying why it does not load."""
    try:
        return importlib.import_module("jax_dflash._dflash_cuda")
    except ImportError as e:
        pytest.skip(f"jax_dflash._dflash_cuda was not built or does not load: {e}")
