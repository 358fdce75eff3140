"""The read side of the pool: each token's K and V rows gathered from ``[2, N, P, H, D]`` (or the
layer-batched ``[layers, 2, N, P, H, D]``) through any of the three addressing forms, and
dequantized as SPEC.md says a reader does: ``float32(stored) * scale``, with the head's static
scale (``k_scale``/``v_scale``) or the row's own dynamic one (``scale_pool[plane, page, row,
head]``); a 16/32-bit pool is read as ``float32(stored)``. An int4 pool (uint8 bytes ``[..., H,
D/2]``, dynamic scales only) is unpacked first: element ``2j`` from the low nibble of byte ``j``,
``2j + 1`` from the high one, each sign-extended from 4-bit two's complement, so it reads as
``[..., H, D]`` too. The product is one float32 multiplication, so the result is bit for bit what
NumPy computes from the stored bytes.

Every function returns ``(k, v, valid)``: ``k`` and ``v`` ``[..., H, D]`` in ``dtype``, ``valid``
a bool mask over the tokens, true where the addressing names a row the writer of that form would
write. Elsewhere (padding, negative positions, ids outside the pool or the table) ``k`` and ``v``
are zeros: ids are clipped before the gather, so no data reads out of bounds. Whether a valid row
holds a written token (or an older one, in a ring) is the caller's to know.

Addressing, as the writers take it (SPEC.md):

- :func:`gather_kv_slot`: the slot contract; row ``b`` of ``positions`` ``[B, T]`` is sequence
  ``b``, which owns pages ``[b * pages_per_slot, (b + 1) * pages_per_slot)``;
- :func:`gather_kv_paged`: the paged contract; row ``b`` of ``positions`` is the sequence of
  table row ``b`` (``kv_page_table`` ``[B, 2, M]``: K ids in ``[0, N)``, V ids in ``[N, 2N)``),
  ``ring`` as the writer's;
- :func:`gather_kv_slots`: flat slots ``page * P + row`` (vLLM's ``slot_mapping``), any shape;
- :func:`gather_kv_rows`: plane-local K and V pages and rows, the form the others reduce to.

:func:`sequence_positions` gives ``[B, width]`` positions ``0 .. lengths[b] - 1`` (-1 after),
the tokens ``[0, length)`` of each sequence. Layer-batched pools read every layer at once: the
scales take their leading layer axis, and an addressing operand with one more leading axis than
the unbatched form is per layer (else shared). All functions are jit-able.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_dflash.paged import _int32_array, _static_int


def _format(pool_dtype) -> dict:
    """The pool format's row of the contract (``scales``: none, static or dynamic only)."""
    from jax_dflash._shapes import POOL_FORMATS

    name = str(np.dtype(pool_dtype))
    if name not in POOL_FORMATS:
        raise TypeError(
            f"past_key_value: expected a pool dtype of {', '.join(POOL_FORMATS)} (uint8: int4), "
            f"got {name}"
        )
    return POOL_FORMATS[name]


class KV(NamedTuple):
    """Dequantized keys and values ``[..., H, D]`` and the mask of the rows they come from."""

    k: jax.Array
    v: jax.Array
    valid: jax.Array


def sequence_positions(lengths, width: int) -> jax.Array:
    """``[B, width]`` int32 (``[..., B, width]`` for ``[..., B]`` lengths): position ``t`` where
    ``t < lengths[b]``, else -1 (read as padding)."""
    width = _static_int("width", width, 0)
    lengths = _int32_array("lengths", lengths)
    t = jnp.arange(width, dtype=jnp.int32)
    return jnp.where(t < lengths[..., None], t, -1)


