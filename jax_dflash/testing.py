"""Random update problems for both contracts, and bitwise comparisons (shared by tests and tools).

Everything here is NumPy. The builders fill every operand with random non-zero values so that a
missing, misplaced or extra write always shows up in a bitwise comparison; ``hostile=True`` mixes
in every runtime-data case the kernels must guard (SPEC.md, "Runtime data never writes out of
bounds") while keeping the rows that valid tokens address distinct, so results are specified.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

DELTA_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))
FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
INT8 = np.dtype(np.int8)
# Pool formats that take k_scale and v_scale (contract.h's descriptors).
SCALED_DTYPES = FP8_DTYPES + (INT8,)
POOL_DTYPES = DELTA_DTYPES + SCALED_DTYPES

ULP_SAMPLE = 1 << 20


def gpu_devices():
    """JAX's GPU devices, or [] when this JAX has no GPU backend."""
    import jax

    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


# ---- operand extras (both contracts) ------------------------------------------------------------


def _dtype_arg(name, dtype, allowed):
    dtype = np.dtype(dtype)
    if dtype not in allowed:
        raise ValueError(
            f"{name}: expected one of {', '.join(str(d) for d in allowed)}, got {dtype}"
        )
    return dtype


def _random_pool(rng, shape, pool_dtype):
    """Standard-normal values in the pool dtype; FP8 zeros are nudged to the smallest subnormal
    of their sign (a zero pool element could not tell an unwritten row from a zero write)."""
    values = rng.standard_normal(shape, dtype=np.float32)
    if pool_dtype == INT8:  # spread over the bytes, zero nudged to +-1 for the same reason
        q = np.clip(np.rint(values * 40), -127, 127)
        return np.where(q == 0, np.where(np.signbit(values), -1, 1), q).astype(np.int8)
    pool = values.astype(pool_dtype)
    if pool_dtype in FP8_DTYPES:
        bits = pool.view(np.uint8)
        bits[(bits & 0x7F) == 0] |= 0x01
    return pool


