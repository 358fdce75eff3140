"""Every shape, dtype and attribute check of both update contracts, in one place.

Used by the primitives' abstract evaluation (so errors come at trace time), by the NumPy
reference, the sharding rules and the command line. Errors name the argument, what was expected
and what was given. The runtime-data guards (positions, lengths, owners, page ids) live with the
kernels (SPEC.md, "Runtime data never writes out of bounds").
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator

import numpy as np

try:  # bfloat16 and the FP8 dtypes come with jax (ml_dtypes); the reference needs them too.
    import ml_dtypes as _ml
except ImportError:  # pragma: no cover
    _ml = None

_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)
_BF16 = np.dtype(_ml.bfloat16) if _ml else None
DELTA_DTYPES = tuple(d for d in (_F16, _BF16, _F32) if d is not None)
FP8_DTYPES = (np.dtype(_ml.float8_e4m3fn), np.dtype(_ml.float8_e5m2)) if _ml else ()
POOL_DTYPES = DELTA_DTYPES + FP8_DTYPES
INDEX_DTYPE = np.dtype(np.int32)

ARG_NAMES = (
    "k_delta",
    "v_delta",
    "past_key_value",
    "rope_cos_sin",
    "delta_start_positions",
    "delta_lengths",
)
PAGED_ARG_NAMES = (
    "k_delta",
    "v_delta",
    "past_key_value",
    "rope_cos_sin",
    "delta_positions",
    "delta_token_to_sequence",
    "kv_page_table",
)
EXTRA_NAMES = ("k_scale", "v_scale", "k_norm_weight")

INT64_MAX = 2**63 - 1


def _names(dtypes) -> str:
    names = [str(d) for d in dtypes]
    return ", ".join(names[:-1]) + " or " + names[-1]


@dataclasses.dataclass(frozen=True)
class Extras:
    """The optional operands: FP8 scales and the k-norm weight, as given."""

    scale_shape: tuple[int, ...] | None  # None: a 16/32-bit pool, no scales
    scales_per_layer: bool
    k_norm: bool
    norm_weight_per_layer: bool

    @property
    def scales_per_head(self) -> bool:
        """Whether the scales have one entry per KV head (``[H]`` or ``[layers, H]``); a
        per-tensor scale is ``[]``, ``[1]`` or ``[layers, 1]``. With H == 1 both read alike."""
        return bool(self.scale_shape) and self._heads_entry > 1

    _heads_entry: int = 1


@dataclasses.dataclass(frozen=True)
class _Common:
    num_layers: int | None
    num_kv_heads: int  # H
    head_dim: int  # D
    num_pages: int  # N
    page_size: int  # P
    rotary_dim: int  # R
    rope_per_layer: bool
    positions_per_layer: bool
    delta_dtype: np.dtype
    pool_dtype: np.dtype
    extras: Extras

    @property
    def dtype(self) -> np.dtype:
        """The pool's dtype (the stored one)."""
        return self.pool_dtype

    @property
    def fp8(self) -> bool:
        return self.pool_dtype in FP8_DTYPES

    @property
    def k_norm(self) -> bool:
        return self.extras.k_norm

    @property
    def scale_shape(self) -> tuple[int, ...] | None:
        return self.extras.scale_shape


@dataclasses.dataclass(frozen=True)
class UpdateShape(_Common):
    """The sizes of one slot-contract update (SPEC.md's names). ``num_layers`` is None when
    unbatched."""

    batch: int = 0  # B
    delta_len: int = 0  # L
    pages_per_slot: int = 1
    rope_batch: int = 1  # Rb
    rope_seq_len: int = 0  # S

    @property
    def max_batch(self) -> int:
        return self.num_pages // self.pages_per_slot

    @property
    def slot_capacity(self) -> int:
        return self.pages_per_slot * self.page_size


@dataclasses.dataclass(frozen=True)
class PagedShape(_Common):
    """The sizes of one paged-contract update (SPEC.md's names). ``positions_per_layer`` covers
    both ``delta_positions`` and ``delta_token_to_sequence``."""

    tokens: int = 0  # T
    batch: int = 0  # B (rows of the page table)
    table_pages: int = 0  # M
    table_per_layer: bool = False


def _shape(name, x) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in x.shape)
    except AttributeError:
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}") from None


