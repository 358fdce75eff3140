"""int4 pools (SPEC.md "int4 pools"): uint8 bytes ``[2, N, P, H, D/2]``, two 4-bit
two's-complement elements per byte (element 2j in the low nibble), stored with per-token-head
dynamic scales only (``scale_pool``, qmax = 7), on every addressing form, unbatched, layered and
under ``vmap``.

Two oracles: the NumPy reference, bit for bit; and, independently of its indexing and packing,
the op on a float32 pool, whose written rows hold the float32 values ``y`` the int4 call
quantizes: the spec's formula on them, packed here by hand, must give the int4 call's bytes and
scales, and every other row keeps its bytes and scale.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
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
    assert_bits_equal,
    gpu_devices,
    make_paged_problem,
    make_problem,
    with_scale_pool,
)

OPS = FORM_OPS
# A NaN whose payload no store produces: marks the float32 pool's rows that were not written.
_UNWRITTEN = np.uint32(0x7FBADBAD)


def test_the_format_row():
    row = POOL_FORMATS["uint8"]
    assert row["name"] == "int4" and row["scales"] == "dynamic"
    assert row["max_finite"] == 7.0 and row["per_byte"] == 2
    assert row["cuda"], "the CUDA kernel stores int4 (test_cuda_matches_the_reference)"
    assert row["tensorrt"]  # the plugin's kUINT8 pool [2, N, 128, H, D/2]


def _problem(rng, form, *, layers=None, delta=np.float16, k_norm=False, v_norm=False, **dims):
    """``(args, kwargs, float32_pool_shape)`` of one hostile call of ``form`` on an int4 pool of
    random bytes with a scale pool of random bits: negative, padded and past-the-pool positions,
    owners, page ids and slots."""
    common = dict(dtype=delta, pool_dtype=np.float32, layers=layers, k_norm=k_norm, v_norm=v_norm)
    common.update(dims)
    if form == "slot":
        problem = make_problem(rng, **{"rope_seq_len": 5, **common})
    else:
        problem = make_paged_problem(rng, **common)
    kwargs = dict(problem.kwargs())
    args = list(problem.args())
    if form == "slot_mapping":
        kwargs.pop("ring")
        pool = args[2]
        rows = pool.shape[-4] * pool.shape[-3]
        tokens = args[0].shape[-3]
        slots = rng.permutation(np.arange(-3, rows + 3))[:tokens].astype(np.int32)
        args = [*args[:4], slots]
    shape = args[2].shape
    args, kwargs = with_scale_pool(rng, args, kwargs, "int4")
    return args, kwargs, shape


def _spec_bytes(y):
    """SPEC.md's int4 formula on float32 rows y [..., D], written out on its own: ``(bytes,
    scales)``."""
    with np.errstate(all="ignore"):
        finite = np.isfinite(y).all(axis=-1)
        s = np.where(finite, np.abs(y).max(axis=-1) / np.float32(7), np.float32(np.nan))
        s = s.astype(np.float32)
        q = np.where(s[..., None] == 0, np.float32(0), (y / s[..., None]).astype(np.float32))
        levels = np.rint(np.clip(np.nan_to_num(q, nan=0.0), -7, 7)).astype(np.int64)
    nibbles = levels % 16  # two's complement in 4 bits
    packed = nibbles[..., 0::2] + 16 * nibbles[..., 1::2]
    return packed.astype(np.uint8), s


def _check_against_float32(form, args, kwargs, shape, pool, scales):
    f32 = np.full(shape, _UNWRITTEN, np.uint32).view(np.float32)
    plain = {k: v for k, v in kwargs.items() if k != "scale_pool"}
    y = np.asarray(OPS[form][0](*args[:2], f32, *args[3:], **plain))
    written = (y.view(np.uint32) != _UNWRITTEN).any(axis=-1)
    want_bytes, want_s = _spec_bytes(y[written])
    if written.any():
        assert_bits_equal(pool[written], want_bytes)
        nan = np.isnan(want_s)
        assert (scales[written].view(np.uint32)[nan] == 0x7FC00000).all()
        assert_bits_equal(scales[written][~nan], want_s[~nan])
    if (~written).any():
        assert_bits_equal(pool[~written], args[2][~written])
        assert_bits_equal(scales[~written], kwargs["scale_pool"][~written])
    return written


@st.composite
def _calls(draw):
    head_dim = 2 * draw(st.sampled_from([1, 2, 3, 4, 8, 12, 20, 64]))
    return dict(
        form=draw(st.sampled_from(FORMS)),
        layers=draw(st.sampled_from([None, 2])),
        delta=draw(st.sampled_from(DELTA_DTYPES)),
        k_norm=draw(st.booleans()),
        v_norm=draw(st.booleans()),
        head_dim=head_dim,
        rotary_dim=2 * draw(st.integers(0, head_dim // 2)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=_calls())
def test_cpu_matches_the_reference_and_the_spec(call):
    seed, form = call.pop("seed"), call.pop("form")
    args, kwargs, shape = _problem(np.random.default_rng(seed), form, **call)
    pool, scales = _run(form, args, kwargs)
    want_pool, want_scales = OPS[form][1](*args, **kwargs)
    assert_bits_equal(pool, want_pool)
    assert_bits_equal(scales, want_scales)
    _check_against_float32(form, args, kwargs, shape, pool, scales)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("layers", [None, 3], ids=["unbatched", "layered"])
@pytest.mark.parametrize("head_dim, rotary_dim", [(16, 8), (128, 128), (128, 64)])
def test_every_form_and_layout_writes_rows(form, layers, head_dim, rotary_dim):
    some, others = False, False
    for seed in range(4):
        args, kwargs, shape = _problem(
            np.random.default_rng(seed),
            form,
            layers=layers,
            k_norm=seed == 1,
            v_norm=seed == 1,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
        )
        pool, scales = _run(form, args, kwargs)
        want = OPS[form][1](*args, **kwargs)
        assert_bits_equal(pool, want[0])
        assert_bits_equal(scales, want[1])
        written = _check_against_float32(form, args, kwargs, shape, pool, scales)
        some, others = some or written.any(), others or not written.all()
    assert some and others, "some rows written, others not"


def _one_row_call(key, value):
    """A slot-mapping call writing one token (one head, no rotation) at slot 1 of a 2-page pool
    of 0x55 bytes and 3.0 scales: the token's K and V ``(bytes, scales)``, checked against the
    reference and against every other row keeping its bytes and scale."""
    d = len(key)
    k = np.asarray(key, np.float32).reshape(1, 1, d)
    v = np.asarray(value, np.float32).reshape(1, 1, d)
    pool = np.full((2, 2, 2, 1, d // 2), 0x55, np.uint8)
    scale_pool = np.full((2, 2, 2, 1), 3.0, np.float32)
    args = [k, v, pool, np.zeros((1, 0), np.float32), np.array([1], np.int32)]
    got = _run("slot_mapping", args, dict(scale_pool=scale_pool))
    want = reference.target_kv_cache_update_slots(*args, scale_pool=scale_pool)
    assert_bits_equal(got[0], want[0])
    assert_bits_equal(got[1], want[1])
    untouched = np.ones((2, 2, 2), bool)
    untouched[:, 0, 1] = False
    assert (got[0][untouched] == 0x55).all() and (got[1][untouched] == 3.0).all()
    return got[0][:, 0, 1, 0], got[1][:, 0, 1, 0]


def test_nibble_order_of_a_hand_made_row():
    # s = 7 / 7 = 1: the levels are the values; byte j = level 2j (low) | level 2j+1 (high).
    values = [1.0, -2.0, 7.0, -7.0, 0.0, 3.0, -1.0, 5.0]
    elements, scales = _one_row_call(values, values)
    assert (scales == 1.0).all()
    want = [0xE1, 0x97, 0x30, 0x5F]  # (1, -2) (7, -7) (0, 3) (-1, 5)
    assert elements[0].tolist() == want and elements[1].tolist() == want


def test_rounding_is_half_to_even_and_the_maximum_is_plus_or_minus_7():
    # s = 3.5 / 7 = 0.5: quotients 7, -7, 1, 3 (0.5 -> 0 and 1.5 -> 2 by half to even), 5, -5.
    values = [3.5, -3.5, 0.25, 0.75, 2.5, -2.5]
    elements, scales = _one_row_call(values, [-v for v in values])
    assert (scales == 0.5).all()
    assert elements[0].tolist() == [0x97, 0x20, 0xB5]  # (7, -7) (0, 2) (5, -5)
    assert elements[1].tolist() == [0x79, 0xE0, 0x5B]  # (-7, 7) (0, -2) (-5, 5)


def test_saturation_where_the_maximum_divides_back_above_7():
    rng = np.random.default_rng(11)
    a = rng.uniform(0.5, 2, 4096).astype(np.float32)
    over = a / (a / np.float32(7)) > np.float32(7)
    assert over.any(), "some maxima divide back to above 7"
    value = float(a[over][0])
    elements, _ = _one_row_call([value, -value], [-value, value])
    assert elements.tolist() == [[0x97], [0x79]]  # (7, -7), (-7, 7): never 8 or -8


def test_zero_rows_store_a_zero_scale_and_zero_bytes():
    elements, scales = _one_row_call([0.0, -0.0, 0.0, 0.0], [-0.0, 0.0, 0.0, -0.0])
    assert (scales.view(np.uint32) == 0).all()
    assert (elements == 0).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_rows_store_a_nan_scale_and_zero_elements(bad):
    elements, scales = _one_row_call([1.0, bad, -2.0, 4.0], [bad, 0.0, 4.0, 1.0])
    assert (scales.view(np.uint32) == 0x7FC00000).all(), "the canonical float32 NaN"
    assert (elements == 0).all()


def test_of_tokens_with_one_slot_the_cpu_stores_the_last_ones_row_and_scale():
    rng = np.random.default_rng(4)
    k = rng.standard_normal((3, 1, 4)).astype(np.float32)
    v = rng.standard_normal((3, 1, 4)).astype(np.float32)
    pool = np.full((2, 2, 2, 1, 2), 0x55, np.uint8)
    scale_pool = np.full((2, 2, 2, 1), 3.0, np.float32)
    args = [k, v, pool, np.zeros((3, 0), np.float32), np.array([2, 2, -1], np.int32)]
    got = _run("slot_mapping", args, dict(scale_pool=scale_pool))
    want = reference.target_kv_cache_update_slots(*args, scale_pool=scale_pool)
    assert_bits_equal(got[0], want[0])
    assert_bits_equal(got[1], want[1])
    for plane, y in ((0, k[1, 0]), (1, v[1, 0])):  # token 1 is the last with slot 2 (page 1, row 0)
        row_bytes, s = _spec_bytes(y)
        assert_bits_equal(got[0][plane, 1, 0, 0], row_bytes)
        assert_bits_equal(got[1][plane, 1, 0], np.atleast_1d(s))


# ---- errors: the one checker --------------------------------------------------------------


def _paged(layers=None, head_dim=16):
    args, kwargs, _ = _problem(np.random.default_rng(0), "paged", layers=layers, head_dim=head_dim)
    return args, kwargs


CALLS = (jax_dflash.target_kv_cache_update_paged, reference.target_kv_cache_update_paged)


def test_an_odd_head_dim_is_an_error_naming_the_pool():
    args, kwargs, _ = _problem(np.random.default_rng(0), "paged", head_dim=7, rotary_dim=0)
    args[2] = np.zeros((*args[2].shape[:-1], 3), np.uint8)
    for call in CALLS:
        with pytest.raises(
            ValueError, match="past_key_value: an int4 pool packs 2 elements per byte"
        ):
            call(*args, **kwargs)
        with pytest.raises(ValueError, match="must be even, got k_delta's D = 7"):
            call(*args, **kwargs)


@pytest.mark.parametrize("last", [16, 7, 9])
def test_a_pool_whose_last_dim_is_not_half_of_d_is_an_error(last):
    args, kwargs = _paged()
    args[2] = np.zeros((*args[2].shape[:-1], last), np.uint8)
    for call in CALLS:
        with pytest.raises(ValueError, match=r"past_key_value: expected last dim D/2 = 8 .*D = 16"):
            call(*args, **kwargs)


def test_static_scales_are_an_error():
    args, kwargs = _paged()
    kwargs.pop("scale_pool")
    for call in CALLS:
        with pytest.raises(ValueError, match="an int4 pool takes no static k_scale, v_scale"):
            call(*args, **kwargs, k_scale=np.float32(1), v_scale=np.float32(1))


def test_a_missing_scale_pool_is_an_error():
    args, kwargs = _paged()
    kwargs.pop("scale_pool")
    for call in CALLS:
        with pytest.raises(
            ValueError, match="an int4 pool .* dynamic scales only: expected scale_pool"
        ):
            call(*args, **kwargs)


def test_a_scale_pool_of_the_wrong_shape_or_dtype_is_an_error():
    args, kwargs = _paged()
    pool = args[2]
    wanted = ", ".join(map(str, pool.shape[:-1]))
    for shape in (pool.shape, pool.shape[:-2]):
        with pytest.raises(ValueError, match=rf"scale_pool: expected \[{wanted}\]"):
            jax_dflash.target_kv_cache_update_paged(
                *args, **dict(kwargs, scale_pool=np.zeros(shape, np.float32))
            )
    with pytest.raises(TypeError, match="scale_pool: expected dtype float32, got float16"):
        jax_dflash.target_kv_cache_update_paged(
            *args, **dict(kwargs, scale_pool=np.zeros(pool.shape[:-1], np.float16))
        )


def test_tensorrt_takes_int4_pools_with_a_scale_pool_only():
    args, kwargs = _paged()
    pool = np.zeros((2, 2, 128, *args[2].shape[3:]), np.uint8)
    args[2] = pool
    with pytest.raises(ValueError, match="per-token-head dynamic scales only"):
        check_call("paged", args, tensorrt=True)
    scales = np.zeros(pool.shape[:-1], np.float32)
    shape = check_call("paged", [*args, scales], tensorrt=True, scale_pool=True)
    assert shape["head_dim"] == 2 * pool.shape[-1] and shape["scale_pool"]
    with pytest.raises(ValueError, match=r"scale_pool: expected \[2, 2, 128, "):
        check_call("paged", [*args, scales[:, :1]], tensorrt=True, scale_pool=True)


def test_the_tensorrt_plugin_takes_int4_pools_with_a_scale_pool(tmp_path):
    """The plugin's own verdict (the contract harness's ``--check-shapes``) on a uint8 pool
    ``[2, N, 128, H, D/2]``: accepted with the field scale_pool=1 and a scale pool, refused
    without, naming the pool and what it needs."""
    from helpers.trt_harness import _built, _harness_path, _run_harness

    harness = _built(_harness_path)
    delta = "float16:8,2,64"
    tensors = [
        delta,
        delta,
        "uint8:2,8,128,2,32",
        "float32:8,64",
        "int32:8",
        "int32:8",
        "int32:3,2,4",
    ]
    lines = [
        "paged_int4_scale_pool|scale_pool=1|" + ";".join([*tensors, "float32:2,8,128,2"]),
        "paged_int4||" + ";".join(tensors),
        "paged_int4_odd_D|scale_pool=1|"
        + ";".join(["float16:8,2,63", "float16:8,2,63", *tensors[2:], "float32:2,8,128,2"]),
    ]
    path = tmp_path / "cases.txt"
    path.write_text("\n".join(lines) + "\n")
    report = _run_harness(harness, "--check-shapes", str(path), report=tmp_path / "report.json")
    good, bad, odd = report["shape_cases"]
    assert good["accepted"] is True, good
    assert bad["accepted"] is False and odd["accepted"] is False, (bad, odd)
    assert "past_key_value: an int4 pool (uint8 [2, N, P, H, D/2])" in bad["message"], bad
    assert "per-token-head dynamic scales only: expected scale_pool" in bad["message"], bad
    assert "must be even, got k_delta's D = 63" in odd["message"], odd


# ---- jit with donation, vmap --------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_jit_with_both_donated_updates_in_place(form):
    args, kwargs, _ = _problem(np.random.default_rng(3), form)
    want = OPS[form][1](*args, **kwargs)
    scale_pool = kwargs.pop("scale_pool")

    def update(pool, scales, *rest):
        return OPS[form][0](*rest[:2], pool, *rest[2:], scale_pool=scales, **kwargs)

    step = jax.jit(update, donate_argnums=(0, 1))
    rest = [*args[:2], *args[3:]]
    pool, scales = jnp.asarray(args[2]), jnp.asarray(scale_pool)
    hlo = step.lower(pool, scales, *rest).compile().as_text()
    assert "input_output_alias" in hlo and "{0}: (0, {}" in hlo and "{1}: (1, {}" in hlo
    out_pool, out_scales = step(pool, scales, *rest)
    assert pool.is_deleted() and scales.is_deleted(), "the donated buffers were not taken"
    assert out_pool.dtype == np.uint8 and out_pool.shape == args[2].shape
    assert_bits_equal(np.asarray(out_pool), want[0])
    assert_bits_equal(np.asarray(out_scales), want[1])


@pytest.mark.parametrize("form", FORMS)
def test_vmap_over_layers_is_the_layered_call(form):
    args, kwargs, _ = _problem(np.random.default_rng(5), form, layers=3)
    want = OPS[form][1](*args, **kwargs)
    op = OPS[form][0]
    in_axes = [0, 0, 0] + [None] * (len(args) - 3)
    kw = {
        k: kwargs[k] for k in ("pages_per_slot", "ring", "k_norm_weight", "v_norm") if k in kwargs
    }

    def one_layer(k, v, pool, *rest_and_scales):
        *rest, scales = rest_and_scales
        return op(k, v, pool, *rest, scale_pool=scales, **kw)

    pool, scales = jax.vmap(one_layer, in_axes=(*in_axes, 0))(*args, kwargs["scale_pool"])
    assert_bits_equal(np.asarray(pool), want[0])
    assert_bits_equal(np.asarray(scales), want[1])
    direct = _run(form, args, kwargs)
    assert_bits_equal(direct[0], want[0])
    assert_bits_equal(direct[1], want[1])


# ---- CUDA ---------------------------------------------------------------------------------

_NO_GPU = "no GPU backend in this JAX: the CUDA suite runs on the H200"


@pytest.mark.skipif(not gpu_devices(), reason=_NO_GPU)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("layers", [None, 2], ids=["unbatched", "layered"])
@pytest.mark.parametrize("norms", [False, True], ids=["plain", "norms"])
# Every CUDA kernel, as in test_dynamic_scales.py: two chunks a lane ((128, 128), (96, 0); four:
# the wide calls below), one ((16, 16), (96, 64)), the warp-per-row kernel ((40, 8), (6, 0)).
@pytest.mark.parametrize(
    "head_dim, rotary_dim", [(16, 16), (128, 128), (96, 0), (40, 8), (6, 0), (96, 64)]
)
def test_cuda_matches_the_reference(form, layers, norms, head_dim, rotary_dim):
    def problem(rng, delta):
        args, kwargs, _ = _problem(
            rng,
            form,
            layers=layers,
            k_norm=norms,
            v_norm=norms,
            delta=delta,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
        )
        return args, kwargs

    assert_cuda_scale_pool_call_matches_the_reference(form, problem)


@pytest.mark.skipif(not gpu_devices(), reason=_NO_GPU)
@pytest.mark.parametrize("norms", [False, True], ids=["plain", "norms"])
def test_cuda_wide_calls_match_the_reference(norms):
    """65536 rows of a 128-channel head, rotated: the four-chunk kernel (16-bit deltas), as in
    test_dynamic_scales.py's wide calls."""

    def problem(rng, delta):
        args, kwargs, _ = _problem(
            rng,
            "slot",
            k_norm=norms,
            v_norm=norms,
            delta=delta,
            head_dim=128,
            rotary_dim=128,
            batch=8,
            delta_len=1024,
            heads=8,
            page_size=16,
            pages_per_slot=64,
            rope_seq_len=None,
        )
        return args, kwargs

    assert_cuda_scale_pool_call_matches_the_reference("slot", problem)
