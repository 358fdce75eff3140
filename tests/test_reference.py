"""The NumPy reference against SPEC.md, from oracles written here independently of its code:
FP8 and 16-bit rounding by searching every code of the format, the norms' summation order one
scalar at a time, the NaN and subnormal rules, and each paged-contract guard on hand-built cases."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import DELTA_DTYPES, FP8_DTYPES, assert_bits_equal, make_paged_problem, make_problem
from jax_dflash import reference

# NaN, infinite and overflowing probes are the point here, not accidents.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

F16, BF16, F32 = DELTA_DTYPES
E4M3, E5M2 = FP8_DTYPES
f32 = np.float32


# ---- oracles: nearest-even rounding by searching the format's codes -----------------------------


def _magnitudes(dtype):
    """(codes, values) of every finite non-negative value of ``dtype``, ascending."""
    bits = np.dtype(f"uint{8 * dtype.itemsize}")
    codes = np.arange(2 ** (8 * dtype.itemsize - 1), dtype=np.uint64).astype(bits)
    values = codes.view(dtype).astype(np.float64)
    finite = np.isfinite(values)
    codes, values = codes[finite], values[finite]
    assert np.all(np.diff(values) > 0)  # sign-magnitude codes: ascending with the value
    return codes.astype(np.int64), values


def _nearest_even(a, codes, values):
    """The code of the value nearest to each magnitude ``a`` (float64, inside the range), ties to
    the even code."""
    hi = np.clip(np.searchsorted(values, a), 1, len(values) - 1)
    lo = hi - 1
    d_lo, d_hi = a - values[lo], values[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    return np.where(pick_hi, codes[hi], codes[lo])


def oracle_fp8(w, dtype):
    """SPEC.md's fp8(w): nearest even, saturating above the largest finite value, NaN -> 0x7F."""
    codes, values = _magnitudes(dtype)
    w = np.asarray(w, np.float32)
    a = np.abs(w.astype(np.float64))
    nearest = _nearest_even(np.minimum(a, values[-1]), codes, values)
    code = np.where(a >= values[-1], codes[-1], nearest)
    code = code | np.where(np.signbit(w), 0x80, 0)
    return np.where(np.isnan(w), 0x7F, code).astype(np.uint8)


def oracle_round16(y, dtype):
    """IEEE nearest even to float16/bfloat16: past the largest value, rounding goes to infinity
    (the code after the largest, one ulp further, is infinity's); NaN -> the canonical NaN."""
    codes, values = _magnitudes(dtype)
    ulp = values[-1] - values[-2]
    inf_code = codes[-1] + 1
    codes = np.append(codes, inf_code)
    values = np.append(values, values[-1] + ulp)
    y = np.asarray(y, np.float32)
    a = np.abs(y.astype(np.float64))
    nearest = _nearest_even(np.minimum(a, values[-1]), codes, values)
    code = np.where(a > values[-1], inf_code, nearest)
    code = code | np.where(np.signbit(y), 0x8000, 0)
    nan = reference.CANONICAL_NAN[dtype]
    return np.where(np.isnan(y), nan, code).astype(np.uint16)


def _probe_values(dtype):
    """float32 probes: every finite value of ``dtype``, the midpoints between neighbours, the
    float32 neighbours of both, values past the largest, infinities, NaNs, zeros, subnormals."""
    _, values = _magnitudes(dtype)
    mids = (values[:-1] + values[1:]) / 2  # one more bit than the format: exact in float32
    base = np.concatenate([values, mids]).astype(np.float32)
    assert np.all(base.astype(np.float64) == np.concatenate([values, mids]))
    top = values[-1]
    past = [top * 1.0001, top + (top - values[-2]) / 2, top * 2, 3.0e38, np.inf]
    past = np.array(past, np.float32)
    tiny = np.array([0.0, 1e-45, 1e-40, 2.0**-126, np.finfo(np.float32).max], np.float32)
    probes = np.concatenate(
        [
            base,
            np.nextafter(base, f32(np.inf)),
            np.nextafter(base, f32(0)),
            past,
            tiny,
        ]
    )
    probes = np.concatenate([probes, -probes])
    nans = np.array([0x7FC00000, 0x7F800001, 0xFFC00001, 0x7FFFFFFF, 0xFF800123], np.uint32)
    return np.concatenate([probes, nans.view(np.float32)])


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
def test_fp8_rounding_matches_a_search_of_every_code(dtype):
    w = _probe_values(dtype)
    got = reference.round_fp8(w, dtype)
    assert got.dtype == dtype
    want = oracle_fp8(w, dtype)
    bad = np.flatnonzero(got.view(np.uint8) != want)
    assert not bad.size, [(float(w[i]), hex(got.view(np.uint8)[i]), hex(want[i])) for i in bad[:5]]


