"""The raw (array) entries of both contracts: ``_dflash_cpu.target_kv_cache_update[_paged]`` over
NumPy arrays and ``_dflash_cuda.launch[_paged]`` over CUDA arrays (torch, cupy or jax through
DLPack). They update the caller's pool in place, bit-exact with the NumPy reference; a pool they
cannot update in place, and every wrong argument, is an error naming the argument that leaves
the caller's pool as it was.
"""

from __future__ import annotations

import ctypes
import dataclasses

import ml_dtypes
import numpy as np
import pytest

from jax_dflash import reference
from jax_dflash.testing import (
    DELTA_DTYPES,
    FP8_DTYPES,
    assert_bits_equal,
    gpu_devices,
    make_paged_problem,
    make_problem,
)

F16, BF16, F32 = DELTA_DTYPES
E4M3, E5M2 = FP8_DTYPES
NATIVE = (np.dtype(np.float16), np.dtype(np.float32))  # the dtypes NumPy hands over as they are


def _cpu():
    from jax_dflash import _dflash_cpu

    return _dflash_cpu


def bits(x):
    """``(array, dtype name)`` as the raw entries take it: bfloat16 and FP8 arrays as unsigned
    views of their bits with the name of their dtype, the others as they are with ''."""
    if x is None:
        return None, ""
    if x.dtype in NATIVE or x.dtype.kind in "iu":
        return x, ""
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint8), str(x.dtype)


@dataclasses.dataclass
class RawCall:
    """One raw-entry call of a problem: positional arrays and keywords, views already taken."""

    contract: str
    args: list
    kwargs: dict

    def run(self, module):
        name = (
            "target_kv_cache_update" if self.contract == "slot" else "target_kv_cache_update_paged"
        )
        if module.__name__.endswith("_dflash_cuda"):
            name = "launch" if self.contract == "slot" else "launch_paged"
        return getattr(module, name)(*self.args, **self.kwargs)


def raw_call(contract, problem, pool) -> RawCall:
    """The call of ``problem`` on ``pool`` (a bits view where needed; updated in place)."""
    k, delta_dtype = bits(problem.k_delta)
    v, _ = bits(problem.v_delta)
    weight, _ = bits(problem.k_norm_weight)
    scales = [None if x is None else np.asarray(x) for x in (problem.k_scale, problem.v_scale)]
    args = [k, v, pool, *problem.args()[3:], *scales, weight]
    kwargs = {
        "v_norm": problem.v_norm,
        "norm_eps": problem.norm_eps,
        "delta_dtype": delta_dtype,
        "pool_dtype": ""
        if problem.past_key_value.dtype in NATIVE
        else str(problem.past_key_value.dtype),
    }
    if contract == "slot":
        kwargs["pages_per_slot"] = problem.pages_per_slot
    else:
        kwargs["ring"] = problem.ring
    return RawCall(contract, args, kwargs)


def expected_pool(contract, problem):
    fn = (
        reference.target_kv_cache_update
        if contract == "slot"
        else reference.target_kv_cache_update_paged
    )
    return fn(*problem.args(), **problem.kwargs())


def build(contract, seed, **kw):
    """A hostile problem of ``contract`` whose update writes something (the first such seed from
    ``seed`` on), so that an entry that writes nothing cannot pass."""
    for s in range(seed, seed + 100):
        rng = np.random.default_rng(s)
        problem = make_problem(rng, **kw) if contract == "slot" else make_paged_problem(rng, **kw)
        expected = expected_pool(contract, problem)
        if not np.array_equal(expected.view(np.uint8), problem.past_key_value.view(np.uint8)):
            return problem
    raise AssertionError(f"no seed in [{seed}, {seed + 100}) writes anything for {kw}")


CONTRACTS = ("slot", "paged")
VARIANTS = {
    "f16": dict(dtype=F16),
    "bf16": dict(dtype=BF16),
    "f32_into_bf16": dict(dtype=F32, pool_dtype=BF16),
    "bf16_into_f16": dict(dtype=BF16, pool_dtype=F16),
    "f16_into_e4m3_per_head": dict(dtype=F16, pool_dtype=E4M3),
    "bf16_into_e5m2_per_tensor": dict(dtype=BF16, pool_dtype=E5M2, scale_shape=()),
    "k_norm_v_norm": dict(dtype=BF16, k_norm=True, v_norm=True, norm_eps=1e-5),
    "f32_into_e4m3_k_norm": dict(dtype=F32, pool_dtype=E4M3, k_norm=True),
    "layered": dict(
        dtype=F16,
        pool_dtype=E5M2,
        layers=3,
        scale_shape=(3, 2),
        k_norm=True,
        norm_weight_per_layer=True,
        rope_per_layer=True,
        positions_per_layer=True,
    ),
}


