"""The paged op (TensorRT Edge-LLM 0.11's contract) against the NumPy reference, bit for bit, on
every available backend; its equivalence with the slot op under an identity page table; vmap
over layers as one launch; donation in place."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_dflash
from conftest import (
    DELTA_DTYPES,
    FP8_DTYPES,
    POOL_DTYPES,
    assert_bits_equal,
    device_of,
    make_paged_problem,
    make_problem,
)
from helpers.ops import expected, jitted_op, run_op
from jax_dflash import reference

PAGED_TARGET = 'custom_call_target="dflash_target_kv_cache_update_paged"'


@pytest.mark.parametrize("hostile", [False, True], ids=["valid", "hostile"])
@pytest.mark.parametrize("ring", [False, True], ids=["flat", "ring"])
@pytest.mark.parametrize(
    "shape",
    [
        dict(tokens=1, batch=1, heads=1, head_dim=2, num_pages=1, page_size=1, table_pages=1),
        dict(
            tokens=9,
            batch=3,
            heads=2,
            head_dim=12,
            rotary_dim=8,
            num_pages=8,
            page_size=3,
            table_pages=2,
        ),
        # Odd head dim, no rotation: the kernels' narrowest vector path.
        dict(
            tokens=6,
            batch=2,
            heads=3,
            head_dim=7,
            rotary_dim=0,
            num_pages=5,
            page_size=2,
            table_pages=2,
        ),
        # The TensorRT shape family: P = 128, D = R = 128.
        dict(tokens=40, batch=4, heads=8, head_dim=128, num_pages=10, page_size=128, table_pages=2),
        # Many heads (more than one 128-thread block of work items).
        dict(
            tokens=5,
            batch=2,
            heads=40,
            head_dim=64,
            rotary_dim=32,
            num_pages=4,
            page_size=8,
            table_pages=2,
        ),
        # More tokens than one CUDA grid dimension holds (65535).
        dict(
            tokens=65537, batch=1, heads=1, head_dim=2, num_pages=1, page_size=65537, table_pages=1
        ),
    ],
    ids=lambda s: "T{tokens}B{batch}H{heads}D{head_dim}P{page_size}".format(**s),
)
def test_matches_reference(backend, shape, ring, hostile):
    """Valid tokens (every one writes), or hostile ones (padding, foreign owners, negative
    positions, positions past the table, bad page ids: whatever is left may be nothing)."""
    problem = make_paged_problem(np.random.default_rng(2024), ring=ring, hostile=hostile, **shape)
    want = expected(problem)
    if not hostile:
        written = want.view(np.uint8) != problem.past_key_value.view(np.uint8)
        assert written.reshape(2, -1).any(-1).all(), "writes nothing to a plane"
    assert_bits_equal(run_op(problem, backend), want)


@pytest.mark.parametrize("ring", [False, True], ids=["flat", "ring"])
@pytest.mark.parametrize("page_size, table_pages", [(3, 7), (5, 1), (128, 3), (100, 6)])
def test_positions_anywhere_in_int32(backend, page_size, table_pages, ring):
    """Page index and row of positions spread over the whole int32 range (the kernels divide
    by P and, under ring, take the remainder by M with a multiply and a shift): each token keeps
    its row in its page slot, moved by a random number of whole windows of M * P positions, so
    that under ring every token still has a row of its own."""
    rng = np.random.default_rng(page_size * 1000 + table_pages)
    window = page_size * table_pages
    problem = make_paged_problem(
        rng,
        tokens=min(24, 2 * window),
        batch=2,
        heads=2,
        head_dim=8,
        num_pages=2 * table_pages + 1,
        page_size=page_size,
        table_pages=table_pages,
        ring=ring,
        hostile=False,
    )
    pos = problem.delta_positions.astype(np.int64)
    windows = rng.integers(0, (np.iinfo(np.int32).max - pos) // window + 1)
    windows[:2] = 0  # some tokens stay in the table's own window, written with or without ring
    windows[2:4] = (np.iinfo(np.int32).max - pos[2:4]) // window  # and some at the very top
    problem = dataclasses.replace(
        problem, delta_positions=(pos + windows * window).astype(np.int32)
    )
    want = expected(problem)
    written = want.view(np.uint8) != problem.past_key_value.view(np.uint8)
    assert written.any(), "writes nothing"
    assert_bits_equal(run_op(problem, backend), want)


@st.composite
def paged_problems(draw):
    head_dim = draw(st.integers(1, 40))
    batch = draw(st.integers(1, 3))
    table_pages = draw(st.integers(1, 3))
    page_size = draw(st.integers(1, 6))
    layers = draw(st.sampled_from([None, None, 2]))
    pool_dtype = draw(st.sampled_from(POOL_DTYPES))
    heads = draw(st.integers(1, 4))
    scale_shape = None
    if pool_dtype in FP8_DTYPES:
        shapes = [(), (heads,)] + ([(layers, 1), (layers, heads)] if layers else [])
        scale_shape = draw(st.sampled_from(shapes))
    k_norm = draw(st.booleans())
    per_layer = (lambda: draw(st.booleans())) if layers else (lambda: False)
    return make_paged_problem(
        np.random.default_rng(draw(st.integers(0, 2**32 - 1))),
        tokens=draw(st.integers(1, min(12, batch * table_pages * page_size))),
        batch=batch,
        heads=heads,
        head_dim=head_dim,
        rotary_dim=2 * draw(st.integers(0, head_dim // 2)),
        num_pages=batch * table_pages + draw(st.integers(0, 3)),
        page_size=page_size,
        table_pages=table_pages,
        dtype=draw(st.sampled_from(DELTA_DTYPES)),
        pool_dtype=pool_dtype,
        layers=layers,
        hostile=draw(st.booleans()),
        k_norm=k_norm,
        v_norm=draw(st.booleans()),
        scale_shape=scale_shape,
        ring=draw(st.booleans()),
        rope_per_layer=per_layer(),
        positions_per_layer=per_layer(),
        table_per_layer=per_layer(),
        norm_weight_per_layer=k_norm and per_layer(),
    )


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(problem=paged_problems())
def test_random_problems_match_reference(backend, problem):
    """Shapes, hostile tables/positions/owners, ring, layers, every delta x pool dtype pair,
    scales and norms drawn together."""
    assert_bits_equal(run_op(problem, backend), expected(problem))


# ---- the identity page table: the paged op writes what the slot op writes ----------------------


def _identity_table(batch, pages_per_slot, num_pages):
    """Slot b's pages as a page table, built independently of jax_dflash.paged."""
    pages = np.arange(batch * pages_per_slot, dtype=np.int32).reshape(batch, pages_per_slot)
    return np.stack([pages, pages + num_pages], axis=1)