def _scales(pool, k_scale, v_scale, scale_pool):
    """Checks that the pool's format is read with the scales it was written with."""
    given = (k_scale is not None) + (v_scale is not None)
    if given == 1:
        raise ValueError(
            "k_scale, v_scale: expected both or neither, got "
            f"k_scale {'None' if k_scale is None else 'given'} and "
            f"v_scale {'None' if v_scale is None else 'given'}"
        )
    row = _format(pool.dtype)
    name = row["name"]
    if row["scales"] == "none":
        if given or scale_pool is not None:
            raise ValueError(
                f"k_scale, v_scale, scale_pool: a {name} pool is read without scales, got "
                + ("k_scale and v_scale" if given else "scale_pool")
            )
        return
    if given and scale_pool is not None:
        raise ValueError(
            "k_scale, v_scale, scale_pool: expected static scales or a scale pool, got both"
        )
    if row["scales"] == "dynamic" and given:
        raise ValueError(
            f"k_scale, v_scale: a {name} pool (uint8 bytes, two elements each) is read with its "
            "scale pool only, expected scale_pool, got k_scale and v_scale"
        )
    if not given and scale_pool is None:
        expected = (
            "scale_pool" if row["scales"] == "dynamic" else "k_scale and v_scale, or scale_pool"
        )
        raise ValueError(
            f"k_scale, v_scale, scale_pool: a {name} pool is read with its scales ({expected}), "
            "got none"
        )
    if scale_pool is not None:
        if np.dtype(scale_pool.dtype) != np.float32:
            raise TypeError(f"scale_pool: expected dtype float32, got {scale_pool.dtype}")
        if tuple(scale_pool.shape) != tuple(pool.shape[:-1]):
            raise ValueError(
                f"scale_pool: expected the pool's dims without D (its last) {tuple(pool.shape[:-1])}, "
                f"got {tuple(scale_pool.shape)}"
            )


def _unpacked(stored, per_byte: int):
    """float32 elements ``[..., D]`` of stored rows: a packed int4 row ``[..., D/2]`` of bytes
    unpacked (element ``2j`` the low nibble of byte ``j``, sign-extended), else converted."""
    if per_byte == 1:
        return stored.astype(jnp.float32)
    low = (stored & 0x0F).astype(jnp.int8)
    high = (stored >> 4).astype(jnp.int8)
    # 4-bit two's complement: nibble n is n - 16 when its sign bit (8) is set.
    levels = jnp.stack([(low ^ 8) - 8, (high ^ 8) - 8], axis=-1)
    return levels.reshape(*stored.shape[:-1], 2 * stored.shape[-1]).astype(jnp.float32)


def _check_pool(pool):
    if pool.ndim not in (5, 6) or pool.shape[-5] != 2:
        raise ValueError(
            "past_key_value: expected [2, N, P, H, D] or [layers, 2, N, P, H, D], got shape "
            f"{tuple(pool.shape)}"
        )


def _per_layer(pool, x, base_rank):
    """The vmap axis of an addressing operand: 0 when it carries the layer axis."""
    if pool.ndim == 6 and x.ndim == base_rank + 1:
        if x.shape[0] != pool.shape[0]:
            raise ValueError(
                f"expected a leading layer axis of {pool.shape[0]} on the addressing, got shape "
                f"{tuple(x.shape)}"
            )
        return 0
    return None


def _read_layer(pool, k_pages, v_pages, rows, valid, k_scale, v_scale, scale_pool, dtype):
    """One layer: the rows at plane-local pages and rows, zeros where not ``valid``."""
    k_pages, v_pages = jnp.where(valid, k_pages, 0), jnp.where(valid, v_pages, 0)
    rows = jnp.where(valid, rows, 0)

    per_byte = int(_format(pool.dtype)["per_byte"])

    def plane(index, pages, scale):
        x = _unpacked(pool[index, pages, rows], per_byte)  # [..., H, D]
        if scale is not None:
            x = x * jnp.asarray(scale, jnp.float32).reshape(-1)[:, None]  # [1] or [H]
        if scale_pool is not None:
            x = x * scale_pool[index, pages, rows][..., None]
        return jnp.where(valid[..., None, None], x, jnp.float32(0)).astype(dtype)

    return KV(plane(0, k_pages, k_scale), plane(1, v_pages, v_scale), valid)


