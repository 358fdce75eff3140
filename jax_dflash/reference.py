"""A NumPy reference of both update contracts that follows docs/SPEC.md literally.

float32 arithmetic with every product and sum rounded on its own (NumPy's float32 ufuncs are
IEEE and never fuse), the norms' sum of squares in SPEC.md's order, its own FP8 rounding with
saturation, canonical NaNs on every computed or converted value. For tests and for checking
results, not for serving: it returns a new pool and leaves the input alone.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jax_dflash import _shapes

_FLOAT16 = np.dtype(np.float16)
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_FLOAT32 = np.dtype(np.float32)
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_E5M2 = np.dtype(ml_dtypes.float8_e5m2)
_INT8 = np.dtype(np.int8)
_INT4_BYTES = np.dtype(np.uint8)  # int4: two 4-bit elements per byte, dynamic scales only

# Canonical quiet NaN bits of each pool dtype (SPEC.md, "NaN").
CANONICAL_NAN = {
    _FLOAT16: 0x7E00,
    _BFLOAT16: 0x7FC0,
    _FLOAT32: 0x7FC00000,
    _E4M3: 0x7F,
    _E5M2: 0x7F,
}
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32}

# FP8 formats: (mantissa bits, exponent bias, code of the largest finite magnitude).
FP8_FORMATS = {_E4M3: (3, 7, 0x7E), _E5M2: (2, 15, 0x7B)}
NORM_CHUNK = 8  # channels summed left to right before the halving tree
_FLOAT32_NAN = np.array(CANONICAL_NAN[_FLOAT32], np.uint32).view(np.float32)


def written_position(start: int, length: int, t: int, capacity: int) -> int | None:
    """Where token t lands in its slot, or None when nothing is written (SPEC.md slot 1-2)."""
    if t >= length:
        return None  # padding
    pos = int(start) + t
    if pos < 0 or pos >= capacity:
        return None  # negative, or dropped past the slot
    return pos


# ---- conversions --------------------------------------------------------------------------------


def _with_canonical_nan(out: np.ndarray, y: np.ndarray) -> np.ndarray:
    bits = out.view(_BITS[out.dtype.itemsize])
    bits[np.isnan(y)] = CANONICAL_NAN[out.dtype]
    return out


def round_to(y: np.ndarray, dtype) -> np.ndarray:
    """``round_X(y)``: float32 ``y`` to a 16/32-bit dtype, nearest even (float16 and bfloat16
    overflow to infinity), NaN as the dtype's canonical NaN."""
    dtype = np.dtype(dtype)
    y = np.asarray(y, np.float32)
    if dtype == _BFLOAT16:
        # Round to nearest even on the bits: add half an ulp minus one, plus the kept lsb.
        u = y.view(np.uint32).astype(np.uint64)
        out = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).view(_BFLOAT16)
    elif dtype in (_FLOAT16, _FLOAT32):
        with np.errstate(all="ignore"):  # overflow to infinity is the rule
            out = y.astype(dtype)  # IEEE nearest even, subnormals kept
    else:
        raise ValueError(f"dtype: expected float16, bfloat16 or float32, got {dtype}")
    return _with_canonical_nan(np.array(out, copy=True), y)


