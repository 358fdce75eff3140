"""A NumPy reference of the update that follows SPEC.md literally.

float32 arithmetic, products and sums rounded separately, one rounding to the pool dtype; the
slot -> page -> row mapping and the guards mirror ``csrc/dflash/kv_update.h``. Slow on purpose:
it is for tests and for checking results, not for serving.
"""

from __future__ import annotations

import numpy as np

from jax_dflash._shapes import check_update


def written_position(start: int, length: int, t: int, capacity: int) -> int | None:
    """Where token t lands in its slot, or None when nothing is written (SPEC.md 1-2)."""
    if t >= length:
        return None  # padding
    pos = int(start) + t
    if pos < 0 or pos >= capacity:
        return None  # negative, or dropped past the slot
    return pos


def rotate_half(x: np.ndarray, cos_sin_row: np.ndarray, rotary_dim: int) -> np.ndarray:
    """Rotate-half RoPE on the first ``rotary_dim`` channels of ``x`` [..., D], in float32."""
    half = rotary_dim // 2
    y = x.astype(np.float32, copy=True)
    x1 = y[..., :half].copy()
    x2 = y[..., half:rotary_dim].copy()
    c = cos_sin_row[:half].astype(np.float32)
    s = cos_sin_row[half:rotary_dim].astype(np.float32)
    y[..., :half] = x1 * c - x2 * s
    y[..., half:rotary_dim] = x2 * c + x1 * s
    return y


def _update_one_layer(k_delta, v_delta, pool, rope_cos_sin, starts, lengths, pages_per_slot):
    page_size = pool.shape[2]
    capacity = pages_per_slot * page_size
    rope_batch, rope_seq_len, rotary_dim = rope_cos_sin.shape
    batch, delta_len = k_delta.shape[:2]
    for b in range(batch):
        for t in range(delta_len):
            pos = written_position(starts[b], lengths[b], t, capacity)
            if pos is None:
                continue
            page = b * pages_per_slot + pos // page_size
            row = pos % page_size
            k = k_delta[b, t]  # [H, D]
            if pos < rope_seq_len:
                rb = 0 if rope_batch == 1 else b
                k = rotate_half(k, rope_cos_sin[rb, pos], rotary_dim).astype(pool.dtype)
            pool[0, page, row] = k
            pool[1, page, row] = v_delta[b, t]


def target_kv_cache_update(
    k_delta, v_delta, past_key_value, rope_cos_sin, delta_start_positions, delta_lengths,
    *, pages_per_slot: int,
) -> np.ndarray:
    """Returns a new pool: ``past_key_value`` with the accepted tokens written (SPEC.md).

    Accepts the unbatched and the layer-batched forms of
    :func:`jax_dflash.target_kv_cache_update`; the input pool is not modified.
    """
    args = [np.asarray(a) for a in (k_delta, v_delta, past_key_value, rope_cos_sin,
                                    delta_start_positions, delta_lengths)]
    shape = check_update(*args, pages_per_slot)
    k, v, pool, rope, starts, lengths = args
    out = pool.copy()
    if shape.num_layers is None:
        _update_one_layer(k, v, out, rope, starts, lengths, shape.pages_per_slot)
        return out
    for layer in range(shape.num_layers):
        _update_one_layer(
            k[layer], v[layer], out[layer],
            rope[layer] if shape.rope_per_layer else rope,
            starts[layer] if shape.positions_per_layer else starts,
            lengths[layer] if shape.positions_per_layer else lengths,
            shape.pages_per_slot,
        )
    return out