def _slot_as_paged(problem):
    """The slot problem's tokens in the paged form (``S == cap``, so every written position has
    a rope row): positions start + t (-1 for padding), owners b (-1 for padding)."""
    batch, delta_len, heads, head_dim = problem.k_delta.shape
    t = np.arange(delta_len, dtype=np.int64)
    real = t[None, :] < problem.delta_lengths[:, None]
    positions = np.where(real, problem.delta_start_positions[:, None] + t[None, :], -1)
    owners = np.where(real, np.arange(batch)[:, None], -1)
    rows = np.clip(positions, 0, problem.rope_cos_sin.shape[1] - 1)
    rope = problem.rope_cos_sin[
        np.zeros_like(rows)
        if problem.rope_cos_sin.shape[0] == 1
        else np.arange(batch)[:, None].repeat(delta_len, 1),
        rows,
    ]
    num_pages = problem.past_key_value.shape[1]
    return (
        problem.k_delta.reshape(-1, heads, head_dim),
        problem.v_delta.reshape(-1, heads, head_dim),
        problem.past_key_value,
        rope.reshape(batch * delta_len, -1).astype(np.float32),
        positions.reshape(-1).astype(np.int32),
        owners.reshape(-1).astype(np.int32),
        _identity_table(batch, problem.pages_per_slot, num_pages),
    )


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    seed=st.integers(0, 2**32 - 1),
    batch=st.integers(1, 3),
    extra_slots=st.integers(0, 2),
    delta_len=st.integers(1, 6),
    page_size=st.integers(1, 5),
    pages_per_slot=st.integers(1, 3),
    rope_batched=st.booleans(),
    dtype=st.sampled_from(DELTA_DTYPES),
    pool_dtype=st.sampled_from(POOL_DTYPES),
    k_norm=st.booleans(),
    v_norm=st.booleans(),
)
def test_identity_page_table_matches_slot_op(
    backend,
    seed,
    batch,
    extra_slots,
    delta_len,
    page_size,
    pages_per_slot,
    rope_batched,
    dtype,
    pool_dtype,
    k_norm,
    v_norm,
):
    problem = make_problem(
        np.random.default_rng(seed),
        batch=batch,
        max_batch=batch + extra_slots,
        delta_len=delta_len,
        heads=2,
        head_dim=6,
        page_size=page_size,
        pages_per_slot=pages_per_slot,
        rope_batch=batch if rope_batched else 1,
        dtype=dtype,
        pool_dtype=pool_dtype,
        k_norm=k_norm,
        v_norm=v_norm,
        hostile=True,
    )
    extras = {k: v for k, v in problem.kwargs().items() if k != "pages_per_slot"}
    device = device_of(backend)
    slot = jax.jit(
        functools.partial(
            jax_dflash.target_kv_cache_update, pages_per_slot=pages_per_slot, **extras
        )
    )
    paged = jax.jit(functools.partial(jax_dflash.target_kv_cache_update_paged, **extras))
    want = slot(*[jax.device_put(a, device) for a in problem.args()])
    got = paged(*[jax.device_put(a, device) for a in _slot_as_paged(problem)])
    assert_bits_equal(got, want)