def round_fp8(w: np.ndarray, dtype) -> np.ndarray:
    """``fp8(w)``: float32 ``w`` to float8_e4m3fn or float8_e5m2, nearest even (subnormals
    included), magnitudes above the largest finite value (infinity too) saturate to it, NaN gives
    0x7F. Returns an array of the FP8 dtype."""
    dtype = np.dtype(dtype)
    if dtype not in FP8_FORMATS:
        raise ValueError(f"dtype: expected float8_e4m3fn or float8_e5m2, got {dtype}")
    mant, bias, max_code = FP8_FORMATS[dtype]
    w = np.asarray(w, np.float32)
    sign = ((w.view(np.uint32) >> 24) & 0x80).astype(np.int64)
    min_exp = 1 - bias  # of the smallest normal; subnormals share its quantum
    largest = 2.0 ** ((max_code >> mant) - bias) * (1 + (max_code & ((1 << mant) - 1)) / 2**mant)
    with np.errstate(all="ignore"):  # NaN and infinite inputs are data here
        a = np.abs(w).astype(np.float64)  # exact; so is every step below until np.rint
        exp = np.maximum(np.frexp(a)[1] - 1, min_exp)
        quantum = np.ldexp(1.0, exp - mant)
        r = np.minimum(np.rint(a / quantum) * quantum, largest)  # nearest even, then saturate
        # Rounding may reach the next binade; zero (frexp exponent 0) has the subnormal quantum.
        exp = np.where(r > 0, np.maximum(np.frexp(r)[1] - 1, min_exp), min_exp)
        # ((exp + bias - 1) << mant) + r / 2^(exp - mant): for normals the implicit 1 carries
        # into the exponent field; for subnormals (exp = min_exp) the first term is zero.
        steps = np.where(np.isnan(r), 0, r / np.ldexp(1.0, exp - mant)).astype(np.int64)
        magnitude = ((exp + bias - 1) << mant) + steps
    code = np.where(np.isnan(a), CANONICAL_NAN[dtype], sign | magnitude)
    return code.astype(np.uint8).view(dtype)


def _as_float32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(np.float32)  # exact for every delta dtype


def _round_delta(y: np.ndarray, dtype) -> np.ndarray:
    """float32 -> the delta dtype -> float32 (a value of the delta dtype)."""
    return round_to(y, dtype).astype(np.float32)


# ---- arithmetic ---------------------------------------------------------------------------------


