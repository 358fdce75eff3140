"""Per-token-head dynamic scales (``scale_pool``, SPEC.md "Dynamic scales"): every addressing
form, every scaled pool format, unbatched, layer-batched and under ``vmap``.

Two oracles. The NumPy reference, bit for bit. And, independently of its indexing, the op itself
on a float32 pool: a float32 pool stores each written row's float32 values ``y`` exactly, so the
rows it writes are the rows the scaled call must write, and quantizing its ``y`` by the spec's
formula must give the scaled call's elements and scales; every other row keeps its bits in both
arrays.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_dflash
from helpers.ops import (
    FORM_OPS,
    FORMS,
    assert_cuda_scale_pool_call_matches_the_reference,
)
from helpers.ops import run_with_scale_pool as _run
from jax_dflash import reference
from jax_dflash._shapes import POOL_FORMATS, check_call
from jax_dflash.testing import (
    DELTA_DTYPES,
    SCALED_DTYPES,
    assert_bits_equal,
    gpu_devices,
    make_paged_problem,
    make_problem,
)

OPS = FORM_OPS
# A NaN whose payload no store produces (stores write the canonical NaN 0x7FC00000): marks the
# float32 pool's rows that were not written.
_UNWRITTEN = np.uint32(0x7FBADBAD)


def _random_scale_pool(rng, pool_shape):
    """Random float32 bits (NaN payloads and infinities included): rows not written must keep
    them exactly."""
    bits = rng.integers(0, 2**32, pool_shape[:-1], dtype=np.uint64).astype(np.uint32)
    return bits.view(np.float32)


def _problem(
    rng,
    form,
    pool_dtype,
    *,
    layers=None,
    delta=np.float16,
    k_norm=False,
    v_norm=False,
    head_dim=16,
    rotary_dim=None,
    **sizes,
):
    """``(args, kwargs)`` of one hostile call of ``form`` with a scale pool (no static scales):
    negative, padded and past-the-pool positions, owners, page ids and slots. ``sizes``: the
    problem builder's own (batch, heads, tokens, pages), default its small ones."""
    common = dict(dtype=delta, pool_dtype=pool_dtype, layers=layers, k_norm=k_norm, v_norm=v_norm)
    common.update(head_dim=head_dim, rotary_dim=rotary_dim, **sizes)
    if form == "slot":
        problem = make_problem(rng, **{"rope_seq_len": 5, **common})
    else:
        problem = make_paged_problem(rng, **common)
    kwargs = {k: v for k, v in problem.kwargs().items() if k not in ("k_scale", "v_scale")}
    args = list(problem.args())
    if form == "slot_mapping":
        kwargs.pop("ring")
        pool = args[2]
        rows = pool.shape[-4] * pool.shape[-3]  # N * P
        tokens = args[0].shape[-3]
        # Distinct slots (one token per row, so CPU and CUDA agree), with slots below 0 and past
        # N * P mixed in.
        slots = rng.permutation(np.arange(-3, rows + 3))[:tokens].astype(np.int32)
        args = [*args[:4], slots]
    kwargs["scale_pool"] = _random_scale_pool(rng, args[2].shape)
    return args, kwargs


def _float32_rows(form, args, kwargs):
    """The float32 values ``y`` the call stores, from the op on a float32 pool filled with the
    unwritten marker: ``(y, written)`` with ``written`` the ``[..., 2, N, P, H]`` rows it wrote."""
    pool = np.full(args[2].shape, _UNWRITTEN, np.uint32).view(np.float32)
    plain = {k: v for k, v in kwargs.items() if k != "scale_pool"}
    y = np.asarray(OPS[form][0](*args[:2], pool, *args[3:], **plain))
    written = (y.view(np.uint32) != _UNWRITTEN).any(axis=-1)
    assert (y.view(np.uint32) != _UNWRITTEN).all(axis=-1)[written].all(), "a row half written"
    return y, written