def _read(pool, addressing, base_ranks, locate, k_scale, v_scale, scale_pool, dtype):
    """Reads ``pool`` at ``locate(*addressing, num_pages, page_size) -> (k_pages, v_pages, rows,
    valid)``, every layer of a layer-batched pool."""
    pool = jnp.asarray(pool)
    _check_pool(pool)
    _scales(pool, k_scale, v_scale, scale_pool)
    num_pages, page_size = pool.shape[-4], pool.shape[-3]
    if k_scale is not None:
        k_scale = jnp.asarray(k_scale, jnp.float32)
        v_scale = jnp.asarray(v_scale, jnp.float32)
        if tuple(k_scale.shape) != tuple(v_scale.shape):
            raise ValueError(
                f"v_scale: expected k_scale's shape {tuple(k_scale.shape)}, got "
                f"{tuple(v_scale.shape)}"
            )

    def layer(pool, k_scale, v_scale, scale_pool, *addressing):
        located = locate(*addressing, num_pages, page_size)
        return _read_layer(pool, *located, k_scale, v_scale, scale_pool, dtype)

    if pool.ndim == 5:
        return layer(pool, k_scale, v_scale, scale_pool, *addressing)
    scale_axis = None if k_scale is None else 0
    if k_scale is not None and (k_scale.ndim != 2 or k_scale.shape[0] != pool.shape[0]):
        raise ValueError(
            f"k_scale, v_scale: a layer-batched pool is read with [layers, 1] or [layers, H] "
            f"scales ({pool.shape[0]} layers), got shape {tuple(k_scale.shape)}"
        )
    axes = (0, scale_axis, scale_axis, None if scale_pool is None else 0)
    axes += tuple(_per_layer(pool, a, r) for a, r in zip(addressing, base_ranks))
    return jax.vmap(layer, in_axes=axes)(pool, k_scale, v_scale, scale_pool, *addressing)


def gather_kv_rows(
    past_key_value,
    k_pages,
    v_pages,
    rows,
    *,
    k_scale=None,
    v_scale=None,
    scale_pool=None,
    dtype=jnp.float32,
) -> KV:
    """K from ``pool[0, k_pages, rows]`` and V from ``pool[1, v_pages, rows]`` (plane-local
    page ids in ``[0, N)``, rows in ``[0, P)``; int32 arrays of one shape), dequantized. A token
    is valid where both pages and its row are in range."""
    k_pages = _int32_array("k_pages", k_pages)
    v_pages = _int32_array("v_pages", v_pages)
    rows = _int32_array("rows", rows)
    if not (k_pages.shape == v_pages.shape == rows.shape):
        raise ValueError(
            f"k_pages, v_pages, rows: expected one shape, got {tuple(k_pages.shape)}, "
            f"{tuple(v_pages.shape)}, {tuple(rows.shape)}"
        )

    def locate(kp, vp, r, num_pages, page_size):
        valid = (kp >= 0) & (kp < num_pages) & (vp >= 0) & (vp < num_pages)
        valid &= (r >= 0) & (r < page_size)
        return kp, vp, r, valid

    # Layer-batched: ids with a leading layer axis are per layer; 1-D ones are shared.
    rank = k_pages.ndim - (jnp.ndim(past_key_value) == 6 and k_pages.ndim > 1)
    return _read(
        past_key_value,
        (k_pages, v_pages, rows),
        (rank,) * 3,
        locate,
        k_scale,
        v_scale,
        scale_pool,
        dtype,
    )


def gather_kv_slot(
    past_key_value,
    positions,
    *,
    pages_per_slot: int,
    k_scale=None,
    v_scale=None,
    scale_pool=None,
    dtype=jnp.float32,
) -> KV:
    """The slot contract's rows: ``positions`` int32 ``[B, T]`` (layer-batched, optionally
    ``[layers, B, T]``), sequence ``b`` at page ``b * pages_per_slot + pos // P``, row
    ``pos % P``. Valid where ``0 <= pos < pages_per_slot * P`` and the page is in the pool."""
    pages_per_slot = _static_int("pages_per_slot", pages_per_slot, 1)
    positions = _int32_array("positions", positions)
    layered = jnp.ndim(past_key_value) == 6 and positions.ndim == 3
    if positions.ndim != 2 + layered:
        raise ValueError(
            f"positions: expected [B, T] (or [layers, B, T]), got shape {tuple(positions.shape)}"
        )

    def locate(pos, num_pages, page_size):
        owner = jnp.arange(pos.shape[0], dtype=jnp.int32)[:, None]
        cap = pages_per_slot * page_size
        page = owner * pages_per_slot + jnp.where(pos >= 0, pos, 0) // page_size
        valid = (pos >= 0) & (pos < cap) & (page < num_pages)
        return page, page, pos % page_size, valid

    return _read(past_key_value, (positions,), (2,), locate, k_scale, v_scale, scale_pool, dtype)


