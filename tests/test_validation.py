"""Every trace-time check of both contracts: the error names the argument, what was expected and
what was given; the NumPy reference rejects the same inputs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_dflash
from conftest import make_paged_problem, make_problem
from jax_dflash import reference

F16, BF16, F32 = np.float16, ml_dtypes.bfloat16, np.float32
E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def _problem(**kw):
    return make_problem(
        np.random.default_rng(0),
        batch=2,
        delta_len=3,
        heads=2,
        head_dim=8,
        page_size=4,
        pages_per_slot=2,
        max_batch=3,
        **kw,
    )


def _paged(**kw):
    return make_paged_problem(
        np.random.default_rng(0),
        tokens=5,
        batch=2,
        heads=2,
        head_dim=8,
        num_pages=6,
        page_size=4,
        table_pages=3,
        **kw,
    )


def _replace(args, index, value):
    args = list(args)
    args[index] = value
    return args


# Long: a table of cases, one entry each.
def _slot_cases():
    p = _problem()
    k, v, pool, rope, starts, lengths = p.args()
    fp8 = _problem(pool_dtype=E4M3)
    f32_scale = np.float32(0.5)
    return [
        # (id, args, keywords, error type, fragments that must appear in the message)
        (
            "numpages-not-divisible",
            p.args(),
            dict(pages_per_slot=4),
            ValueError,
            ["past_key_value", "numPages", "6", "pages_per_slot = 4"],
        ),
        (
            "batch-larger-than-slots",
            p.args(),
            dict(pages_per_slot=6),
            ValueError,
            ["k_delta", "B = 2", "slots numPages / pages_per_slot = 1"],
        ),
        (
            "rope-longer-than-slot",
            _replace(p.args(), 3, np.zeros((1, 9, 8), np.float32)),
            {},
            ValueError,
            ["rope_cos_sin", "S = 9", "slot capacity", "8"],
        ),
        (
            "rotary-odd",
            _replace(p.args(), 3, np.zeros((1, 8, 7), np.float32)),
            {},
            ValueError,
            ["rope_cos_sin", "R = 7", "even"],
        ),
        (
            "rotary-larger-than-head",
            _replace(p.args(), 3, np.zeros((1, 8, 10), np.float32)),
            {},
            ValueError,
            ["rope_cos_sin", "R = 10", "D = 8"],
        ),
        (
            "rope-batch",
            _replace(p.args(), 3, np.zeros((3, 8, 8), np.float32)),
            {},
            ValueError,
            ["rope_cos_sin", "batch Rb must be 1 or B = 2", "got 3"],
        ),
        (
            "rope-rank",
            _replace(p.args(), 3, np.zeros((8, 8), np.float32)),
            {},
            ValueError,
            ["rope_cos_sin", "rank 3", "[8, 8]"],
        ),
        (
            "rope-dtype",
            _replace(p.args(), 3, rope.astype(F16)),
            {},
            TypeError,
            ["rope_cos_sin", "float32", "float16"],
        ),
        (
            "v-shape",
            _replace(p.args(), 1, v[:, :2]),
            {},
            ValueError,
            ["v_delta", "[2, 3, 2, 8]", "[2, 2, 2, 8]"],
        ),
        (
            "k-heads",
            _replace(_replace(p.args(), 0, k[:, :, :1]), 1, v[:, :, :1]),
            {},
            ValueError,
            ["k_delta", "H, D = 2, 8", "[2, 3, 1, 8]"],
        ),
        (
            "k-rank",
            _replace(_replace(p.args(), 0, k[0]), 1, v[0]),
            {},
            ValueError,
            ["k_delta", "rank 4", "[3, 2, 8]"],
        ),
        (
            "k-v-dtype-mismatch",
            _replace(p.args(), 1, v.astype(F32)),
            {},
            TypeError,
            ["v_delta", "float16", "float32"],
        ),
        (
            "delta-dtype-fp8",
            _replace(_replace(p.args(), 0, k.astype(E4M3)), 1, v.astype(E4M3)),
            {},
            TypeError,
            ["k_delta", "float16, bfloat16 or float32", "float8_e4m3fn"],
        ),
        (
            "delta-dtype-float64",
            _replace(_replace(p.args(), 0, k.astype(np.float64)), 1, v.astype(np.float64)),
            {},
            TypeError,
            ["k_delta", "float64"],
        ),
        (
            "pool-dtype-int",
            _replace(p.args(), 2, pool.astype(np.int16)),
            {},
            TypeError,
            ["past_key_value", "float8_e4m3fn, float8_e5m2, int8 or uint8 (int4)", "int16"],
        ),
        (
            "pool-rank",
            _replace(p.args(), 2, pool[0]),
            {},
            ValueError,
            ["past_key_value", "rank 5", "[6, 4, 2, 8]"],
        ),
        (
            "pool-planes",
            _replace(p.args(), 2, np.concatenate([pool, pool[:1]])),
            {},
            ValueError,
            ["past_key_value", "== 2", "[3, 6, 4, 2, 8]"],
        ),
        (
            "positions-float",
            _replace(p.args(), 4, starts.astype(np.float32)),
            {},
            TypeError,
            ["delta_start_positions", "int32", "float32"],
        ),
        (
            "positions-int64",
            _replace(p.args(), 4, starts.astype(np.int64)),
            {},
            TypeError,
            ["delta_start_positions", "int32", "int64"],
        ),
        (
            "lengths-int64",
            _replace(p.args(), 5, lengths.astype(np.int64)),
            {},
            TypeError,
            ["delta_lengths", "int32", "int64"],
        ),
        (
            "lengths-shape",
            _replace(p.args(), 5, lengths[:1]),
            {},
            ValueError,
            ["delta_lengths", "[2]", "[1]"],
        ),
        (
            "pages-per-slot-zero",
            p.args(),
            dict(pages_per_slot=0),
            ValueError,
            ["pages_per_slot", "> 0", "0"],
        ),
        (
            "pages-per-slot-float",
            p.args(),
            dict(pages_per_slot=2.0),
            TypeError,
            ["pages_per_slot", "int", "2.0"],
        ),
        (
            "pages-per-slot-past-int64",
            p.args(),
            dict(pages_per_slot=2**63),
            ValueError,
            ["pages_per_slot", str(2**63 - 1), str(2**63)],
        ),
        # FP8 pools and scales.
        (
            "fp8-without-scales",
            fp8.args(),
            {},
            ValueError,
            ["k_scale", "float8_e4m3fn pool needs k_scale and v_scale", "got none"],
        ),
        (
            "fp8-without-v-scale",
            fp8.args(),
            dict(k_scale=fp8.k_scale),
            ValueError,
            ["v_scale", "expected too", "None"],
        ),
        (
            "scales-on-16-bit-pool",
            p.args(),
            dict(k_scale=f32_scale, v_scale=f32_scale),
            ValueError,
            ["k_scale", "float16 pool takes no k_scale, v_scale", "got k_scale of shape"],
        ),
        (
            "scale-dtype",
            fp8.args(),
            dict(k_scale=fp8.k_scale.astype(F16), v_scale=fp8.v_scale),
            TypeError,
            ["k_scale", "float32", "float16"],
        ),
        (
            "scale-shape",
            fp8.args(),
            dict(k_scale=np.ones(3, np.float32), v_scale=np.ones(3, np.float32)),
            ValueError,
            ["k_scale", "1 or H = 2 scales", "[3]"],
        ),
        (
            "scale-per-layer-unbatched",
            fp8.args(),
            dict(k_scale=np.ones((1, 2), np.float32), v_scale=np.ones((1, 2), np.float32)),
            ValueError,
            ["k_scale", "[1, 2]"],
        ),
        (
            "scales-differ",
            fp8.args(),
            dict(k_scale=np.ones(2, np.float32), v_scale=np.float32(1)),
            ValueError,
            ["v_scale", "k_scale's shape [2]", "[]"],
        ),
        # The k-norm weight and the norm options.
        (
            "weight-length",
            p.args(),
            dict(k_norm_weight=np.ones(7, F16)),
            ValueError,
            ["k_norm_weight", "[8]", "[7]"],
        ),
        (
            "weight-dtype",
            p.args(),
            dict(k_norm_weight=np.ones(8, F32)),
            TypeError,
            ["k_norm_weight", "dtype float16 (k_delta's)", "float32"],
        ),
        (
            "weight-per-layer-unbatched",
            p.args(),
            dict(k_norm_weight=np.ones((1, 8), F16)),
            ValueError,
            ["k_norm_weight", "[8]", "[1, 8]"],
        ),
        (
            "norm-eps-zero",
            p.args(),
            dict(v_norm=True, norm_eps=0.0),
            ValueError,
            ["norm_eps", "> 0", "got 0"],
        ),
        (
            "norm-eps-nan",
            p.args(),
            dict(v_norm=True, norm_eps=float("nan")),
            ValueError,
            ["norm_eps", "finite", "nan"],
        ),
        (
            "norm-eps-underflows-float32",
            p.args(),
            dict(v_norm=True, norm_eps=1e-60),
            ValueError,
            ["norm_eps", "float32", "1e-60"],
        ),
        (
            "norm-eps-array",
            p.args(),
            dict(v_norm=True, norm_eps=np.ones(2)),
            TypeError,
            ["norm_eps", "float", "ndarray"],
        ),
        ("v-norm-not-bool", p.args(), dict(v_norm=1), TypeError, ["v_norm", "bool", "int"]),
    ]


SLOT_CASES = _slot_cases()


def _expect(error, fragments, fn):
    with pytest.raises(error) as info:
        fn()
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def _jit_converts(args) -> bool:
    """With x64 off, jax.jit itself narrows 64-bit arguments before the op sees them; only a
    direct call can refuse them."""
    return any(np.dtype(a.dtype).itemsize == 8 for a in args)


@pytest.mark.parametrize("case", SLOT_CASES, ids=[c[0] for c in SLOT_CASES])
def test_slot_trace_time_errors(case):
    _, args, keywords, error, fragments = case
    keywords = {"pages_per_slot": 2, **keywords}
    op = functools.partial(jax_dflash.target_kv_cache_update, **keywords)
    _expect(error, fragments, lambda: op(*args))  # checked before anything is bound or run
    if not _jit_converts(args):
        _expect(error, fragments, lambda: jax.jit(op).lower(*args))  # abstract evaluation
    _expect(error, [fragments[0]], lambda: reference.target_kv_cache_update(*args, **keywords))


# Long: a table of cases, one entry each.
def _paged_cases():
    p = _paged()
    k, v, pool, rope, positions, owners, table = p.args()
    fp8 = _paged(pool_dtype=E5M2)
    return [
        (
            "k-rank",
            _replace(_replace(p.args(), 0, k[None]), 1, v[None]),
            {},
            ValueError,
            ["k_delta", "rank 3", "T, H, D", "[1, 5, 2, 8]"],
        ),
        (
            "k-heads",
            _replace(_replace(p.args(), 0, k[:, :1]), 1, v[:, :1]),
            {},
            ValueError,
            ["k_delta", "H, D = 2, 8", "[5, 1, 8]"],
        ),
        (
            "rope-rows",
            _replace(p.args(), 3, rope[:4]),
            {},
            ValueError,
            ["rope_cos_sin", "one row per token, T = 5", "[4, 8]"],
        ),
        (
            "rope-rank",
            _replace(p.args(), 3, rope[None]),
            {},
            ValueError,
            ["rope_cos_sin", "rank 2", "[1, 5, 8]"],
        ),
        (
            "rope-odd",
            _replace(p.args(), 3, rope[:, :7]),
            {},
            ValueError,
            ["rope_cos_sin", "R = 7", "even"],
        ),
        (
            "rope-dtype",
            _replace(p.args(), 3, rope.astype(BF16)),
            {},
            TypeError,
            ["rope_cos_sin", "float32", "bfloat16"],
        ),
        (
            "positions-int64",
            _replace(p.args(), 4, positions.astype(np.int64)),
            {},
            TypeError,
            ["delta_positions", "int32", "int64"],
        ),
        (
            "owners-uint32",
            _replace(p.args(), 5, owners.astype(np.uint32)),
            {},
            TypeError,
            ["delta_token_to_sequence", "int32", "uint32"],
        ),
        (
            "table-int64",
            _replace(p.args(), 6, table.astype(np.int64)),
            {},
            TypeError,
            ["kv_page_table", "int32", "int64", "silently narrow"],
        ),
        (
            "table-float32",
            _replace(p.args(), 6, table.astype(np.float32)),
            {},
            TypeError,
            ["kv_page_table", "int32", "float32", "indices are integers"],
        ),
        (
            "owners-length",
            _replace(p.args(), 5, owners[:4]),
            {},
            ValueError,
            ["delta_token_to_sequence", "[5]", "[4]"],
        ),
        (
            "table-planes",
            _replace(p.args(), 6, table[:, :1]),
            {},
            ValueError,
            ["kv_page_table", "[B, 2, M]", "[2, 1, 3]"],
        ),
        (
            "table-rank",
            _replace(p.args(), 6, table[0]),
            {},
            ValueError,
            ["kv_page_table", "[B, 2, M]", "[2, 3]"],
        ),
        (
            "table-longer-than-pool",
            _replace(p.args(), 6, np.zeros((2, 2, 7), np.int32)),
            {},
            ValueError,
            ["kv_page_table", "M (last dim) must be <= numPages N = 6", "M = 7"],
        ),
        (
            "pool-planes",
            _replace(p.args(), 2, pool[:1]),
            {},
            ValueError,
            ["past_key_value", "== 2", "[1, 6, 4, 2, 8]"],
        ),
        ("fp8-without-scales", fp8.args(), {}, ValueError, ["k_scale", "float8_e5m2 pool needs"]),
        (
            "scales-on-16-bit-pool",
            p.args(),
            dict(k_scale=1.0, v_scale=1.0),
            ValueError,
            ["k_scale", "pool takes no k_scale, v_scale"],
        ),
        (
            "weight-dtype",
            p.args(),
            dict(k_norm_weight=np.ones(8, BF16)),
            TypeError,
            ["k_norm_weight", "float16", "bfloat16"],
        ),
        ("ring-not-bool", p.args(), dict(ring="yes"), TypeError, ["ring", "bool", "str"]),
    ]


PAGED_CASES = _paged_cases()


@pytest.mark.parametrize("case", PAGED_CASES, ids=[c[0] for c in PAGED_CASES])
def test_paged_trace_time_errors(case):
    _, args, keywords, error, fragments = case
    op = functools.partial(jax_dflash.target_kv_cache_update_paged, **keywords)
    _expect(error, fragments, lambda: op(*args))
    if not _jit_converts(args):
        _expect(error, fragments, lambda: jax.jit(op).lower(*args))
    # Python-float scales are a convenience of the JAX op; give the reference arrays.
    ref_keywords = {
        name: (np.float32(x) if isinstance(x, float) else x) for name, x in keywords.items()
    }
    _expect(
        error, [fragments[0]], lambda: reference.target_kv_cache_update_paged(*args, **ref_keywords)
    )


def test_int64_start_is_an_error_not_a_narrowed_start():
    """With jax_enable_x64 off, jnp would turn a start of 2**32 + 1 into 1 without a word: the op
    refuses anything but int32 arrays before any conversion, in both contracts."""
    assert not jax.config.jax_enable_x64
    p = _problem(hostile=False)
    starts = np.full(2, 2**32 + 1, np.int64)
    _expect(
        TypeError,
        ["delta_start_positions", "int32", "int64"],
        lambda: jax_dflash.target_kv_cache_update(*_replace(p.args(), 4, starts), pages_per_slot=2),
    )
    _expect(
        TypeError,
        ["delta_start_positions", "int32", "list"],
        lambda: jax_dflash.target_kv_cache_update(
            *_replace(p.args(), 4, [2**32 + 1, 0]), pages_per_slot=2
        ),
    )
    q = _paged(hostile=False)
    positions = q.delta_positions.astype(np.int64) + 2**32
    _expect(
        TypeError,
        ["delta_positions", "int32", "int64"],
        lambda: jax_dflash.target_kv_cache_update_paged(*_replace(q.args(), 4, positions)),
    )


def test_layered_operands_must_agree():
    p = _problem(layers=3)
    k, v, pool, rope, starts, lengths = p.args()
    op = functools.partial(jax_dflash.target_kv_cache_update, pages_per_slot=2)
    with pytest.raises(ValueError, match=r"k_delta: expected 3 layers"):
        jax.eval_shape(op, k[:2], v[:2], pool, rope, starts, lengths)
    with pytest.raises(ValueError, match=r"rope_cos_sin: expected 3 layers"):
        jax.eval_shape(op, k, v, pool, np.stack([rope] * 2), starts, lengths)
    with pytest.raises(
        ValueError, match=r"delta_lengths: expected the layout of delta_start_positions"
    ):
        jax.eval_shape(op, k, v, pool, rope, np.stack([starts] * 3), lengths)
    with pytest.raises(ValueError, match=r"k_norm_weight: expected \[D\] = \[8\] or \[layers, D\]"):
        jax.eval_shape(functools.partial(op, k_norm_weight=np.ones((2, 8), F16)), *p.args())
    # Per-layer rope, positions and weight are accepted.
    out = jax.eval_shape(
        functools.partial(op, k_norm_weight=np.ones((3, 8), F16)),
        k,
        v,
        pool,
        np.stack([rope] * 3),
        np.stack([starts] * 3),
        np.stack([lengths] * 3),
    )
    assert out.shape == pool.shape and out.dtype == pool.dtype


def test_layered_paged_operands_must_agree():
    p = _paged(layers=2, pool_dtype=E4M3, scale_shape=(2, 1))
    k, v, pool, rope, positions, owners, table = p.args()
    op = functools.partial(jax_dflash.target_kv_cache_update_paged, **p.kwargs())
    with pytest.raises(ValueError, match=r"kv_page_table: expected 2 layers"):
        jax.eval_shape(op, *_replace(p.args(), 6, np.stack([table] * 3)))
    with pytest.raises(
        ValueError, match=r"delta_token_to_sequence: expected the layout of delta_positions"
    ):
        jax.eval_shape(op, *_replace(p.args(), 4, np.stack([positions] * 2)))
    with pytest.raises(ValueError, match=r"k_scale: expected 2 layers"):
        jax.eval_shape(
            functools.partial(op, k_scale=np.ones((3, 1), F32), v_scale=np.ones((3, 1), F32)),
            *p.args(),
        )
    out = jax.eval_shape(
        op,
        k,
        v,
        pool,
        np.stack([rope] * 2),
        np.stack([positions] * 2),
        np.stack([owners] * 2),
        np.stack([table] * 2),
    )
    assert out.shape == pool.shape and out.dtype == pool.dtype


def test_hand_bound_primitive_checks_its_operand_count():
    """A bind that forgets the scales of an FP8 pool is a trace-time error naming the ABI."""
    p = _problem(pool_dtype=E4M3)
    with pytest.raises(
        ValueError, match=r"past_key_value: a float8_e4m3fn pool needs k_scale and v_scale"
    ):
        jax.eval_shape(
            functools.partial(
                jax_dflash.target_kv_cache_update_p.bind,
                pages_per_slot=2,
                k_norm=False,
                v_norm=False,
                norm_eps=1e-6,
            ),
            *p.args(),
        )


def test_not_differentiable_is_an_error_not_a_wrong_gradient():
    p = _problem(dtype=np.float32)
    k, v, pool, rope, starts, lengths = p.args()
    op = functools.partial(jax_dflash.target_kv_cache_update, pages_per_slot=2)
    with pytest.raises(NotImplementedError):
        jax.grad(lambda k_: op(k_, v, pool, rope, starts, lengths).sum())(jnp.asarray(k))
