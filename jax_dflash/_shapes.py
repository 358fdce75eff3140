"""Every shape, dtype and attribute check of the update, in one place.

Used by the primitive's abstract evaluation (so errors come at trace time), by the NumPy
reference and by the command line. Errors name the argument, what was expected and what was
given. The runtime-data guards (positions, lengths) live with the kernels: see
``csrc/dflash/kv_update.h``.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

try:  # bfloat16 comes with jax (ml_dtypes); the reference also works without it.
    from ml_dtypes import bfloat16 as _bfloat16
except ImportError:  # pragma: no cover
    _bfloat16 = None

POOL_DTYPES = tuple(
    np.dtype(d) for d in (np.float16, _bfloat16, np.float32) if d is not None
)
ARG_NAMES = (
    "k_delta",
    "v_delta",
    "past_key_value",
    "rope_cos_sin",
    "delta_start_positions",
    "delta_lengths",
)


@dataclasses.dataclass(frozen=True)
class UpdateShape:
    """The sizes of one update (SPEC.md's names). ``num_layers`` is None when unbatched."""

    num_layers: int | None
    batch: int  # B
    delta_len: int  # L
    num_kv_heads: int  # H
    head_dim: int  # D
    num_pages: int
    page_size: int  # P
    pages_per_slot: int
    rotary_dim: int  # R
    rope_batch: int  # Rb
    rope_seq_len: int  # S
    rope_per_layer: bool
    positions_per_layer: bool
    dtype: np.dtype

    @property
    def max_batch(self) -> int:
        return self.num_pages // self.pages_per_slot

    @property
    def slot_capacity(self) -> int:
        return self.pages_per_slot * self.page_size


def _shape(x) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def check_pages_per_slot(pages_per_slot) -> int:
    if isinstance(pages_per_slot, (bool, np.bool_)) or not isinstance(
        pages_per_slot, (int, np.integer)
    ):
        raise TypeError(
            "pages_per_slot: expected a static Python int > 0, "
            f"got {type(pages_per_slot).__name__} {pages_per_slot!r}"
        )
    pages_per_slot = operator.index(pages_per_slot)
    if pages_per_slot <= 0:
        raise ValueError(f"pages_per_slot: expected an int > 0, got {pages_per_slot}")
    return pages_per_slot


def check_update(
    k_delta, v_delta, past_key_value, rope_cos_sin, delta_start_positions, delta_lengths,
    pages_per_slot,
) -> UpdateShape:
    """Checks the operands (anything with .shape and .dtype) and returns their sizes.

    Unbatched: k/v ``[B, L, H, D]``, pool ``[2, numPages, P, H, D]``, rope ``[Rb, S, R]``,
    positions and lengths ``[B]``. Layer-batched: a leading ``layers`` axis on k/v/pool, and
    optionally on rope (``[layers, Rb, S, R]``) and positions/lengths (``[layers, B]``).
    """
    pages_per_slot = check_pages_per_slot(pages_per_slot)
    pool = _shape(past_key_value)
    if len(pool) not in (5, 6):
        raise ValueError(
            "past_key_value: expected rank 5 [2, numPages, P, H, D] (or rank 6 with a leading "
            f"layers axis), got shape {pool}"
        )
    layered = len(pool) == 6
    lead = 1 if layered else 0
    num_layers = pool[0] if layered else None
    layers_txt = "[layers, " if layered else "["
    if pool[lead] != 2:
        raise ValueError(
            f"past_key_value: expected dim {lead} == 2 (K and V planes), got shape {pool}"
        )
    num_pages, page_size, heads, head_dim = pool[lead + 1 :]
    if page_size <= 0:
        raise ValueError(f"past_key_value: expected page size P (dim {lead + 2}) > 0, got {pool}")

    dtype = np.dtype(past_key_value.dtype)
    for name, x in (("k_delta", k_delta), ("v_delta", v_delta), ("past_key_value", past_key_value)):
        if np.dtype(x.dtype) not in POOL_DTYPES:
            raise TypeError(
                f"{name}: expected dtype float16, bfloat16 or float32, got {np.dtype(x.dtype)}"
            )
    for name, x in (("k_delta", k_delta), ("v_delta", v_delta)):
        if np.dtype(x.dtype) != dtype:
            raise TypeError(
                f"{name}: expected the pool's dtype {dtype} (k, v and the pool must agree), "
                f"got {np.dtype(x.dtype)}"
            )

    k = _shape(k_delta)
    if len(k) != 4 + lead:
        raise ValueError(
            f"k_delta: expected rank {4 + lead} {layers_txt}B, L, H, D], got shape {k}"
        )
    if _shape(v_delta) != k:
        raise ValueError(f"v_delta: expected k_delta's shape {k}, got {_shape(v_delta)}")
    if layered and k[0] != num_layers:
        raise ValueError(
            f"k_delta: expected {num_layers} layers (past_key_value dim 0), got shape {k}"
        )
    batch, delta_len = k[lead], k[lead + 1]
    if k[lead + 2 :] != (heads, head_dim):
        raise ValueError(
            f"k_delta: expected H, D = {heads}, {head_dim} (from past_key_value {pool}), "
            f"got shape {k}"
        )
    if num_pages % pages_per_slot:
        raise ValueError(
            f"past_key_value: numPages (dim {lead + 1}) = {num_pages} is not divisible by "
            f"pages_per_slot = {pages_per_slot}"
        )
    max_batch = num_pages // pages_per_slot
    if batch > max_batch:
        raise ValueError(
            f"k_delta: batch B = {batch} is larger than the pool's {max_batch} slots "
            f"(numPages {num_pages} / pages_per_slot {pages_per_slot})"
        )

    if np.dtype(rope_cos_sin.dtype) != np.float32:
        raise TypeError(f"rope_cos_sin: expected dtype float32, got {np.dtype(rope_cos_sin.dtype)}")
    rope = _shape(rope_cos_sin)
    if len(rope) == 3 or (layered and len(rope) == 4):
        rope_per_layer = len(rope) == 4
    else:
        expected = "rank 3 [Rb, S, R]" + (" or rank 4 [layers, Rb, S, R]" if layered else "")
        raise ValueError(f"rope_cos_sin: expected {expected}, got shape {rope}")
    if rope_per_layer and rope[0] != num_layers:
        raise ValueError(f"rope_cos_sin: expected {num_layers} layers, got shape {rope}")
    rope_batch, rope_seq_len, rotary_dim = rope[-3:]
    if rope_batch not in (1, batch):
        raise ValueError(f"rope_cos_sin: expected batch 1 or B = {batch}, got shape {rope}")
    capacity = pages_per_slot * page_size
    if rope_seq_len > capacity:
        raise ValueError(
            f"rope_cos_sin: length S = {rope_seq_len} is larger than the slot capacity "
            f"pages_per_slot * P = {capacity}"
        )
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"rope_cos_sin: rotary dim R = {rotary_dim} must be even and <= head dim D = "
            f"{head_dim}"
        )

    positions_per_layer = None
    for name, x in (("delta_start_positions", delta_start_positions), ("delta_lengths", delta_lengths)):
        if np.dtype(x.dtype) != np.int32:
            raise TypeError(f"{name}: expected dtype int32, got {np.dtype(x.dtype)}")
        s = _shape(x)
        per_layer = layered and len(s) == 2
        if s != (batch,) and not (per_layer and s == (num_layers, batch)):
            expected = f"[{batch}]" + (f" or [{num_layers}, {batch}]" if layered else "")
            raise ValueError(f"{name}: expected shape {expected}, got {s}")
        if positions_per_layer is not None and per_layer != positions_per_layer:
            raise ValueError(
                "delta_lengths: expected the same layout as delta_start_positions "
                f"({_shape(delta_start_positions)}), got {s}"
            )
        positions_per_layer = per_layer

    return UpdateShape(
        num_layers=num_layers, batch=batch, delta_len=delta_len, num_kv_heads=heads,
        head_dim=head_dim, num_pages=num_pages, page_size=page_size,
        pages_per_slot=pages_per_slot, rotary_dim=rotary_dim, rope_batch=rope_batch,
        rope_seq_len=rope_seq_len, rope_per_layer=rope_per_layer,
        positions_per_layer=bool(positions_per_layer), dtype=dtype,
    )