def sum_of_squares(x: np.ndarray) -> np.ndarray:
    """The fused norms' sum of ``x[..., j]**2`` over the last axis in SPEC.md's order: chunks of
    8 channels summed left to right, chunk sums zero-padded to a power of two, then halved
    (``s[c] += s[c + h]`` for ``h = Np/2 .. 1``)."""
    x = np.asarray(x, np.float32)
    head_dim = x.shape[-1]
    chunks = -(-head_dim // NORM_CHUNK)
    q = x * x
    # Zero channels after the last one: adding +0 to a sum of squares (never -0) is exact.
    pad = np.zeros((*x.shape[:-1], chunks * NORM_CHUNK - head_dim), np.float32)
    q = np.concatenate([q, pad], -1)
    q = q.reshape(*x.shape[:-1], chunks, NORM_CHUNK)
    s = q[..., 0]
    for k in range(1, NORM_CHUNK):
        s = s + q[..., k]
    leaves = 1
    while leaves < chunks:
        leaves *= 2
    s = np.concatenate([s, np.zeros((*x.shape[:-1], leaves - chunks), np.float32)], -1)
    h = leaves // 2
    while h >= 1:
        s = s[..., :h] + s[..., h : 2 * h]
        h //= 2
    return s[..., 0]


def rms_norm(x: np.ndarray, dtype, eps, weight: np.ndarray | None = None) -> np.ndarray:
    """The fused RMS norm of each head (last axis) of float32 ``x`` holding values of the delta
    ``dtype``: returns float32 values of that dtype (SPEC.md, "Fused norms" 1-5)."""
    x = np.asarray(x, np.float32)
    head_dim = x.shape[-1]
    ms = sum_of_squares(x) / np.float32(head_dim)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv_rms = np.float32(1) / np.sqrt(ms + np.float32(eps))
    u = _round_delta(x * inv_rms[..., None], dtype)
    if weight is None:
        return u
    return _round_delta(u * _as_float32(weight), dtype)


def rope_rotate(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of float32 ``x`` [n, H, D] with float32 rows [n, R] (R/2 cosines then
    R/2 sines) on the first R channels; each product rounded, then the difference or sum."""
    rotary_dim = rows.shape[-1]
    half = rotary_dim // 2
    c = rows[:, None, :half]
    s = rows[:, None, half:rotary_dim]
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    y = x.copy()
    y[..., :half] = x1 * c - x2 * s
    y[..., half:rotary_dim] = x2 * c + x1 * s
    return y


def round_int8(q: np.ndarray) -> np.ndarray:
    """float32 ``q`` (already divided by the scale) to int8: round half to even, clamp to
    [-127, 127] (infinities too), NaN gives 0."""
    q = np.asarray(q, np.float32)
    with np.errstate(invalid="ignore"):
        clamped = np.clip(np.where(np.isnan(q), np.float32(0), q), -127, 127)
    return np.rint(clamped).astype(np.int8)


def round_int4(q: np.ndarray) -> np.ndarray:
    """float32 ``q`` (already divided by the scale) to the int4 levels as int8: round half to
    even, clamp to [-7, 7] (infinities too), NaN gives 0."""
    q = np.asarray(q, np.float32)
    with np.errstate(invalid="ignore"):
        clamped = np.clip(np.where(np.isnan(q), np.float32(0), q), -7, 7)
    return np.rint(clamped).astype(np.int8)


def pack_int4(levels: np.ndarray) -> np.ndarray:
    """int4 levels [..., D] (int8 in [-7, 7], D even) as the pool's bytes [..., D/2]: element 2j
    in the low nibble, 2j + 1 in the high one, each in 4-bit two's complement."""
    nibbles = np.asarray(levels).astype(np.uint8) & np.uint8(0x0F)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << np.uint8(4))


def dynamic_store(y: np.ndarray, pool_dtype):
    """Per-token-head dynamic scales (SPEC.md, "Dynamic scales") of float32 rows y [..., D]:
    ``(elements, scales)``, with ``s = max_j |y_j| / qmax`` (the canonical NaN for a row with a
    non-finite element) and the elements ``y / s`` in the format's conversion (zeros where
    ``s == 0``)."""
    pool_dtype = np.dtype(pool_dtype)
    qmax = np.float32(_shapes.POOL_FORMATS[str(pool_dtype)]["max_finite"])
    y = np.asarray(y, np.float32)
    with np.errstate(all="ignore"):
        finite = np.all(np.isfinite(y), axis=-1)
        a = np.max(np.abs(y), axis=-1, initial=np.float32(0)).astype(np.float32)
        s = np.where(finite, a / qmax, _FLOAT32_NAN).astype(np.float32)
        q = np.where(s[..., None] == 0, np.float32(0), y / s[..., None]).astype(np.float32)
    if pool_dtype == _INT4_BYTES:
        return pack_int4(round_int4(q)), s
    elements = round_int8(q) if pool_dtype == _INT8 else round_fp8(q, pool_dtype)
    return elements, s


def _store(delta, y, touched, pool_dtype, inv_scale):
    """The pool elements for delta [n, H, D] whose float32 result is y; `touched` [n or 1, D]
    marks channels arithmetic changed (else, in the same dtype, the delta's bits are copied).
    ``inv_scale`` is what the format's conversion takes (_conversion_scale); ``"dynamic"``
    stores with per-token-head scales (then the result is ``(elements, scales)``)."""
    if isinstance(inv_scale, str):
        return dynamic_store(y, pool_dtype)
    if pool_dtype == _INT8:
        return round_int8(y / inv_scale)
    if pool_dtype in FP8_FORMATS:
        return round_fp8(y * inv_scale, pool_dtype)
    out = round_to(y, pool_dtype)
    if pool_dtype == delta.dtype:
        out = np.where(touched[:, None, :], out, delta)
    return out


def _stored_rows(
    k, v, rope_rows, rotated, *, pool_dtype, rotary_dim, inv_k, inv_v, k_norm_weight, v_norm, eps
):
    """What one layer stores for n written tokens: K and V rows [n, H, D] of the pool dtype.
    rope_rows [n, R] (any values where not ``rotated``), rotated [n] bool."""
    dtype = k.dtype
    n, _, head_dim = k.shape
    channel = np.arange(head_dim)
    x = _as_float32(k)
    if k_norm_weight is not None:
        x = rms_norm(x, dtype, eps, k_norm_weight)
        k_touched = np.ones((n, head_dim), bool)
    else:
        k_touched = rotated[:, None] & (channel < rotary_dim)[None, :]
    y = np.where(rotated[:, None, None], rope_rotate(x, rope_rows), x) if rotary_dim else x
    z = _as_float32(v)
    if v_norm:
        z = rms_norm(z, dtype, eps)
    v_touched = np.full((n, head_dim), bool(v_norm))
    return (_store(k, y, k_touched, pool_dtype, inv_k), _store(v, z, v_touched, pool_dtype, inv_v))


def _conversion_scale(scale, pool_dtype):
    """What a scaled store takes, shaped to broadcast over [n, H, D]: ``1 / scale`` in float32
    (FP8: the value times it), or the scale itself (int8: the value divided by it)."""
    if scale is None:
        return None
    scale = np.asarray(scale, np.float32).reshape(-1)
    if pool_dtype != _INT8:
        with np.errstate(divide="ignore"):
            scale = np.float32(1) / scale
    return scale[None, :, None]  # [1] (per tensor) or [H] (per head)


class _Pools:
    """A layer's pool and, with dynamic scales, its scale pool: a row stored at ``pool[index]``
    stores its scales at ``scale_pool[index]`` (the pool's index without D), and nowhere else."""

    def __init__(self, pool, scales):
        self.pool, self.scales = pool, scales
        self.shape = pool.shape

    def __setitem__(self, index, rows):
        if self.scales is None:
            self.pool[index] = rows
        else:
            self.pool[index], self.scales[index] = rows


def _layer_slice(x, per_layer, layer):
    return None if x is None else (x[layer] if per_layer else x)


def _each_layer(update_layer, args, *, base_ranks, extras, static, rotary_dim, v_norm, eps):
    """A new pool: ``update_layer`` applied to each layer's operands (the layer-batched form
    slices every operand that carries a leading layers axis, one more dim than ``base_ranks``;
    the extras likewise). ``static`` follows the base operands: a tuple, or a function of the
    layer that returns one (a per-layer ring)."""
    pool = args[2]
    out = pool.copy()
    layered = pool.ndim == 6
    ks, vs, w = (extras.get(n) for n in ("k_scale", "v_scale", "k_norm_weight"))
    scales = extras.get("scale_pool")
    scales_out = None if scales is None else scales.astype(np.float32, copy=True)
    dynamic = None if scales is None else "dynamic"
    for layer in range(pool.shape[0] if layered else 1):

        def at(x, per_layer):
            return _layer_slice(x, layered and per_layer, layer)

        operands = [at(x, x.ndim > rank) for x, rank in zip(args, base_ranks)]
        layer_scales = (
            None if scales_out is None else (scales_out[layer] if layered else scales_out)
        )
        operands[2] = _Pools(out[layer] if layered else out, layer_scales)
        with np.errstate(all="ignore"):  # inf and NaN in the data are not errors
            update_layer(
                *operands,
                *(static(layer) if callable(static) else static),
                pool_dtype=pool.dtype,
                rotary_dim=rotary_dim,
                inv_k=dynamic
                or _conversion_scale(at(ks, ks is not None and ks.ndim == 2), pool.dtype),
                inv_v=dynamic
                or _conversion_scale(at(vs, vs is not None and vs.ndim == 2), pool.dtype),
                k_norm_weight=at(w, w is not None and w.ndim == 2),
                v_norm=bool(v_norm),
                eps=eps,
            )
    return out if scales_out is None else (out, scales_out)


def _options(v_norm, norm_eps):
    _shapes.check_bool_attr("v_norm", v_norm)
    return np.float32(_shapes.check_norm_eps(norm_eps))


def _extras(k_scale, v_scale, k_norm_weight, scale_pool=None):
    return {
        name: np.asarray(x)
        for name, x in (
            ("k_scale", k_scale),
            ("v_scale", v_scale),
            ("k_norm_weight", k_norm_weight),
            ("scale_pool", scale_pool),
        )
        if x is not None
    }


# ---- the slot contract --------------------------------------------------------------------------


def _slot_layer(k, v, pool, rope, starts, lengths, pages_per_slot, **stored):
    page_size = pool.shape[2]
    capacity = pages_per_slot * page_size
    rope_batch, rope_seq_len, _ = rope.shape
    batch, delta_len = k.shape[:2]
    t = np.arange(delta_len, dtype=np.int64)[None, :]
    pos = starts.astype(np.int64)[:, None] + t  # 64-bit: no int32 start wraps into the slot
    written = (t < lengths.astype(np.int64)[:, None]) & (pos >= 0) & (pos < capacity)
    bs, ts = np.nonzero(written)
    pos = pos[bs, ts]
    rotated = pos < rope_seq_len
    rb = np.zeros_like(bs) if rope_batch == 1 else bs
    rows = (
        rope[rb, np.minimum(pos, max(rope_seq_len - 1, 0))]
        if rope_seq_len
        else np.zeros((len(pos), rope.shape[-1]), np.float32)
    )
    k_rows, v_rows = _stored_rows(k[bs, ts], v[bs, ts], rows, rotated, **stored)
    page = bs * pages_per_slot + pos // page_size
    pool[0, page, pos % page_size] = k_rows
    pool[1, page, pos % page_size] = v_rows


def target_kv_cache_update(
    k_delta,
    v_delta,
    past_key_value,
    rope_cos_sin,
    delta_start_positions,
    delta_lengths,
    *,
    pages_per_slot: int,
    k_scale=None,
    v_scale=None,
    k_norm_weight=None,
    norm_eps=1e-6,
    v_norm=False,
    scale_pool=None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Returns a new pool: ``past_key_value`` with the accepted tokens written (SPEC.md, the slot
    contract). Accepts the unbatched and layer-batched forms of
    :func:`jax_dflash.target_kv_cache_update`; the input arrays are not modified. With
    ``scale_pool`` (per-token-head dynamic scales, SPEC.md) the result is ``(pool, scale_pool)``,
    both new; so in the other forms."""
    args = [
        np.asarray(a)
        for a in (
            k_delta,
            v_delta,
            past_key_value,
            rope_cos_sin,
            delta_start_positions,
            delta_lengths,
        )
    ]
    extras = _extras(k_scale, v_scale, k_norm_weight, scale_pool)
    _shapes.check_update(*args, pages_per_slot, **extras)
    eps = _options(v_norm, norm_eps)
    return _each_layer(
        _slot_layer,
        args,
        base_ranks=(4, 4, 5, 3, 1, 1),
        extras=extras,
        static=(pages_per_slot,),
        rotary_dim=args[3].shape[-1],
        v_norm=v_norm,
        eps=eps,
    )


# ---- the paged contract -------------------------------------------------------------------------


def _paged_layer(k, v, pool, rope, positions, owners, table, ring, **stored):
    num_pages, page_size = pool.shape[1:3]
    batch, _, table_pages = table.shape
    b = owners.astype(np.int64)
    p = positions.astype(np.int64)
    (ts,) = np.nonzero((b >= 0) & (b < batch) & (p >= 0) & (table_pages > 0))
    i = p[ts] // page_size
    if ring:
        i = i % max(table_pages, 1)
    ts, i = ts[i < table_pages], i[i < table_pages]
    kp = table[b[ts], 0, i].astype(np.int64)
    vp = table[b[ts], 1, i].astype(np.int64)
    valid = (kp >= 0) & (kp < num_pages) & (vp >= num_pages) & (vp < 2 * num_pages)
    ts, kp, vp = ts[valid], kp[valid], vp[valid]
    k_rows, v_rows = _stored_rows(k[ts], v[ts], rope[ts], np.ones(len(ts), bool), **stored)
    row = p[ts] % page_size
    pool[0, kp, row] = k_rows
    pool[1, vp - num_pages, row] = v_rows


def target_kv_cache_update_paged(
    k_delta,
    v_delta,
    past_key_value,
    rope_cos_sin,
    delta_positions,
    delta_token_to_sequence,
    kv_page_table,
    *,
    ring=False,
    k_scale=None,
    v_scale=None,
    k_norm_weight=None,
    norm_eps=1e-6,
    v_norm=False,
    scale_pool=None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Returns a new pool: ``past_key_value`` with the tokens written (SPEC.md, the paged
    contract, with the ring option: a bool, or in the layer-batched form one per layer). Accepts
    the unbatched and layer-batched forms of :func:`jax_dflash.target_kv_cache_update_paged`;
    the input arrays are not modified."""
    args = [
        np.asarray(a)
        for a in (
            k_delta,
            v_delta,
            past_key_value,
            rope_cos_sin,
            delta_positions,
            delta_token_to_sequence,
            kv_page_table,
        )
    ]
    extras = _extras(k_scale, v_scale, k_norm_weight, scale_pool)
    ring = _shapes.check_update_paged(*args, **extras, ring=ring).ring
    eps = _options(v_norm, norm_eps)
    return _each_layer(
        _paged_layer,
        args,
        base_ranks=(3, 3, 5, 2, 1, 1, 3),
        extras=extras,
        static=lambda layer: (ring[layer] if isinstance(ring, tuple) else ring,),
        rotary_dim=args[3].shape[-1],
        v_norm=v_norm,
        eps=eps,
    )


def _mapped_layer(k, v, pool, rope, slots, **stored):
    num_pages, page_size = pool.shape[1:3]
    s = slots.astype(np.int64)
    (ts,) = np.nonzero((s >= 0) & (s < num_pages * page_size))
    # Of tokens with one slot, the last one's rows are stored (SPEC.md, "The slot-mapping form").
    _, last = np.unique(s[ts][::-1], return_index=True)
    ts = np.sort(ts[::-1][last])
    k_rows, v_rows = _stored_rows(k[ts], v[ts], rope[ts], np.ones(len(ts), bool), **stored)
    page, row = s[ts] // page_size, s[ts] % page_size
    pool[0, page, row] = k_rows
    pool[1, page, row] = v_rows


def target_kv_cache_update_slots(
    k_delta,
    v_delta,
    past_key_value,
    rope_cos_sin,
    slot_mapping,
    *,
    k_scale=None,
    v_scale=None,
    k_norm_weight=None,
    norm_eps=1e-6,
    v_norm=False,
    scale_pool=None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Returns a new pool: ``past_key_value`` with the tokens written through their flat slots
    (SPEC.md, "The slot-mapping form"). Accepts the unbatched and layer-batched forms of
    :func:`jax_dflash.target_kv_cache_update_slots`; the input arrays are not modified."""
    args = [np.asarray(a) for a in (k_delta, v_delta, past_key_value, rope_cos_sin, slot_mapping)]
    extras = _extras(k_scale, v_scale, k_norm_weight, scale_pool)
    _shapes.check_update_slots(*args, **extras)
    eps = _options(v_norm, norm_eps)
    return _each_layer(
        _mapped_layer,
        args,
        base_ranks=(3, 3, 5, 2, 1),
        extras=extras,
        static=(),
        rotary_dim=args[3].shape[-1],
        v_norm=v_norm,
        eps=eps,
    )