def gather_kv_paged(
    past_key_value,
    kv_page_table,
    positions,
    *,
    ring: bool = False,
    k_scale=None,
    v_scale=None,
    scale_pool=None,
    dtype=jnp.float32,
) -> KV:
    """The paged contract's rows: ``positions`` int32 ``[B, T]``, row ``b`` read through table
    row ``b`` of ``kv_page_table`` ``[B, 2, M]`` (layer-batched, either optionally with a leading
    layer axis). Position ``p`` is in page slot ``i = p // P`` (``ring``: ``(p // P) % M``), K
    from ``pool[0, table[b, 0, i]]``, V from ``pool[1, table[b, 1, i] - N]``, row ``p % P``.
    Valid where the writer writes: ``p >= 0``, ``i < M``, the K id in ``[0, N)`` and the V id in
    ``[N, 2N)``."""
    if not isinstance(ring, bool):
        raise TypeError(f"ring: expected a bool, got {type(ring).__name__} {ring!r}")
    table = _int32_array("kv_page_table", kv_page_table)
    positions = _int32_array("positions", positions)
    layered = jnp.ndim(past_key_value) == 6
    if table.ndim not in (3, 3 + layered) or table.shape[-2] != 2:
        raise ValueError(
            f"kv_page_table: expected [B, 2, M] (or [layers, B, 2, M]), got shape "
            f"{tuple(table.shape)}"
        )
    if positions.ndim not in (2, 2 + layered) or positions.shape[-2] != table.shape[-3]:
        raise ValueError(
            f"positions: expected [B, T] with the table's B = {table.shape[-3]} (or "
            f"[layers, B, T]), got shape {tuple(positions.shape)}"
        )

    def locate(table, pos, num_pages, page_size):
        table_pages = table.shape[-1]
        index = jnp.where(pos >= 0, pos, 0) // page_size
        if ring and table_pages > 0:
            index = index % table_pages
        valid = (pos >= 0) & (index < table_pages)
        if table_pages == 0:
            zeros = jnp.zeros(pos.shape, jnp.int32)
            return zeros, zeros, zeros, valid
        entry = jnp.where(valid, index, 0)
        owner = jnp.arange(pos.shape[0], dtype=jnp.int32)[:, None]
        k_page = table[owner, 0, entry]
        v_page = table[owner, 1, entry] - num_pages
        valid &= (k_page >= 0) & (k_page < num_pages)
        valid &= (table[owner, 1, entry] >= num_pages) & (v_page < num_pages)
        return k_page, v_page, pos % page_size, valid

    return _read(
        past_key_value, (table, positions), (3, 2), locate, k_scale, v_scale, scale_pool, dtype
    )


def gather_kv_slots(
    past_key_value,
    slot_mapping,
    *,
    k_scale=None,
    v_scale=None,
    scale_pool=None,
    dtype=jnp.float32,
) -> KV:
    """The slot-mapping form's rows: ``slot_mapping`` int32 or int64 ``[T]`` (any shape for an
    unbatched pool; layer-batched, ``[layers, T]`` is per layer and ``[T]`` shared), K and V from
    ``pool[plane, s // P, s % P]``. Valid where ``0 <= s < N * P``."""
    index_dtype = getattr(slot_mapping, "dtype", None)
    if index_dtype is None or np.dtype(index_dtype) not in (np.int32, np.int64):
        raise TypeError(f"slot_mapping: expected an int32 or int64 array, got {index_dtype}")
    if np.dtype(index_dtype) == np.int64 and not jax.config.jax_enable_x64:
        # Converting would narrow it: a slot past 2^31 would read another row.
        raise TypeError(
            "slot_mapping: expected int32 (or int64 with jax_enable_x64 on), got int64 with "
            "jax_enable_x64 off"
        )
    slots = jnp.asarray(slot_mapping)
    if slots.ndim < 1:
        raise ValueError(f"slot_mapping: expected rank >= 1, got shape {tuple(slots.shape)}")

    def locate(s, num_pages, page_size):
        valid = (s >= 0) & (s < num_pages * page_size)
        s = jnp.where(valid, s, 0)
        page, row = (s // page_size).astype(jnp.int32), (s % page_size).astype(jnp.int32)
        return page, page, row, valid

    # Layer-batched: a [layers, T] mapping is per layer; a [T] one is shared.
    rank = 1 if slots.ndim <= 2 else slots.ndim
    return _read(past_key_value, (slots,), (rank,), locate, k_scale, v_scale, scale_pool, dtype)