def test_identity_helpers_match_slot_op(backend):
    """The same equivalence through jax_dflash's jnp helpers (token_positions, gather_rope,
    identity_page_table), all inside one jit."""
    problem = make_problem(
        np.random.default_rng(31),
        batch=3,
        max_batch=4,
        delta_len=5,
        heads=2,
        head_dim=8,
        page_size=4,
        pages_per_slot=2,
        rope_batch=3,
        hostile=True,
    )
    batch, delta_len, heads, head_dim = problem.k_delta.shape
    num_pages = problem.past_key_value.shape[1]

    def via_paged(k, v, pool, rope, starts, lengths):
        positions, owners = jax_dflash.token_positions(starts, lengths, delta_len)
        rows = jax_dflash.gather_rope(rope, positions, owners)
        table = jax_dflash.identity_page_table(batch, problem.pages_per_slot, num_pages)
        return jax_dflash.target_kv_cache_update_paged(
            k.reshape(-1, heads, head_dim),
            v.reshape(-1, heads, head_dim),
            pool,
            rows,
            positions,
            owners,
            table,
        )

    device = device_of(backend)
    args = [jax.device_put(a, device) for a in problem.args()]
    want = jax.jit(
        functools.partial(jax_dflash.target_kv_cache_update, pages_per_slot=problem.pages_per_slot)
    )(*args)
    assert_bits_equal(jax.jit(via_paged)(*args), want)


# ---- vmap over layers ----------------------------------------------------------------------------


def _layer(problem, i, per_layer):
    args = problem.args()
    return [a[i] if (j < 3 or per_layer[j]) else a for j, a in enumerate(args)]


def test_vmap_matches_per_layer_loop_in_one_call(backend):
    layers = 3
    problem = make_paged_problem(
        np.random.default_rng(5),
        tokens=7,
        batch=2,
        heads=2,
        head_dim=8,
        num_pages=6,
        page_size=3,
        table_pages=3,
        layers=layers,
        positions_per_layer=True,
        table_per_layer=True,
        ring=True,
    )
    op = functools.partial(jax_dflash.target_kv_cache_update_paged, ring=True)
    # k/v/pool, positions/owners and the table per layer; rope shared.
    in_axes = (0, 0, 0, None, 0, 0, 0)
    fn = jax.jit(jax.vmap(op, in_axes=in_axes), donate_argnums=(2,))
    device = device_of(backend)
    hlo = fn.lower(*problem.args()).compile().as_text()
    assert hlo.count(PAGED_TARGET) == 1
    assert "while" not in hlo  # not a loop over layers
    out = fn(*[jax.device_put(a, device) for a in problem.args()])
    per_layer = [a is not None for a in in_axes]
    looped = np.stack(
        [
            reference.target_kv_cache_update_paged(*_layer(problem, i, per_layer), ring=True)
            for i in range(layers)
        ]
    )
    assert_bits_equal(out, looped)