def with_scale_pool(rng, args, kwargs, pool_format):
    """``(args, kwargs)`` of a call rewritten for per-token-head scales: the pool ``args[2]``
    (any dtype; its shape ``[..., D]`` gives the layout) replaced by random bytes of
    ``pool_format`` (a pool dtype that takes a scale pool, or ``"int4"``: uint8 bytes
    ``[..., D/2]``), static scales dropped, and ``scale_pool`` random float32 bits (NaN payloads
    and infinities included: rows not written must keep them exactly). The pool's bytes are
    drawn first, then the scales'."""
    args = list(args)
    shape = args[2].shape
    if str(pool_format) == "int4":
        args[2] = rng.integers(0, 256, (*shape[:-1], shape[-1] // 2), dtype=np.uint8)
    else:
        dtype = np.dtype(getattr(ml_dtypes, str(pool_format), pool_format))
        args[2] = rng.integers(0, 256, shape, dtype=np.uint8).view(dtype)
    bits = rng.integers(0, 2**32, shape[:-1], dtype=np.uint64).astype(np.uint32)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("k_scale", "v_scale")}
    kwargs["scale_pool"] = bits.view(np.float32)
    return args, kwargs


def _scale_shape(scale_shape, heads, layers):
    if scale_shape is None:
        return (heads,)
    scale_shape = tuple(int(d) for d in scale_shape)
    allowed = [(), (heads,)]
    if layers is not None:
        allowed += [(layers, 1), (layers, heads)]
    if scale_shape not in allowed:
        raise ValueError(
            f"scale_shape: expected one of {allowed} (per tensor or per head, shared or per "
            f"layer), got {scale_shape}"
        )
    return scale_shape


def _random_scales(rng, shape, pool_dtype, hostile):
    # Log-uniform: hostile ranges reach far past the format's largest value (saturation) and
    # down into its subnormals; otherwise the scale roughly fits unit-normal data to the format.
    ranges = {  # (hostile, fitted) log2 ranges per format
        FP8_DTYPES[0]: ((-8.0, 1.0), (-6.0, -4.0)),
        FP8_DTYPES[1]: ((-14.0, 1.0), (-12.0, -10.0)),
        INT8: ((-10.0, 2.0), (-5.0, -3.0)),
    }
    low, high = ranges[pool_dtype][0 if hostile else 1]
    return np.exp2(rng.uniform(low, high, shape)).astype(np.float32)


@dataclasses.dataclass(kw_only=True)
class _Extras:
    """The optional operands and options of either contract (keyword-only, so that a problem's
    own operands stay positional before them)."""

    k_scale: np.ndarray | None = None
    v_scale: np.ndarray | None = None
    k_norm_weight: np.ndarray | None = None
    norm_eps: float = 1e-6
    v_norm: bool = False

    def extra_kwargs(self) -> dict:
        """Each extra that is in use: scales, k_norm_weight, v_norm, norm_eps."""
        out = {}
        if self.k_scale is not None:
            out["k_scale"] = self.k_scale
            out["v_scale"] = self.v_scale
        if self.k_norm_weight is not None:
            out["k_norm_weight"] = self.k_norm_weight
        if self.v_norm:
            out["v_norm"] = True
        if self.k_norm_weight is not None or self.v_norm:
            out["norm_eps"] = self.norm_eps
        return out


def _make_extras(
    rng,
    *,
    dtype,
    pool_dtype,
    heads,
    head_dim,
    layers,
    hostile,
    k_norm,
    v_norm,
    scale_shape,
    norm_eps,
    norm_weight_per_layer,
) -> _Extras:
    extras = _Extras(norm_eps=float(norm_eps), v_norm=bool(v_norm))
    if pool_dtype in SCALED_DTYPES:
        shape = _scale_shape(scale_shape, heads, layers)
        extras.k_scale = _random_scales(rng, shape, pool_dtype, hostile)
        extras.v_scale = _random_scales(rng, shape, pool_dtype, hostile)
    elif scale_shape is not None:
        raise ValueError(
            f"scale_shape: scales go with a pool format that takes them (FP8, int8), got "
            f"pool_dtype {pool_dtype}"
        )
    if k_norm:
        if norm_weight_per_layer and layers is None:
            raise ValueError("norm_weight_per_layer: expected layers to be set, got layers=None")
        lead = (layers,) if norm_weight_per_layer else ()
        weight = rng.standard_normal((*lead, head_dim), dtype=np.float32)
        extras.k_norm_weight = weight.astype(dtype)
    elif norm_weight_per_layer:
        raise ValueError("norm_weight_per_layer: expected k_norm=True, got k_norm=False")
    return extras


# ---- the slot contract --------------------------------------------------------------------------


@dataclasses.dataclass
class Problem(_Extras):
    """One random slot-contract update: the six operands (NumPy), pages_per_slot, and the
    optional extras (scales for an FP8 pool, the k-norm weight, v_norm, norm_eps)."""

    k_delta: np.ndarray
    v_delta: np.ndarray
    past_key_value: np.ndarray
    rope_cos_sin: np.ndarray
    delta_start_positions: np.ndarray
    delta_lengths: np.ndarray
    pages_per_slot: int

    def args(self):
        return (
            self.k_delta,
            self.v_delta,
            self.past_key_value,
            self.rope_cos_sin,
            self.delta_start_positions,
            self.delta_lengths,
        )

    def kwargs(self) -> dict:
        """Keywords for jax_dflash.target_kv_cache_update and the reference: pages_per_slot, and
        each extra that is in use (scales, k_norm_weight, v_norm, norm_eps)."""
        return {"pages_per_slot": self.pages_per_slot, **self.extra_kwargs()}


def make_problem(
    rng: np.random.Generator,
    *,
    batch=2,
    delta_len=4,
    heads=2,
    head_dim=16,
    rotary_dim=None,
    page_size=4,
    pages_per_slot=2,
    max_batch=None,
    rope_batch=1,
    rope_seq_len=None,
    dtype=np.float16,
    layers=None,
    hostile=True,
    rope_per_layer=False,
    positions_per_layer=False,
    pool_dtype=None,
    k_norm=False,
    v_norm=False,
    scale_shape=None,
    norm_eps=1e-6,
    norm_weight_per_layer=False,
) -> Problem:
    """Random values everywhere (never zeros); positions include padding, pass-through past S,
    drops past the slot and negative starts when ``hostile``.

    ``dtype`` is the delta dtype; ``pool_dtype`` (default: ``dtype``) may also be an FP8 dtype,
    which adds random ``k_scale``/``v_scale`` of ``scale_shape`` (default ``(heads,)``; ``()``,
    or ``(layers, 1)``/``(layers, heads)`` with layers). ``k_norm`` adds a random
    ``k_norm_weight`` ``[D]`` (``[layers, D]`` with ``norm_weight_per_layer``) in the delta dtype.
    """
    dtype = _dtype_arg("dtype", dtype, DELTA_DTYPES)
    pool_dtype = dtype if pool_dtype is None else _dtype_arg("pool_dtype", pool_dtype, POOL_DTYPES)
    rotary_dim = head_dim - head_dim % 2 if rotary_dim is None else rotary_dim
    max_batch = batch if max_batch is None else max_batch
    capacity = page_size * pages_per_slot
    rope_seq_len = capacity if rope_seq_len is None else rope_seq_len
    lead = () if layers is None else (layers,)

    def normal(shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    # The draw order (pool, rope, positions, k, v, then extras) keeps the problems of a seed
    # unchanged for callers that use no extras.
    delta_shape = (*lead, batch, delta_len, heads, head_dim)
    pool = _random_pool(
        rng, (*lead, 2, max_batch * pages_per_slot, page_size, heads, head_dim), pool_dtype
    )
    rope_lead = lead if rope_per_layer else ()
    rope = rng.uniform(-1, 1, (*rope_lead, rope_batch, rope_seq_len, rotary_dim)).astype(np.float32)
    pos_shape = (*(lead if positions_per_layer else ()), batch)
    if hostile:
        starts = rng.integers(-delta_len - 1, capacity + 2, pos_shape).astype(np.int32)
        lengths = rng.integers(-1, delta_len + 3, pos_shape).astype(np.int32)
    else:
        starts = rng.integers(0, max(capacity - delta_len, 0) + 1, pos_shape).astype(np.int32)
        lengths = np.full(pos_shape, delta_len, np.int32)
    k_delta, v_delta = normal(delta_shape), normal(delta_shape)
    extras = _make_extras(
        rng,
        dtype=dtype,
        pool_dtype=pool_dtype,
        heads=heads,
        head_dim=head_dim,
        layers=layers,
        hostile=hostile,
        k_norm=k_norm,
        v_norm=v_norm,
        scale_shape=scale_shape,
        norm_eps=norm_eps,
        norm_weight_per_layer=norm_weight_per_layer,
    )
    return Problem(
        k_delta, v_delta, pool, rope, starts, lengths, pages_per_slot, **dataclasses.asdict(extras)
    )


# ---- the paged contract -------------------------------------------------------------------------


@dataclasses.dataclass
class PagedProblem(_Extras):
    """One random paged-contract update: the seven operands (NumPy), ring, and the extras."""

    k_delta: np.ndarray
    v_delta: np.ndarray
    past_key_value: np.ndarray
    rope_cos_sin: np.ndarray
    delta_positions: np.ndarray
    delta_token_to_sequence: np.ndarray
    kv_page_table: np.ndarray
    ring: bool | tuple[bool, ...] = False  # a tuple: one per layer (the layer-batched form)

    def args(self):
        return (
            self.k_delta,
            self.v_delta,
            self.past_key_value,
            self.rope_cos_sin,
            self.delta_positions,
            self.delta_token_to_sequence,
            self.kv_page_table,
        )

    def kwargs(self) -> dict:
        """Keywords for jax_dflash.target_kv_cache_update_paged and the reference: ring, and
        each extra that is in use (scales, k_norm_weight, v_norm, norm_eps)."""
        return {"ring": self.ring, **self.extra_kwargs()}


_INT32_MAX = np.iinfo(np.int32).max
_INT32_MIN = np.iinfo(np.int32).min


def _random_page_table(rng, batch, table_pages, num_pages, hostile):
    """``[B, 2, M]``: K pages a random choice of distinct pool pages (distinct across sequences
    too), V pages another, offset by N; hostile entries are out of their plane's range."""
    k_pages = rng.permutation(num_pages)[: batch * table_pages].reshape(batch, table_pages)
    v_pages = rng.permutation(num_pages)[: batch * table_pages].reshape(batch, table_pages)
    table = np.stack([k_pages, v_pages + num_pages], axis=1).astype(np.int64)
    if hostile:
        n = num_pages
        k_bad = np.array([-1, -n, n, 2 * n - 1, 2 * n, _INT32_MIN, _INT32_MAX], np.int64)
        v_bad = np.array([-1, 0, n - 1, 2 * n, 3 * n, _INT32_MIN, _INT32_MAX], np.int64)
        for plane, bad in ((0, k_bad), (1, v_bad)):
            corrupt = rng.random((batch, table_pages)) < 0.15
            table[:, plane][corrupt] = rng.choice(bad, int(corrupt.sum()))
    return np.clip(table, _INT32_MIN, _INT32_MAX).astype(np.int32)


def _random_tokens(rng, tokens, batch, table_pages, page_size, hostile):
    """``(positions [T], owners [T])``: distinct (owner, position) pairs inside the table, in a
    random (interleaved) order; hostile tokens are padding, foreign owners, negative positions
    or positions past the table (under ring, those wrap onto a slot no other token uses)."""
    window = table_pages * page_size
    if tokens > batch * window:
        raise ValueError(
            f"tokens: expected at most batch * table_pages * page_size = {batch * window} "
            f"(distinct rows), got {tokens}"
        )
    pairs = rng.choice(batch * window, tokens, replace=False)
    owners = (pairs // window).astype(np.int64)
    positions = (pairs % window).astype(np.int64)
    if hostile:
        kind = rng.choice(7, tokens, p=[0.55, 0.1, 0.05, 0.05, 0.05, 0.15, 0.05])
        owners[kind == 1] = -1  # padding
        owners[kind == 2] = batch + rng.integers(0, 3, int((kind == 2).sum()))
        owners[kind == 3] = rng.choice([_INT32_MIN, -2, _INT32_MAX], int((kind == 3).sum()))
        neg = kind == 4
        positions[neg] = rng.choice([-1, -page_size, -window, _INT32_MIN], int(neg.sum()))
        # Past the table by whole windows: dropped without ring, the same page slot with it.
        past = kind == 5
        positions[past] += window * rng.integers(1, 4, int(past.sum()))
        far = kind == 6
        positions[far] += window * ((_INT32_MAX - positions[far]) // window)
    return positions.astype(np.int32), owners.astype(np.int32)


# Long: one keyword per knob of the problem, each drawn in turn.
def make_paged_problem(
    rng: np.random.Generator,
    *,
    tokens=8,
    batch=2,
    heads=2,
    head_dim=16,
    rotary_dim=None,
    num_pages=8,
    page_size=4,
    table_pages=2,
    dtype=np.float16,
    pool_dtype=None,
    layers=None,
    hostile=True,
    k_norm=False,
    v_norm=False,
    scale_shape=None,
    norm_eps=1e-6,
    ring=False,
    rope_per_layer=False,
    positions_per_layer=False,
    table_per_layer=False,
    norm_weight_per_layer=False,
) -> PagedProblem:
    """A random paged update: ``tokens`` tokens of ``batch`` sequences over a pool of
    ``num_pages`` pages of ``page_size`` rows, a ``[B, 2, table_pages]`` page table.

    Every sequence's pages are distinct pool pages (``batch * table_pages <= num_pages``) and
    valid tokens address distinct rows. ``hostile`` mixes in padding owners (-1), owners >= B,
    negative positions, positions past the table (wrapping under ``ring``) and table ids that are
    negative, of the other plane or past N. Extras as in :func:`make_problem`.
    """
    dtype = _dtype_arg("dtype", dtype, DELTA_DTYPES)
    pool_dtype = dtype if pool_dtype is None else _dtype_arg("pool_dtype", pool_dtype, POOL_DTYPES)
    rotary_dim = head_dim - head_dim % 2 if rotary_dim is None else rotary_dim
    if table_pages < 1 or batch * table_pages > num_pages:
        raise ValueError(
            f"table_pages: expected 1 <= table_pages and batch * table_pages <= num_pages "
            f"(distinct pages per sequence) = {num_pages}, got table_pages={table_pages}, "
            f"batch={batch}"
        )
    lead = () if layers is None else (layers,)
    per_layer = {
        "rope_per_layer": rope_per_layer,
        "positions_per_layer": positions_per_layer,
        "table_per_layer": table_per_layer,
    }
    for name, flag in per_layer.items():
        if flag and layers is None:
            raise ValueError(f"{name}: expected layers to be set, got layers=None")

    def normal(shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    pool = _random_pool(rng, (*lead, 2, num_pages, page_size, heads, head_dim), pool_dtype)
    rope = rng.uniform(-1, 1, (*(lead if rope_per_layer else ()), tokens, rotary_dim))
    rope = rope.astype(np.float32)
    token_sets = [
        _random_tokens(rng, tokens, batch, table_pages, page_size, hostile)
        for _ in range(layers if positions_per_layer else 1)
    ]
    positions = np.stack([p for p, _ in token_sets]) if positions_per_layer else token_sets[0][0]
    owners = np.stack([o for _, o in token_sets]) if positions_per_layer else token_sets[0][1]
    tables = [
        _random_page_table(rng, batch, table_pages, num_pages, hostile)
        for _ in range(layers if table_per_layer else 1)
    ]
    table = np.stack(tables) if table_per_layer else tables[0]
    delta_shape = (*lead, tokens, heads, head_dim)
    k_delta, v_delta = normal(delta_shape), normal(delta_shape)
    extras = _make_extras(
        rng,
        dtype=dtype,
        pool_dtype=pool_dtype,
        heads=heads,
        head_dim=head_dim,
        layers=layers,
        hostile=hostile,
        k_norm=k_norm,
        v_norm=v_norm,
        scale_shape=scale_shape,
        norm_eps=norm_eps,
        norm_weight_per_layer=norm_weight_per_layer,
    )
    return PagedProblem(
        k_delta,
        v_delta,
        pool,
        rope,
        positions,
        owners,
        table,
        tuple(bool(r) for r in ring) if isinstance(ring, (tuple, list)) else bool(ring),
        **dataclasses.asdict(extras),
    )


# ---- comparisons --------------------------------------------------------------------------------


def assert_bits_equal(actual, expected):
    """Raises AssertionError unless both arrays have the same shape, dtype and bits."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(
            f"expected shape {expected.shape} dtype {expected.dtype}, "
            f"got shape {actual.shape} dtype {actual.dtype}"
        )
    a = actual.view(np.uint8).reshape(*actual.shape, -1)
    e = expected.view(np.uint8).reshape(*expected.shape, -1)
    mismatched = np.any(a != e, axis=-1)
    if mismatched.any():
        idx = np.argwhere(mismatched)
        first = tuple(idx[0])
        raise AssertionError(
            f"{len(idx)} of {actual.size} elements differ bitwise; first at {first}: "
            f"{actual[first]!r} != {expected[first]!r}"
        )


def compare_bits(actual: np.ndarray, expected: np.ndarray) -> tuple[int, int]:
    """``(elements whose bits differ, the largest difference in ulps)``: -0.0 != 0.0, and the
    ulp distance counts representable values between the two (across zero too). The ulps are
    taken over the first ``ULP_SAMPLE`` differing elements (a failed check need not be fast,
    but it should not need gigabytes either)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise ValueError(
            f"actual: expected shape {expected.shape} dtype {expected.dtype}, "
            f"got shape {actual.shape} dtype {actual.dtype}"
        )
    bits = np.dtype(f"int{8 * expected.dtype.itemsize}")
    a, e = actual.view(bits).reshape(-1), expected.view(bits).reshape(-1)
    differ = np.flatnonzero(a != e)
    count = differ.size
    if not count:
        return 0, 0
    differ = differ[:ULP_SAMPLE]
    a, e = a[differ].astype(np.int64), e[differ].astype(np.int64)
    sign = np.int64(1) << (8 * expected.dtype.itemsize - 1)
    # Sign-magnitude to a monotonic integer line: negative values count down from zero.
    a = np.where(a < 0, -(a & (sign - 1)), a)
    e = np.where(e < 0, -(e & (sign - 1)), e)
    return count, int(np.abs(a - e).max())