@pytest.mark.parametrize(
    "dtype, largest, code", [(E4M3, 448.0, 0x7E), (E5M2, 57344.0, 0x7B)], ids=str
)
def test_fp8_saturation_and_nan_codes(dtype, largest, code):
    w = [largest, largest * 1.5, np.inf, -np.inf, -largest * 4, np.nan, -np.nan, 0.0, -0.0]
    w = np.array(w, np.float32)
    got = reference.round_fp8(w, dtype).view(np.uint8)
    assert got.tolist() == [code, code, code, 0x80 | code, 0x80 | code, 0x7F, 0x7F, 0x00, 0x80]


@pytest.mark.parametrize("dtype", FP8_DTYPES, ids=str)
def test_fp8_every_finite_value_encodes_to_its_own_code(dtype):
    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(dtype).astype(np.float32)
    finite = np.isfinite(values)
    assert_bits_equal(reference.round_fp8(values[finite], dtype), codes[finite].view(dtype))


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_16bit_rounding_matches_a_search_of_every_code(dtype):
    y = _probe_values(dtype)
    got = reference.round_to(y, dtype).view(np.uint16)
    want = oracle_round16(y, dtype)
    bad = np.flatnonzero(got != want)
    assert not bad.size, [(float(y[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]


def test_float32_rounding_keeps_bits_and_canonicalizes_nan():
    y = np.array([1.5, -0.0, 1e-45, -np.inf], np.float32)
    nans = np.array([0x7F800001, 0xFFC00001, 0x7FFFFFFF], np.uint32).view(np.float32)
    got = reference.round_to(np.concatenate([y, nans]), F32).view(np.uint32)
    assert_bits_equal(got[:4], y.view(np.uint32))
    assert got[4:].tolist() == [0x7FC00000] * 3


# ---- fused norms: the order of the sum of squares -----------------------------------------------


def literal_sum_of_squares(x):
    """SPEC.md "Fused norms" 1-2, one float32 scalar operation at a time."""
    x = [f32(v) for v in x]
    d = len(x)
    chunks = (d + 7) // 8
    s = []
    for c in range(chunks):
        acc = f32(x[8 * c] * x[8 * c])
        for j in range(8 * c + 1, min(8 * c + 8, d)):
            acc = f32(acc + f32(x[j] * x[j]))
        s.append(acc)
    leaves = 1
    while leaves < chunks:
        leaves *= 2
    s += [f32(0)] * (leaves - chunks)
    h = leaves // 2
    while h >= 1:
        for c in range(h):
            s[c] = f32(s[c] + s[c + h])
        h //= 2
    return s[0]


def literal_rms_norm(x, dtype, eps, weight=None):
    """SPEC.md "Fused norms" 3-5 for one head ``x`` (values of the delta ``dtype``)."""
    scalar = dtype.type
    x = [f32(v) for v in x]
    ms = f32(literal_sum_of_squares(x) / f32(len(x)))
    inv_rms = f32(f32(1) / np.sqrt(f32(ms + f32(eps))))
    u = [f32(scalar(f32(v * inv_rms))) for v in x]
    if weight is None:
        return np.array(u, np.float32)
    return np.array([f32(scalar(f32(a * f32(w)))) for a, w in zip(u, weight)], np.float32)


@pytest.mark.parametrize("head_dim", [1, 7, 8, 9, 24, 40, 64, 100, 128, 257])
def test_sum_of_squares_order_is_spec_order(head_dim):
    rng = np.random.default_rng(head_dim)
    magnitudes = np.exp2(rng.integers(-20, 20, (6, head_dim)))
    x = (rng.standard_normal((6, head_dim)) * magnitudes).astype(np.float32)
    got = reference.sum_of_squares(x)
    want = np.array([literal_sum_of_squares(row) for row in x], np.float32)
    assert_bits_equal(got, want)


def test_sum_of_squares_order_differs_from_left_to_right():
    # 2^24 + 1 rounds back to 2^24: a left-to-right sum loses every 1, the chunked order keeps
    # the second chunk's 8 ones together.
    x = np.array([2.0**12] + [1.0] * 15, np.float32)
    left_to_right = f32(0)
    for v in x:
        left_to_right = f32(left_to_right + f32(v * v))
    assert left_to_right == f32(2.0**24)
    assert reference.sum_of_squares(x[None])[0] == f32(2.0**24 + 8)
    assert literal_sum_of_squares(x) == f32(2.0**24 + 8)
    # And on ordinary random heads the two orders often differ (so the order is pinned).
    rng = np.random.default_rng(0)
    heads = rng.standard_normal((200, 128)).astype(np.float32)
    plain = np.zeros(200, np.float32)
    for j in range(128):
        plain = plain + heads[:, j] * heads[:, j]
    assert np.count_nonzero(reference.sum_of_squares(heads) != plain) > 20


def test_float16_squares_are_exact_in_float32():
    # The CUDA kernel sums a float16 head's squares with fused multiply-adds: the same sums as the
    # spec's rounded product then rounded sum only because every float16 square is exact in
    # float32. Every finite float16 value, against float64 (exact for these products).
    x = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    x = x[np.isfinite(x)].astype(np.float32)
    assert x.size == 2**16 - 2**11
    assert np.array_equal((x * x).astype(np.float64), x.astype(np.float64) ** 2)
    # Not so for bfloat16 (the kernel keeps the separate product there): (1 + 2^-7) * 2^-70 is a
    # bfloat16 value whose square needs bits below float32's smallest subnormal.
    tiny = f32((1 + 2.0**-7) * 2.0**-70)
    assert np.float64(tiny * tiny) != np.float64(tiny) ** 2


@pytest.mark.parametrize("dtype", DELTA_DTYPES, ids=str)
@pytest.mark.parametrize("with_weight", [False, True])
def test_rms_norm_matches_literal_steps(dtype, with_weight):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((5, 3, 40)).astype(np.float32).astype(dtype)
    w = rng.standard_normal(40).astype(np.float32).astype(dtype) if with_weight else None
    got = reference.rms_norm(x.astype(np.float32), dtype, 1e-6, w)
    want = np.array([[literal_rms_norm(head, dtype, 1e-6, w) for head in tok] for tok in x])
    assert_bits_equal(got, want)


def _unfused_norm(x, dtype, weight, jnp_jit):
    """HF RMSNorm of ``x`` (values of ``dtype``): float32 variance, normalize, round to the dtype,
    then the weight in the dtype. In NumPy's own summation order, or jnp's under jax.jit (where
    XLA may keep a bfloat16 product in float32: its excess precision)."""
    if jnp_jit:
        import jax
        import jax.numpy as jnp

        def norm(x, w):
            x32 = x.astype(jnp.float32)
            u = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(
                x.dtype
            )
            return u if w is None else u * w

        return np.asarray(jax.jit(norm)(x, weight))
    x32 = x.astype(np.float32)
    u = (x32 / np.sqrt(np.mean(x32 * x32, axis=-1, keepdims=True) + f32(1e-6))).astype(dtype)
    return u if weight is None else (u.astype(np.float32) * weight.astype(np.float32)).astype(dtype)


def _ulps(a, b, dtype):
    bits = np.dtype(f"int{8 * np.dtype(dtype).itemsize}")
    return np.abs(a.view(bits).astype(np.int64) - b.view(bits).astype(np.int64))


def _norm_inputs(dtype, weights):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2048, 8, 128)).astype(np.float32).astype(dtype)
    low, high = weights
    return x, rng.uniform(low, high, 128).astype(np.float32).astype(dtype)


@pytest.mark.parametrize("jnp_jit", [False, True], ids=["numpy", "jnp-jit"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_normalized_values_within_one_ulp_of_the_unfused_norm(dtype, jnp_jit):
    # SPEC.md, "Against the unfused composition": the sums' orders differ, so a few elements
    # differ, by one unit at most.
    x, _ = _norm_inputs(dtype, (1, 1))
    fused = reference.rms_norm(x.astype(np.float32), dtype, 1e-6).astype(dtype)
    ulps = _ulps(fused, _unfused_norm(x, dtype, None, jnp_jit), dtype)
    assert ulps.max() <= 1
    assert np.count_nonzero(ulps) <= x.size * 1e-4


@pytest.mark.parametrize("weights", [(0.5, 1.5), (0.0, 4.0)], ids=["w0.5-1.5", "w0-4"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_weighted_keys_equal_where_the_normalized_values_are(dtype, weights):
    # With a weight, a key differs from the unfused one only where its normalized value does, and
    # then by at most two units (SPEC.md, "Against the unfused composition").
    x, w = _norm_inputs(dtype, weights)
    x32 = x.astype(np.float32)
    same_u = (
        _ulps(
            reference.rms_norm(x32, dtype, 1e-6).astype(dtype),
            _unfused_norm(x, dtype, None, False),
            dtype,
        )
        == 0
    )
    fused = reference.rms_norm(x32, dtype, 1e-6, w).astype(dtype)
    unfused = _unfused_norm(x, dtype, w, False)
    assert_bits_equal(fused[same_u], unfused[same_u])
    assert _ulps(fused, unfused, dtype).max() <= 2


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_weighted_keys_within_two_ulps_of_the_jitted_jnp_norm(dtype):
    x, w = _norm_inputs(dtype, (0.5, 1.5))
    fused = reference.rms_norm(x.astype(np.float32), dtype, 1e-6, w).astype(dtype)
    assert _ulps(fused, _unfused_norm(x, dtype, w, True), dtype).max() <= 2


def test_float32_rms_norm_within_the_summation_error_bound():
    # In float32 the final rounding does not hide the order: bound the error against float64.
    # A float32 sum of n terms in any order is within (n - 1) * 2^-24 (relative, to first
    # order) of the exact sum; the inverse square root halves that; each later step adds one
    # rounding (division by D, + eps, sqrt, 1/x, the product): 5 half-ulps more.
    rng = np.random.default_rng(3)
    x = rng.standard_normal((256, 128)).astype(np.float32)
    fused = reference.rms_norm(x, F32, 1e-6).astype(np.float64)
    x64 = x.astype(np.float64)
    exact = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + np.float64(f32(1e-6)))
    bound = ((128 - 1) / 2 + 5 * 0.5) * 2.0**-24
    assert np.all(np.abs(fused - exact) <= bound * np.abs(exact))


def test_zero_head_stays_zero():
    x = np.zeros((2, 1, 16), np.float32)
    assert_bits_equal(reference.rms_norm(x, F16, 1e-6, np.ones(16, F16)), x)


# ---- what is stored: one key, step by step ------------------------------------------------------


def _literal_key(k_head, rope_row, rotated, pool_dtype, *, weight=None, eps=1e-6, scale=None):
    """SPEC.md "What is stored" for one key head, scalar by scalar; returns the stored bits."""
    dtype = k_head.dtype
    x = k_head.astype(np.float32)
    if weight is not None:
        x = literal_rms_norm(k_head, dtype, eps, weight)
    y = x.copy()
    rotary_dim = len(rope_row) if rotated else 0
    half = rotary_dim // 2
    for i in range(half):
        c, s = f32(rope_row[i]), f32(rope_row[half + i])
        y[i] = f32(f32(x[i] * c) - f32(x[i + half] * s))
        y[i + half] = f32(f32(x[i + half] * c) + f32(x[i] * s))
    if pool_dtype in FP8_DTYPES:
        inv = f32(f32(1) / f32(scale))
        return oracle_fp8(np.array([f32(v * inv) for v in y], np.float32), pool_dtype)
    if pool_dtype == F32:
        out = y.view(np.uint32).copy()
        out[np.isnan(y)] = 0x7FC00000
        return out
    out = oracle_round16(y, pool_dtype)
    if pool_dtype == dtype and weight is None:
        untouched = np.arange(len(y)) >= rotary_dim
        out[untouched] = k_head.view(np.uint16)[untouched]
    return out


@pytest.mark.parametrize("pool_dtype", [F16, F32, BF16, E4M3, E5M2], ids=str)
@pytest.mark.parametrize("k_norm", [False, True])
def test_written_keys_match_the_literal_steps(pool_dtype, k_norm):
    rng = np.random.default_rng(11)
    problem = make_problem(
        rng,
        batch=3,
        delta_len=4,
        heads=2,
        head_dim=20,
        rotary_dim=12,
        page_size=3,
        pages_per_slot=3,
        rope_seq_len=7,
        dtype=F16,
        pool_dtype=pool_dtype,
        k_norm=k_norm,
        hostile=False,
    )
    out = reference.target_kv_cache_update(*problem.args(), **problem.kwargs())
    bits = np.dtype(f"uint{8 * pool_dtype.itemsize}")
    capacity = 9
    checked = 0
    for b in range(3):
        for t in range(4):
            pos = reference.written_position(
                problem.delta_start_positions[b], problem.delta_lengths[b], t, capacity
            )
            assert pos is not None  # hostile=False: every token lands
            page, row = b * 3 + pos // 3, pos % 3
            rotated = pos < 7
            for h in range(2):
                want = _literal_key(
                    problem.k_delta[b, t, h],
                    problem.rope_cos_sin[0, min(pos, 6)],
                    rotated,
                    pool_dtype,
                    weight=problem.k_norm_weight,
                    scale=None if problem.k_scale is None else problem.k_scale[h],
                )
                assert_bits_equal(out[0, page, row, h].view(bits), want.astype(bits))
                checked += 1
    assert checked == 24


# ---- NaN and subnormals -------------------------------------------------------------------------


def _one_token_problem(k_bits, v_bits, pool_dtype, *, rotary_dim=2, k_norm=False, v_norm=False):
    """One float16 token of 4 channels (given as bits) at slot 0 position 0, rope (c=1, s=0)."""
    k = np.array(k_bits, np.uint16).view(F16).reshape(1, 1, 1, 4)
    v = np.array(v_bits, np.uint16).view(F16).reshape(1, 1, 1, 4)
    pool = np.ones((2, 1, 1, 1, 4), np.float32).astype(pool_dtype)
    rope = np.array([[[1.0] * (rotary_dim // 2) + [0.0] * (rotary_dim // 2)]], np.float32)
    kwargs = {"pages_per_slot": 1}
    if pool_dtype in FP8_DTYPES:
        kwargs.update(k_scale=np.float32(1), v_scale=np.float32(1))
    if k_norm:
        kwargs["k_norm_weight"] = np.ones(4, F16)
    if v_norm:
        kwargs["v_norm"] = True
    out = reference.target_kv_cache_update(
        k, v, pool, rope, np.zeros(1, np.int32), np.ones(1, np.int32), **kwargs
    )
    bits = np.dtype(f"uint{8 * np.dtype(pool_dtype).itemsize}")
    return out[0, 0, 0, 0].view(bits).tolist(), out[1, 0, 0, 0].view(bits).tolist()


NAN_A, NAN_B = 0x7C01, 0xFE05  # float16 NaNs with payloads (a signalling one, a negative one)


def test_nan_copies_keep_bits_computed_nans_are_canonical():
    k, v = _one_token_problem([NAN_A, 0x3C00, NAN_B, NAN_A], [NAN_B, NAN_A, 0x3C00, 0x3C00], F16)
    # Channels < R are computed (channel 1 too: NaN * s poisons it); channels >= R are copied.
    assert k == [0x7E00, 0x7E00, NAN_B, NAN_A]
    assert v == [NAN_B, NAN_A, 0x3C00, 0x3C00]  # values copied


def test_normed_nans_are_canonical():
    k, v = _one_token_problem(
        [0x3C00, 0x3C00, 0x3C00, NAN_B],
        [NAN_B, 0x3C00, 0x3C00, 0x3C00],
        F16,
        k_norm=True,
        v_norm=True,
    )
    assert k == [0x7E00] * 4 and v == [0x7E00] * 4  # a NaN channel poisons the head's rms


@pytest.mark.parametrize(
    "pool_dtype, nan", [(F32, 0x7FC00000), (BF16, 0x7FC0), (E4M3, 0x7F), (E5M2, 0x7F)], ids=str
)
def test_converted_nans_are_canonical(pool_dtype, nan):
    k, v = _one_token_problem(
        [NAN_A, NAN_B, NAN_B, NAN_A], [NAN_B, NAN_A, 0x3C00, NAN_B], pool_dtype
    )
    assert k == [nan] * 4
    assert v[:2] == [nan] * 2 and v[3] == nan


def test_subnormals_are_kept():
    # float16 subnormals into a float32 pool, and float32 subnormal products (no flush to zero).
    k, v = _one_token_problem(
        [0x0001, 0x8003, 0x0001, 0x03FF], [0x0001, 0x0002, 0x8001, 0x0000], F32
    )
    want = np.array([0x0001, 0x8003, 0x0001, 0x03FF], np.uint16).view(F16).astype(np.float32)
    assert k == want.view(np.uint32).tolist()
    assert (
        v
        == np.array([0x0001, 0x0002, 0x8001, 0x0000], np.uint16)
        .view(F16)
        .astype(np.float32)
        .view(np.uint32)
        .tolist()
    )
    x = np.array([[[1e-39, 3e-39, 0, 0]]], np.float32)
    rope = np.array([[[0.5, 0.25]]], np.float32)  # subnormal products and differences
    out = reference.target_kv_cache_update(
        x[None],
        x[None],
        np.ones((2, 1, 1, 1, 4), np.float32),
        rope,
        np.zeros(1, np.int32),
        np.ones(1, np.int32),
        pages_per_slot=1,
    )
    y0 = f32(f32(x[0, 0, 0] * f32(0.5)) - f32(x[0, 0, 1] * f32(0.25)))
    y1 = f32(f32(x[0, 0, 1] * f32(0.5)) + f32(x[0, 0, 0] * f32(0.25)))
    assert 0 < abs(y0) < np.finfo(np.float32).tiny and 0 < y1 < np.finfo(np.float32).tiny
    assert_bits_equal(out[0, 0, 0, 0, :2], np.array([y0, y1], np.float32))


# ---- FP8 scales ---------------------------------------------------------------------------------


def _fp8_values(values, scale, dtype=E4M3):
    """Stores one float32 token of values (no rope) into an FP8 pool with per-tensor scale."""
    x = np.array(values, np.float32).reshape(1, 1, 1, -1)
    pool = np.zeros((2, 1, 1, 1, x.shape[-1]), dtype)
    rope = np.zeros((1, 1, 0), np.float32)
    out = reference.target_kv_cache_update(
        x,
        x,
        pool,
        rope,
        np.zeros(1, np.int32),
        np.ones(1, np.int32),
        pages_per_slot=1,
        k_scale=np.float32(scale),
        v_scale=np.float32(scale),
    )
    return out[0, 0, 0, 0].view(np.uint8).tolist(), out[1, 0, 0, 0].view(np.uint8).tolist()


def test_fp8_stores_value_times_reciprocal_scale():
    k, v = _fp8_values([1.0, -3.0, 0.5, 1000.0], 0.5)
    assert k == v == [0x40, 0xCC, 0x38, 0x7E]  # 2, -6, 1, and 2000 saturated to 448


def test_fp8_zero_scale_gives_nan_for_zeros_and_saturates_the_rest():
    k, _ = _fp8_values([0.0, 1.0, -1e-30], 0.0)
    assert k == [0x7F, 0x7E, 0xFE]


def test_fp8_negative_scale_flips_signs():
    k, _ = _fp8_values([1.0, -2.0], -1.0)
    assert k == [0xB8, 0x40]


def test_fp8_per_head_scales():
    x = np.ones((1, 1, 2, 2), np.float32)
    pool = np.zeros((2, 1, 1, 2, 2), E4M3)
    out = reference.target_kv_cache_update(
        x,
        x,
        pool,
        np.zeros((1, 1, 0), np.float32),
        np.zeros(1, np.int32),
        np.ones(1, np.int32),
        pages_per_slot=1,
        k_scale=np.array([1.0, 0.25], np.float32),
        v_scale=np.array([2.0, 1.0], np.float32),
    )
    assert out[0, 0, 0].astype(np.float32).tolist() == [[1, 1], [4, 4]]
    assert out[1, 0, 0].astype(np.float32).tolist() == [[0.5, 0.5], [1, 1]]


# ---- the paged contract on hand-built cases -----------------------------------------------------

N, P, D = 4, 2, 2  # pages, page size, head dim; one head; R = 0 so stored rows are the deltas


def _paged(positions, owners, table, *, ring=False):
    """Runs tokens 0..T-1 (token t's K is all 10+t, V all 20+t) into a pool of -1s; returns the
    pool as {(plane, page, row): value} of the rows that changed."""
    tokens = len(positions)
    k = np.repeat(np.arange(tokens, dtype=np.float32) + 10, D).reshape(tokens, 1, D)
    pool = np.full((2, N, P, 1, D), -1, np.float32)
    out = reference.target_kv_cache_update_paged(
        k,
        k + 10,
        pool,
        np.zeros((tokens, 0), np.float32),
        np.array(positions, np.int32),
        np.array(owners, np.int32),
        np.array(table, np.int32),
        ring=ring,
    )
    changed = np.argwhere(out[..., 0, 0] != -1)
    return {tuple(int(i) for i in idx): float(out[(*idx, 0, 0)]) for idx in changed}


# Two sequences, two pages each: K pages (2, 0) and (3, 1), V ids N + (1, 3) and N + (0, 2).
TABLE = [[[2, 0], [N + 1, N + 3]], [[3, 1], [N + 0, N + 2]]]


def test_paged_valid_tokens_interleaved():
    got = _paged([3, 0, 2, 1], [0, 1, 1, 0], TABLE)
    assert got == {
        (0, 0, 1): 10,
        (1, 3, 1): 20,  # seq 0, p 3: page 1 of seq 0 -> K 0, V 3, row 1
        (0, 3, 0): 11,
        (1, 0, 0): 21,  # seq 1, p 0: K 3, V 0, row 0
        (0, 1, 0): 12,
        (1, 2, 0): 22,  # seq 1, p 2: K 1, V 2
        (0, 2, 1): 13,
        (1, 1, 1): 23,  # seq 0, p 1: K 2, V 1
    }


@pytest.mark.parametrize(
    "owner, position",
    [(-1, 0), (2, 0), (7, 1), (0, -1), (1, -(2**31))],
    ids=["padding", "owner_B", "owner_past_B", "negative_pos", "int32_min_pos"],
)
def test_paged_guard_tokens_write_nothing(owner, position):
    assert _paged([1, position], [1, owner], TABLE) == {(0, 3, 1): 10, (1, 0, 1): 20}


def test_paged_positions_past_the_table():
    assert _paged([4, 7, 2**31 - 1], [0, 1, 0], TABLE) == {}
    # Ring: page index (p // P) % M.
    assert _paged([4, 7], [0, 1], TABLE, ring=True) == {
        (0, 2, 0): 10,
        (1, 1, 0): 20,  # p 4 -> slot 0 of seq 0, row 0
        (0, 1, 1): 11,
        (1, 2, 1): 21,  # p 7 -> slot 1 of seq 1, row 1
    }
    # 2^31 - 1 = page 2^30 - 1 (odd): slot 1 of seq 0, row 1.
    assert _paged([2**31 - 1], [0], TABLE, ring=True) == {(0, 0, 1): 10, (1, 3, 1): 20}


@pytest.mark.parametrize(
    "plane, bad",
    [
        (0, -1),
        (0, N),
        (0, 2 * N - 1),
        (0, -(2**31)),
        (1, N - 1),
        (1, 0),
        (1, 2 * N),
        (1, 2**31 - 1),
    ],
    ids=[
        "K_negative",
        "K_is_V_id",
        "K_last_V_id",
        "K_int32_min",
        "V_below_N",
        "V_zero",
        "V_past_2N",
        "V_int32_max",
    ],
)
def test_paged_invalid_page_ids_skip_both_planes(plane, bad):
    table = np.array(TABLE)
    table[0, plane, 1] = bad  # sequence 0's second page
    # Token 0 (seq 0, p 2) uses the broken entry; token 1 (seq 0, p 0) and 2 (seq 1) do not.
    got = _paged([2, 0, 3], [0, 0, 1], table)
    assert got == {(0, 2, 0): 11, (1, 1, 0): 21, (0, 1, 1): 12, (1, 2, 1): 22}


def test_paged_keys_always_rotated_with_their_token_row():
    k = np.array([[[1.0, 2.0]], [[3.0, 4.0]]], np.float32)
    rope = np.array([[0.0, 1.0], [1.0, 0.0]], np.float32)  # token 0 rotates by 90 degrees
    pool = np.zeros((2, 2, 1, 1, 2), np.float32)
    table = np.array([[[0, 1], [2, 3]]], np.int32)
    out = reference.target_kv_cache_update_paged(
        k, k, pool, rope, np.array([1, 0], np.int32), np.array([0, 0], np.int32), table
    )
    assert out[0, 1, 0, 0].tolist() == [-2.0, 1.0] and out[0, 0, 0, 0].tolist() == [3.0, 4.0]
    assert out[1, 1, 0, 0].tolist() == [1.0, 2.0] and out[1, 0, 0, 0].tolist() == [3.0, 4.0]


# ---- the two contracts agree; layers; inputs untouched ------------------------------------------


def _as_paged(problem):
    """The slot problem's tokens in the paged contract, built by hand: token-major deltas,
    identity page table, gathered rope rows (-1 owners for padding)."""
    k, v = problem.k_delta, problem.v_delta
    batch, delta_len = k.shape[:2]
    pps = problem.pages_per_slot
    num_pages, page_size = problem.past_key_value.shape[1:3]
    positions = np.full((batch, delta_len), -1, np.int32)
    owners = np.full((batch, delta_len), -1, np.int32)
    rope = np.zeros((batch, delta_len, problem.rope_cos_sin.shape[-1]), np.float32)
    for b in range(batch):
        for t in range(int(problem.delta_lengths[b])):
            pos = int(problem.delta_start_positions[b]) + t
            positions[b, t], owners[b, t] = pos, b
            rope[b, t] = problem.rope_cos_sin[0 if problem.rope_cos_sin.shape[0] == 1 else b, pos]
    pages = np.arange(batch * pps, dtype=np.int32).reshape(batch, pps)
    table = np.stack([pages, pages + num_pages], axis=1)
    flat = (batch * delta_len, *k.shape[2:])
    return (
        k.reshape(flat),
        v.reshape(flat),
        problem.past_key_value,
        rope.reshape(-1, rope.shape[-1]),
        positions.reshape(-1),
        owners.reshape(-1),
        table,
    )


@pytest.mark.parametrize("pool_dtype", [None, F32, E4M3, E5M2], ids=str)
@pytest.mark.parametrize("dtype", DELTA_DTYPES, ids=str)
@pytest.mark.parametrize("norms", [False, True])
def test_identity_table_paged_equals_slot(dtype, pool_dtype, norms):
    rng = np.random.default_rng(5)
    problem = make_problem(
        rng,
        batch=3,
        delta_len=5,
        heads=2,
        head_dim=12,
        rotary_dim=8,
        page_size=3,
        pages_per_slot=3,
        max_batch=4,
        rope_batch=3,
        dtype=dtype,
        pool_dtype=pool_dtype,
        k_norm=norms,
        v_norm=norms,
        hostile=False,
    )
    problem.delta_lengths[1] = 2  # padding in the middle of the batch
    slot = reference.target_kv_cache_update(*problem.args(), **problem.kwargs())
    kwargs = {k: v for k, v in problem.kwargs().items() if k != "pages_per_slot"}
    paged = reference.target_kv_cache_update_paged(*_as_paged(problem), **kwargs)
    assert_bits_equal(paged, slot)
    assert np.count_nonzero(slot != problem.past_key_value) > 0


def test_layered_slot_is_each_layer_alone():
    rng = np.random.default_rng(2)
    problem = make_problem(
        rng,
        layers=3,
        pool_dtype=E4M3,
        k_norm=True,
        v_norm=True,
        scale_shape=(3, 2),
        norm_weight_per_layer=True,
        rope_per_layer=True,
        positions_per_layer=True,
    )
    out = reference.target_kv_cache_update(*problem.args(), **problem.kwargs())
    for layer in range(3):
        args = [a[layer] for a in problem.args()]
        kwargs = dict(
            problem.kwargs(),
            k_scale=problem.k_scale[layer],
            v_scale=problem.v_scale[layer],
            k_norm_weight=problem.k_norm_weight[layer],
        )
        assert_bits_equal(out[layer], reference.target_kv_cache_update(*args, **kwargs))


@pytest.mark.parametrize("shared", [False, True])
def test_layered_paged_is_each_layer_alone(shared):
    rng = np.random.default_rng(4)
    per_layer = not shared
    problem = make_paged_problem(
        rng,
        tokens=10,
        batch=3,
        num_pages=9,
        table_pages=3,
        layers=3,
        pool_dtype=E5M2,
        k_norm=True,
        ring=True,
        scale_shape=(2,) if shared else (3, 1),
        rope_per_layer=per_layer,
        positions_per_layer=per_layer,
        table_per_layer=per_layer,
        norm_weight_per_layer=per_layer,
    )
    out = reference.target_kv_cache_update_paged(*problem.args(), **problem.kwargs())
    for layer in range(3):
        args = [a[layer] if per_layer or i < 3 else a for i, a in enumerate(problem.args())]
        kwargs = problem.kwargs()
        if per_layer:
            kwargs.update(
                k_scale=problem.k_scale[layer],
                v_scale=problem.v_scale[layer],
                k_norm_weight=problem.k_norm_weight[layer],
            )
        assert_bits_equal(out[layer], reference.target_kv_cache_update_paged(*args, **kwargs))


def test_inputs_are_not_modified():
    rng = np.random.default_rng(9)
    problem = make_paged_problem(rng, k_norm=True, v_norm=True, pool_dtype=E4M3)
    before = [np.copy(a) for a in problem.args()]
    out = reference.target_kv_cache_update_paged(*problem.args(), **problem.kwargs())
    for a, b in zip(problem.args(), before):
        assert_bits_equal(a, b)
    assert out is not problem.past_key_value


@pytest.mark.parametrize(
    "kwargs, name",
    [({"v_norm": 1}, "v_norm"), ({"norm_eps": "1e-6"}, "norm_eps"), ({"ring": None}, "ring")],
)
def test_bad_options_name_the_argument(kwargs, name):
    problem = make_paged_problem(np.random.default_rng(0))
    with pytest.raises((TypeError, ValueError), match=name):
        reference.target_kv_cache_update_paged(*problem.args(), **{**problem.kwargs(), **kwargs})


def test_fp8_pool_without_scales_is_rejected():
    problem = make_problem(np.random.default_rng(0), pool_dtype=E4M3)
    kwargs = {k: v for k, v in problem.kwargs().items() if k not in ("k_scale", "v_scale")}
    with pytest.raises((TypeError, ValueError), match="k_scale"):
        reference.target_kv_cache_update(*problem.args(), **kwargs)


# ---- bit-exact with the CPU kernel, special values included ----------------------------------


def _raw(x):
    """The compiled entries take bfloat16 and FP8 arrays as uint16/uint8 views."""
    x = np.ascontiguousarray(x)
    return x.view(f"uint{8 * x.dtype.itemsize}") if x.dtype in (BF16, *FP8_DTYPES) else x


def _run_cpu_kernel(problem, paged):
    cpu = pytest.importorskip("jax_dflash._dflash_cpu", reason="the CPU extension is not built")
    args = [_raw(a) for a in problem.args()]
    pool = args[2].copy()
    kw = problem.kwargs()
    extras = [_raw(kw[n]) if n in kw else None for n in ("k_scale", "v_scale", "k_norm_weight")]
    opts = dict(
        v_norm=kw.get("v_norm", False),
        norm_eps=kw.get("norm_eps", 1e-6),
        delta_dtype=str(problem.k_delta.dtype),
        pool_dtype=str(problem.past_key_value.dtype),
    )
    if paged:
        cpu.target_kv_cache_update_paged(
            *args[:2], pool, *args[3:], *extras, ring=kw["ring"], **opts
        )
    else:
        cpu.target_kv_cache_update(
            *args[:2], pool, *args[3:], *extras, pages_per_slot=kw["pages_per_slot"], **opts
        )
    return pool.view(problem.past_key_value.dtype)


SPECIALS = [np.nan, -np.inf, np.inf, 1e-40, -0.0, 6e-8, 1e30, -3e38]


@pytest.mark.parametrize("seed", range(40))
def test_bit_exact_with_the_cpu_kernel_on_special_values(seed):
    rng = np.random.default_rng(seed)
    pool_dtype = [F16, BF16, F32, E4M3, E5M2][seed % 5]
    dtype = DELTA_DTYPES[(seed // 5) % 3]
    layers = [None, 2][seed % 2]
    head_dim = int(rng.integers(2, 70))
    rotary_dim = 2 * int(rng.integers(1, head_dim // 2 + 1))
    common = dict(
        heads=2,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        dtype=dtype,
        pool_dtype=pool_dtype,
        layers=layers,
        k_norm=seed % 3 != 0,
        v_norm=seed % 4 == 0,
        norm_eps=float(rng.choice([1e-6, 0.5])),
    )
    paged = seed % 7 < 4
    if paged:
        problem = make_paged_problem(
            rng,
            tokens=16,
            batch=3,
            num_pages=7,
            page_size=3,
            table_pages=2,
            ring=seed % 3 == 1,
            **common,
        )
    else:
        problem = make_problem(
            rng,
            batch=3,
            delta_len=4,
            page_size=3,
            pages_per_slot=2,
            max_batch=4,
            rope_batch=3,
            rope_seq_len=5,
            **common,
        )
    for delta in (problem.k_delta, problem.v_delta):  # NaN, inf, subnormal, huge: 1 in 8
        flat = delta.reshape(-1)
        hit = rng.random(flat.size) < 0.125
        flat[hit] = rng.choice(np.array(SPECIALS, np.float32), int(hit.sum())).astype(dtype)
    want = (reference.target_kv_cache_update_paged if paged else reference.target_kv_cache_update)(
        *problem.args(), **problem.kwargs()
    )
    assert_bits_equal(_run_cpu_kernel(problem, paged), want)
