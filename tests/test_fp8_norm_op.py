"""Both ops with the extras: every delta x pool dtype pair, FP8 pools with per-tensor and
per-head scales (saturating ones included), the fused k/v RMS norms, NaN/inf inputs and zero
rows, against the NumPy reference bit for bit, plus the SPEC.md rules checked directly."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

import jax_dflash
from conftest import (
    DELTA_DTYPES,
    FP8_DTYPES,
    POOL_DTYPES,
    assert_bits_equal,
    device_of,
    make_paged_problem,
    make_problem,
)
from helpers.children import run_script
from helpers.ops import expected, jitted_op, run_op
from jax_dflash import reference

E4M3, E5M2 = FP8_DTYPES
# Largest finite magnitude's byte (saturation) and the NaN byte of each FP8 format.
SATURATED = {E4M3: 0x7E, E5M2: 0x7B}
FP8_NAN = 0x7F


def _both(contract, rng, **kw):
    if contract == "slot":
        return make_problem(
            rng,
            batch=3,
            max_batch=4,
            delta_len=4,
            heads=2,
            head_dim=12,
            rotary_dim=8,
            page_size=3,
            pages_per_slot=2,
            **kw,
        )
    return make_paged_problem(
        rng,
        tokens=9,
        batch=3,
        heads=2,
        head_dim=12,
        rotary_dim=8,
        num_pages=8,
        page_size=3,
        table_pages=2,
        **kw,
    )


CONTRACTS = ["slot", "paged"]


def _check(problem, backend):
    """The op equals the reference bit for bit, and writes something (a comparison of two
    untouched pools would prove nothing)."""
    out = run_op(problem, backend)
    want = expected(problem)
    assert_bits_equal(out, want)
    assert (want.view(np.uint8) != problem.past_key_value.view(np.uint8)).any(), "writes nothing"
    return out


@pytest.mark.parametrize("contract", CONTRACTS)
@pytest.mark.parametrize("pool_dtype", POOL_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", DELTA_DTYPES, ids=str)
def test_dtype_pairs_match_reference(backend, contract, dtype, pool_dtype):
    problem = _both(contract, np.random.default_rng(1), dtype=dtype, pool_dtype=pool_dtype)
    _check(problem, backend)


@pytest.mark.parametrize("contract", CONTRACTS)
@pytest.mark.parametrize(
    "norms", [(True, False), (False, True), (True, True)], ids=["k_norm", "v_norm", "both"]
)
@pytest.mark.parametrize("pool_dtype", [np.float32, ml_dtypes.bfloat16, E4M3, E5M2], ids=str)
@pytest.mark.parametrize("dtype", DELTA_DTYPES, ids=str)
def test_norms_match_reference(backend, contract, dtype, pool_dtype, norms):
    k_norm, v_norm = norms
    problem = _both(
        contract,
        np.random.default_rng(2),
        dtype=dtype,
        pool_dtype=pool_dtype,
        k_norm=k_norm,
        v_norm=v_norm,
        norm_eps=1e-5,
        hostile=False,
    )
    _check(problem, backend)


@pytest.mark.parametrize("contract", CONTRACTS)
@pytest.mark.parametrize("scale_shape", [(), (2,)], ids=["per_tensor", "per_head"])
@pytest.mark.parametrize("pool_dtype", FP8_DTYPES, ids=str)
def test_hostile_scales_match_reference(backend, contract, pool_dtype, scale_shape):
    """The builder's hostile scales reach past the format's range (saturation) and into its
    subnormals."""
    problem = _both(
        contract,
        np.random.default_rng(3),
        pool_dtype=pool_dtype,
        scale_shape=scale_shape,
        k_norm=True,
        hostile=True,
    )
    _check(problem, backend)


def _written_rows(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """[2, N, P] mask of the pool rows whose bytes changed."""
    lead = before.shape[:3]
    return (before.view(np.uint8) != after.view(np.uint8)).reshape(*lead, -1).any(-1)


@pytest.mark.parametrize("pool_dtype", FP8_DTYPES, ids=str)
def test_tiny_scale_saturates(backend, pool_dtype):
    """``y * (1 / 1e-30)`` is past every finite FP8 value: each stored byte is the largest
    finite magnitude of its sign, never NaN or a wrapped value."""
    problem = make_problem(
        np.random.default_rng(4),
        batch=2,
        delta_len=3,
        heads=2,
        head_dim=8,
        pool_dtype=pool_dtype,
        scale_shape=(),
        hostile=False,
    )
    problem.k_scale = np.float32(1e-30)
    problem.v_scale = np.float32(1e-30)
    out = _check(problem, backend)
    rows = _written_rows(problem.past_key_value, out)
    assert rows.sum() == 2 * 2 * 3  # both planes of every token
    stored = out.view(np.uint8)[rows]
    assert set(np.unique(stored & 0x7F)) == {SATURATED[np.dtype(pool_dtype)]}


def _poison(rng, x: np.ndarray) -> np.ndarray:
    """Puts NaNs (with a payload, both signs) and infinities at random places of x."""
    x = x.copy()
    flat = x.reshape(-1)
    picks = rng.choice(flat.size, size=max(4, flat.size // 6), replace=False)
    kinds = np.array([np.nan, -np.inf, np.inf, -np.nan], np.float32)
    flat[picks] = kinds[np.arange(len(picks)) % 4].astype(x.dtype)
    if x.dtype == np.float16:  # a NaN payload, to show copies keep their bits
        bits = flat.view(np.uint16)
        bits[picks[::4]] = 0x7D55
    return x


@pytest.mark.parametrize("contract", CONTRACTS)
@pytest.mark.parametrize("pool_dtype", [np.float16, np.float32, E4M3, E5M2], ids=str)
def test_nan_and_inf_inputs(backend, contract, pool_dtype):
    rng = np.random.default_rng(5)
    problem = _both(
        contract, rng, dtype=np.float16, pool_dtype=pool_dtype, k_norm=True, hostile=False
    )
    problem.k_delta = _poison(rng, problem.k_delta)
    problem.v_delta = _poison(rng, problem.v_delta)
    out = _check(problem, backend)
    rows = _written_rows(problem.past_key_value, out)
    if np.dtype(pool_dtype) in FP8_DTYPES:
        # NaN is 0x7F (positive), infinities saturate: no other NaN or infinity byte.
        stored = out.view(np.uint8)[rows]
        magnitude = stored & 0x7F
        special = magnitude == 0x7F if np.dtype(pool_dtype) == E4M3 else magnitude >= 0x7C
        assert FP8_NAN in stored
        assert (stored[special] == FP8_NAN).all()
    elif np.dtype(pool_dtype) == np.float16:
        # Values are copied (same dtype, no v-norm): the payload NaN survives, bit for bit.
        assert np.isin(out[1].view(np.uint16)[rows[1]], [0x7D55]).any()


@pytest.mark.parametrize("contract", CONTRACTS)
@pytest.mark.parametrize("pool_dtype", [np.float16, E4M3], ids=str)
def test_zero_rows_stay_zero_under_norms(backend, contract, pool_dtype):
    """eps > 0 keeps 1 / rms finite: a zero head is stored as zero, not NaN."""
    problem = _both(
        contract,
        np.random.default_rng(6),
        dtype=np.float16,
        pool_dtype=pool_dtype,
        k_norm=True,
        v_norm=True,
        hostile=False,
    )
    problem.k_delta[..., 0, :] = 0
    problem.v_delta[..., 1, :] = 0
    out = _check(problem, backend)
    rows = _written_rows(problem.past_key_value, out)
    as_f32 = out.astype(np.float32)
    assert (as_f32[0][rows[0]][:, 0] == 0).all()  # keys, head 0
    assert (as_f32[1][rows[1]][:, 1] == 0).all()  # values, head 1
    assert not np.isnan(as_f32[:, rows.any(0)]).any()


@pytest.mark.parametrize("k_norm", [False, True], ids=["plain", "k_norm"])
@pytest.mark.parametrize("pool_dtype", FP8_DTYPES, ids=str)
def test_large_paged_fp8_launch_matches_reference(backend, pool_dtype, k_norm):
    """32 MiB of float16 K and V deltas (8192 tokens of 8 heads of 128 channels, with hostile
    tokens among them): the size from which the CUDA launcher reads the paged FP8 kernels'
    deltas with evict-first loads, a second instantiation of each kernel."""
    problem = make_paged_problem(
        np.random.default_rng(7),
        tokens=8192,
        batch=3,
        heads=8,
        head_dim=128,
        num_pages=72,
        page_size=128,
        table_pages=24,
        dtype=np.float16,
        pool_dtype=pool_dtype,
        k_norm=k_norm,
        scale_shape=(8,),
    )
    assert 2 * problem.k_delta.nbytes >= 32 << 20
    _check(problem, backend)


def test_scalar_python_scale_is_a_per_tensor_scale(backend):
    problem = make_problem(np.random.default_rng(7), pool_dtype=E4M3, scale_shape=(), hostile=False)
    device = device_of(backend)
    op = functools.partial(
        jax_dflash.target_kv_cache_update,
        pages_per_slot=2,
        k_scale=float(problem.k_scale),
        v_scale=float(problem.v_scale),
    )
    out = jax.jit(op)(*[jax.device_put(a, device) for a in problem.args()])
    assert_bits_equal(out, expected(problem))


# ---- vmap with per-layer extras ------------------------------------------------------------------


@pytest.mark.parametrize("contract", CONTRACTS)
def test_vmap_with_per_layer_scales_and_weight(backend, contract):
    """Mapped scalar scales become [layers, 1], a mapped weight [layers, D]; one launch equals
    the per-layer loop."""
    layers = 3
    rng = np.random.default_rng(8)
    problems = [
        _both(contract, rng, pool_dtype=E4M3, scale_shape=(), k_norm=True, v_norm=True)
        for _ in range(layers)
    ]
    # Shared rope and index operands (layer 0's); per-layer k, v, pool, scales and weight.
    shared = problems[0].args()[3:]
    stacked = [np.stack([p.args()[i] for p in problems]) for i in range(3)]
    scales = [np.stack([getattr(p, n) for p in problems]) for n in ("k_scale", "v_scale")]
    weight = np.stack([p.k_norm_weight for p in problems])
    if contract == "slot":

        def op(k, v, pool, *rest, k_scale, v_scale, w):
            return jax_dflash.target_kv_cache_update(
                k,
                v,
                pool,
                *rest,
                pages_per_slot=2,
                k_scale=k_scale,
                v_scale=v_scale,
                k_norm_weight=w,
                v_norm=True,
            )

        ref = functools.partial(reference.target_kv_cache_update, pages_per_slot=2)
        primitive = jax_dflash.target_kv_cache_update_p
    else:

        def op(k, v, pool, *rest, k_scale, v_scale, w):
            return jax_dflash.target_kv_cache_update_paged(
                k, v, pool, *rest, k_scale=k_scale, v_scale=v_scale, k_norm_weight=w, v_norm=True
            )

        ref = reference.target_kv_cache_update_paged
        primitive = jax_dflash.target_kv_cache_update_paged_p

    def batched(k, v, pool, ks, vs, w, *rest):
        return jax.vmap(
            lambda k_, v_, p_, ks_, vs_, w_: op(k_, v_, p_, *rest, k_scale=ks_, v_scale=vs_, w=w_)
        )(k, v, pool, ks, vs, w)

    operands = [*stacked, *scales, weight, *shared]
    jaxpr = jax.make_jaxpr(batched)(*operands)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is primitive]
    extra_shapes = [tuple(x.aval.shape) for x in eqn.invars[-3:]]
    assert extra_shapes == [(layers, 1), (layers, 1), (layers, problems[0].k_delta.shape[-1])]
    device = device_of(backend)
    out = jax.jit(batched)(*[jax.device_put(a, device) for a in operands])
    want = np.stack(
        [
            ref(
                *p.args()[:3],
                *shared,
                k_scale=p.k_scale,
                v_scale=p.v_scale,
                k_norm_weight=p.k_norm_weight,
                v_norm=True,
            )
            for p in problems
        ]
    )
    assert_bits_equal(out, want)


# ---- the FFI ABI (SPEC.md, "The XLA FFI custom calls"), read from the lowered program ------------


def _custom_call_line(text: str, target: str) -> str:
    (line,) = [ln for ln in text.splitlines() if f"stablehlo.custom_call @{target}(" in ln]
    return line


@pytest.mark.parametrize("contract", CONTRACTS)
def test_lowering_follows_the_ffi_abi(contract):
    """Operands: the base ones, k_scale, v_scale, then k_norm_weight; typed attributes; the
    result aliases operand 2."""
    problem = _both(
        contract,
        np.random.default_rng(9),
        dtype=ml_dtypes.bfloat16,
        pool_dtype=E5M2,
        k_norm=True,
        v_norm=True,
        norm_eps=1e-5,
    )
    fn, operands = jitted_op(problem)
    line = _custom_call_line(
        fn.lower(*operands).as_text(),
        "dflash_target_kv_cache_update" + ("_paged" if contract == "paged" else ""),
    )
    signature = line.split(" : (", 1)[1].split(") -> ", 1)[0]
    types = [t.strip() for t in signature.split("tensor<")[1:]]
    base = 7 if contract == "paged" else 6
    assert len(types) == base + 3
    heads, head_dim = problem.k_delta.shape[-2:]
    assert types[base].startswith(f"{heads}xf32>") and types[base + 1].startswith(f"{heads}xf32>")
    assert types[base + 2].startswith(f"{head_dim}xbf16>")
    assert "operand_index = 2" in line
    assert "k_norm = true" in line and "v_norm = true" in line
    assert "norm_eps = 9.99999974E-6 : f32" in line
    if contract == "slot":
        assert "pages_per_slot = 2 : i64" in line and "ring" not in line
    else:
        assert "ring = false" in line and "pages_per_slot" not in line


def test_nested_vmap_folds_scales_and_weight(backend):
    """vmap over a vmap: scales mapped by the outer one only (scalar per outer index) and a
    weight shared by everything become [outer * layers, 1] and [outer * layers, D] operands of
    one call."""
    outer, layers = 2, 3
    rng = np.random.default_rng(10)
    problems = [
        [
            make_problem(
                rng,
                batch=2,
                delta_len=3,
                heads=2,
                head_dim=4,
                page_size=2,
                pages_per_slot=2,
                pool_dtype=E4M3,
                scale_shape=(),
                k_norm=True,
            )
            for _ in range(layers)
        ]
        for _ in range(outer)
    ]
    first = problems[0][0]
    stacked = [
        np.stack([np.stack([p.args()[i] for p in row]) for row in problems]) for i in range(3)
    ]
    k_scale = np.stack([row[0].k_scale for row in problems])  # [outer]
    v_scale = np.stack([row[0].v_scale for row in problems])
    weight = first.k_norm_weight

    def op(k, v, pool, ks, vs):
        return jax_dflash.target_kv_cache_update(
            k,
            v,
            pool,
            *first.args()[3:],
            pages_per_slot=2,
            k_scale=ks,
            v_scale=vs,
            k_norm_weight=weight,
        )

    fn = jax.vmap(jax.vmap(op, in_axes=(0, 0, 0, None, None)), in_axes=(0, 0, 0, 0, 0))
    jaxpr = jax.make_jaxpr(fn)(*stacked, k_scale, v_scale)
    (eqn,) = [e for e in jaxpr.eqns if e.primitive is jax_dflash.target_kv_cache_update_p]
    assert [tuple(x.aval.shape) for x in eqn.invars[-3:]] == [
        (outer * layers, 1),
        (outer * layers, 1),
        (outer * layers, 4),
    ]
    device = device_of(backend)
    out = jax.jit(fn)(*[jax.device_put(a, device) for a in (*stacked, k_scale, v_scale)])
    want = np.stack(
        [
            np.stack(
                [
                    reference.target_kv_cache_update(
                        *p.args()[:3],
                        *first.args()[3:],
                        pages_per_slot=2,
                        k_scale=row[0].k_scale,
                        v_scale=row[0].v_scale,
                        k_norm_weight=weight,
                    )
                    for p in row
                ]
            )
            for row in problems
        ]
    )
    assert_bits_equal(out, want)


@pytest.mark.parametrize("pool_dtype", FP8_DTYPES, ids=str)
def test_fp8_slot_donation_is_in_place(backend, pool_dtype):
    """A donated FP8 pool is updated in its own buffer: no copy in the program, same pointer."""
    problem = make_problem(
        np.random.default_rng(11), pool_dtype=pool_dtype, k_norm=True, hostile=False
    )
    fn, operands = jitted_op(problem, donate=True)
    hlo = fn.lower(*operands).compile().as_text()
    assert "input_output_alias={ {}: (2, {}" in hlo
    pool_type = {"float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2"}[np.dtype(pool_dtype).name]
    shape = f"{pool_type}[{','.join(map(str, problem.past_key_value.shape))}]"
    assert [ln for ln in hlo.splitlines() if " copy(" in ln and shape in ln] == []
    device = device_of(backend)
    operands = [jax.device_put(a, device) for a in operands]
    operands[2] = jax.numpy.copy(operands[2])  # a buffer of XLA's own, which donation reuses
    pointer = operands[2].unsafe_buffer_pointer()
    out = fn(*operands)
    assert out.unsafe_buffer_pointer() == pointer
    assert_bits_equal(out, expected(problem))


# ---- the CPU kernel's vector and portable paths -------------------------------------------------

_CPU_PATHS_SCRIPT = r"""
import sys, numpy as np, ml_dtypes
from jax_dflash import _dflash_cpu, reference, testing