def _variant(contract, name):
    kw = dict(VARIANTS[name])
    if contract == "paged" and name == "layered":
        kw["table_per_layer"] = True
        kw["ring"] = True
    return kw


# ---- CPU: in place, bit-exact -------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("contract", CONTRACTS)
def test_cpu_updates_the_callers_pool_in_place(contract, variant):
    problem = build(contract, 11, **_variant(contract, variant))
    pool = problem.past_key_value.copy()
    view, _ = bits(pool)
    before = pool.copy()
    result = raw_call(contract, problem, view).run(_cpu())
    assert result is None  # the update is the caller's array, nothing is returned
    expected = expected_pool(contract, problem)
    assert_bits_equal(pool, expected)
    assert not np.array_equal(pool.view(np.uint8), before.view(np.uint8)), "nothing was written"


def test_cpu_ring_paged_in_place():
    problem = build("paged", 12, ring=True, table_pages=1, tokens=6, pool_dtype=E4M3)
    pool = problem.past_key_value.copy()
    raw_call("paged", problem, bits(pool)[0]).run(_cpu())
    assert_bits_equal(pool, expected_pool("paged", problem))


def test_cpu_pool_given_as_a_bits_view_of_another_name():
    """The bits of a uint16 array are what pool_dtype says: the same memory read as float16 or
    as bfloat16 gives each dtype's update."""
    for pool_dtype in (F16, BF16):
        problem = build("slot", 13, dtype=F32, pool_dtype=pool_dtype)
        pool = problem.past_key_value.copy()
        call = raw_call("slot", problem, pool.view(np.uint16))
        call.kwargs["pool_dtype"] = str(pool_dtype)
        call.run(_cpu())
        assert_bits_equal(pool, expected_pool("slot", problem))


EMPTY = {
    "slot": {
        "no_tokens": dict(delta_len=0),
        "no_rope_rows": dict(rope_seq_len=0),
        "no_rotary_channels": dict(rotary_dim=0),
    },
    "paged": {"no_tokens": dict(tokens=0), "no_rotary_channels": dict(rotary_dim=0)},
}


@pytest.mark.parametrize("contract, empty", [(c, e) for c in EMPTY for e in EMPTY[c]])
def test_cpu_empty_operands_are_valid(contract, empty):
    """An operand with a zero dimension has no elements: whatever strides NumPy gives it, it is
    contiguous, and the update is the reference's (nothing written for no tokens)."""
    problem = (
        make_problem(np.random.default_rng(14), **EMPTY[contract][empty])
        if contract == "slot"
        else make_paged_problem(np.random.default_rng(14), **EMPTY[contract][empty])
    )
    pool = problem.past_key_value.copy()
    raw_call(contract, problem, pool).run(_cpu())
    assert_bits_equal(pool, expected_pool(contract, problem))


def test_cpu_empty_slices_with_strides_are_contiguous():
    """Zero-length slices of larger arrays keep their parent's strides; they are still valid."""
    problem = make_problem(np.random.default_rng(15))
    call = raw_call("slot", problem, problem.past_key_value.copy())
    call.args[0], call.args[1] = problem.k_delta[:, :0], problem.v_delta[:, :0]
    call.args[3] = problem.rope_cos_sin[:, :0]
    assert call.args[0].strides == problem.k_delta.strides
    call.run(_cpu())
    assert_bits_equal(call.args[2], problem.past_key_value)


@pytest.mark.parametrize("contract", CONTRACTS)
def test_cpu_read_only_inputs_are_accepted(contract):
    """Only the pool is written: read-only inputs (np.asarray of a jax.Array is one) are fine."""
    problem = build(contract, 16, dtype=F16, pool_dtype=E4M3, k_norm=True)
    pool = problem.past_key_value.copy()
    call = raw_call(contract, problem, bits(pool)[0])
    for i, x in enumerate(call.args):
        if isinstance(x, np.ndarray) and i != 2:
            x = x.copy()
            x.flags.writeable = False
            call.args[i] = x
    call.run(_cpu())
    assert_bits_equal(pool, expected_pool(contract, problem))


# ml_dtypes' bfloat16 and FP8 NumPy arrays, which DLPack cannot carry: taken as they are.
ML_DTYPES_VARIANTS = [
    "bf16",
    "f32_into_bf16",
    "f16_into_e4m3_per_head",
    "bf16_into_e5m2_per_tensor",
    "k_norm_v_norm",
    "layered",
]


