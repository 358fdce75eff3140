"""Every trace-time check: the error names the argument, what was expected and what was given."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from conftest import make_problem

import jax_dflash
from jax_dflash import reference


def _problem(**kw):
    return make_problem(np.random.default_rng(0), batch=2, delta_len=3, heads=2, head_dim=8,
                        page_size=4, pages_per_slot=2, max_batch=3, **kw)


def _replace(args, index, value):
    args = list(args)
    args[index] = value
    return args


def _cases():
    p = _problem()
    k, v, pool, rope, starts, lengths = p.args()
    f16 = np.float16
    return [
        # (id, args, pages_per_slot, error type, fragments that must appear in the message)
        ("numpages-not-divisible", p.args(), 4, ValueError,
         ["past_key_value", "numPages", "6", "pages_per_slot = 4"]),
        ("batch-larger-than-slots", p.args(), 6, ValueError, ["k_delta", "B = 2", "1 slots"]),
        ("rope-longer-than-slot", _replace(p.args(), 3, np.zeros((1, 9, 8), np.float32)), 2,
         ValueError, ["rope_cos_sin", "S = 9", "slot capacity", "8"]),
        ("rotary-odd", _replace(p.args(), 3, np.zeros((1, 8, 7), np.float32)), 2, ValueError,
         ["rope_cos_sin", "R = 7", "even"]),
        ("rotary-larger-than-head", _replace(p.args(), 3, np.zeros((1, 8, 10), np.float32)), 2,
         ValueError, ["rope_cos_sin", "R = 10", "D = 8"]),
        ("rope-batch", _replace(p.args(), 3, np.zeros((3, 8, 8), np.float32)), 2, ValueError,
         ["rope_cos_sin", "batch 1 or B = 2", "(3, 8, 8)"]),
        ("rope-rank", _replace(p.args(), 3, np.zeros((8, 8), np.float32)), 2, ValueError,
         ["rope_cos_sin", "rank 3", "(8, 8)"]),
        ("rope-dtype", _replace(p.args(), 3, rope.astype(f16)), 2, TypeError,
         ["rope_cos_sin", "float32", "float16"]),
        ("v-shape", _replace(p.args(), 1, v[:, :2]), 2, ValueError,
         ["v_delta", "(2, 3, 2, 8)", "(2, 2, 2, 8)"]),
        ("k-heads", _replace(_replace(p.args(), 0, k[:, :, :1]), 1, v[:, :, :1]), 2, ValueError,
         ["k_delta", "H, D = 2, 8", "(2, 3, 1, 8)"]),
        ("k-rank", _replace(_replace(p.args(), 0, k[0]), 1, v[0]), 2, ValueError,
         ["k_delta", "rank 4", "(3, 2, 8)"]),
        ("v-dtype", _replace(p.args(), 1, v.astype(np.float32)), 2, TypeError,
         ["v_delta", "float16", "float32"]),
        ("pool-dtype-int", _replace(p.args(), 2, pool.astype(np.int16)), 2, TypeError,
         ["past_key_value", "float16, bfloat16 or float32", "int16"]),
        ("pool-rank", _replace(p.args(), 2, pool[0]), 2, ValueError,
         ["past_key_value", "rank 5", "(6, 4, 2, 8)"]),
        ("pool-planes", _replace(p.args(), 2, np.concatenate([pool, pool[:1]])), 2, ValueError,
         ["past_key_value", "== 2", "(3, 6, 4, 2, 8)"]),
        ("positions-dtype", _replace(p.args(), 4, starts.astype(np.float32)), 2, TypeError,
         ["delta_start_positions", "int32", "float32"]),
        ("lengths-shape", _replace(p.args(), 5, lengths[:1]), 2, ValueError,
         ["delta_lengths", "[2]", "(1,)"]),
        ("pages-per-slot-zero", p.args(), 0, ValueError, ["pages_per_slot", "> 0", "0"]),
        ("pages-per-slot-float", p.args(), 2.0, TypeError, ["pages_per_slot", "int", "2.0"]),
    ]


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_trace_time_errors(case):
    _, args, pages_per_slot, error, fragments = case
    fn = jax.jit(functools.partial(jax_dflash.target_kv_cache_update, pages_per_slot=pages_per_slot))
    with pytest.raises(error) as info:
        fn.lower(*args)  # abstract evaluation alone: no compile, no run
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    # The reference validates identically.
    with pytest.raises(error):
        reference.target_kv_cache_update(*args, pages_per_slot=pages_per_slot)


def test_layered_operands_must_agree():
    p = _problem(layers=3)
    k, v, pool, rope, starts, lengths = p.args()
    op = functools.partial(jax_dflash.target_kv_cache_update, pages_per_slot=2)
    with pytest.raises(ValueError, match=r"k_delta: expected 3 layers"):
        jax.eval_shape(op, k[:2], v[:2], pool, rope, starts, lengths)
    with pytest.raises(ValueError, match=r"rope_cos_sin: expected 3 layers"):
        jax.eval_shape(op, k, v, pool, np.stack([rope] * 2), starts, lengths)
    with pytest.raises(ValueError, match=r"delta_lengths: expected the same layout"):
        jax.eval_shape(op, k, v, pool, rope, np.stack([starts] * 3), lengths)
    # Per-layer rope and positions are accepted.
    out = jax.eval_shape(op, k, v, pool, np.stack([rope] * 3), np.stack([starts] * 3),
                         np.stack([lengths] * 3))
    assert out.shape == pool.shape and out.dtype == pool.dtype


def test_not_differentiable_is_an_error_not_a_wrong_gradient():
    p = _problem(dtype=np.float32)
    k, v, pool, rope, starts, lengths = p.args()
    op = functools.partial(jax_dflash.target_kv_cache_update, pages_per_slot=2)
    with pytest.raises(NotImplementedError):
        jax.grad(lambda k_: op(k_, v, pool, rope, starts, lengths).sum())(k)