def _dtype(name, x) -> np.dtype:
    try:
        return np.dtype(x.dtype)
    except AttributeError:
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}") from None


def check_int_attr(name: str, value, *, maximum: int = INT64_MAX) -> int:
    """A static Python int in ``[1, maximum]`` (a NumPy integer is accepted, a bool is not)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{name}: expected a static Python int > 0, got {type(value).__name__} {value!r}"
        )
    value = operator.index(value)
    if value <= 0:
        raise ValueError(f"{name}: expected an int > 0, got {value}")
    if value > maximum:
        raise ValueError(
            f"{name}: expected an int <= {maximum} (it is an int64 attribute), got {value}"
        )
    return value


def check_pages_per_slot(pages_per_slot) -> int:
    return check_int_attr("pages_per_slot", pages_per_slot)


def check_bool_attr(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a static bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_norm_eps(norm_eps) -> float:
    """A finite float > 0 that stays finite and > 0 in float32 (the attribute's type)."""
    if isinstance(norm_eps, (bool, np.bool_)) or not isinstance(
        norm_eps, (int, float, np.integer, np.floating)
    ):
        raise TypeError(
            f"norm_eps: expected a static Python float > 0, got {type(norm_eps).__name__} "
            f"{norm_eps!r}"
        )
    return _checked_eps(float(norm_eps))


@functools.lru_cache(maxsize=64)
def _checked_eps(value: float) -> float:
    # Cached: every eager call checks it, and the float32 round trip is slow in NumPy.
    with np.errstate(over="ignore", under="ignore"):
        as_f32 = float(np.float32(value))
    if not (math.isfinite(value) and value > 0 and math.isfinite(as_f32) and as_f32 > 0):
        raise ValueError(
            f"norm_eps: expected a finite float > 0 (also once rounded to float32), got {value!r}"
        )
    return value


def _check_pool(pool_arr):
    pool = _shape("past_key_value", pool_arr)
    if len(pool) not in (5, 6):
        raise ValueError(
            "past_key_value: expected rank 5 [2, numPages, P, H, D] (or rank 6 with a leading "
            f"layers axis), got shape {pool}"
        )
    layered = len(pool) == 6
    lead = 1 if layered else 0
    if pool[lead] != 2:
        raise ValueError(
            f"past_key_value: expected dim {lead} == 2 (K and V planes), got shape {pool}"
        )
    if pool[lead + 2] <= 0:
        raise ValueError(
            f"past_key_value: expected page size P (dim {lead + 2}) > 0, got shape {pool}"
        )
    pool_dtype = _dtype("past_key_value", pool_arr)
    if pool_dtype not in POOL_DTYPES:
        raise TypeError(f"past_key_value: expected dtype {_names(POOL_DTYPES)}, got {pool_dtype}")
    # The kernels address the pool with 64-bit offsets (the native checks refuse the same).
    if math.prod(pool) * pool_dtype.itemsize > INT64_MAX:
        raise ValueError(
            f"past_key_value: its size in bytes overflows int64 (shape {pool}, {pool_dtype})"
        )
    return pool, layered, lead, pool_dtype


def _check_deltas(k_delta, v_delta, rank, layers_txt, dims_txt, num_layers, heads, head_dim, pool):
    delta_dtype = _dtype("k_delta", k_delta)
    if delta_dtype not in DELTA_DTYPES:
        raise TypeError(f"k_delta: expected dtype {_names(DELTA_DTYPES)}, got {delta_dtype}")
    v_dtype = _dtype("v_delta", v_delta)
    if v_dtype != delta_dtype:
        raise TypeError(
            f"v_delta: expected k_delta's dtype {delta_dtype} (k and v must agree), got {v_dtype}"
        )
    k = _shape("k_delta", k_delta)
    if len(k) != rank:
        raise ValueError(f"k_delta: expected rank {rank} {layers_txt}{dims_txt}], got shape {k}")
    v = _shape("v_delta", v_delta)
    if v != k:
        raise ValueError(f"v_delta: expected k_delta's shape {k}, got {v}")
    if num_layers is not None and k[0] != num_layers:
        raise ValueError(
            f"k_delta: expected {num_layers} layers (past_key_value dim 0), got shape {k}"
        )
    if k[-2:] != (heads, head_dim):
        raise ValueError(
            f"k_delta: expected H, D = {heads}, {head_dim} (from past_key_value {pool}), "
            f"got shape {k}"
        )
    return k, delta_dtype


def _check_rotary(rotary_dim, head_dim):
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"rope_cos_sin: rotary dim R = {rotary_dim} must be even and <= head dim D = {head_dim}"
        )


