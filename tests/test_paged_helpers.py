"""The paged-input helpers (token_positions, gather_rope, identity_page_table) and the paged
problem builder: hand-checked values, jit, errors, and the helpers turning any slot update into a
paged one that the reference writes identically."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import (
    DELTA_DTYPES,
    FP8_DTYPES,
    assert_bits_equal,
    compare_bits,
    make_paged_problem,
    make_problem,
)
from jax_dflash import reference
from jax_dflash.paged import gather_rope, identity_page_table, token_positions

I32 = np.int32


def test_token_positions_values():
    starts = np.array([5, -2, 2**31 - 2, 0], I32)
    lengths = np.array([2, 3, 3, -1], I32)
    positions, owners = token_positions(starts, lengths, 3)
    assert positions.dtype == jnp.int32 and owners.dtype == jnp.int32
    assert positions.tolist() == [5, 6, -1, -2, -1, 0, 2**31 - 2, 2**31 - 1, -1, -1, -1, -1]
    # Padding, and the position past int32 (token 2 of sequence 2), are -1 in both arrays.
    assert owners.tolist() == [0, 0, -1, 1, 1, 1, 2, 2, -1, -1, -1, -1]


def test_token_positions_jit_and_leading_axes():
    starts = np.array([[0, 4], [7, 1]], I32)
    lengths = np.array([[1, 2], [2, 0]], I32)
    positions, owners = jax.jit(token_positions, static_argnums=2)(starts, lengths, 2)
    assert positions.shape == (2, 4)
    assert positions.tolist() == [[0, -1, 4, 5], [7, 8, -1, -1]]
    assert owners.tolist() == [[0, -1, 1, 1], [0, 0, -1, -1]]


def test_gather_rope_rows_and_zero_rows():
    rope = np.arange(2 * 4 * 2, dtype=np.float32).reshape(2, 4, 2) + 1  # no zero entry
    positions = np.array([0, 3, 2, 4, -1, 1, 1, 1], I32)
    owners = np.array([0, 1, 1, 0, 0, -1, 2, 0], I32)
    got = np.asarray(jax.jit(gather_rope)(rope, positions, owners))
    want = np.stack(
        [
            rope[0, 0],
            rope[1, 3],
            rope[1, 2],
            np.zeros(2),
            np.zeros(2),
            np.zeros(2),
            np.zeros(2),
            rope[0, 1],
        ]
    ).astype(np.float32)
    assert_bits_equal(got, want)
    # A table shared by the batch (Rb = 1) serves every owner.
    shared = np.asarray(gather_rope(rope[:1], positions, owners))
    assert_bits_equal(shared[[0, 1, 2, 6]], rope[0, [0, 3, 2, 1]])
    assert not shared[[3, 4, 5]].any()


def test_identity_page_table_values():
    table = identity_page_table(2, 3, 7)
    assert table.dtype == jnp.int32
    assert table.tolist() == [[[0, 1, 2], [7, 8, 9]], [[3, 4, 5], [10, 11, 12]]]


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: token_positions(np.zeros(2, I32), np.zeros(3, I32), 2), ValueError, "lengths"),
        (
            lambda: token_positions(np.int32(0), np.int32(1), 2),
            ValueError,
            r"start_positions: expected shape \[B\] or \[\.\.\., B\] \(rank >= 1\), got \(\)",
        ),
        (
            lambda: token_positions(np.zeros(2, np.int64), np.zeros(2, I32), 2),
            TypeError,
            "start_positions",
        ),
        (lambda: token_positions(np.zeros(2, I32), np.zeros(2, I32), -1), ValueError, "width"),
        (lambda: token_positions(np.zeros(2, I32), np.zeros(2, I32), 2.0), TypeError, "width"),
        (
            lambda: gather_rope(
                np.zeros((1, 2, 2), np.float16), np.zeros(1, I32), np.zeros(1, I32)
            ),
            TypeError,
            "rope_cos_sin",
        ),
        (
            lambda: gather_rope(np.zeros((2, 2), np.float32), np.zeros(1, I32), np.zeros(1, I32)),
            ValueError,
            r"rope_cos_sin: expected shape \[Rb, S, R\] \(rank 3\), got \(2, 2\)",
        ),
        (
            lambda: gather_rope(
                np.zeros((1, 2, 2), np.float32), np.zeros(2, I32), np.zeros(1, I32)
            ),
            ValueError,
            "delta_token_to_sequence",
        ),
        (
            lambda: gather_rope(
                np.zeros((1, 2, 2), np.float32), np.zeros((1, 2), I32), np.zeros(2, I32)
            ),
            ValueError,
            "delta_positions",
        ),
        (lambda: identity_page_table(3, 2, 5), ValueError, "num_pages"),
        (lambda: identity_page_table(1, 0, 5), ValueError, "pages_per_slot"),
        (lambda: identity_page_table(1, True, 5), TypeError, "pages_per_slot"),
    ],
)
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _paged_from_slot(problem):
    """The slot problem as a paged one, through the helpers alone."""
    k = problem.k_delta
    batch, delta_len, heads, head_dim = k.shape
    num_pages = problem.past_key_value.shape[1]
    positions, owners = token_positions(
        problem.delta_start_positions, problem.delta_lengths, delta_len
    )
    rope = gather_rope(problem.rope_cos_sin, positions, owners)
    table = identity_page_table(batch, problem.pages_per_slot, num_pages)
    flat = (batch * delta_len, heads, head_dim)
    return (
        k.reshape(flat),
        problem.v_delta.reshape(flat),
        problem.past_key_value,
        np.asarray(rope),
        np.asarray(positions),
        np.asarray(owners),
        np.asarray(table),
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pool_dtype", [None, *FP8_DTYPES], ids=str)
@pytest.mark.parametrize("dtype", DELTA_DTYPES, ids=str)
def test_helpers_turn_a_slot_update_into_the_same_paged_update(dtype, pool_dtype, seed):
    # Hostile starts and lengths (negative, padding, past the slot), every position < S = cap:
    # the identity table drops exactly what the slot contract drops.
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, 4))
    problem = make_problem(
        rng,
        batch=batch,
        delta_len=int(rng.integers(1, 6)),
        heads=2,
        head_dim=10,
        rotary_dim=6,
        page_size=3,
        pages_per_slot=int(rng.integers(1, 4)),
        max_batch=4,
        rope_batch=int(rng.choice([1, batch])),
        dtype=dtype,
        pool_dtype=pool_dtype,
        k_norm=seed % 2 == 0,
        v_norm=seed % 3 == 0,
    )
    slot = reference.target_kv_cache_update(*problem.args(), **problem.kwargs())
    kwargs = {k: v for k, v in problem.kwargs().items() if k != "pages_per_slot"}
    paged = reference.target_kv_cache_update_paged(*_paged_from_slot(problem), **kwargs)
    assert_bits_equal(paged, slot)
    assert compare_bits(slot, problem.past_key_value)[0] > 0  # not an empty update


def test_helpers_with_a_per_sequence_rope_table():
    rng = np.random.default_rng(1)
    problem = make_problem(rng, batch=3, delta_len=4, rope_batch=3, dtype=np.float32)
    slot = reference.target_kv_cache_update(*problem.args(), **problem.kwargs())
    paged = reference.target_kv_cache_update_paged(*_paged_from_slot(problem))
    assert_bits_equal(paged, slot)
    assert np.count_nonzero(slot != problem.past_key_value)


# ---- make_paged_problem's guarantees ------------------------------------------------------------


def _valid_rows(problem):
    """[(plane, page, row)] each valid token writes, computed from SPEC.md's rules here."""
    num_pages, page_size = problem.past_key_value.shape[1:3]
    table = problem.kv_page_table
    batch, _, table_pages = table.shape
    rows = []
    for p, b in zip(problem.delta_positions.tolist(), problem.delta_token_to_sequence.tolist()):
        if b < 0 or b >= batch or p < 0:
            continue
        i = p // page_size
        if problem.ring:
            i %= table_pages
        elif i >= table_pages:
            continue
        kp, vp = int(table[b, 0, i]), int(table[b, 1, i])
        if 0 <= kp < num_pages and num_pages <= vp < 2 * num_pages:
            rows += [(0, kp, p % page_size), (1, vp - num_pages, p % page_size)]
    return rows