def test_vmap_jaxpr_is_the_layered_form():
    """Unmapped operands stay shared; mapped positions bring their owners along."""
    problem = make_paged_problem(np.random.default_rng(6), tokens=4, layers=2)
    op = jax_dflash.target_kv_cache_update_paged
    k, v, pool, rope, positions, owners, table = problem.args()
    jaxpr = jax.make_jaxpr(jax.vmap(op, in_axes=(0, 0, 0, None, 0, None, None)))(
        k, v, pool, rope, np.stack([positions] * 2), owners, table
    )
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is jax_dflash.target_kv_cache_update_paged_p]
    shapes = [tuple(x.aval.shape) for x in eqn.invars]
    assert shapes[3] == rope.shape  # shared
    assert shapes[4] == shapes[5] == (2, *positions.shape)  # both per layer
    assert shapes[6] == table.shape  # shared


def test_nested_vmap_folds_into_one_call(backend):
    outer, layers = 2, 3
    rng = np.random.default_rng(7)
    problems = [
        make_paged_problem(
            rng,
            tokens=5,
            batch=2,
            heads=2,
            head_dim=4,
            num_pages=4,
            page_size=2,
            table_pages=2,
            layers=layers,
        )
        for _ in range(outer)
    ]
    stacked = [np.stack(x) for x in zip(*(p.args() for p in problems))]
    stacked[3] = problems[0].rope_cos_sin  # rope shared by everything
    stacked[6] = problems[0].kv_page_table  # the table too; positions/owners per outer index
    op = jax_dflash.target_kv_cache_update_paged
    inner = jax.vmap(op, in_axes=(0, 0, 0, None, None, None, None))
    fn = jax.jit(jax.vmap(inner, in_axes=(0, 0, 0, None, 0, 0, None)))
    assert fn.lower(*stacked).as_text().count("@dflash_target_kv_cache_update_paged(") == 1
    device = device_of(backend)
    out = fn(*[jax.device_put(a, device) for a in stacked])
    want = np.stack(
        [
            reference.target_kv_cache_update_paged(
                p.k_delta,
                p.v_delta,
                p.past_key_value,
                problems[0].rope_cos_sin,
                p.delta_positions,
                p.delta_token_to_sequence,
                problems[0].kv_page_table,
            )
            for p in problems
        ]
    )
    assert_bits_equal(out, want)


# ---- in place --------------------------------------------------------------------------------


def _pool_copies(hlo: str, pool_shape, dtype_name):
    shape = f"{dtype_name}[{','.join(map(str, pool_shape))}]"
    return [line for line in hlo.splitlines() if " copy(" in line and shape in line]


@pytest.mark.parametrize("pool_dtype", [np.float16, FP8_DTYPES[0]], ids=str)
def test_donation_aliases_pool_and_copies_nothing(pool_dtype):
    problem = make_paged_problem(np.random.default_rng(8), tokens=6, pool_dtype=pool_dtype)
    fn, operands = jitted_op(problem, donate=True)
    donated = fn.lower(*operands).compile().as_text()
    hlo_dtype = {"float16": "f16", "float8_e4m3fn": "f8e4m3fn"}[np.dtype(pool_dtype).name]
    assert "input_output_alias={ {}: (2, {}" in donated
    assert "output_to_operand_aliasing={{}: (2, {})}" in donated
    assert _pool_copies(donated, problem.past_key_value.shape, hlo_dtype) == []
    kept_fn, _ = jitted_op(problem, donate=False)
    kept = kept_fn.lower(*operands).compile().as_text()
    assert _pool_copies(kept, problem.past_key_value.shape, hlo_dtype)


def test_donated_buffer_is_updated_in_place(backend):
    problem = make_paged_problem(
        np.random.default_rng(9), tokens=6, hostile=False, pool_dtype=FP8_DTYPES[1], k_norm=True
    )
    fn, operands = jitted_op(problem, donate=True)
    device = device_of(backend)
    operands = [jax.device_put(a, device) for a in operands]
    operands[2] = jnp.copy(operands[2])  # a buffer of XLA's own (donation can reuse it)
    pool = operands[2]
    pointer = pool.unsafe_buffer_pointer()
    out = fn(*operands)
    assert pool.is_deleted()
    assert out.unsafe_buffer_pointer() == pointer
    assert_bits_equal(out, expected(problem))