def _check_float32(name, x):
    dtype = _dtype(name, x)
    if dtype != np.float32:
        raise TypeError(f"{name}: expected dtype float32, got {dtype}")


def _check_index_pair(names, arrays, base_shape, num_layers, base_txt):
    """Two int32 index operands sharing one layout: ``base_shape`` or ``[layers, *base]``."""
    per_layer_seen = None
    for name, x in zip(names, arrays):
        dtype = _dtype(name, x)
        if dtype != INDEX_DTYPE:
            raise TypeError(f"{name}: expected dtype int32, got {dtype}")
        s = _shape(name, x)
        per_layer = num_layers is not None and s == (num_layers, *base_shape)
        if s != base_shape and not per_layer:
            expected = base_txt + (
                f" or [{num_layers}, {base_txt[1:]}" if num_layers is not None else ""
            )
            raise ValueError(f"{name}: expected shape {expected}, got {s}")
        if per_layer_seen is not None and per_layer != per_layer_seen:
            raise ValueError(
                f"{name}: expected the same layout as {names[0]} "
                f"({_shape(names[0], arrays[0])}), got {s}"
            )
        per_layer_seen = per_layer
    return bool(per_layer_seen)


def _check_extras(
    k_scale, v_scale, k_norm_weight, *, pool_dtype, delta_dtype, heads, head_dim, num_layers
) -> Extras:
    layered = num_layers is not None
    scale_shape = None
    scales_per_layer = False
    heads_entry = 1
    if pool_dtype in FP8_DTYPES:
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            if x is None:
                raise ValueError(
                    f"{name}: a {pool_dtype} pool needs k_scale and v_scale (float32, [] or [1] "
                    f"per tensor, [{heads}] per KV head), got None"
                )
        allowed = [(), (1,), (heads,)]
        if layered:
            allowed += [(num_layers, 1), (num_layers, heads)]
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            _check_float32(name, x)
            s = _shape(name, x)
            if s not in allowed:
                raise ValueError(
                    f"{name}: expected shape {' or '.join(str(list(a)) for a in allowed)} "
                    f"(per tensor or per KV head{', shared or per layer' if layered else ''}), "
                    f"got {s}"
                )
        scale_shape = _shape("k_scale", k_scale)
        v_shape = _shape("v_scale", v_scale)
        if v_shape != scale_shape:
            raise ValueError(f"v_scale: expected k_scale's shape {scale_shape}, got {v_shape}")
        scales_per_layer = len(scale_shape) == 2
        heads_entry = scale_shape[-1] if scale_shape else 1
    else:
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            if x is not None:
                raise ValueError(
                    f"{name}: scales are for FP8 pools ({_names(FP8_DTYPES)}); the pool is "
                    f"{pool_dtype}, so expected None, got an array of shape {_shape(name, x)}"
                )
    norm_weight_per_layer = False
    if k_norm_weight is not None:
        dtype = _dtype("k_norm_weight", k_norm_weight)
        if dtype != delta_dtype:
            raise TypeError(f"k_norm_weight: expected the delta dtype {delta_dtype}, got {dtype}")
        s = _shape("k_norm_weight", k_norm_weight)
        norm_weight_per_layer = layered and s == (num_layers, head_dim)
        if s != (head_dim,) and not norm_weight_per_layer:
            expected = f"[{head_dim}]" + (f" or [{num_layers}, {head_dim}]" if layered else "")
            raise ValueError(f"k_norm_weight: expected shape {expected} (D = {head_dim}), got {s}")
    return Extras(
        scale_shape=scale_shape,
        scales_per_layer=scales_per_layer,
        k_norm=k_norm_weight is not None,
        norm_weight_per_layer=norm_weight_per_layer,
        _heads_entry=heads_entry,
    )