# FP8 stores: V of float32 deltas (no norm, no rotation) over 2^24 float32 bit patterns, every
# exponent and the top 16 mantissa bits (ties of both formats included), low bits random; with
# a scale of 1 and one that is not a power of two.
rng = np.random.default_rng(7)
bits = (np.arange(2**24, dtype=np.uint32) << 8) | rng.integers(0, 256, 2**24).astype(np.uint32)
values = bits.view(np.float32)
heads, head_dim, page = 1, 128, 128
tokens = values.size // head_dim
pages = tokens // page
v = values.reshape(tokens, heads, head_dim)
k = np.zeros_like(v)
positions = np.arange(tokens, dtype=np.int32)
owners = np.zeros(tokens, np.int32)
table = np.stack([np.arange(pages), pages + np.arange(pages)]).astype(np.int32)[None]
rope = np.zeros((tokens, 0), np.float32)
for name in ("float8_e4m3fn", "float8_e5m2"):
    dtype = np.dtype(getattr(ml_dtypes, name))
    for scale in (1.0, 0.37):
        pool = np.zeros((2, pages, page, heads, head_dim), np.uint8)
        s = np.full((heads,), scale, np.float32)
        _dflash_cpu.target_kv_cache_update_paged(k, v, pool, rope, positions, owners, table, s, s,
                                                 pool_dtype=name)
        inv = np.float32(1) / np.float32(scale)
        with np.errstate(all="ignore"):
            want = reference.round_fp8(values * inv, dtype).view(np.uint8)
        got = pool[1].reshape(-1)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, (name, scale, bad.size, hex(bits[bad[0]]), got[bad[0]], want[bad[0]])

