"""norm_eps is judged once, by the core, on its float32 bits: a subnormal value (zero under the
flush-to-zero mode XLA's CPU runtime sets) is refused by every entry point before anything runs,
with one message, instead of passing some checks and failing others at run time."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jax_dflash
from jax_dflash import _ext, reference
from jax_dflash.interop import onnx as dflash_onnx
from jax_dflash.testing import make_problem

MESSAGE = "norm_eps: expected a finite float > 0 that is a normal float32"
BAD = (1e-40, 1e-45, 0.0, -1e-6, float("inf"), float("nan"))


@pytest.fixture(scope="module")
def problem():
    return make_problem(np.random.default_rng(7), dtype=np.float32)


@pytest.mark.parametrize("eps", BAD)
def test_the_jax_op_and_the_reference(problem, eps):
    kwargs = {**problem.kwargs(), "v_norm": True, "norm_eps": eps}
    with pytest.raises(ValueError, match=MESSAGE):
        jax_dflash.target_kv_cache_update(*problem.args(), **kwargs)
    with pytest.raises(ValueError, match=MESSAGE):
        reference.target_kv_cache_update(*problem.args(), **kwargs)


@pytest.mark.parametrize("eps", BAD)
def test_the_onnx_node(eps):
    with pytest.raises(ValueError, match=MESSAGE):
        dflash_onnx.make_update_node(pages_per_slot=2, k_norm=True, norm_eps=eps)


@pytest.mark.parametrize("eps", (1e-40, 0.0))
def test_a_hand_written_ffi_call(problem, eps):
    _ext.ensure_registered("cpu")
    pool = problem.past_key_value
    call = jax.ffi.ffi_call(
        "dflash_target_kv_cache_update",
        jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={2: 0},
    )
    attrs = dict(
        pages_per_slot=np.int64(problem.pages_per_slot),
        v_norm=np.bool_(True),
        norm_eps=np.float32(eps),
    )
    with pytest.raises(Exception, match=MESSAGE):
        jax.block_until_ready(jax.jit(lambda *a: call(*a, **attrs))(*problem.args()))


@pytest.mark.parametrize("eps", (1e-40, 0.0))
def test_the_raw_cpu_entry(problem, eps):
    args = [np.asarray(a) for a in problem.args()]
    pool = args[2].copy()
    before = pool.copy()
    with pytest.raises(ValueError, match=MESSAGE):
        _ext.extension("cpu").target_kv_cache_update(
            args[0],
            args[1],
            pool,
            *args[3:],
            pages_per_slot=problem.pages_per_slot,
            v_norm=True,
            norm_eps=eps,
        )
    assert np.array_equal(pool.view(np.uint8), before.view(np.uint8))


def test_the_smallest_normal_float32_is_accepted(problem):
    eps = float(np.finfo(np.float32).tiny)
    kwargs = {**problem.kwargs(), "v_norm": True, "norm_eps": eps}
    got = np.asarray(jax_dflash.target_kv_cache_update(*problem.args(), **kwargs))
    want = reference.target_kv_cache_update(*problem.args(), **kwargs)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