@pytest.mark.parametrize("ring", [False, True])
def test_paged_problem_rows_are_distinct_and_hostile_cases_appear(ring):
    seen = set()
    for seed in range(20):
        problem = make_paged_problem(
            np.random.default_rng(seed),
            tokens=24,
            batch=3,
            num_pages=10,
            page_size=4,
            table_pages=3,
            ring=ring,
        )
        rows = _valid_rows(problem)
        assert len(rows) == len(set(rows))  # no two valid tokens share a pool row
        assert rows, "every problem writes something"
        table = problem.kv_page_table
        k_ids, v_ids = table[:, 0].ravel(), table[:, 1].ravel()
        good_k, good_v = k_ids[(k_ids >= 0) & (k_ids < 10)], v_ids[(v_ids >= 10) & (v_ids < 20)]
        assert len(set(good_k)) == len(good_k) and len(set(good_v)) == len(good_v)
        p, b = problem.delta_positions, problem.delta_token_to_sequence
        seen.update(
            name
            for name, hit in [
                ("padding", (b == -1).any()),
                ("owner>=B", (b >= 3).any()),
                ("negative position", (p < 0).any()),
                ("past the table", (p >= 12).any()),
                ("negative K", (k_ids < 0).any()),
                ("K in V range", (k_ids >= 10).any()),
                ("V below N", (v_ids < 10).any()),
                ("V past 2N", (v_ids >= 20).any()),
                ("interleaved", (np.diff(b[b >= 0]) != 0).sum() > 2),
            ]
            if hit
        )
    assert len(seen) == 9, seen