def _spec_quantize(y, pool_dtype):
    """SPEC.md's formula, written out on its own: ``s = max|y| / qmax`` (NaN for a non-finite
    row), elements ``y / s`` in the format's conversion, zeros where ``s == 0``."""
    qmax = np.float32(POOL_FORMATS[str(np.dtype(pool_dtype))]["max_finite"])
    with np.errstate(all="ignore"):
        finite = np.isfinite(y).all(axis=-1)
        s = np.where(finite, np.abs(y).max(axis=-1) / qmax, np.float32(np.nan)).astype(np.float32)
        q = (y / s[..., None]).astype(np.float32)
        q = np.where(s[..., None] == 0, np.float32(0), q)
        if np.dtype(pool_dtype) == np.int8:
            elements = np.rint(np.clip(np.nan_to_num(q, nan=0.0), -127, 127)).astype(np.int8)
        else:
            elements = reference.round_fp8(q, pool_dtype)
    return elements, s


def _same_bits(actual, expected):
    """assert_bits_equal, also for selections of no rows."""
    if np.asarray(expected).size or np.asarray(actual).size:
        assert_bits_equal(actual, expected)


def _check_against_float32(form, args, kwargs, pool, scales):
    """The scaled call wrote exactly the float32 call's rows, as the spec's formula says, and
    kept every other row's element and scale bits."""
    y, written = _float32_rows(form, args, kwargs)
    elements, s = _spec_quantize(y[written], args[2].dtype)
    _same_bits(pool[written], elements)
    got_s = scales[written]
    nan = np.isnan(s)
    assert (got_s.view(np.uint32)[nan] == 0x7FC00000).all(), "a non-finite row's scale"
    _same_bits(got_s[~nan], s[~nan])
    _same_bits(pool[~written], args[2][~written])
    _same_bits(scales[~written], kwargs["scale_pool"][~written])
    return written