@pytest.mark.parametrize("variant", ML_DTYPES_VARIANTS)
@pytest.mark.parametrize("contract", CONTRACTS)
def test_cpu_ml_dtypes_arrays_as_they_are(contract, variant):
    """bfloat16 and FP8 NumPy arrays need no bits view and no dtype keyword: the update is the
    reference's, in the caller's own pool."""
    problem = build(contract, 17, **_variant(contract, variant))
    pool = problem.past_key_value.copy()
    call = raw_call(contract, problem, pool)
    call.args[0], call.args[1], call.args[WEIGHT] = (
        problem.k_delta,
        problem.v_delta,
        problem.k_norm_weight,
    )
    call.kwargs["delta_dtype"] = call.kwargs["pool_dtype"] = ""
    assert any(x.dtype not in NATIVE for x in (problem.k_delta, pool))  # an ml_dtypes array
    call.run(_cpu())
    assert_bits_equal(pool, expected_pool(contract, problem))


@pytest.mark.parametrize(
    "name",
    ["bfloat16", np.dtype(ml_dtypes.bfloat16), ml_dtypes.bfloat16],
    ids=["str", "dtype", "type"],
)
def test_cpu_dtype_keywords_name_the_arrays_own_dtype(name):
    """A dtype keyword that agrees with an ml_dtypes array is fine, as a name or a dtype."""
    problem = build("slot", 18, dtype=BF16, pool_dtype=BF16)
    pool = problem.past_key_value.copy()
    call = raw_call("slot", problem, pool)
    call.args[0], call.args[1] = problem.k_delta, problem.v_delta
    call.kwargs["delta_dtype"] = call.kwargs["pool_dtype"] = name
    call.run(_cpu())
    assert_bits_equal(pool, expected_pool("slot", problem))


def test_cpu_numpy_scalars_as_keywords():
    """NumPy ints, floats and bools are the keywords' types too, as in the JAX op."""
    problem = build("slot", 19, dtype=F16, k_norm=True, v_norm=True, norm_eps=1e-5)
    pool = problem.past_key_value.copy()
    call = raw_call("slot", problem, pool)
    call.kwargs.update(
        pages_per_slot=np.int64(problem.pages_per_slot),
        norm_eps=np.float32(problem.norm_eps),
        v_norm=np.bool_(True),
    )
    call.run(_cpu())
    assert_bits_equal(pool, expected_pool("slot", problem))


