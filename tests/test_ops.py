"""The slot op against the NumPy reference, on every available backend (CPU always; CUDA on a
GPU)."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_dflash
from conftest import (
    DTYPES,
    FP8_DTYPES,
    POOL_DTYPES,
    Problem,
    assert_bits_equal,
    device_of,
    make_problem,
)
from helpers.children import run_script
from helpers.ops import expected, jitted_op, run_op  # noqa: F401
from jax_dflash import reference


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "shape",
    [
        dict(batch=1, delta_len=1, heads=1, head_dim=2, page_size=1, pages_per_slot=1),
        dict(
            batch=3,
            delta_len=5,
            heads=2,
            head_dim=16,
            rotary_dim=8,
            page_size=4,
            pages_per_slot=3,
            max_batch=5,
        ),
        dict(
            batch=2,
            delta_len=7,
            heads=3,
            head_dim=12,
            rotary_dim=12,
            page_size=5,
            pages_per_slot=2,
            rope_batch=2,
            rope_seq_len=6,
        ),
        # Odd head dim, no rotation, page size 1: the kernels' narrowest vector path.
        dict(
            batch=2, delta_len=3, heads=2, head_dim=7, rotary_dim=0, page_size=1, pages_per_slot=6
        ),
        # The TensorRT shape family: P = 128, D = R = 128.
        dict(
            batch=4,
            delta_len=16,
            heads=8,
            head_dim=128,
            page_size=128,
            pages_per_slot=2,
            max_batch=6,
            rope_seq_len=200,
        ),
        # Many heads (40 x 6 work items, more than one 128-thread block): heads split across blocks.
        dict(
            batch=2,
            delta_len=3,
            heads=40,
            head_dim=64,
            rotary_dim=32,
            page_size=8,
            pages_per_slot=1,
            rope_batch=2,
        ),
        # A head of 256 one-channel vectors: its items split across two blocks.
        dict(
            batch=2, delta_len=2, heads=2, head_dim=257, rotary_dim=2, page_size=2, pages_per_slot=2
        ),
        # More slots than one CUDA grid dimension holds (65535): the launcher splits the batch.
        dict(batch=65537, delta_len=1, heads=1, head_dim=2, page_size=1, pages_per_slot=1),
    ],
    ids=lambda s: "B{batch}L{delta_len}H{heads}D{head_dim}".format(**s),
)
def test_matches_reference(backend, dtype, shape):
    rng = np.random.default_rng(1234)
    problem = make_problem(rng, dtype=dtype, **shape)
    assert_bits_equal(run_op(problem, backend), expected(problem))


@st.composite
def problems(draw):
    head_dim = draw(st.integers(1, 40))
    rotary_dim = 2 * draw(st.integers(0, head_dim // 2))
    batch = draw(st.integers(1, 4))
    page_size = draw(st.integers(1, 9))
    pages_per_slot = draw(st.integers(1, 4))
    capacity = page_size * pages_per_slot
    seed = draw(st.integers(0, 2**32 - 1))
    return make_problem(
        np.random.default_rng(seed),
        batch=batch,
        delta_len=draw(st.integers(1, 9)),
        heads=draw(st.integers(1, 4)),
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        page_size=page_size,
        pages_per_slot=pages_per_slot,
        max_batch=batch + draw(st.integers(0, 2)),
        rope_batch=draw(st.sampled_from([1, batch])),
        rope_seq_len=draw(st.integers(0, capacity)),
        dtype=draw(st.sampled_from(DTYPES)),
        hostile=draw(st.booleans()),
    )


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(problem=problems())
def test_random_shapes_match_reference(backend, problem):
    assert_bits_equal(run_op(problem, backend), expected(problem))


@st.composite
def problems_with_extras(draw):
    """Slot problems with every extra drawn: a pool of any dtype (FP8 with per-tensor or
    per-head scales), the k-norm weight, the v-norm, a layer axis with per-layer extras."""
    heads = draw(st.integers(1, 3))
    head_dim = draw(st.integers(1, 24))
    batch = draw(st.integers(1, 3))
    layers = draw(st.sampled_from([None, 2]))
    pool_dtype = np.dtype(draw(st.sampled_from(POOL_DTYPES)))
    scale_shape = None
    if pool_dtype in FP8_DTYPES:
        scale_shape = draw(
            st.sampled_from([(), (heads,)] + ([(layers, 1), (layers, heads)] if layers else []))
        )
    k_norm = draw(st.booleans())
    return make_problem(
        np.random.default_rng(draw(st.integers(0, 2**32 - 1))),
        batch=batch,
        delta_len=draw(st.integers(1, 5)),
        heads=heads,
        head_dim=head_dim,
        rotary_dim=2 * draw(st.integers(0, head_dim // 2)),
        page_size=draw(st.integers(1, 5)),
        pages_per_slot=draw(st.integers(1, 3)),
        max_batch=batch + draw(st.integers(0, 1)),
        rope_batch=draw(st.sampled_from([1, batch])),
        dtype=draw(st.sampled_from(DTYPES)),
        pool_dtype=pool_dtype,
        layers=layers,
        hostile=draw(st.booleans()),
        k_norm=k_norm,
        v_norm=draw(st.booleans()),
        scale_shape=scale_shape,
        norm_eps=draw(st.sampled_from([1e-6, 1e-5, 0.5])),
        rope_per_layer=bool(layers) and draw(st.booleans()),
        positions_per_layer=bool(layers) and draw(st.booleans()),
        norm_weight_per_layer=bool(layers) and k_norm and draw(st.booleans()),
    )


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(problem=problems_with_extras())
def test_random_problems_with_extras_match_reference(backend, problem):
    assert_bits_equal(run_op(problem, backend), expected(problem))


def _written_mask(problem: Problem):
    """Which pool rows (plane, page, row) the spec writes, computed independently of the
    reference: slot b owns rows [b * cap, (b + 1) * cap) of the flattened pages."""
    pool = problem.past_key_value
    page_size = pool.shape[2]
    capacity = problem.pages_per_slot * page_size
    mask = np.zeros(pool.shape[:3], bool).reshape(2, -1)
    for b, (start, length) in enumerate(zip(problem.delta_start_positions, problem.delta_lengths)):
        for t in range(min(int(length), problem.k_delta.shape[1])):
            pos = int(start) + t
            if 0 <= pos < capacity:
                mask[:, b * capacity + pos] = True
    return mask.reshape(pool.shape[:3])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_untouched_pool_is_bit_identical(backend, dtype):
    """Poison the pool with NaNs carrying a payload; only the addressed rows may change."""
    rng = np.random.default_rng(7)
    problem = make_problem(
        rng,
        batch=3,
        delta_len=6,
        heads=2,
        head_dim=8,
        page_size=3,
        pages_per_slot=3,
        max_batch=4,
        dtype=dtype,
    )
    problem.delta_start_positions[:] = [-3, 4, 8]  # negative, in the middle, past the end
    problem.delta_lengths[:] = [6, 100, -2]  # full, larger than L, negative
    if dtype.itemsize == 2:
        poison = np.full(
            problem.past_key_value.shape, 0x7E01 if dtype == np.float16 else 0x7FC1, np.uint16
        ).view(dtype)
    else:
        poison = np.full(problem.past_key_value.shape, 0x7FC00123, np.uint32).view(dtype)
    problem.past_key_value = poison
    out = run_op(problem, backend)
    mask = _written_mask(problem)
    assert mask.sum() == 2 * (3 + 5)  # rows 0..2 of slot 0, rows 4..8 of slot 1, nothing for slot 2
    assert_bits_equal(out[~mask], poison[~mask])
    assert not np.isnan(out[mask].astype(np.float32)).any()
    assert_bits_equal(out, expected(problem))


def test_layer_batched_matches_loop(backend):
    rng = np.random.default_rng(3)
    layers = 3
    problem = make_problem(
        rng,
        batch=2,
        delta_len=5,
        heads=2,
        head_dim=8,
        page_size=4,
        pages_per_slot=2,
        layers=layers,
        dtype=np.float16,
    )
    device = device_of(backend)
    args = [jax.device_put(a, device) for a in problem.args()]
    op = functools.partial(jax_dflash.target_kv_cache_update, pages_per_slot=2)
    # vmap over layers: k/v/pool per layer, rope and positions shared.
    vmapped = jax.jit(jax.vmap(op, in_axes=(0, 0, 0, None, None, None)))(*args)
    direct = jax.jit(op)(*args)  # the layered form called directly
    looped = np.stack(
        [
            reference.target_kv_cache_update(
                problem.k_delta[i],
                problem.v_delta[i],
                problem.past_key_value[i],
                problem.rope_cos_sin,
                problem.delta_start_positions,
                problem.delta_lengths,
                pages_per_slot=2,
            )
            for i in range(layers)
        ]
    )
    assert_bits_equal(vmapped, looped)
    assert_bits_equal(direct, looped)


def test_layer_batched_per_layer_rope_and_positions(backend):
    rng = np.random.default_rng(4)
    problem = make_problem(
        rng,
        batch=3,
        delta_len=4,
        heads=1,
        head_dim=6,
        page_size=2,
        pages_per_slot=3,
        layers=4,
        rope_batch=3,
        rope_per_layer=True,
        positions_per_layer=True,
        dtype=np.float32,
    )
    device = device_of(backend)
    args = [jax.device_put(a, device) for a in problem.args()]
    op = functools.partial(jax_dflash.target_kv_cache_update, pages_per_slot=3)
    out = jax.jit(jax.vmap(op))(*args)
    assert_bits_equal(out, expected(problem))


def test_more_layers_than_one_grid_holds(backend):
    """65537 layers, each with its own rope rows and positions: the CUDA launcher puts layers on
    grid.z (at most 65535), so the last two layers go to a second launch whose layer index must
    start at 65535, not 0."""
    rng = np.random.default_rng(10)
    problem = make_problem(
        rng,
        batch=1,
        delta_len=2,
        heads=1,
        head_dim=2,
        page_size=2,
        pages_per_slot=2,
        layers=65537,
        rope_per_layer=True,
        positions_per_layer=True,
        dtype=np.float32,
    )
    out = run_op(problem, backend)
    want = expected(problem)
    assert_bits_equal(out[65530:], want[65530:])  # the split first: a readable failure
    assert_bits_equal(out, want)


def test_nested_vmap(backend):
    """vmap over an already layer-batched call folds both axes into one launch."""
    rng = np.random.default_rng(5)
    outer, layers = 2, 3
    problems = [
        make_problem(
            rng,
            batch=2,
            delta_len=3,
            heads=2,
            head_dim=4,
            page_size=2,
            pages_per_slot=2,
            layers=layers,
            dtype=np.float16,
        )
        for _ in range(outer)
    ]
    stacked = [np.stack(x) for x in zip(*(p.args() for p in problems))]
    # rope shared by everything, positions per outer index only.
    stacked[3] = problems[0].rope_cos_sin
    op = functools.partial(jax_dflash.target_kv_cache_update, pages_per_slot=2)
    fn = jax.jit(
        jax.vmap(jax.vmap(op, in_axes=(0, 0, 0, None, None, None)), in_axes=(0, 0, 0, None, 0, 0))
    )
    device = device_of(backend)
    out = fn(*[jax.device_put(a, device) for a in stacked])
    want = np.stack(
        [
            reference.target_kv_cache_update(
                p.k_delta,
                p.v_delta,
                p.past_key_value,
                problems[0].rope_cos_sin,
                p.delta_start_positions,
                p.delta_lengths,
                pages_per_slot=2,
            )
            for p in problems
        ]
    )
    assert_bits_equal(out, want)
    hlo = fn.lower(*stacked).as_text()
    assert hlo.count("dflash_target_kv_cache_update") == 1


def test_vmap_is_one_custom_call():
    rng = np.random.default_rng(6)
    problem = make_problem(rng, layers=5)
    op = functools.partial(jax_dflash.target_kv_cache_update, pages_per_slot=2)
    fn = jax.jit(jax.vmap(op, in_axes=(0, 0, 0, None, None, None)), donate_argnums=(2,))
    hlo = fn.lower(*problem.args()).compile().as_text()
    assert hlo.count('custom_call_target="dflash_target_kv_cache_update"') == 1
    assert "while" not in hlo  # not a loop over layers


def _pool_copies(hlo: str, pool_shape, dtype_name):
    shape = f"{dtype_name}[{','.join(map(str, pool_shape))}]"
    return [line for line in hlo.splitlines() if " copy(" in line and shape in line]


def test_donation_aliases_pool_and_copies_nothing():
    rng = np.random.default_rng(8)
    problem = make_problem(rng, batch=2, delta_len=4, heads=2, head_dim=8, dtype=np.float16)
    op = functools.partial(jax_dflash.target_kv_cache_update, pages_per_slot=2)
    donated = jax.jit(op, donate_argnums=(2,)).lower(*problem.args()).compile().as_text()
    # The pool parameter (2) is the program's output buffer, and the custom call writes into it.
    assert "input_output_alias={ {}: (2, {}" in donated
    assert "output_to_operand_aliasing={{}: (2, {})}" in donated
    assert _pool_copies(donated, problem.past_key_value.shape, "f16") == []
    # Without donation XLA keeps the caller's pool: it must copy (the docstring says so).
    kept = jax.jit(op).lower(*problem.args()).compile().as_text()
    assert _pool_copies(kept, problem.past_key_value.shape, "f16")


def test_donated_buffer_is_updated_in_place():
    rng = np.random.default_rng(9)
    problem = make_problem(rng, hostile=False)
    pool = jnp.asarray(problem.past_key_value)
    pointer = pool.unsafe_buffer_pointer()
    op = jax.jit(
        functools.partial(jax_dflash.target_kv_cache_update, pages_per_slot=2), donate_argnums=(2,)
    )
    out = op(problem.k_delta, problem.v_delta, pool, *problem.args()[3:])
    assert pool.is_deleted()
    assert out.unsafe_buffer_pointer() == pointer
    assert_bits_equal(out, expected(problem))


def test_eager_call_works():
    rng = np.random.default_rng(10)
    problem = make_problem(rng)
    out = jax_dflash.target_kv_cache_update(*problem.args(), pages_per_slot=2)
    assert_bits_equal(out, expected(problem))


def test_cpu_extension_numpy_entry_point_matches_reference():
    """The nanobind module's NumPy entry runs the same kernel, in place (the ONNX reference uses
    it); bfloat16 travels as a uint16 view named by delta_dtype / pool_dtype."""
    from jax_dflash import _dflash_cpu

    rng = np.random.default_rng(11)
    for dtype in DTYPES:
        problem = make_problem(rng, dtype=dtype, batch=3, max_batch=4)
        pool = problem.past_key_value.copy()
        as_bits = (lambda a: a.view(np.uint16)) if dtype.itemsize == 2 else (lambda a: a)
        _dflash_cpu.target_kv_cache_update(
            as_bits(problem.k_delta),
            as_bits(problem.v_delta),
            as_bits(pool),
            problem.rope_cos_sin,
            problem.delta_start_positions,
            problem.delta_lengths,
            pages_per_slot=problem.pages_per_slot,
            delta_dtype=str(dtype),
            pool_dtype=str(dtype),
        )
        assert_bits_equal(pool, expected(problem))


def test_portable_cpu_path_matches_reference():
    """The CPU kernel's portable conversions (used without AVX2/F16C) give the same bits."""

    script = r"""
import functools, numpy as np, jax, jax_dflash
from conftest import DTYPES, make_problem, assert_bits_equal
from jax_dflash import reference
rng = np.random.default_rng(0)
for dtype in DTYPES:
    for head_dim, rotary_dim in ((128, 128), (20, 12), (9, 6)):
        p = make_problem(rng, batch=3, delta_len=5, heads=2, head_dim=head_dim,
                         rotary_dim=rotary_dim, dtype=dtype)
        out = jax.jit(functools.partial(jax_dflash.target_kv_cache_update,
                                        pages_per_slot=p.pages_per_slot))(*p.args())
        assert_bits_equal(out, reference.target_kv_cache_update(
            *p.args(), pages_per_slot=p.pages_per_slot))
print("portable ok")
"""
    result = run_script(
        script, Path(__file__).parent, {"JAX_DFLASH_CPU_PORTABLE": "1"}, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "portable ok" in result.stdout


def test_decode_loop_in_scan_is_in_place(backend):
    """A jitted decode loop (lax.scan over steps, pool carried and donated) matches the reference
    step by step and holds no copy of the pool."""
    rng = np.random.default_rng(12)
    problem = make_problem(
        rng, batch=2, delta_len=3, heads=2, head_dim=8, page_size=4, pages_per_slot=4, hostile=False
    )
    steps = 5
    ks = np.stack([problem.k_delta + i for i in range(steps)]).astype(problem.k_delta.dtype)
    vs = (ks + 1).astype(ks.dtype)
    op = functools.partial(jax_dflash.target_kv_cache_update, pages_per_slot=4)

    def body(pool, xs):
        k, v, step = xs
        starts = problem.delta_start_positions + 3 * step
        return op(k, v, pool, problem.rope_cos_sin, starts, problem.delta_lengths), None

    def loop(pool, ks, vs):
        return jax.lax.scan(body, pool, (ks, vs, jnp.arange(steps, dtype=jnp.int32)))[0]

    fn = jax.jit(loop, donate_argnums=0)
    device = device_of(backend)
    args = [jax.device_put(a, device) for a in (problem.past_key_value, ks, vs)]
    hlo = fn.lower(*args).compile().as_text()
    assert _pool_copies(hlo, problem.past_key_value.shape, "f16") == []
    out = fn(*args)
    want = problem.past_key_value
    for i in range(steps):
        want = reference.target_kv_cache_update(
            ks[i],
            vs[i],
            want,
            problem.rope_cos_sin,
            problem.delta_start_positions + 3 * i,
            problem.delta_lengths,
            pages_per_slot=4,
        )
    assert_bits_equal(out, want)