def check_update(
    k_delta,
    v_delta,
    past_key_value,
    rope_cos_sin,
    delta_start_positions,
    delta_lengths,
    pages_per_slot,
    *,
    k_scale=None,
    v_scale=None,
    k_norm_weight=None,
) -> UpdateShape:
    """Checks the slot-contract operands (anything with .shape and .dtype); returns their sizes.

    Unbatched: k/v ``[B, L, H, D]``, pool ``[2, numPages, P, H, D]``, rope ``[Rb, S, R]``,
    positions and lengths ``[B]``. Layer-batched: a leading ``layers`` axis on k/v/pool, and
    optionally on rope (``[layers, Rb, S, R]``), positions/lengths (``[layers, B]``), the scales
    (``[layers, 1]``/``[layers, H]``) and the k-norm weight (``[layers, D]``).
    """
    pages_per_slot = check_pages_per_slot(pages_per_slot)
    pool, layered, lead, pool_dtype = _check_pool(past_key_value)
    num_layers = pool[0] if layered else None
    num_pages, page_size, heads, head_dim = pool[lead + 1 :]
    k, delta_dtype = _check_deltas(
        k_delta,
        v_delta,
        4 + lead,
        "[layers, " if layered else "[",
        "B, L, H, D",
        num_layers,
        heads,
        head_dim,
        pool,
    )
    batch, delta_len = k[lead], k[lead + 1]
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

    _check_float32("rope_cos_sin", rope_cos_sin)
    rope = _shape("rope_cos_sin", rope_cos_sin)
    if not (len(rope) == 3 or (layered and len(rope) == 4)):
        expected = "rank 3 [Rb, S, R]" + (" or rank 4 [layers, Rb, S, R]" if layered else "")
        raise ValueError(f"rope_cos_sin: expected {expected}, got shape {rope}")
    rope_per_layer = len(rope) == 4
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
    _check_rotary(rotary_dim, head_dim)

    positions_per_layer = _check_index_pair(
        ("delta_start_positions", "delta_lengths"),
        (delta_start_positions, delta_lengths),
        (batch,),
        num_layers,
        f"[{batch}]",
    )
    extras = _check_extras(
        k_scale,
        v_scale,
        k_norm_weight,
        pool_dtype=pool_dtype,
        delta_dtype=delta_dtype,
        heads=heads,
        head_dim=head_dim,
        num_layers=num_layers,
    )
    return UpdateShape(
        num_layers=num_layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        num_pages=num_pages,
        page_size=page_size,
        rotary_dim=rotary_dim,
        rope_per_layer=rope_per_layer,
        positions_per_layer=positions_per_layer,
        delta_dtype=delta_dtype,
        pool_dtype=pool_dtype,
        extras=extras,
        batch=batch,
        delta_len=delta_len,
        pages_per_slot=pages_per_slot,
        rope_batch=rope_batch,
        rope_seq_len=rope_seq_len,
    )