@pytest.mark.parametrize("pool_dtype", [BF16, E4M3, E5M2], ids=str)
def test_cpu_torch_pool_of_its_own_dtype(pool_dtype):
    """A CPU torch tensor is a pool the caller owns; bfloat16 and FP8 cross DLPack as themselves
    (DLPack's bfloat and float8 type codes), no pool_dtype needed."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    torch_dtype = {BF16: torch.bfloat16, E4M3: torch.float8_e4m3fn, E5M2: torch.float8_e5m2}[
        pool_dtype
    ]
    problem = build("slot", 20, dtype=F16, pool_dtype=pool_dtype)
    bits_dtype = np.int16 if pool_dtype.itemsize == 2 else np.uint8
    host = problem.past_key_value.view(bits_dtype).copy()
    pool = torch.from_numpy(host).view(torch_dtype)
    call = raw_call("slot", problem, pool)
    call.kwargs["pool_dtype"] = ""
    call.run(_cpu())
    assert_bits_equal(host.view(pool_dtype), expected_pool("slot", problem))


# ---- CPU: pools that cannot be updated in place --------------------------------------------------


def _fortran(pool):
    return np.asfortranarray(pool)


def _strided(pool):
    wide = np.concatenate([pool, pool], axis=1)  # every other page: the pool's shape, strided
    return wide[:, ::2]


def _reversed(pool):
    return np.ascontiguousarray(pool)[:, ::-1]


def _read_only(pool):
    pool = pool.copy()
    pool.flags.writeable = False
    return pool


BAD_LAYOUTS = {
    "fortran_order": (_fortran, "C-contiguous"),
    "every_other_page": (_strided, "C-contiguous"),
    "negative_strides": (_reversed, "C-contiguous"),
    "read_only": (_read_only, "writable"),
}


@pytest.mark.parametrize("layout", list(BAD_LAYOUTS))
@pytest.mark.parametrize("pool_dtype", [F16, E4M3], ids=str)
@pytest.mark.parametrize("contract", CONTRACTS)
def test_cpu_pool_that_is_not_updatable_in_place_raises(contract, pool_dtype, layout):
    make, word = BAD_LAYOUTS[layout]
    problem = build(contract, 21, dtype=F16, pool_dtype=pool_dtype)
    pool = make(bits(problem.past_key_value.copy())[0])  # the layout of the array handed over
    assert pool.shape == problem.past_key_value.shape
    snapshot = pool.copy()
    call = raw_call(contract, problem, pool)
    with pytest.raises(ValueError) as err:
        call.run(_cpu())
    assert "past_key_value" in str(err.value) and word in str(err.value), str(err.value)
    assert_bits_equal(np.ascontiguousarray(pool), snapshot)


# ---- CPU: wrong arguments ------------------------------------------------------------------------


def _set_arg(i, fn):
    def mutate(call):
        call.args[i] = fn(call.args[i])

    return mutate


def _set_kw(**kw):
    def mutate(call):
        call.kwargs.update(kw)

    return mutate


def _drop_kw(name):
    def mutate(call):
        del call.kwargs[name]

    return mutate


def _chain(*fns):
    def mutate(call):
        for fn in fns:
            fn(call)

    return mutate


K_SCALE, V_SCALE, WEIGHT = -3, -2, -1  # positions of the extras in RawCall.args


@dataclasses.dataclass(frozen=True)
class Bad:
    name: str
    problem: dict
    mutate: object
    error: type
    words: tuple
    contracts: tuple = CONTRACTS
    host_only: bool = False  # a bad argument that only a host array can be (a list, ml_dtypes)


def _ones_f32(n):
    return lambda _: np.ones((n,), np.float32)


BAD_CALLS = [
    Bad(
        "k_scale_without_v_scale",
        dict(pool_dtype=E4M3),
        _set_arg(V_SCALE, lambda _: None),
        ValueError,
        ("v_scale", "None"),
    ),
    Bad(
        "v_scale_without_k_scale",
        dict(pool_dtype=E4M3),
        _set_arg(K_SCALE, lambda _: None),
        ValueError,
        ("k_scale", "None"),
    ),
    Bad(
        "scales_for_a_float16_pool",
        {},
        _chain(_set_arg(K_SCALE, _ones_f32(2)), _set_arg(V_SCALE, _ones_f32(2))),
        ValueError,
        ("past_key_value", "k_scale"),
    ),
    Bad(
        "fp8_pool_without_scales",
        dict(pool_dtype=E4M3),
        _chain(_set_arg(K_SCALE, lambda _: None), _set_arg(V_SCALE, lambda _: None)),
        ValueError,
        ("past_key_value", "k_scale"),
    ),
    Bad(
        "k_scale_float16",
        dict(pool_dtype=E5M2),
        _set_arg(K_SCALE, lambda x: x.astype(F16)),
        ValueError,
        ("k_scale", "float32"),
    ),
    Bad(
        "v_scale_of_three_heads",
        dict(pool_dtype=E5M2),
        _set_arg(V_SCALE, _ones_f32(3)),
        ValueError,
        ("v_scale",),
    ),
    Bad(
        "bfloat16_bits_without_delta_dtype",
        dict(dtype=BF16),
        _set_kw(delta_dtype=""),
        ValueError,
        ("k_delta", "uint16"),
    ),
    Bad(
        "fp8_bits_without_pool_dtype",
        dict(pool_dtype=E4M3),
        _set_kw(pool_dtype=""),
        ValueError,
        ("past_key_value", "uint8"),
    ),
    Bad(
        "delta_dtype_misspelt",
        dict(dtype=BF16),
        _set_kw(delta_dtype="bf16"),
        ValueError,
        ("delta_dtype", "bf16"),
    ),
    Bad(
        "pool_dtype_misspelt",
        dict(pool_dtype=E4M3),
        _set_kw(pool_dtype="float8_e4m3"),
        ValueError,
        ("pool_dtype", "float8_e4m3"),
    ),
    Bad(
        "pool_dtype_wider_than_the_view",
        dict(pool_dtype=E4M3),
        _set_kw(pool_dtype="float16"),
        TypeError,
        ("past_key_value", "uint8"),
    ),
    Bad(
        "pool_dtype_against_a_native_array",
        {},
        _set_kw(pool_dtype="bfloat16"),
        TypeError,
        ("past_key_value", "float16"),
    ),
    Bad(
        "delta_dtype_fp8",
        dict(dtype=BF16),
        _set_kw(delta_dtype="float8_e4m3fn"),
        TypeError,
        ("k_delta", "uint16"),
    ),
    Bad(
        "deltas_float64",
        dict(dtype=F32),
        _chain(
            _set_arg(0, lambda x: x.astype(np.float64)), _set_arg(1, lambda x: x.astype(np.float64))
        ),
        ValueError,
        ("k_delta",),
    ),
    Bad(
        "v_delta_other_dtype",
        dict(dtype=F16),
        _set_arg(1, lambda x: x.astype(np.float32)),
        ValueError,
        ("v_delta", "float16"),
    ),
    Bad(
        "k_delta_fortran_order",
        dict(dtype=F16),
        _set_arg(0, np.asfortranarray),
        ValueError,
        ("k_delta", "C-contiguous"),
    ),
    Bad(
        "index_int64",
        {},
        _set_arg(4, lambda x: x.astype(np.int64)),
        ValueError,
        ("int64", "delta_start_positions|delta_positions"),
    ),
    Bad(
        "index_as_a_list",
        {},
        _set_arg(5, lambda x: x.tolist()),
        TypeError,
        ("list", "delta_lengths|delta_token_to_sequence"),
    ),
    Bad("pool_as_an_int", {}, _set_arg(2, lambda _: 3), TypeError, ("past_key_value", "int")),
    Bad(
        "k_norm_weight_float32_for_float16_deltas",
        dict(dtype=F16, k_norm=True),
        _set_arg(WEIGHT, lambda x: x.astype(np.float32)),
        ValueError,
        ("k_norm_weight", "float16"),
    ),
    Bad(
        "k_norm_weight_one_too_long",
        dict(dtype=F16, k_norm=True),
        _set_arg(WEIGHT, lambda x: np.concatenate([x, x[:1]])),
        ValueError,
        ("k_norm_weight",),
    ),
    Bad(
        "norm_eps_nan", dict(v_norm=True), _set_kw(norm_eps=float("nan")), ValueError, ("norm_eps",)
    ),
    Bad("norm_eps_negative", dict(k_norm=True), _set_kw(norm_eps=-1e-6), ValueError, ("norm_eps",)),
    Bad(
        "pages_per_slot_zero",
        {},
        _set_kw(pages_per_slot=0),
        ValueError,
        ("pages_per_slot",),
        ("slot",),
    ),
    Bad(
        "pages_per_slot_missing",
        {},
        _drop_kw("pages_per_slot"),
        TypeError,
        ("pages_per_slot: expected an int in [1, 2^63-1], got NoneType None",),
        ("slot",),
    ),
    Bad(
        "pages_per_slot_2_to_the_63",
        {},
        _set_kw(pages_per_slot=2**63),
        ValueError,
        ("pages_per_slot: expected an int in [1, 2^63-1], got 9223372036854775808",),
        ("slot",),
    ),
    Bad(
        "pages_per_slot_negative",
        {},
        _set_kw(pages_per_slot=-(2**70)),
        ValueError,
        ("pages_per_slot: expected an int in [1, 2^63-1], got -1180591620717411303424",),
        ("slot",),
    ),
    Bad(
        "pages_per_slot_float",
        {},
        _set_kw(pages_per_slot=2.0),
        TypeError,
        ("pages_per_slot: expected an int in [1, 2^63-1], got float 2.0",),
        ("slot",),
    ),
    Bad(
        "pages_per_slot_bool",
        {},
        _set_kw(pages_per_slot=True),
        TypeError,
        ("pages_per_slot: expected an int in [1, 2^63-1], got bool True",),
        ("slot",),
    ),
    Bad(
        "pages_per_slot_not_dividing_the_pages",
        {},
        _set_kw(pages_per_slot=3),
        ValueError,
        ("past_key_value", "pages_per_slot"),
        ("slot",),
    ),
    Bad(
        "ring_on_the_slot_entry",
        {},
        _set_kw(ring=True),
        TypeError,
        ("ring: expected a keyword of ", "pages_per_slot", "got ring=bool True"),
        ("slot",),
    ),
    Bad(
        "pages_per_slot_on_the_paged_entry",
        {},
        _set_kw(pages_per_slot=1),
        TypeError,
        ("pages_per_slot: expected a keyword of ", "ring", "got pages_per_slot=int 1"),
        ("paged",),
    ),
    Bad(
        "positions_bool",
        {},
        _set_arg(4, lambda x: x.astype(bool)),
        ValueError,
        ("delta_start_positions|delta_positions", "expected dtype int32, got bool"),
    ),
    Bad(
        "page_table_uint32",
        {},
        _set_arg(6, lambda x: x.astype(np.uint32)),
        ValueError,
        ("kv_page_table: expected dtype int32, got uint32",),
        ("paged",),
        host_only=True,  # torch's DLPack export refuses uint32
    ),
    Bad(
        "pool_complex64",
        {},
        _set_arg(2, lambda x: x.astype(np.complex64)),
        ValueError,
        ("past_key_value: expected dtype float16, bfloat16, float32", "got complex64"),
    ),
    Bad(
        "k_scale_bool",
        dict(pool_dtype=E4M3),
        _set_arg(K_SCALE, lambda _: True),
        TypeError,
        ("k_scale: expected a float32 scale", "got bool True"),
    ),
    Bad(
        "v_scale_numpy_bool",
        dict(pool_dtype=E5M2),
        _set_arg(V_SCALE, lambda _: np.bool_(False)),
        TypeError,
        ("v_scale: expected a float32 scale", "got bool"),
    ),
    Bad(
        "k_scale_bool_array",
        dict(pool_dtype=E4M3),
        _set_arg(K_SCALE, lambda x: np.ones(x.shape, bool)),
        ValueError,
        ("k_scale: expected dtype float32, got bool",),
    ),
    Bad(
        "v_norm_int",
        {},
        _set_kw(v_norm=1),
        TypeError,
        ("v_norm: expected a bool, got int 1",),
    ),
    Bad(
        "ring_str",
        {},
        _set_kw(ring="yes"),
        TypeError,
        ("ring: expected a bool, or a sequence of bools (one per layer), got str 'yes'",),
        ("paged",),
    ),
    Bad(
        "norm_eps_str",
        dict(k_norm=True),
        _set_kw(norm_eps="1e-6"),
        TypeError,
        ("norm_eps: expected a float, got str '1e-6'",),
    ),
    Bad(
        "norm_eps_bool",
        dict(k_norm=True),
        _set_kw(norm_eps=True),
        TypeError,
        ("norm_eps: expected a float, got bool True",),
    ),
    Bad(
        "delta_dtype_an_int",
        {},
        _set_kw(delta_dtype=3),
        TypeError,
        ("delta_dtype: expected a dtype name", "got int 3"),
    ),
    Bad(
        "k_delta_float8_e4m3fnuz",
        dict(dtype=F16),
        _set_arg(0, lambda x: x.astype(ml_dtypes.float8_e4m3fnuz)),
        ValueError,
        ("k_delta: expected dtype float16, bfloat16 or float32, got float8_e4m3fnuz",),
        host_only=True,
    ),
    Bad(
        "bfloat16_array_named_float16",
        dict(dtype=BF16),
        _chain(
            _set_arg(0, lambda x: x.view(BF16)),
            _set_arg(1, lambda x: x.view(BF16)),
            _set_kw(delta_dtype="float16"),
        ),
        TypeError,
        ("k_delta: expected float16 elements", "got bfloat16"),
        host_only=True,
    ),
    Bad(
        "rope_rows_not_tokens",
        {},
        _set_arg(3, lambda x: x[:-1]),
        ValueError,
        ("rope_cos_sin",),
        ("paged",),
    ),
    Bad(
        "table_pages_past_pool_pages",
        {},
        _set_arg(6, lambda x: np.concatenate([x] * 5, -1)),
        ValueError,
        ("kv_page_table",),
        ("paged",),
    ),
]
_BAD_PARAMS = [
    pytest.param(contract, bad, id=f"{contract}-{bad.name}")
    for bad in BAD_CALLS
    for contract in bad.contracts
]


@pytest.mark.parametrize("contract, bad", _BAD_PARAMS)
def test_cpu_wrong_argument_names_it_and_leaves_the_pool(contract, bad):
    problem = build(contract, 31, **bad.problem)
    pool = problem.past_key_value.copy()
    snapshot = pool.copy()
    call = raw_call(contract, problem, bits(pool)[0])
    bad.mutate(call)
    with pytest.raises(bad.error) as err:
        call.run(_cpu())
    _assert_names(err.value, bad.words)
    # The entry's own message, not nanobind's dump of the signature.
    assert "incompatible function arguments" not in str(err.value), str(err.value)
    assert_bits_equal(pool, snapshot)


def _assert_names(error, words):
    """Each word of ``words`` ("a|b": either) is in the message of ``error``."""
    for word in words:
        assert any(w in str(error) for w in word.split("|")), f"expected {word!r} in: {error}"


# ---- CUDA: the same entries over device arrays --------------------------------------------------


def _cuda_reason():
    if not gpu_devices():
        return "no GPU backend in this JAX: the CUDA raw entries run on the H200"
    from jax_dflash import _ext

    if not _ext.cuda_extension_available():
        return "jax_dflash._dflash_cuda was not built (no CUDA toolkit at build time)"
    return None


def _cudart():
    """libcudart, for a device-wide synchronize after launches on jax arrays."""
    for name in ("libcudart.so.12", "libcudart.so.13", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    try:
        from pathlib import Path

        import nvidia.cuda_runtime as rt  # the wheel jax[cuda12] installs

        for lib in sorted(Path(rt.__path__[0], "lib").glob("libcudart.so*")):
            return ctypes.CDLL(str(lib))
    except (ImportError, OSError):
        pass
    return None


class _Torch:
    def __init__(self):
        self.torch = pytest.importorskip("torch", reason="torch is not installed")

    def to_device(self, x):
        if x is None:
            return None
        x = np.ascontiguousarray(x)
        if x.dtype == np.uint16:  # bits() makes uint16 views of bfloat16 only: hand over bfloat16
            return self.torch.from_numpy(x.view(np.int16)).cuda().view(self.torch.bfloat16)
        return self.torch.from_numpy(x).cuda()

    def to_host(self, x):
        if x.dtype == self.torch.bfloat16:
            return x.view(self.torch.int16).cpu().numpy().view(np.uint16)
        return x.cpu().numpy()

    def synchronize(self):
        self.torch.cuda.synchronize()


class _Cupy:
    def __init__(self):
        self.cupy = pytest.importorskip("cupy", reason="cupy is not installed")

    def to_device(self, x):
        return None if x is None else self.cupy.asarray(x)

    def to_host(self, x):
        return self.cupy.asnumpy(x)

    def synchronize(self):
        self.cupy.cuda.runtime.deviceSynchronize()


class _Jax:
    def __init__(self):
        import jax

        self.jax = jax
        self.cudart = _cudart()
        if self.cudart is None:
            pytest.skip("libcudart not found: cannot synchronize after a launch on jax arrays")
        self.device = jax.devices("gpu")[0]

    def to_device(self, x):
        # device_put is asynchronous, on JAX's own stream: finished before a launch reads it.
        return None if x is None else self.jax.device_put(x, self.device).block_until_ready()

    def to_host(self, x):
        return np.asarray(x)

    def synchronize(self):
        assert self.cudart.cudaDeviceSynchronize() == 0


ARRAY_LIBRARIES = {"torch": _Torch, "cupy": _Cupy, "jax": _Jax}
# torch hands bfloat16 over as itself, not as uint16 bits: these bad calls are then valid ones.
TORCH_HAS_BFLOAT16 = {"bfloat16_bits_without_delta_dtype", "delta_dtype_fp8"}


def _cuda_module():
    from jax_dflash import _dflash_cuda

    return _dflash_cuda


def _on_device(lib, call: RawCall) -> RawCall:
    return RawCall(
        call.contract,
        [lib.to_device(x) if isinstance(x, np.ndarray) else x for x in call.args],
        dict(call.kwargs),
    )


@pytest.mark.parametrize(
    "variant",
    ["f16", "bf16_into_e5m2_per_tensor", "f32_into_e4m3_k_norm", "k_norm_v_norm", "layered"],
)
@pytest.mark.parametrize("contract", CONTRACTS)
@pytest.mark.parametrize("library", list(ARRAY_LIBRARIES))
def test_cuda_updates_the_callers_pool_in_place(library, contract, variant):
    reason = _cuda_reason()
    if reason:
        pytest.skip(reason)
    lib = ARRAY_LIBRARIES[library]()
    problem = build(contract, 41, **_variant(contract, variant))
    host = problem.past_key_value.copy()
    call = _on_device(lib, raw_call(contract, problem, bits(host)[0]))
    # A jax.Array is immutable, so the entry refuses one as the pool (test below): jax inputs
    # update a torch pool here.
    pool_lib = ARRAY_LIBRARIES["torch"]() if library == "jax" else lib
    if library == "jax":
        call.args[2] = pool_lib.to_device(bits(host)[0])
    device_pool = call.args[2]
    assert call.run(_cuda_module()) is None
    lib.synchronize()
    got = pool_lib.to_host(device_pool).view(host.dtype)
    assert_bits_equal(got, expected_pool(contract, problem))


# A k-norm weight at an odd element offset (a view of a larger array; XLA's and TensorRT's buffers
# are aligned) cannot be read a vector at a time: the CUDA launch takes the row form for it, which
# must store the same bits as the butterfly kernels take for an aligned weight. Heads of 16 and
# 128 channels: one and eight lanes per head in the butterfly.
UNALIGNED_WEIGHT_CASES = [
    (contract, dtype, head_dim)
    for contract in CONTRACTS
    for dtype in (F16, BF16)
    for head_dim in (16, 128)
]


def _unaligned_weight_problem(contract, dtype, head_dim):
    return build(contract, 47, dtype=dtype, k_norm=True, head_dim=head_dim, norm_eps=1e-5)


@pytest.mark.parametrize("contract,dtype,head_dim", UNALIGNED_WEIGHT_CASES)
def test_cpu_unaligned_k_norm_weight(contract, dtype, head_dim):
    problem = _unaligned_weight_problem(contract, dtype, head_dim)
    pool = problem.past_key_value.copy()
    call = raw_call(contract, problem, bits(pool)[0])
    weight = call.args[-1]
    padded = np.empty(weight.size + 1, weight.dtype)
    padded[1:] = weight
    call.args[-1] = padded[1:]
    assert call.args[-1].ctypes.data % 16 != 0
    call.run(_cpu())
    assert_bits_equal(pool, expected_pool(contract, problem))


@pytest.mark.parametrize("contract,dtype,head_dim", UNALIGNED_WEIGHT_CASES)
def test_cuda_unaligned_k_norm_weight(contract, dtype, head_dim):
    reason = _cuda_reason()
    if reason:
        pytest.skip(reason)
    torch = _Torch()
    problem = _unaligned_weight_problem(contract, dtype, head_dim)
    host = problem.past_key_value.copy()
    call = _on_device(torch, raw_call(contract, problem, bits(host)[0]))
    weight = call.args[-1]
    padded = torch.torch.empty(weight.numel() + 1, dtype=weight.dtype, device=weight.device)
    padded[1:] = weight
    call.args[-1] = padded[1:]
    assert call.args[-1].data_ptr() % 16 != 0
    device_pool = call.args[2]
    assert call.run(_cuda_module()) is None
    torch.synchronize()
    assert_bits_equal(torch.to_host(device_pool).view(host.dtype), expected_pool(contract, problem))


@pytest.mark.parametrize("contract", CONTRACTS)
def test_cuda_jax_array_pool_is_refused(contract):
    """Writing into a jax.Array's buffer would change a value JAX still holds."""
    reason = _cuda_reason()
    if reason:
        pytest.skip(reason)
    lib = ARRAY_LIBRARIES["jax"]()
    problem = build(contract, 45)
    call = _on_device(lib, raw_call(contract, problem, bits(problem.past_key_value.copy())[0]))
    with pytest.raises(ValueError) as err:
        call.run(_cuda_module())
    assert "past_key_value" in str(err.value) and "jax.Array" in str(err.value), str(err.value)
    lib.synchronize()
    assert_bits_equal(
        lib.to_host(call.args[2]).view(problem.past_key_value.dtype), problem.past_key_value
    )