def test_paged_problem_without_hostile_writes_every_token():
    problem = make_paged_problem(
        np.random.default_rng(0),
        tokens=16,
        batch=2,
        num_pages=6,
        page_size=4,
        table_pages=2,
        hostile=False,
    )
    assert len(_valid_rows(problem)) == 2 * 16
    assert not (problem.k_delta == 0).any() and not (problem.past_key_value == 0).any()


def test_paged_problem_extras_and_layers():
    problem = make_paged_problem(
        np.random.default_rng(0),
        layers=2,
        pool_dtype=FP8_DTYPES[0],
        k_norm=True,
        v_norm=True,
        scale_shape=(2, 2),
        norm_weight_per_layer=True,
        table_per_layer=True,
    )
    kwargs = problem.kwargs()
    assert set(kwargs) == {"ring", "k_scale", "v_scale", "k_norm_weight", "v_norm", "norm_eps"}
    assert kwargs["k_scale"].shape == (2, 2) and kwargs["k_norm_weight"].shape == (2, 16)
    assert problem.kv_page_table.shape == (2, 2, 2, 2) and problem.delta_positions.shape == (8,)
    assert not (problem.past_key_value.view(np.uint8) & 0x7F == 0).any()  # no FP8 zeros


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tokens=100, batch=2, table_pages=2, page_size=4), "tokens"),
        (dict(batch=3, table_pages=3, num_pages=8), "table_pages"),
        (dict(scale_shape=(2,)), "scale_shape"),
        (dict(pool_dtype=FP8_DTYPES[1], scale_shape=(3,)), "scale_shape"),
        (dict(dtype=FP8_DTYPES[0]), "dtype"),
        (dict(table_per_layer=True), "table_per_layer"),
    ],
)
def test_paged_problem_rejects_bad_requests(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_paged_problem(np.random.default_rng(0), **kwargs)