# int8 stores with static scales over the same patterns: y / s, rounded half to even, clamped.
for scale in (1.0, 0.37):
    pool = np.zeros((2, pages, page, heads, head_dim), np.int8)
    s = np.full((heads,), scale, np.float32)
    _dflash_cpu.target_kv_cache_update_paged(k, v, pool, rope, positions, owners, table, s, s,
                                             pool_dtype="int8")
    with np.errstate(all="ignore"):
        want = reference.round_int8(values / np.float32(scale))
    bad = np.flatnonzero(pool[1].reshape(-1) != want)
    assert bad.size == 0, ("int8", scale, bad.size, hex(bits[bad[0]]))

# Scale-pool stores (every format) over the same patterns, in rows of neighbouring patterns and
# in shuffled rows (mixed exponents; rows with infinities and NaNs), plus rows whose scale is 0:
# zeros of both signs, and the smallest subnormals (whose maximum / qmax underflows).
tiny = np.full((4, head_dim), 1e-45, np.float32)
tiny[1] = -tiny[1]
zeros = np.zeros((2, head_dim), np.float32)
zeros[1] = -0.0
for order in ("neighbours", "shuffled"):
    rows = values if order == "neighbours" else values[rng.permutation(values.size)]
    rows = np.concatenate([rows.reshape(-1, head_dim), tiny, zeros])
    rows = rows[: rows.shape[0] // page * page]  # whole pages (drops the last few shuffled rows)
    n = rows.shape[0]
    vv = rows.reshape(n, heads, head_dim)
    kk = np.zeros_like(vv)
    p_rows = np.arange(n, dtype=np.int32)
    p_owners = np.zeros(n, np.int32)
    p_pages = n // page
    p_table = np.stack([np.arange(p_pages), p_pages + np.arange(p_pages)]).astype(np.int32)[None]
    p_rope = np.zeros((n, 0), np.float32)
    for name in ("int8", "float8_e4m3fn", "float8_e5m2", "int4"):
        last = head_dim // 2 if name == "int4" else head_dim
        pool = np.zeros((2, p_pages, page, heads, last), np.int8 if name == "int8" else np.uint8)
        scales = np.zeros((2, p_pages, page, heads), np.float32)
        fp8 = name.startswith("float8")  # given as bytes, named
        _dflash_cpu.update("paged", [kk, vv, pool, p_rope, p_rows, p_owners, p_table],
                           scale_pool=scales, pool_dtype=name if fp8 else "")
        pool_dtype = np.dtype(np.uint8) if name == "int4" else np.dtype(getattr(ml_dtypes, name, name))
        want, want_scales = reference.dynamic_store(rows, pool_dtype)
        got = pool[1].reshape(n, last)
        got_scales = scales[1].reshape(n)
        bad = np.flatnonzero(np.any(got.view(np.uint8) != want.view(np.uint8).reshape(n, last), axis=1))
        assert bad.size == 0, (name, order, bad.size, rows[bad[0]])
        testing.assert_bits_equal(got_scales, want_scales)

# Norms, cross-dtype and FP8 pools on rows of every width class (8-channel blocks and tails).
for delta in testing.DELTA_DTYPES:
    for pool_dtype in testing.POOL_DTYPES:
        for head_dim, rotary_dim in ((128, 128), (40, 24), (9, 6)):
            p = testing.make_paged_problem(rng, tokens=12, batch=3, heads=2, head_dim=head_dim,
                                           rotary_dim=rotary_dim, num_pages=12, table_pages=4,
                                           dtype=delta, pool_dtype=pool_dtype, k_norm=True,
                                           v_norm=True)
            want = reference.target_kv_cache_update_paged(*p.args(), **p.kwargs())
            import jax, jax_dflash
            got = jax.jit(lambda *a: jax_dflash.target_kv_cache_update_paged(*a, **p.kwargs()))(*p.args())
            testing.assert_bits_equal(np.asarray(got), want)
print("cpu paths ok")
"""


@pytest.mark.parametrize("portable", [False, True], ids=["avx2-if-present", "portable"])
def test_cpu_general_path_matches_reference(portable):
    """The CPU kernel's general path (norms, cross-dtype, FP8), with its AVX2 + F16C row passes
    where the CPU has them and with the portable code: FP8 stores equal the reference's rounding
    over 2^24 float32 bit patterns, and norm/FP8/cross-dtype updates equal the reference."""
    env = {"JAX_DFLASH_CPU_PORTABLE": "1"} if portable else {}
    result = run_script(_CPU_PATHS_SCRIPT, Path(__file__).parent, env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cpu paths ok" in result.stdout