@pytest.mark.parametrize("contract", CONTRACTS)
@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_cuda_non_contiguous_pool_raises_and_is_left(library, contract):
    reason = _cuda_reason()
    if reason:
        pytest.skip(reason)
    lib = ARRAY_LIBRARIES[library]()
    problem = build(contract, 42)
    wide = lib.to_device(np.concatenate([problem.past_key_value] * 2, axis=1))
    pool = wide[:, ::2]
    call = _on_device(lib, raw_call(contract, problem, problem.past_key_value))
    call.args[2] = pool
    with pytest.raises(ValueError) as err:
        call.run(_cuda_module())
    assert "past_key_value" in str(err.value) and "C-contiguous" in str(err.value)
    lib.synchronize()
    assert_bits_equal(lib.to_host(wide), np.concatenate([problem.past_key_value] * 2, axis=1))


@pytest.mark.parametrize("contract", CONTRACTS)
def test_cuda_entry_rejects_host_arrays(contract):
    reason = _cuda_reason()
    if reason:
        pytest.skip(reason)
    problem = build(contract, 43)
    pool = problem.past_key_value.copy()
    with pytest.raises(ValueError) as err:
        raw_call(contract, problem, pool).run(_cuda_module())
    assert "k_delta" in str(err.value) and "CUDA" in str(err.value), str(err.value)
    assert_bits_equal(pool, problem.past_key_value)