@st.composite
def _calls(draw):
    return dict(
        form=draw(st.sampled_from(FORMS)),
        pool_dtype=draw(st.sampled_from(SCALED_DTYPES)),
        layers=draw(st.sampled_from([None, 2])),
        delta=draw(st.sampled_from(DELTA_DTYPES)),
        k_norm=draw(st.booleans()),
        v_norm=draw(st.booleans()),
        **draw(st.integers(1, 40).flatmap(_head_dims)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _head_dims(head_dim):
    rotary = st.integers(0, head_dim // 2).map(lambda half: 2 * half)
    return rotary.map(lambda r: dict(head_dim=head_dim, rotary_dim=r))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=_calls())
def test_cpu_matches_the_reference_and_the_spec(call):
    seed, form = call.pop("seed"), call.pop("form")
    args, kwargs = _problem(np.random.default_rng(seed), form, call.pop("pool_dtype"), **call)
    pool, scales = _run(form, args, kwargs)
    want_pool, want_scales = OPS[form][1](*args, **kwargs)
    assert_bits_equal(pool, want_pool)
    assert_bits_equal(scales, want_scales)
    _check_against_float32(form, args, kwargs, pool, scales)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("pool_dtype", SCALED_DTYPES, ids=str)
@pytest.mark.parametrize("layers", [None, 3], ids=["unbatched", "layered"])
def test_every_form_format_and_layout_writes_rows(form, pool_dtype, layers):
    args, kwargs = _problem(np.random.default_rng(7), form, pool_dtype, layers=layers)
    pool, scales = _run(form, args, kwargs)
    want_pool, want_scales = OPS[form][1](*args, **kwargs)
    assert_bits_equal(pool, want_pool)
    assert_bits_equal(scales, want_scales)
    written = _check_against_float32(form, args, kwargs, pool, scales)
    assert written.any() and not written.all(), "the problem writes some rows and not others"


def _one_row_call(pool_dtype, key, value, delta=np.float32):
    """A slot-mapping call writing one token (one head, no rotation) at slot 1 of a 2-page pool:
    ``(pool, scale_pool)`` from the CPU kernel, checked against the reference."""
    d = len(key)
    k = np.asarray(key, np.float32).astype(delta).reshape(1, 1, d)
    v = np.asarray(value, np.float32).astype(delta).reshape(1, 1, d)
    pool = np.full((2, 2, 2, 1, d), 5, np.uint8).view(pool_dtype)
    scale_pool = np.full((2, 2, 2, 1), 3.0, np.float32)
    args = [k, v, pool, np.zeros((1, 0), np.float32), np.array([1], np.int32)]
    kwargs = dict(scale_pool=scale_pool)
    got = _run("slot_mapping", args, kwargs)
    want = reference.target_kv_cache_update_slots(*args, **kwargs)
    assert_bits_equal(got[0], want[0])
    assert_bits_equal(got[1], want[1])
    untouched = np.ones((2, 2, 2), bool)
    untouched[:, 0, 1] = False
    assert (got[0].view(np.uint8)[untouched] == 5).all() and (got[1][untouched] == 3.0).all()
    return got[0][:, 0, 1, 0], got[1][:, 0, 1, 0]


QMAX_CODE = {np.dtype(np.int8): 127, SCALED_DTYPES[0]: 0x7E, SCALED_DTYPES[1]: 0x7B}


@pytest.mark.parametrize("pool_dtype", SCALED_DTYPES, ids=str)
def test_zero_rows_store_a_zero_scale_and_zeros(pool_dtype):
    elements, scales = _one_row_call(pool_dtype, [0.0, -0.0, 0.0], [0.0, 0.0, -0.0])
    assert (scales.view(np.uint32) == 0).all()
    assert (elements.view(np.uint8) == 0).all()


@pytest.mark.parametrize("pool_dtype", SCALED_DTYPES, ids=str)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_rows_store_a_nan_scale(pool_dtype, bad):
    elements, scales = _one_row_call(pool_dtype, [1.0, bad, -2.0], [bad, 0.0, 4.0])
    assert (scales.view(np.uint32) == 0x7FC00000).all(), "the canonical float32 NaN"
    want = 0 if np.dtype(pool_dtype) == np.int8 else 0x7F
    assert (elements.view(np.uint8) == want).all()


@pytest.mark.parametrize("pool_dtype", SCALED_DTYPES, ids=str)
def test_a_row_spans_the_format_and_keeps_its_sign(pool_dtype):
    values = [3.0, -1.5, 0.25, -3.0, 0.0]
    elements, scales = _one_row_call(pool_dtype, values, values)
    qmax = np.float32(POOL_FORMATS[str(np.dtype(pool_dtype))]["max_finite"])
    assert (scales == np.float32(3.0) / qmax).all()
    code = QMAX_CODE[np.dtype(pool_dtype)]
    bits = elements.view(np.uint8)
    if np.dtype(pool_dtype) == np.int8:
        assert elements[0].tolist() == [127, -64, 11, -127, 0]
    else:
        assert bits[0, 0] == code and bits[0, 3] == code | 0x80 and bits[0, 4] == 0


@pytest.mark.parametrize("pool_dtype", SCALED_DTYPES, ids=str)
@pytest.mark.parametrize("magnitude", [1e-45, 3e-43, 1e-39, 1e-38], ids=str)
def test_tiny_rows_saturate_where_the_scale_is_subnormal(pool_dtype, magnitude):
    """For a maximum near the smallest floats the scale a / qmax is subnormal (or 0), so y / s
    can land past qmax: the stores saturate (or, at s = 0, store zeros)."""
    values = np.array([magnitude, -magnitude, magnitude / 3, 0.0], np.float32)
    elements, scales = _one_row_call(pool_dtype, values, values * 2)
    code = QMAX_CODE[np.dtype(pool_dtype)]
    bits = elements.view(np.uint8).astype(int)
    if np.dtype(pool_dtype) == np.int8:
        assert np.abs(elements.astype(int)).max() <= 127
    else:
        assert ((bits & 0x7F) <= code).all(), "never past the largest finite code"
    zero = scales == 0
    assert (bits[zero] == 0).all()


def test_saturation_of_the_maximum():
    # Where a / (a / qmax) rounds above qmax the maximum saturates to the largest code.
    for pool_dtype in SCALED_DTYPES:
        qmax = np.float32(POOL_FORMATS[str(np.dtype(pool_dtype))]["max_finite"])
        rng = np.random.default_rng(11)
        a = rng.uniform(0.5, 2, 4096).astype(np.float32)
        over = a / (a / qmax) > qmax
        assert over.any(), "some maxima divide back to above qmax"
        value = float(a[over][0])
        elements, _ = _one_row_call(pool_dtype, [value, -value], [value, 1.0])
        code = QMAX_CODE[np.dtype(pool_dtype)]
        if np.dtype(pool_dtype) == np.int8:
            assert elements[:, 0].tolist() == [127, 127]
        else:
            assert (elements.view(np.uint8)[:, 0] == code).all()


# ---- errors: one checker for every entry point ----------------------------------------------


def _paged_args(pool_dtype=np.int8, layers=None):
    args, kwargs = _problem(np.random.default_rng(0), "paged", pool_dtype, layers=layers)
    return args, kwargs


def test_static_scales_and_a_scale_pool_together_are_an_error():
    args, kwargs = _paged_args()
    scale = dict(k_scale=np.float32(1), v_scale=np.float32(1))
    for call in (jax_dflash.target_kv_cache_update_paged, reference.target_kv_cache_update_paged):
        with pytest.raises(TypeError, match="scale_pool: per-token-head scales replace"):
            call(*args, **kwargs, **scale)


@pytest.mark.parametrize("pool_dtype", DELTA_DTYPES, ids=str)
def test_a_scale_pool_needs_a_pool_format_with_scales(pool_dtype):
    args, kwargs = _paged_args()
    args[2] = np.zeros(args[2].shape, pool_dtype)
    for call in (jax_dflash.target_kv_cache_update_paged, reference.target_kv_cache_update_paged):
        with pytest.raises(TypeError, match=f"scale_pool: a {np.dtype(pool_dtype)} pool takes no"):
            call(*args, **kwargs)


def test_a_scale_pool_of_the_wrong_shape_or_dtype_is_an_error():
    args, kwargs = _paged_args()
    pool = args[2]
    wanted = ", ".join(map(str, pool.shape[:-1]))
    for shape in (pool.shape, pool.shape[:-2], (2, *pool.shape[1:-2], pool.shape[-2] + 1)):
        bad = dict(kwargs, scale_pool=np.zeros(shape, np.float32))
        with pytest.raises(ValueError, match=rf"scale_pool: expected \[{wanted}\]"):
            jax_dflash.target_kv_cache_update_paged(*args, **bad)
    bad = dict(kwargs, scale_pool=np.zeros(pool.shape[:-1], np.float16))
    with pytest.raises(TypeError, match="scale_pool: expected dtype float32, got float16"):
        jax_dflash.target_kv_cache_update_paged(*args, **bad)
    layered_args, layered_kwargs = _paged_args(layers=2)
    bad = dict(layered_kwargs, scale_pool=kwargs["scale_pool"])  # one layer's scale pool
    with pytest.raises(ValueError, match=r"scale_pool: expected \[2, 2, 8, 4, 2\]"):
        jax_dflash.target_kv_cache_update_paged(*layered_args, **bad)


def test_tensorrt_takes_a_scale_pool_of_pages_of_128_tokens():
    args, kwargs = _paged_args()
    operands = [*args, kwargs["scale_pool"]]
    # The problem's pages hold 8 tokens: TensorRT's profile wants 128, named on the pool.
    with pytest.raises(ValueError, match="past_key_value: expected .*128 tokens per page"):
        check_call("paged", operands, tensorrt=True, scale_pool=True)
    pool = np.zeros((2, 2, 128, *args[2].shape[3:]), args[2].dtype)
    scales = np.zeros(pool.shape[:-1], np.float32)
    shape = check_call(
        "paged", [*args[:2], pool, *args[3:], scales], tensorrt=True, scale_pool=True
    )
    assert shape["scale_pool"]


# ---- jit with donation, vmap, sharding -----------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_jit_with_both_donated_updates_in_place(form):
    args, kwargs = _problem(np.random.default_rng(3), form, ml_dtypes.float8_e4m3fn)
    want = OPS[form][1](*args, **kwargs)
    scale_pool = kwargs.pop("scale_pool")

    def update(pool, scales, *rest):
        return OPS[form][0](*rest[:2], pool, *rest[2:], scale_pool=scales, **kwargs)

    step = jax.jit(update, donate_argnums=(0, 1))
    rest = [*args[:2], *args[3:]]
    pool, scales = jnp.asarray(args[2]), jnp.asarray(scale_pool)
    hlo = step.lower(pool, scales, *rest).compile().as_text()
    assert "input_output_alias" in hlo and "{0}: (0, {}" in hlo and "{1}: (1, {}" in hlo, (
        "the program does not alias both donated buffers to its results"
    )
    out_pool, out_scales = step(pool, scales, *rest)
    assert pool.is_deleted() and scales.is_deleted(), "the donated buffers were not taken"
    assert_bits_equal(np.asarray(out_pool), want[0])
    assert_bits_equal(np.asarray(out_scales), want[1])


@pytest.mark.parametrize("form", FORMS)
def test_vmap_over_layers_is_the_layered_call(form):
    args, kwargs = _problem(np.random.default_rng(5), form, np.int8, layers=3)
    want = OPS[form][1](*args, **kwargs)
    op = OPS[form][0]
    shared = list(args)
    in_axes = [0, 0, 0] + [None] * (len(args) - 3)
    if form == "slot":
        kw = dict(pages_per_slot=kwargs["pages_per_slot"])
    elif form == "paged":
        kw = dict(ring=kwargs["ring"])
    else:
        kw = {}
    for name in ("k_norm_weight", "v_norm", "norm_eps"):
        if name in kwargs:
            kw[name] = kwargs[name]

    def one_layer(k, v, pool, *rest_and_scales):
        *rest, scales = rest_and_scales
        return op(k, v, pool, *rest, scale_pool=scales, **kw)

    pool, scales = jax.vmap(one_layer, in_axes=(*in_axes, 0))(*shared, kwargs["scale_pool"])
    assert_bits_equal(np.asarray(pool), want[0])
    assert_bits_equal(np.asarray(scales), want[1])
    # The layered call itself, and a vmap over it (both axes folded into one layer axis).
    direct = _run(form, args, kwargs)
    assert_bits_equal(direct[0], want[0])
    assert_bits_equal(direct[1], want[1])
    double = [np.stack([a, a]) for a in args[:3]] + list(args[3:])
    nested = jax.vmap(one_layer, in_axes=(*in_axes, 0))(
        *double, np.stack([kwargs["scale_pool"]] * 2)
    )
    for i in range(2):
        assert_bits_equal(np.asarray(nested[0][i]), want[0])
        assert_bits_equal(np.asarray(nested[1][i]), want[1])


_SHARDED = textwrap.dedent(
    """
    import jax, numpy as np, ml_dtypes
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_dflash
    from jax_dflash import reference
    from jax_dflash.testing import make_paged_problem, assert_bits_equal

    rng = np.random.default_rng(2)
    problem = make_paged_problem(rng, heads=4, layers=2, pool_dtype=ml_dtypes.float8_e5m2)
    args = list(problem.args())
    scales = rng.standard_normal(args[2].shape[:-1]).astype(np.float32)
    want = reference.target_kv_cache_update_paged(*args, scale_pool=scales)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("layers", "heads"))
    pool = jax.device_put(args[2], NamedSharding(mesh, P("layers", None, None, None, "heads")))
    sp = jax.device_put(scales, NamedSharding(mesh, P("layers", None, None, None, "heads")))
    step = jax.jit(
        lambda pool, sp, *rest: jax_dflash.target_kv_cache_update_paged(
            *rest[:2], pool, *rest[2:], scale_pool=sp
        ),
        donate_argnums=(0, 1),
    )
    out, out_scales = step(pool, sp, *args[:2], *args[3:])
    split = ("layers", None, None, None, "heads")
    assert tuple(out_scales.sharding.spec)[:5] == split, out_scales.sharding
    assert tuple(out.sharding.spec)[:5] == split, out.sharding
    assert len(out_scales.addressable_shards) == 4
    assert out_scales.addressable_shards[0].data.shape == (1, 2, 8, 4, 2)
    assert_bits_equal(np.asarray(out), want[0])
    assert_bits_equal(np.asarray(out_scales), want[1])
    print("OK")
    """
)


def test_sharded_on_layers_and_heads_the_scale_pool_follows_the_pool():
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", _SHARDED],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


# ---- CUDA ------------------------------------------------------------------------------------

_NO_GPU = "no GPU backend in this JAX: the CUDA suite runs on the H200"


# 65536 rows of a 128-channel head: more than one pass of the resident blocks of the four-chunk
# kernel on any current GPU, which such calls take (16-bit deltas; the small calls above take two
# chunks a lane). Rotated rows throughout (the slot form's rope table covers every position).
_WIDE_SIZES = {
    "slot": dict(
        batch=8, delta_len=1024, heads=8, page_size=16, pages_per_slot=64, rope_seq_len=None
    ),
    "paged": dict(tokens=8192, batch=8, heads=8, num_pages=512, page_size=16, table_pages=64),
}
_WIDE_SIZES["slot_mapping"] = _WIDE_SIZES["paged"]


@pytest.mark.skipif(not gpu_devices(), reason=_NO_GPU)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("pool_dtype", SCALED_DTYPES, ids=str)
# 4 and 12 heads: a warp's 8 rows then hold two tokens' rows (two rope rows a group), at least 32768
# rows in all, still the four-chunk kernel's calls.
@pytest.mark.parametrize(
    "norms, rotary_dim, heads",
    [
        (False, 128, 8),
        (True, 128, 8),
        (True, 0, 8),
        (False, 128, 4),
        (True, 128, 4),
        (False, 128, 12),
        (True, 128, 12),
    ],
    ids=[
        "plain",
        "norms",
        "norms-unrotated",
        "plain-4-heads",
        "norms-4-heads",
        "plain-12-heads",
        "norms-12-heads",
    ],
)
def test_cuda_wide_calls_match_the_reference(form, pool_dtype, norms, rotary_dim, heads):
    def problem(rng, delta):
        return _problem(
            rng,
            form,
            pool_dtype,
            k_norm=norms,
            v_norm=norms,
            delta=delta,
            head_dim=128,
            rotary_dim=rotary_dim,
            **{**_WIDE_SIZES[form], "heads": heads},
        )

    assert_cuda_scale_pool_call_matches_the_reference(form, problem)


@pytest.mark.skipif(not gpu_devices(), reason=_NO_GPU)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("pool_dtype", SCALED_DTYPES, ids=str)
@pytest.mark.parametrize("layers", [None, 2], ids=["unbatched", "layered"])
@pytest.mark.parametrize("norms", [False, True], ids=["plain", "norms"])
# Every CUDA kernel of a scale pool: two chunks a lane at these sizes ((128, 128), (128, 0), and
# (96, 0), whose second chunks exist in half the lanes; four chunks: the wide calls above), one
# chunk a lane ((16, 16), (96, 64), (128, 64)), and the warp-per-row kernel ((40, 8), (7, 0)).
@pytest.mark.parametrize(
    "head_dim, rotary_dim",
    [(16, 16), (128, 128), (128, 0), (96, 0), (128, 64), (40, 8), (7, 0), (96, 64)],
)
def test_cuda_matches_the_reference(form, pool_dtype, layers, norms, head_dim, rotary_dim):
    def problem(rng, delta):
        return _problem(
            rng,
            form,
            pool_dtype,
            layers=layers,
            k_norm=norms,
            v_norm=norms,
            delta=delta,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
        )

    assert_cuda_scale_pool_call_matches_the_reference(form, problem)
