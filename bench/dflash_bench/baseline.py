"""The straightforward JAX version of the update: what a JAX user writes without this project.

jnp RoPE on the keys, then a scatter with ``.at[].set(mode="drop")``. It has the same semantics
as the kernel on valid inputs (padding, pass-through past S, dropping past the slot and negative
positions) and is the benchmark's ``jax_baseline`` contender. (``jax-dflash run --compare``
has its own, over a whole decode step: jax_dflash/cli/pipeline.py.)
"""

from __future__ import annotations

import jax.numpy as jnp


def target_kv_cache_update(
    k_delta,
    v_delta,
    past_key_value,
    rope_cos_sin,
    delta_start_positions,
    delta_lengths,
    *,
    pages_per_slot: int,
):
    """Same result as :func:`jax_dflash.target_kv_cache_update` (unbatched form, 16/32-bit pool
    of the delta dtype, no fused norm)."""
    batch, delta_len, heads, head_dim = k_delta.shape
    _, num_pages, page_size, _, _ = past_key_value.shape
    rope_batch, rope_seq_len, rotary_dim = rope_cos_sin.shape
    capacity = pages_per_slot * page_size
    half = rotary_dim // 2

    t = jnp.arange(delta_len, dtype=jnp.int32)
    pos = delta_start_positions[:, None] + t[None, :]  # [B, L]
    valid = (t[None, :] < delta_lengths[:, None]) & (pos >= 0) & (pos < capacity)

    rows = jnp.broadcast_to(rope_cos_sin, (batch, rope_seq_len, rotary_dim))
    table = (
        jnp.take_along_axis(rows, jnp.clip(pos, 0, max(rope_seq_len - 1, 0))[..., None], axis=1)
        if rope_seq_len
        else jnp.zeros((batch, delta_len, rotary_dim))
    )
    cos = table[..., None, :half]  # [B, L, 1, R/2]
    sin = table[..., None, half:]
    k = k_delta.astype(jnp.float32)
    x1, x2 = k[..., :half], k[..., half:rotary_dim]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, k[..., rotary_dim:]], -1)
    k_out = jnp.where((pos < rope_seq_len)[..., None, None], rotated, k).astype(k_delta.dtype)

    slot = jnp.arange(batch, dtype=jnp.int32)[:, None]
    flat_row = jnp.where(valid, slot * capacity + pos, num_pages * page_size)  # OOB -> dropped
    pool = past_key_value.reshape(2, num_pages * page_size, heads, head_dim)
    pool = pool.at[0, flat_row].set(k_out, mode="drop")
    pool = pool.at[1, flat_row].set(v_delta, mode="drop")
    return pool.reshape(past_key_value.shape)
