"""The read side (``jax_dflash.read``): write with the op, read back with the helpers, and compare
with the NumPy reference's stored values dequantized by hand (``float32(stored) * scale``), bit
for bit, for every addressing form, pool format (16-bit, FP8 and int8 with static scales, int8, FP8 and
int4 with dynamic ones; int4's nibbles unpacked here with plain integer arithmetic), unbatched
and layer-batched; out-of-range ids read as zeros and are masked."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_dflash
from jax_dflash import reference

H, D, P, N = 2, 8, 4, 8  # heads, head dim, page size, pages
PAGES_PER_SLOT = 2
B, L = 3, 5  # slot contract: sequences, tokens per step
FORMS = ("slot", "paged", "slot_mapping")
# (pool dtype, scales): "static" per-head k/v scales, "dynamic" a scale pool.
FORMATS = (
    (np.float16, None),
    (ml_dtypes.bfloat16, None),
    (ml_dtypes.float8_e4m3fn, "static"),
    (ml_dtypes.float8_e5m2, "static"),
    (np.int8, "static"),
    (np.int8, "dynamic"),
    (ml_dtypes.float8_e4m3fn, "dynamic"),
    (ml_dtypes.float8_e5m2, "dynamic"),
    (np.uint8, "dynamic"),  # int4: two elements per byte
)


def _format_id(fmt):
    name = "int4" if np.dtype(fmt[0]) == np.uint8 else np.dtype(fmt[0]).name
    return f"{name}-{fmt[1] or 'plain'}"


def _pool(rng, shape, dtype):
    """Random finite bits: rows nobody writes must read as what they hold (an int4 pool: every
    byte, -8 nibbles included)."""
    if np.dtype(dtype) == np.int8:
        return rng.integers(-127, 128, shape).astype(np.int8)
    if np.dtype(dtype) == np.uint8:
        return rng.integers(0, 256, (*shape[:-1], shape[-1] // 2)).astype(np.uint8)
    return (rng.standard_normal(shape) * 0.5).astype(dtype)


def _written(rng, form, pool_dtype, scales, layers):
    """``(pool, scale_pool or None, (k_scale, v_scale) or None, addressing)`` after the op wrote a
    random call of ``form``; asserts the op stored what the reference stores."""
    lead = () if layers is None else (layers,)
    pool = _pool(rng, (*lead, 2, N, P, H, D), pool_dtype)
    k = rng.standard_normal((*lead, B, L, H, D)).astype(np.float16)
    v = rng.standard_normal((*lead, B, L, H, D)).astype(np.float16)
    extra = {}
    if scales == "static":
        shape = (*lead, H)
        extra["k_scale"] = rng.uniform(0.01, 0.05, shape).astype(np.float32)
        extra["v_scale"] = rng.uniform(0.01, 0.05, shape).astype(np.float32)
    elif scales == "dynamic":
        extra["scale_pool"] = rng.uniform(0.001, 0.01, pool.shape[:-1]).astype(np.float32)
    if form == "slot":
        rope = np.asarray(jax_dflash.rope_cos_sin(PAGES_PER_SLOT * P, D))
        starts = np.array([0, 3, 6], np.int32)
        lengths = np.array([5, 4, 2], np.int32)
        args = (k, v, pool, rope, starts, lengths)
        op = functools.partial(jax_dflash.target_kv_cache_update, pages_per_slot=PAGES_PER_SLOT)
        ref = functools.partial(reference.target_kv_cache_update, pages_per_slot=PAGES_PER_SLOT)
        addressing = dict(starts=starts, lengths=lengths)
    else:
        k = k.reshape(*lead, B * L, H, D)
        v = v.reshape(*lead, B * L, H, D)
        positions = np.tile(np.arange(L, dtype=np.int32), B)
        owners = np.repeat(np.arange(B, dtype=np.int32), L)
        # A table with pages out of order, one missing K page (-1) and one bad V id.
        table = np.stack(
            [np.array([[5, 2], [0, 7], [3, -1]]), np.array([[5, 2], [4, 7], [3, 6]]) + N]
        ).transpose(1, 0, 2)
        table = np.ascontiguousarray(table, np.int32)
        rope = np.asarray(jax_dflash.rope_cos_sin(2 * L, D))[0][positions]
        if form == "paged":
            args = (k, v, pool, rope, positions, owners, table)
            op = jax_dflash.target_kv_cache_update_paged
            ref = reference.target_kv_cache_update_paged
        else:
            slots = np.array(jax_dflash.slots_from_pages(positions, owners, table, N, P), np.int32)
            slots[3] = N * P + 1  # past the pool: written nowhere, read as nothing
            args = (k, v, pool, rope, slots)
            op = jax_dflash.target_kv_cache_update_slots
            ref = reference.target_kv_cache_update_slots
            addressing = dict(slots=slots)
        if form == "paged":
            addressing = dict(table=table)
    out = op(*(jnp.asarray(a) for a in args), **{n: jnp.asarray(x) for n, x in extra.items()})
    expected = ref(*args, **extra)
    if scales == "dynamic":
        out = tuple(np.asarray(o) for o in out)
        for o, e in zip(out, expected):
            np.testing.assert_array_equal(o.view(np.uint8), e.view(np.uint8))
        pool_out, scale_pool = expected
    else:
        np.testing.assert_array_equal(np.asarray(out).view(np.uint8), expected.view(np.uint8))
        pool_out, scale_pool = expected, None
    static = (extra["k_scale"], extra["v_scale"]) if scales == "static" else None
    addressing["v_delta"] = v
    return pool_out, scale_pool, static, addressing


def _int4_levels(row_bytes):
    """By hand: a packed row ``[H, D/2]`` as its ``D`` int4 levels, element ``2j`` from byte
    ``j``'s low nibble, ``2j + 1`` from its high one, nibbles of 8 or more being negative."""
    levels = np.empty((*row_bytes.shape[:-1], 2 * row_bytes.shape[-1]), np.int64)
    for j in range(row_bytes.shape[-1]):
        for half, nibble in enumerate((row_bytes[..., j] % 16, row_bytes[..., j] // 16)):
            nibble = nibble.astype(np.int64)
            levels[..., 2 * j + half] = np.where(nibble >= 8, nibble - 16, nibble)
    return levels


def _dequantized(pool, scale_pool, static, layer, plane, page, row):
    """By hand: one stored row ``[H, D]`` of layer ``layer`` (None: unbatched) times its scale."""
    at = () if layer is None else (layer,)
    x = pool[(*at, plane, page, row)]
    x = (_int4_levels(x) if pool.dtype == np.uint8 else x).astype(np.float32)
    if static is not None:
        s = static[plane][at] if layer is not None else static[plane]
        x = x * np.asarray(s, np.float32)[:, None]
    if scale_pool is not None:
        x = x * scale_pool[(*at, plane, page, row)][:, None]
    return x


def _expected_rows(form, pool, scale_pool, static, addressing, layer, queries):
    """``(k, v, valid)`` for the queries ([B, T] positions or [T] slots) by the SPEC's rules,
    token by token."""
    shape = queries.shape
    k = np.zeros((*shape, H, D), np.float32)
    v = np.zeros_like(k)
    valid = np.zeros(shape, bool)
    for idx in np.ndindex(shape):
        q = int(queries[idx])
        if form == "slot":
            b = idx[0]
            if not 0 <= q < PAGES_PER_SLOT * P:
                continue
            kp = vp = b * PAGES_PER_SLOT + q // P
        elif form == "paged":
            b = idx[0]
            table = addressing["table"]
            if q < 0 or q // P >= table.shape[-1]:
                continue
            kp, vp = int(table[b, 0, q // P]), int(table[b, 1, q // P]) - N
            if not (0 <= kp < N and 0 <= vp < N):
                continue
        else:
            if not 0 <= q < N * P:
                continue
            kp = vp = q // P
        valid[idx] = True
        k[idx] = _dequantized(pool, scale_pool, static, layer, 0, kp, q % P)
        v[idx] = _dequantized(pool, scale_pool, static, layer, 1, vp, q % P)
    return k, v, valid


def _read(form, pool, scale_pool, static, addressing, queries):
    kwargs = {}
    if static is not None:
        kwargs.update(k_scale=jnp.asarray(static[0]), v_scale=jnp.asarray(static[1]))
    if scale_pool is not None:
        kwargs["scale_pool"] = jnp.asarray(scale_pool)
    pool, queries = jnp.asarray(pool), jnp.asarray(queries)
    if form == "slot":
        read = functools.partial(jax_dflash.gather_kv_slot, pages_per_slot=PAGES_PER_SLOT)
        return jax.jit(read)(pool, queries, **kwargs)
    if form == "paged":
        return jax.jit(jax_dflash.gather_kv_paged)(
            pool, jnp.asarray(addressing["table"]), queries, **kwargs
        )
    return jax.jit(jax_dflash.gather_kv_slots)(pool, queries, **kwargs)


def _queries(form, addressing):
    """What to read: every token the call wrote, and hostile ones (negative, past the slot,
    past the table, past the pool)."""
    if form == "slot":
        q = np.arange(-1, PAGES_PER_SLOT * P + 1, dtype=np.int32)
        return np.broadcast_to(q, (B, q.size)).copy()
    if form == "paged":
        q = np.arange(-2, 2 * P + 3, dtype=np.int32)
        return np.broadcast_to(q, (B, q.size)).copy()
    slots = addressing["slots"]
    return np.concatenate([slots, np.array([-1, N * P, N * P - 1, 2**31 - 1], np.int32)])


def _assert_bits(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape
    np.testing.assert_array_equal(actual.view(np.uint32), expected.view(np.uint32))


# Layer-batched: a 16-bit pool, FP8 and int8 with static scales, int8, e4m3 and int4 with
# dynamic ones.
LAYERED = tuple(FORMATS[i] for i in (0, 2, 4, 5, 6, 8))
CASES = [(fmt, None) for fmt in FORMATS] + [(fmt, 2) for fmt in LAYERED]


@pytest.mark.parametrize(
    "fmt, layers",
    CASES,
    ids=[f"{_format_id(f)}-{'layered' if n else 'unbatched'}" for f, n in CASES],
)
@pytest.mark.parametrize("form", FORMS)
def test_read_back_is_the_stored_value_times_its_scale(form, fmt, layers):
    rng = np.random.default_rng([FORMS.index(form), FORMATS.index(fmt), layers or 0])
    pool, scale_pool, static, addressing = _written(rng, form, fmt[0], fmt[1], layers)
    queries = _queries(form, addressing)
    k, v, valid = _read(form, pool, scale_pool, static, addressing, queries)
    for layer in [None] if layers is None else range(layers):
        ek, ev, evalid = _expected_rows(form, pool, scale_pool, static, addressing, layer, queries)
        at = slice(None) if layer is None else layer
        _assert_bits(k[at], ek)
        _assert_bits(v[at], ev)
        np.testing.assert_array_equal(np.asarray(valid[at]), evalid)
    assert np.asarray(valid).any() and not np.asarray(valid).all()


def test_read_back_of_written_tokens_is_the_written_value():
    """The rows a float32 pool holds are the keys (after RoPE) and values the op wrote: the
    values come back as written, through each form's addressing of one write."""
    rng = np.random.default_rng(7)
    pool, _, _, addressing = _written(rng, "slot", np.float32, None, None)
    # Sequence 1 wrote positions 3..6; the values are stored unchanged (no v-norm).
    positions = jax_dflash.sequence_positions(jnp.array([0, 7, 0], jnp.int32), 7)
    k, v, valid = jax_dflash.gather_kv_slot(
        jnp.asarray(pool), positions, pages_per_slot=PAGES_PER_SLOT
    )
    assert np.asarray(valid).tolist()[1] == [True] * 7
    assert not np.asarray(valid[0]).any() and not np.asarray(k[0]).any()
    written = addressing["v_delta"][1, :4].astype(np.float32)
    np.testing.assert_array_equal(np.asarray(v[1, 3:7]), written)


def test_ring_reads_the_page_slot_modulo_the_table():
    rng = np.random.default_rng(3)
    pool = _pool(rng, (2, N, P, H, D), np.float16)
    table = np.array([[[1, 4], [N + 1, N + 4]]], np.int32)
    positions = jnp.asarray(np.array([[0, 5, 9, 13]], np.int32))  # slots 0, 1, 0 (ring), 1
    k, v, valid = jax_dflash.gather_kv_paged(jnp.asarray(pool), table, positions, ring=True)
    assert np.asarray(valid).all()
    for t, (page, row) in enumerate([(1, 0), (4, 1), (1, 1), (4, 1)]):
        np.testing.assert_array_equal(np.asarray(k[0, t]), pool[0, page, row].astype(np.float32))
    _, _, valid = jax_dflash.gather_kv_paged(jnp.asarray(pool), table, positions)
    assert np.asarray(valid).tolist() == [[True, True, False, False]]


def test_dtype_and_layer_shared_addressing():
    rng = np.random.default_rng(4)
    pools = _pool(rng, (3, 2, N, P, H, D), np.float32)
    slots = jnp.array([0, 5, 31], jnp.int32)
    k, v, valid = jax_dflash.gather_kv_slots(jnp.asarray(pools), slots, dtype=jnp.bfloat16)
    assert k.shape == (3, 3, H, D) and k.dtype == jnp.bfloat16 and valid.shape == (3, 3)
    np.testing.assert_array_equal(np.asarray(v[2, 1]), pools[2, 1, 1, 1].astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(), ValueError, "got none"),
        (dict(k_scale=0.1), ValueError, "both or neither"),
        (dict(k_scale=0.1, v_scale=0.1, scale_pool="pool"), ValueError, "got both"),
        (dict(scale_pool="bad shape"), ValueError, "dims without D"),
    ],
)
def test_scaled_pool_refuses_missing_or_mixed_scales(kwargs, error, match):
    pool = jnp.zeros((2, N, P, H, D), jnp.int8)
    if kwargs.get("scale_pool") == "pool":
        kwargs["scale_pool"] = jnp.zeros((2, N, P, H), jnp.float32)
    elif "scale_pool" in kwargs:
        kwargs["scale_pool"] = jnp.zeros((2, N, P), jnp.float32)
    with pytest.raises(error, match=match):
        jax_dflash.gather_kv_slots(pool, jnp.zeros(2, jnp.int32), **kwargs)


def test_plain_pool_refuses_scales_and_bad_operands():
    pool = jnp.zeros((2, N, P, H, D), jnp.float16)
    with pytest.raises(ValueError, match="read without scales"):
        jax_dflash.gather_kv_slots(pool, jnp.zeros(2, jnp.int32), k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match=r"past_key_value: expected \[2, N, P, H, D\]"):
        jax_dflash.gather_kv_slots(pool[0], jnp.zeros(2, jnp.int32))
    with pytest.raises(TypeError, match="positions: expected an int32 array"):
        jax_dflash.gather_kv_slot(pool, jnp.zeros((1, 2), jnp.float32), pages_per_slot=2)
    with pytest.raises(ValueError, match="positions: expected"):
        jax_dflash.gather_kv_paged(
            pool, jnp.zeros((2, 2, 2), jnp.int32), jnp.zeros((3, 2), jnp.int32)
        )
    with pytest.raises(TypeError, match="slot_mapping: expected int32 .* jax_enable_x64 off"):
        jax_dflash.gather_kv_slots(pool, np.zeros(2, np.int64))


def test_int4_bytes_unpack_low_nibble_first_with_sign():
    """Known bytes through ``gather_kv_rows``: 0x8F holds -1 (low) then -8 (high), 0x71 holds 1
    then 7, 0x00 zeros; unbatched and layer-batched, each row times its own scale."""
    pool = np.zeros((2, 2, 1, 1, 2), np.uint8)  # [2, N=2, P=1, H=1, D/2=2]: D = 4
    pool[0, 1, 0, 0] = [0x8F, 0x71]
    pool[1, 0, 0, 0] = [0x10, 0xF9]  # 0 then 1; -7 then -1
    scale_pool = np.array([[[[0.5]], [[0.25]]], [[[3.0]], [[1.0]]]], np.float32)
    ids = jnp.array([1], jnp.int32), jnp.array([0], jnp.int32), jnp.array([0], jnp.int32)
    k, v, valid = jax_dflash.gather_kv_rows(pool, *ids, scale_pool=scale_pool)
    assert k.shape == v.shape == (1, 1, 4) and np.asarray(valid).tolist() == [True]
    np.testing.assert_array_equal(np.asarray(k[0, 0]), np.float32([-1, -8, 1, 7]) * 0.25)
    np.testing.assert_array_equal(np.asarray(v[0, 0]), np.float32([0, 1, -7, -1]) * 3.0)
    layered = np.stack([pool, pool ^ 0xFF])  # a second layer with every bit flipped
    k, v, _ = jax_dflash.gather_kv_rows(
        layered, *ids, scale_pool=np.stack([scale_pool, scale_pool])
    )
    assert k.shape == (2, 1, 1, 4)
    # 0x70 holds 0 then 7; 0x8E holds -2 then -8 (0xFF ^ 0x8F, 0xFF ^ 0x71).
    np.testing.assert_array_equal(np.asarray(k[1, 0, 0]), np.float32([0, 7, -2, -8]) * 0.25)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(), ValueError, r"int4 pool is read with its scales \(scale_pool\), got none"),
        (dict(k_scale=0.1, v_scale=0.1), ValueError, "int4 pool .* expected scale_pool"),
        (dict(scale_pool=np.zeros((2, N, P, H, D // 2), np.float32)), ValueError, "without D"),
        (dict(scale_pool=np.zeros((2, N, P, H), np.float16)), TypeError, "float32, got float16"),
    ],
)
def test_int4_pool_refuses_static_or_missing_scales(kwargs, error, match):
    pool = jnp.zeros((2, N, P, H, D // 2), jnp.uint8)
    with pytest.raises(error, match=match):
        jax_dflash.gather_kv_slots(pool, jnp.zeros(2, jnp.int32), **kwargs)


def test_a_pool_dtype_without_a_format_is_refused():
    with pytest.raises(TypeError, match="past_key_value: expected a pool dtype of .* got int16"):
        jax_dflash.gather_kv_slots(jnp.zeros((2, N, P, H, D), jnp.int16), jnp.zeros(2, jnp.int32))