@pytest.mark.parametrize("contract", CONTRACTS)
@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_cuda_wrong_arguments_name_them(library, contract):
    reason = _cuda_reason()
    if reason:
        pytest.skip(reason)
    lib = ARRAY_LIBRARIES[library]()
    for bad in BAD_CALLS:
        if (
            contract not in bad.contracts
            or bad.host_only
            or bad.name in ("index_as_a_list", "pool_as_an_int", "k_delta_fortran_order")
        ):
            continue  # host-only shapes of a bad argument
        if library == "torch" and bad.name in TORCH_HAS_BFLOAT16:
            continue
        problem = build(contract, 44, **bad.problem)
        call = raw_call(contract, problem, bits(problem.past_key_value.copy())[0])
        bad.mutate(call)
        call = _on_device(lib, call)
        with pytest.raises(bad.error) as err:
            call.run(_cuda_module())
        _assert_names(err.value, bad.words)


@pytest.mark.parametrize(
    "stream, error, words",
    [
        (-1, ValueError, "stream: expected an int in [0, 2^64-1] (a cudaStream_t), got -1"),
        (2**64, ValueError, "got 18446744073709551616"),
        ("0", TypeError, "stream: expected an int in [0, 2^64-1] (a cudaStream_t), got str '0'"),
        (True, TypeError, "got bool True"),
    ],
)
def test_cuda_stream_argument_is_checked(stream, error, words):
    reason = _cuda_reason()
    if reason:
        pytest.skip(reason)
    lib = ARRAY_LIBRARIES["torch"]()
    problem = build("slot", 48)
    call = _on_device(lib, raw_call("slot", problem, problem.past_key_value.copy()))
    call.kwargs["stream"] = stream
    with pytest.raises(error) as err:
        call.run(_cuda_module())
    assert words in str(err.value), str(err.value)


@pytest.mark.parametrize("contract", CONTRACTS)
def test_cpu_jax_array_pool_is_refused(contract):
    """A jax.Array is immutable: the in-place entry refuses it as the pool, naming it."""
    import jax.numpy as jnp

    problem = build(contract, 46)
    call = raw_call(contract, problem, problem.past_key_value.copy())
    call.args[2] = jnp.asarray(problem.past_key_value)
    with pytest.raises(ValueError) as err:
        call.run(_cpu())
    assert "past_key_value" in str(err.value) and "jax.Array" in str(err.value), str(err.value)
