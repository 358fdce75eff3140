"""jnp helpers that build the paged contract's inputs from slot-style ones, as Edge-LLM does:
token positions and owners from per-sequence (start, length), token-aligned rope rows from a
``[Rb, S, R]`` table, and the identity page table (slot b's pages). Under these the paged op
writes exactly what the slot op writes for positions below S. All are jit-able (the sizes are
static Python ints)."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

_INT32_MAX = np.iinfo(np.int32).max


def _static_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name}: expected a static Python int, got {type(value).__name__} {value!r}"
        )
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


def _int32_array(name, x, rank=None):
    dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else None
    if dtype != np.int32:
        raise TypeError(
            f"{name}: expected an int32 array, got "
            f"{dtype if dtype is not None else type(x).__name__}"
        )
    if rank is not None and len(x.shape) != rank:
        raise ValueError(f"{name}: expected rank {rank}, got shape {tuple(x.shape)}")
    return jnp.asarray(x)


def token_positions(start_positions, lengths, width: int) -> tuple[jax.Array, jax.Array]:
    """``(delta_positions, delta_token_to_sequence)``, int32 ``[B * width]``, from int32
    ``start_positions`` and ``lengths`` ``[B]`` (or ``[..., B]``, giving ``[..., B * width]``):
    token ``b * width + t`` is at position ``start_positions[b] + t`` of sequence ``b`` when
    ``t < lengths[b]``; otherwise both entries are -1 (padding). A position past the int32 range
    is marked -1 too (it cannot be written)."""
    width = _static_int("width", width, 0)
    starts = _int32_array("start_positions", start_positions)
    lengths = _int32_array("lengths", lengths)
    if starts.ndim < 1:
        raise ValueError(
            f"start_positions: expected shape [B] or [..., B] (rank >= 1), got {tuple(starts.shape)}"
        )
    if lengths.shape != starts.shape:
        raise ValueError(
            f"lengths: expected start_positions' shape {tuple(starts.shape)}, got {tuple(lengths.shape)}"
        )
    batch = starts.shape[-1]
    t = jnp.arange(width, dtype=jnp.int32)
    owner = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], (batch, width))
    valid = (t < lengths[..., None]) & (starts[..., None] <= _INT32_MAX - t)
    positions = jnp.where(valid, starts[..., None] + t, -1)
    owners = jnp.where(valid, owner, -1)
    flat = (*starts.shape[:-1], batch * width)
    return positions.reshape(flat), owners.reshape(flat)


def gather_rope(rope_cos_sin, delta_positions, delta_token_to_sequence) -> jax.Array:
    """Token-aligned rope rows ``[T, R]`` float32 from a ``[Rb, S, R]`` table: row
    ``rope_cos_sin[0 if Rb == 1 else owner, position]``, or zeros where the position is negative
    or ``>= S``, or the token is padding (owner < 0, or owner >= Rb when Rb > 1)."""
    rope = jnp.asarray(rope_cos_sin)
    if rope.dtype != jnp.float32:
        raise TypeError(f"rope_cos_sin: expected dtype float32, got {rope.dtype}")
    if rope.ndim != 3:
        raise ValueError(
            f"rope_cos_sin: expected shape [Rb, S, R] (rank 3), got {tuple(rope.shape)}"
        )
    positions = _int32_array("delta_positions", delta_positions, 1)
    owners = _int32_array("delta_token_to_sequence", delta_token_to_sequence, 1)
    if owners.shape != positions.shape:
        raise ValueError(
            f"delta_token_to_sequence: expected delta_positions' shape "
            f"{tuple(positions.shape)}, got {tuple(owners.shape)}"
        )
    rope_batch, seq_len, rotary_dim = rope.shape
    valid = (owners >= 0) & (positions >= 0) & (positions < seq_len)
    if rope_batch > 1:
        valid &= owners < rope_batch
    if rope_batch == 0 or seq_len == 0:
        return jnp.zeros((positions.shape[0], rotary_dim), jnp.float32)
    rb = jnp.zeros_like(owners) if rope_batch == 1 else jnp.where(valid, owners, 0)
    rows = rope[rb, jnp.where(valid, positions, 0)]
    return jnp.where(valid[:, None], rows, jnp.float32(0))


def identity_page_table(batch: int, pages_per_slot: int, num_pages: int) -> jax.Array:
    """``[batch, 2, pages_per_slot]`` int32: sequence ``b``'s K pages are the slot contract's
    ``b * pages_per_slot + i``, its V ids the same plus ``num_pages`` (the paged contract's V
    offset)."""
    batch = _static_int("batch", batch, 0)
    pages_per_slot = _static_int("pages_per_slot", pages_per_slot, 1)
    num_pages = _static_int("num_pages", num_pages, 1)
    if batch * pages_per_slot > num_pages:
        raise ValueError(
            f"num_pages: expected at least batch * pages_per_slot = "
            f"{batch * pages_per_slot} pages, got {num_pages}"
        )
    if 2 * num_pages > _INT32_MAX + 1:
        raise ValueError(
            f"num_pages: expected V ids (up to 2 * num_pages - 1) to fit int32, got {num_pages}"
        )
    pages = jnp.arange(batch * pages_per_slot, dtype=jnp.int32).reshape(batch, pages_per_slot)
    return jnp.stack([pages, pages + num_pages], axis=1)


def gather_kv(
    past_key_value, kv_page_table, *, k_scale=None, v_scale=None, dtype=jnp.float32
) -> tuple[jax.Array, jax.Array]:
    """The read side: each sequence's K and V, ``[B, M * P, H, D]`` in ``dtype``, gathered from
    the pool ``[2, N, P, H, D]`` through its page table ``[B, 2, M]`` (the paged contract's; for
    the slot contract, ``identity_page_table``) and dequantized.

    Row ``i * P + r`` of sequence ``b`` is row ``r`` of its ``i``-th page: K from
    ``pool[0, table[b, 0, i]]``, V from ``pool[1, table[b, 1, i] - N]``. A page id outside its
    plane's range reads as zeros (so a padded or ring table is safe to read); which rows hold
    written tokens is the caller's to know (its lengths, or the ring's window). A pool format
    with scales is read as ``float32(stored) * scale`` (``k_scale``/``v_scale`` as the op took
    them: ``[]``/``[1]`` per tensor or ``[H]`` per KV head), then cast to ``dtype``."""
    from jax_dflash._shapes import DYNAMIC_ONLY_DTYPES, takes_scales

    pool = jnp.asarray(past_key_value)
    if pool.ndim != 5 or pool.shape[0] != 2:
        raise ValueError(
            f"past_key_value: expected [2, N, P, H, D] (one layer), got shape {tuple(pool.shape)}"
        )
    table = _int32_array("kv_page_table", kv_page_table, 3)
    if table.shape[1] != 2:
        raise ValueError(f"kv_page_table: expected [B, 2, M], got shape {tuple(table.shape)}")
    if np.dtype(pool.dtype) in DYNAMIC_ONLY_DTYPES:
        raise ValueError(
            "past_key_value: gather_kv reads pools with static scales or none, got an int4 "
            "pool (uint8), which is read with its scale pool: use gather_kv_paged(pool, "
            "kv_page_table, positions, scale_pool=...)"
        )
    _, num_pages, page_size, heads, head_dim = pool.shape
    scaled = takes_scales(pool.dtype)
    if scaled != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError(
            f"k_scale, v_scale: a {pool.dtype} pool is read "
            + ("with both" if scaled else "with neither")
            + f", got k_scale {'None' if k_scale is None else 'given'} and v_scale "
            + ("None" if v_scale is None else "given")
        )

    def plane(index, ids, scale):
        valid = (ids >= 0) & (ids < num_pages)
        pages = pool[index][jnp.where(valid, ids, 0)]  # [B, M, P, H, D]
        values = pages.astype(jnp.float32)
        if scale is not None:
            scale = jnp.asarray(scale, jnp.float32).reshape(-1)  # [1] or [H]
            values = values * scale[:, None]
        values = jnp.where(valid[..., None, None, None], values, jnp.float32(0))
        return values.reshape(ids.shape[0], -1, heads, head_dim).astype(dtype)

    return plane(0, table[:, 0], k_scale), plane(1, table[:, 1] - num_pages, v_scale)


def slots_from_pages(
    delta_positions,
    delta_token_to_sequence,
    kv_page_table,
    num_pages: int,
    page_size: int,
    *,
    ring=False,
) -> jax.Array:
    """``[T]`` int32 flat slots (``page * P + row``; -1: nothing written) of the paged contract's
    tokens: what ``target_kv_cache_update_slots`` needs to write what
    ``target_kv_cache_update_paged`` writes, for tables whose V page is its K page (V id = K id +
    N, as ``identity_page_table`` and vLLM's caches have). The paged rules decide which tokens
    are written: owner in ``[0, B)``, position >= 0, page index in the table (or ``ring``), K id
    in ``[0, N)`` and V id in ``[N, 2N)``."""
    positions = _int32_array("delta_positions", delta_positions, 1)
    owners = _int32_array("delta_token_to_sequence", delta_token_to_sequence, 1)
    table = _int32_array("kv_page_table", kv_page_table, 3)
    num_pages = _static_int("num_pages", num_pages, 1)
    page_size = _static_int("page_size", page_size, 1)
    if num_pages * page_size > _INT32_MAX:
        raise ValueError(
            f"num_pages, page_size: expected N * P < 2^31 rows a plane for int32 slots, got "
            f"{num_pages} * {page_size}"
        )
    batch, _, table_pages = table.shape
    index = positions // page_size
    if ring and table_pages > 0:
        index = index % table_pages
    valid = (owners >= 0) & (owners < batch) & (positions >= 0) & (index < table_pages)
    owner, entry = jnp.where(valid, owners, 0), jnp.where(valid, index, 0)
    k_page, v_page = table[owner, 0, entry], table[owner, 1, entry]
    valid &= (k_page >= 0) & (k_page < num_pages) & (v_page >= num_pages)
    valid &= v_page - num_pages < num_pages
    return jnp.where(valid, k_page * page_size + positions % page_size, -1).astype(jnp.int32)