def check_update_paged(
    k_delta,
    v_delta,
    past_key_value,
    rope_cos_sin,
    delta_positions,
    delta_token_to_sequence,
    kv_page_table,
    *,
    k_scale=None,
    v_scale=None,
    k_norm_weight=None,
) -> PagedShape:
    """Checks the paged-contract operands (anything with .shape and .dtype); returns their sizes.

    Unbatched: k/v ``[T, H, D]``, pool ``[2, N, P, H, D]``, rope ``[T, R]``, positions and owners
    ``[T]``, page table ``[B, 2, M]`` with ``M <= N``. Layer-batched: a leading ``layers`` axis on
    k/v/pool, and optionally on rope (``[layers, T, R]``), positions/owners (``[layers, T]``), the
    table (``[layers, B, 2, M]``), the scales and the k-norm weight (as in the slot contract).
    """
    pool, layered, lead, pool_dtype = _check_pool(past_key_value)
    num_layers = pool[0] if layered else None
    num_pages, page_size, heads, head_dim = pool[lead + 1 :]
    k, delta_dtype = _check_deltas(
        k_delta,
        v_delta,
        3 + lead,
        "[layers, " if layered else "[",
        "T, H, D",
        num_layers,
        heads,
        head_dim,
        pool,
    )
    tokens = k[lead]

    _check_float32("rope_cos_sin", rope_cos_sin)
    rope = _shape("rope_cos_sin", rope_cos_sin)
    if not (len(rope) == 2 or (layered and len(rope) == 3)):
        expected = "rank 2 [T, R] (token-aligned rows)" + (
            " or rank 3 [layers, T, R]" if layered else ""
        )
        raise ValueError(f"rope_cos_sin: expected {expected}, got shape {rope}")
    rope_per_layer = len(rope) == 3
    if rope_per_layer and rope[0] != num_layers:
        raise ValueError(f"rope_cos_sin: expected {num_layers} layers, got shape {rope}")
    if rope[-2] != tokens:
        raise ValueError(
            f"rope_cos_sin: expected one row per token, T = {tokens} rows (from k_delta), "
            f"got shape {rope}"
        )
    rotary_dim = rope[-1]
    _check_rotary(rotary_dim, head_dim)

    positions_per_layer = _check_index_pair(
        ("delta_positions", "delta_token_to_sequence"),
        (delta_positions, delta_token_to_sequence),
        (tokens,),
        num_layers,
        f"[{tokens}]",
    )

    table_dtype = _dtype("kv_page_table", kv_page_table)
    if table_dtype != INDEX_DTYPE:
        raise TypeError(f"kv_page_table: expected dtype int32, got {table_dtype}")
    table = _shape("kv_page_table", kv_page_table)
    if not (len(table) == 3 or (layered and len(table) == 4)) or table[-2] != 2:
        expected = "[B, 2, M]" + (" or [layers, B, 2, M]" if layered else "")
        raise ValueError(
            f"kv_page_table: expected shape {expected} (K and V page ids), got {table}"
        )
    table_per_layer = len(table) == 4
    if table_per_layer and table[0] != num_layers:
        raise ValueError(f"kv_page_table: expected {num_layers} layers, got shape {table}")
    batch, table_pages = table[-3], table[-1]
    if table_pages > num_pages:
        raise ValueError(
            f"kv_page_table: expected M <= N = {num_pages} pages per sequence (the pool's "
            f"numPages), got M = {table_pages} (shape {table})"
        )
    extras = _check_extras(
        k_scale,
        v_scale,
        k_norm_weight,
        pool_dtype=pool_dtype,
        delta_dtype=delta_dtype,
        heads=heads,
        head_dim=head_dim,
        num_layers=num_layers,
    )
    return PagedShape(
        num_layers=num_layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        num_pages=num_pages,
        page_size=page_size,
        rotary_dim=rotary_dim,
        rope_per_layer=rope_per_layer,
        positions_per_layer=positions_per_layer,
        delta_dtype=delta_dtype,
        pool_dtype=pool_dtype,
        extras=extras,
        tokens=tokens,
        batch=batch,
        table_pages=table_pages,
        table_per_layer=table_per_layer,
    )


# ---- a bound primitive's operand list: the base operands, then the extras ----------------------

BASE_NAMES = {"slot": ARG_NAMES, "paged": PAGED_ARG_NAMES}


def operand_names(contract: str, pool_dtype, k_norm: bool) -> tuple[str, ...]:
    """The names of a primitive's operands in order (SPEC.md's FFI ABI): the base operands, then
    ``k_scale, v_scale`` for an FP8 pool, then ``k_norm_weight`` when ``k_norm``."""
    names = BASE_NAMES[contract]
    if np.dtype(pool_dtype) in FP8_DTYPES:
        names += ("k_scale", "v_scale")
    if k_norm:
        names += ("k_norm_weight",)
    return names


def split_operands(operands, contract: str, k_norm: bool):
    """``(base operands, {k_scale, v_scale, k_norm_weight})`` of a primitive's operand list."""
    base = len(BASE_NAMES[contract])
    if len(operands) <= 2:
        raise TypeError(f"expected at least {base} operands, got {len(operands)}")
    names = operand_names(contract, _dtype("past_key_value", operands[2]), k_norm)
    if len(operands) != len(names):
        raise TypeError(
            f"dflash_target_kv_cache_update{'_paged' if contract == 'paged' else ''}: expected "
            f"{len(names)} operands ({', '.join(names)}), got {len(operands)}"
        )
    extras = dict(zip(names[base:], operands[base:]))
    return list(operands[:base]), {name: extras.get(name) for name in EXTRA_NAMES}


def check_operands(operands, contract: str, params: dict) -> UpdateShape | PagedShape:
    """The checks of ``contract`` ('slot' or 'paged') on a primitive's operands and params."""
    base, extras = split_operands(operands, contract, params["k_norm"])
    if contract == "slot":
        return check_update(*base, params["pages_per_slot"], **extras)
    return check_update_paged(*base, **extras)
