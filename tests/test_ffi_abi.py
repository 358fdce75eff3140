"""Hand-written ``jax.ffi.ffi_call``s of both custom-call targets (SPEC.md, "The XLA FFI custom
calls"): calls that follow the ABI are bit-exact with the NumPy reference; every other call is an
error that names the operand or attribute, never a crash.

The calls bypass jax_dflash's Python checks, so they reach the handlers with anything. They run
in child processes (this file run as a script), many per process: a crash fails the case it
happened in, and the remaining cases still run in a fresh child.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from helpers.children import run_in_children

SLOT_TARGET = "dflash_target_kv_cache_update"
PAGED_TARGET = "dflash_target_kv_cache_update_paged"
OK = "ok"  # the call must succeed and equal the reference over the whole pool


# ---- one call: named operands, results, attributes --------------------------------------------


@dataclasses.dataclass
class Call:
    target: str
    ops: dict  # SPEC.md's operand name -> NumPy array, in ABI order
    results: list  # [(shape, dtype)]
    attrs: dict
    alias: bool = True
    side_effect: bool = False

    @property
    def pool(self):
        return self.ops["past_key_value"]


def _base_call(contract: str, problem) -> Call:
    names = (
        (
            "k_delta",
            "v_delta",
            "past_key_value",
            "rope_cos_sin",
            "delta_start_positions",
            "delta_lengths",
        )
        if contract == "slot"
        else (
            "k_delta",
            "v_delta",
            "past_key_value",
            "rope_cos_sin",
            "delta_positions",
            "delta_token_to_sequence",
            "kv_page_table",
        )
    )
    ops = dict(zip(names, problem.args()))
    if problem.k_scale is not None:
        ops["k_scale"], ops["v_scale"] = problem.k_scale, problem.v_scale
    if problem.k_norm_weight is not None:
        ops["k_norm_weight"] = problem.k_norm_weight
    attrs = {}
    if contract == "slot":
        attrs["pages_per_slot"] = np.int64(problem.pages_per_slot)
    elif isinstance(problem.ring, tuple):  # one 0/1 entry per layer, an int8 array
        attrs["ring"] = np.asarray(problem.ring, np.int8)
    elif problem.ring:
        attrs["ring"] = np.bool_(True)
    if problem.k_norm_weight is not None:
        attrs["k_norm"] = np.bool_(True)
    if problem.v_norm:
        attrs["v_norm"] = np.bool_(True)
    if problem.k_norm_weight is not None or problem.v_norm:
        attrs["norm_eps"] = np.float32(problem.norm_eps)
    pool = ops["past_key_value"]
    target = SLOT_TARGET if contract == "slot" else PAGED_TARGET
    return Call(target, ops, [(pool.shape, pool.dtype)], attrs)


# ---- mutations of a valid call ------------------------------------------------------------------


def _set(name, fn):
    def mutate(c: Call):
        c.ops[name] = fn(c.ops[name])

    return mutate


def _both(names, fn):
    def mutate(c: Call):
        for n in names:
            c.ops[n] = fn(c.ops[n])

    return mutate


def _attr(**attrs):
    def mutate(c: Call):
        c.attrs.update(attrs)

    return mutate


def _drop_attr(name):
    def mutate(c: Call):
        del c.attrs[name]

    return mutate


def _drop(name):
    def mutate(c: Call):
        del c.ops[name]

    return mutate


def _append(name, fn):
    def mutate(c: Call):
        c.ops[name] = fn(c)

    return mutate


def _order(*names):
    def mutate(c: Call):
        moved = {n: c.ops.pop(n) for n in names}
        c.ops.update(moved)

    return mutate


def _result(shape_fn=None, dtype=None, alias=False):
    def mutate(c: Call):
        shape, old = c.results[0]
        c.results = [(tuple(shape_fn(shape)) if shape_fn else shape, dtype or old)]
        c.alias = alias

    return mutate


def _results(n):
    def mutate(c: Call):
        c.results = c.results[:1] * n
        c.alias = False
        c.side_effect = True  # else a call with no results would be dropped as dead code

    return mutate


def _chain(*mutations):
    def mutate(c: Call):
        for m in mutations:
            m(c)

    return mutate


def _no_alias(c: Call):
    c.alias = False


def _side_effect(c: Call):
    # XLA skips a call whose only result has no elements, unless it has a side effect.
    c.side_effect = True


def _dt(name):
    """A dtype by name, ml_dtypes' (bfloat16, FP8) included."""
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, str(name)) else np.dtype(name)


def _astype(dtype):
    return lambda x: np.asarray(x).astype(_dt(dtype) if isinstance(dtype, str) else dtype)


def _grow(axis, by=1):
    def fn(x):
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, by)
        return np.pad(x, pad, mode="edge")

    return fn


def _shrink(axis):
    return lambda x: np.take(x, range(x.shape[axis] - 1), axis=axis)


def _add_axis(x):
    return x[None]


def _drop_axis(x):
    return x[0]


def _int32_scalar(_):
    return np.ones((1,), np.int32)


def _more_slots(c: Call):
    """One sequence more than the pool has slots (B = maxBatch + 1)."""
    for n in ("k_delta", "v_delta"):
        c.ops[n] = _grow(0, 1)(c.ops[n])
    for n in ("delta_start_positions", "delta_lengths"):
        c.ops[n] = _grow(0, 1)(c.ops[n])


# ---- the cases ----------------------------------------------------------------------------------

F16, F32 = np.dtype(np.float16), np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    contract: str  # "slot" / "paged"
    problem: tuple  # keyword items for make_problem / make_paged_problem
    mutate: Callable | None
    expect: object  # OK, or the words the message must contain ("a|b": either)

    @property
    def id(self):
        return f"{self.contract}-{self.name}"


def _fp8(scale_shape=None, **more):
    return (
        ("pool_dtype", "float8_e4m3fn"),
        *((("scale_shape", scale_shape),) if scale_shape is not None else ()),
        *more.items(),
    )


_LAYERED_SLOT = (
    ("layers", 2),
    ("pool_dtype", "float8_e5m2"),
    ("scale_shape", (2, 2)),
    ("k_norm", True),
    ("v_norm", True),
    ("norm_weight_per_layer", True),
    ("rope_per_layer", True),
    ("positions_per_layer", True),
    ("dtype", "bfloat16"),
)
_LAYERED_PAGED = (
    ("layers", 2),
    ("pool_dtype", "float8_e4m3fn"),
    ("scale_shape", (2, 1)),
    ("k_norm", True),
    ("norm_weight_per_layer", True),
    ("rope_per_layer", True),
    ("positions_per_layer", True),
    ("table_per_layer", True),
    ("ring", True),
)
_NORMS = (("k_norm", True), ("v_norm", True))
# A draft of sliding-window and full layers: one ring entry per layer.
_PER_LAYER_RING = (("layers", 3), ("ring", (True, False, True)))


def _both_contracts(name, problem, mutate, expect):
    return [
        Case(name, "slot", problem, mutate, expect),
        Case(name, "paged", problem, mutate, expect),
    ]


def _index_names(contract):
    return (
        ("delta_start_positions", "delta_lengths")
        if contract == "slot"
        else ("delta_positions", "delta_token_to_sequence", "kv_page_table")
    )


# Long: a table of cases, one entry each.
def _cases() -> list[Case]:
    cases = []
    both = lambda *a: cases.extend(_both_contracts(*a))  # noqa: E731
    slot = lambda *a: cases.append(Case(a[0], "slot", *a[1:]))  # noqa: E731
    paged = lambda *a: cases.append(Case(a[0], "paged", *a[1:]))  # noqa: E731

    # Calls that follow the ABI.
    both("ok_plain", (), None, OK)
    both("ok_bf16_into_f32_pool", (("dtype", "bfloat16"), ("pool_dtype", "float32")), None, OK)
    both("ok_fp8_per_head_scales", _fp8(), None, OK)
    both(
        "ok_fp8_e5m2_per_tensor_scales",
        (("pool_dtype", "float8_e5m2"), ("scale_shape", ())),
        None,
        OK,
    )
    both("ok_k_norm_and_v_norm", _NORMS, None, OK)
    both("ok_fp8_and_k_norm", _fp8(k_norm=True), None, OK)
    slot("ok_layered_all_extras_per_layer", _LAYERED_SLOT, None, OK)
    paged("ok_layered_all_extras_per_layer", _LAYERED_PAGED, None, OK)
    paged("ok_ring", (("ring", True),), None, OK)
    paged("ok_per_layer_ring", _PER_LAYER_RING, None, OK)
    paged(
        "ok_layered_all_extras_per_layer_ring",
        (*_LAYERED_PAGED[:-1], ("ring", (False, True))),
        None,
        OK,
    )
    slot("ok_pages_per_slot_int32", (), _attr(pages_per_slot=np.int32(2)), OK)
    both("ok_result_not_aliased", _fp8(k_norm=True), _no_alias, OK)
    both(
        "ok_optional_attributes_explicit",
        (),
        _attr(k_norm=np.bool_(False), v_norm=np.bool_(False), norm_eps=np.float32(1e-5)),
        OK,
    )
    paged("ok_ring_false_explicit", (), _attr(ring=np.bool_(False)), OK)

    # The result: exactly the pool's dims and dtype (not aliased, so the handler sees it).
    both(
        "result_fewer_pages",
        (),
        _result(lambda s: (*s[:1], s[1] - 1, *s[2:])),
        ("present_key_value",),
    )
    both(
        "result_more_pages",
        (),
        _result(lambda s: (*s[:1], s[1] + 1, *s[2:])),
        ("present_key_value",),
    )
    both("result_other_dims", (), _result(lambda s: (*s[:3], s[4], s[3])), ("present_key_value",))
    both("result_other_rank", (), _result(lambda s: (s[0] * s[1], *s[2:])), ("present_key_value",))
    both("result_other_dtype", (), _result(dtype=F32), ("present_key_value", "float32"))
    both(
        "result_fp8_pool_other_fp8",
        _fp8(),
        _result(dtype=np.dtype("uint8")),
        ("present_key_value",),
    )
    both(
        "result_aliased_other_dims",
        (),
        _result(lambda s: (*s[:1], s[1] - 1, *s[2:]), alias=True),
        ("input_output_aliases",),
    )
    both("two_results", (), _results(2), ("present_key_value", "got 2"))
    # With a side effect: XLA on GPU drops a call whose results nobody uses.
    both("no_result", (), _chain(_results(0), _side_effect), ("present_key_value", "got 0"))

    # Operand counts and the extras.
    for contract in ("slot", "paged"):
        last = "delta_lengths" if contract == "slot" else "kv_page_table"
        target = SLOT_TARGET if contract == "slot" else PAGED_TARGET
        base = 6 if contract == "slot" else 7
        cases.append(
            Case(
                "missing_last_base_operand",
                contract,
                (),
                _drop(last),
                (target, f"expected {base} operands", f"got {base - 1} operands"),
            )
        )
        cases.append(
            Case(
                "missing_rope_with_extras",
                contract,
                _fp8(k_norm=True),
                _drop("rope_cos_sin"),
                (target, "operands", "got 8|got 9"),
            )
        )
    both("extra_int32_operand", (), _append("extra", _int32_scalar), ("got 7|got 8", "operands"))
    both(
        "weight_without_k_norm_attribute", (("k_norm", True),), _drop_attr("k_norm"), ("operands",)
    )
    both(
        "k_norm_attribute_without_weight",
        (("k_norm", True),),
        _drop("k_norm_weight"),
        ("k_norm_weight",),
    )
    both(
        "extras_weight_before_scales",
        _fp8(k_norm=True),
        _order("k_norm_weight", "k_scale", "v_scale"),
        ("k_scale",),
    )
    both(
        "extras_weight_between_scales",
        _fp8(k_norm=True, dtype="float32"),
        _order("k_scale", "k_norm_weight", "v_scale"),
        ("v_scale|k_norm_weight",),
    )
    both("k_scale_float16", _fp8(), _set("k_scale", _astype(F16)), ("k_scale", "float32"))
    both("v_scale_int32", _fp8(), _set("v_scale", _astype(np.int32)), ("v_scale", "float32"))
    both(
        "k_scale_one_too_many_heads", _fp8(), _both(("k_scale", "v_scale"), _grow(0)), ("k_scale",)
    )
    both("v_scale_other_shape", _fp8(), _set("v_scale", lambda x: x[:1].reshape(())), ("v_scale",))
    both("k_scale_rank_2_unbatched", _fp8(), _both(("k_scale", "v_scale"), _add_axis), ("k_scale",))
    both(
        "k_norm_weight_float32_for_float16_deltas",
        (("k_norm", True),),
        _set("k_norm_weight", _astype(F32)),
        ("k_norm_weight", "float16"),
    )
    both(
        "k_norm_weight_one_too_long",
        (("k_norm", True),),
        _set("k_norm_weight", _grow(0)),
        ("k_norm_weight",),
    )
    both(
        "k_norm_weight_rank_2_unbatched",
        (("k_norm", True),),
        _set("k_norm_weight", _add_axis),
        ("k_norm_weight",),
    )
    both(
        "scales_for_a_float16_pool",
        (),
        _chain(
            _append("k_scale", lambda c: np.ones((2,), np.float32)),
            _append("v_scale", lambda c: np.ones((2,), np.float32)),
        ),
        ("past_key_value", "k_scale"),
    )
    both(
        "fp8_pool_without_scales",
        _fp8(),
        _chain(_drop("k_scale"), _drop("v_scale")),
        ("past_key_value", "k_scale"),
    )
    both("fp8_pool_one_scale", _fp8(), _drop("v_scale"), ("operands",))

    # Attributes.
    slot("pages_per_slot_float", (), _attr(pages_per_slot=2.0), ("pages_per_slot",))
    slot("pages_per_slot_float32", (), _attr(pages_per_slot=np.float32(2)), ("pages_per_slot",))
    slot("pages_per_slot_int8", (), _attr(pages_per_slot=np.int8(2)), ("pages_per_slot",))
    slot("pages_per_slot_uint32", (), _attr(pages_per_slot=np.uint32(2)), ("pages_per_slot",))
    slot("pages_per_slot_bool", (), _attr(pages_per_slot=np.bool_(True)), ("pages_per_slot",))
    slot("pages_per_slot_string", (), _attr(pages_per_slot="2"), ("pages_per_slot",))
    slot(
        "pages_per_slot_array",
        (),
        _attr(pages_per_slot=np.array([2, 2], np.int64)),
        ("pages_per_slot",),
    )
    slot("pages_per_slot_zero", (), _attr(pages_per_slot=np.int64(0)), ("pages_per_slot",))
    slot("pages_per_slot_negative", (), _attr(pages_per_slot=np.int64(-2)), ("pages_per_slot",))
    slot("pages_per_slot_huge", (), _attr(pages_per_slot=np.int64(2**62)), ("pages_per_slot",))
    slot("pages_per_slot_missing", (), _drop_attr("pages_per_slot"), ("pages_per_slot", "missing"))
    slot("ring_on_the_slot_target", (), _attr(ring=np.bool_(False)), ("unknown", "ring"))
    paged(
        "pages_per_slot_on_the_paged_target",
        (),
        _attr(pages_per_slot=np.int64(2)),
        ("unknown", "pages_per_slot"),
    )
    both("unknown_attribute", (), _attr(page_size=np.int64(4)), ("unknown", "page_size"))
    both("k_norm_given_as_int", (("k_norm", True),), _attr(k_norm=np.int32(1)), ("k_norm", "bool"))
    both(
        "v_norm_given_as_int64", (("v_norm", True),), _attr(v_norm=np.int64(1)), ("v_norm", "bool")
    )
    both("v_norm_given_as_string", (), _attr(v_norm="true"), ("v_norm",))
    paged("ring_given_as_int", (("ring", True),), _attr(ring=np.int32(1)), ("ring", "bool"))
    paged(
        "per_layer_ring_as_int32",
        _PER_LAYER_RING,
        _attr(ring=np.array([1, 0, 1], np.int32)),
        ("ring", "int8 array"),
    )
    paged(
        "per_layer_ring_entry_2",
        _PER_LAYER_RING,
        _attr(ring=np.array([1, 2, 0], np.int8)),
        ("ring", "0 or 1", "got 2 for layer 1"),
    )
    paged(
        "per_layer_ring_one_short",
        _PER_LAYER_RING,
        _attr(ring=np.array([1, 0], np.int8)),
        ("ring", "one entry per layer, 3", "got entries for 2 layers"),
    )
    paged(
        "per_layer_ring_unbatched",
        (),
        _attr(ring=np.array([1], np.int8)),
        ("ring", "layer-batched form", "expected a bool"),
    )
    both(
        "norm_eps_float64",
        (("v_norm", True),),
        _attr(norm_eps=np.float64(1e-6)),
        ("norm_eps", "float32"),
    )
    both("norm_eps_int", (("v_norm", True),), _attr(norm_eps=np.int64(1)), ("norm_eps",))
    both("norm_eps_string", (("v_norm", True),), _attr(norm_eps="1e-6"), ("norm_eps",))
    both(
        "norm_eps_zero_with_k_norm",
        (("k_norm", True),),
        _attr(norm_eps=np.float32(0)),
        ("norm_eps",),
    )
    both(
        "norm_eps_nan_with_v_norm",
        (("v_norm", True),),
        _attr(norm_eps=np.float32("nan")),
        ("norm_eps",),
    )

    # Operand dtypes.
    for contract in ("slot", "paged"):
        for name in _index_names(contract):
            cases.append(
                Case(f"{name}_int64", contract, (), _set(name, _astype(np.int64)), (name, "int32"))
            )
            cases.append(
                Case(f"{name}_float32", contract, (), _set(name, _astype(F32)), (name, "int32"))
            )
    both("rope_float16", (), _set("rope_cos_sin", _astype(F16)), ("rope_cos_sin", "float32"))
    both("rope_float64", (), _set("rope_cos_sin", _astype(np.float64)), ("rope_cos_sin", "float32"))
    both("deltas_int32", (), _both(("k_delta", "v_delta"), _astype(np.int32)), ("k_delta",))
    both("deltas_float64", (), _both(("k_delta", "v_delta"), _astype(np.float64)), ("k_delta",))
    both("deltas_fp8", (), _both(("k_delta", "v_delta"), _astype("float8_e4m3fn")), ("k_delta",))
    both("v_delta_other_dtype", (), _set("v_delta", _astype(F32)), ("v_delta", "float16"))
    both(
        "pool_int32",
        (),
        _chain(
            _set("past_key_value", _astype(np.int32)), _result(dtype=np.dtype(np.int32), alias=True)
        ),
        ("past_key_value",),
    )
    both(
        "pool_float64",
        (),
        _chain(
            _set("past_key_value", _astype(np.float64)),
            _result(dtype=np.dtype(np.float64), alias=True),
        ),
        ("past_key_value",),
    )

    # Shapes: ranks off by one, the contract's equalities.
    both("k_delta_rank_plus_one", (), _both(("k_delta", "v_delta"), _add_axis), ("k_delta",))
    both("k_delta_rank_minus_one", (), _both(("k_delta", "v_delta"), _drop_axis), ("k_delta",))
    both(
        "pool_rank_4",
        (),
        _chain(_set("past_key_value", _drop_axis), _result(lambda s: s[1:], alias=True)),
        ("past_key_value",),
    )
    both(
        "pool_rank_7",
        (),
        _chain(
            _set("past_key_value", lambda x: x[None, None]),
            _result(lambda s: (1, 1, *s), alias=True),
        ),
        ("past_key_value",),
    )
    both(
        "pool_three_planes",
        (),
        _chain(_set("past_key_value", _grow(0)), _result(lambda s: (3, *s[1:]), alias=True)),
        ("past_key_value",),
    )
    both(
        "pool_page_size_zero",
        (),
        _chain(
            _set("past_key_value", lambda x: x[:, :, :0]),
            _result(lambda s: (*s[:2], 0, *s[3:]), alias=True),
            _side_effect,
        ),
        ("past_key_value",),
    )
    both("rope_rank_plus_one", (), _set("rope_cos_sin", _add_axis), ("rope_cos_sin",))
    both("rope_rank_minus_one", (), _set("rope_cos_sin", _drop_axis), ("rope_cos_sin",))
    both("rope_rotary_dim_odd", (), _set("rope_cos_sin", lambda x: x[..., :-1]), ("rope_cos_sin",))
    both("rope_rotary_dim_past_head_dim", (), _set("rope_cos_sin", _grow(-1, 2)), ("rope_cos_sin",))
    both("heads_mismatch", (), _both(("k_delta", "v_delta"), _grow(-2)), ("k_delta",))
    both("head_dim_mismatch", (), _both(("k_delta", "v_delta"), _shrink(-1)), ("k_delta",))
    both("v_delta_other_shape", (), _set("v_delta", _shrink(0)), ("v_delta",))
    for contract in ("slot", "paged"):
        first, second = _index_names(contract)[:2]
        cases.append(
            Case(
                f"{first}_rank_2_unbatched",
                contract,
                (),
                _both((first, second), _add_axis),
                (first,),
            )
        )
        cases.append(
            Case(f"{second}_one_too_long", contract, (), _set(second, _grow(0)), (second,))
        )
    slot(
        "rope_batch_not_1_or_B",
        (),
        _set("rope_cos_sin", lambda x: np.repeat(x, 3, 0)),
        ("rope_cos_sin",),
    )
    slot("rope_longer_than_slot_capacity", (), _set("rope_cos_sin", _grow(1)), ("rope_cos_sin",))
    slot("batch_larger_than_slots", (), _more_slots, ("k_delta",))
    slot(
        "pages_not_divisible_by_pages_per_slot",
        (),
        _attr(pages_per_slot=np.int64(3)),
        ("past_key_value", "pages_per_slot"),
    )
    paged(
        "table_pages_larger_than_pool_pages",
        (),
        _set("kv_page_table", lambda x: np.concatenate([x] * 5, axis=-1)),
        ("kv_page_table", "M"),
    )
    paged("rope_rows_not_tokens", (), _set("rope_cos_sin", _shrink(0)), ("rope_cos_sin",))
    paged("table_dim_1_is_3", (), _set("kv_page_table", _grow(1)), ("kv_page_table",))
    paged(
        "table_rank_2",
        (),
        _set("kv_page_table", lambda x: x.reshape(x.shape[0], -1)),
        ("kv_page_table",),
    )

    # Layered forms: every per-layer operand must agree with the pool's layers.
    slot(
        "layered_k_delta_other_layers",
        _LAYERED_SLOT,
        _both(("k_delta", "v_delta"), _grow(0)),
        ("k_delta", "layers"),
    )
    paged(
        "layered_k_delta_other_layers",
        _LAYERED_PAGED,
        _both(("k_delta", "v_delta"), _grow(0)),
        ("k_delta", "layers"),
    )
    slot(
        "layered_rope_other_layers",
        _LAYERED_SLOT,
        _set("rope_cos_sin", _grow(0)),
        ("rope_cos_sin",),
    )
    paged(
        "layered_table_other_layers",
        _LAYERED_PAGED,
        _set("kv_page_table", _grow(0)),
        ("kv_page_table",),
    )
    slot(
        "layered_lengths_shared_starts_per_layer",
        _LAYERED_SLOT,
        _set("delta_lengths", lambda x: x[0]),
        ("delta_lengths",),
    )
    paged(
        "layered_owners_shared_positions_per_layer",
        _LAYERED_PAGED,
        _set("delta_token_to_sequence", lambda x: x[0]),
        ("delta_token_to_sequence",),
    )
    both(
        "layered_scales_other_layers",
        (("layers", 2), ("pool_dtype", "float8_e4m3fn"), ("scale_shape", (2, 2))),
        _both(("k_scale", "v_scale"), _grow(0)),
        ("k_scale",),
    )
    both(
        "layered_weight_other_layers",
        (("layers", 2), ("k_norm", True), ("norm_weight_per_layer", True)),
        _set("k_norm_weight", _grow(0)),
        ("k_norm_weight",),
    )
    return cases


CASES = _cases()


# ---- the child process ---------------------------------------------------------------------------


def _problem(case: Case):
    from jax_dflash import testing

    kwargs = dict(case.problem)
    for key in ("dtype", "pool_dtype"):
        if key in kwargs:
            kwargs[key] = _dt(kwargs[key])
    rng = np.random.default_rng(sum(map(ord, case.id)))
    if case.contract == "slot":
        return testing.make_problem(rng, **kwargs)
    return testing.make_paged_problem(rng, **kwargs)


def _expected(case: Case, problem):
    from jax_dflash import reference

    fn = (
        reference.target_kv_cache_update
        if case.contract == "slot"
        else reference.target_kv_cache_update_paged
    )
    return fn(*problem.args(), **problem.kwargs())


def _run_case(case: Case, platform: str) -> dict:
    import jax
    import jax.numpy as jnp

    from jax_dflash import testing

    problem = _problem(case)
    call = _base_call(case.contract, problem)
    if case.mutate is not None:
        case.mutate(call)
    device = jax.devices(platform)[0]
    results = [jax.ShapeDtypeStruct(s, d) for s, d in call.results]
    fn = jax.ffi.ffi_call(
        call.target,
        results[0] if len(results) == 1 else results,
        input_output_aliases={2: 0} if call.alias else None,
        has_side_effect=call.side_effect,
    )
    operands = [jax.device_put(x, device) for x in call.ops.values()]
    out = {"id": case.id}

    def run(*a):
        got = fn(*a, **call.attrs)
        if not results:
            # An output of the same execution: on the GPU an error of a call without results is
            # reported through the execution's outputs, and there would be none to wait on.
            return got, jnp.sum(a[0].astype(jnp.float32))
        return got

    try:
        got = jax.block_until_ready(jax.jit(run)(*operands))
        got = np.asarray(got[0] if not results else got)
    except Exception as e:  # noqa: BLE001  (the error is the result)
        return {**out, "status": "error", "type": type(e).__name__, "message": str(e)}
    out["status"] = "ok"
    try:
        testing.assert_bits_equal(got, _expected(case, problem))
        out["bits_equal"] = True
    except AssertionError as e:
        out.update(bits_equal=False, mismatch=str(e))
    return out


def _child(platform: str, ids: list[str]) -> None:
    import jax

    jax.config.update("jax_enable_x64", True)  # so int64/float64 operands reach the handler
    from jax_dflash import _ext

    _ext.ensure_registered("cpu" if platform == "cpu" else "cuda")
    by_id = {c.id: c for c in CASES}
    for case_id in ids:
        print(json.dumps({"start": case_id}), flush=True)
        print(json.dumps(_run_case(by_id[case_id], platform)), flush=True)


# ---- the tests -----------------------------------------------------------------------------------


def _gpu_reason():
    from jax_dflash.testing import gpu_devices

    if not gpu_devices():
        return "no GPU backend in this JAX: the CUDA handlers' ABI cases run on the H200"
    from jax_dflash import _ext

    if not _ext.cuda_extension_available():
        return "jax_dflash._dflash_cuda was not built (no CUDA toolkit at build time)"
    return None


_cache: dict = {}


def _results_for(platform: str) -> dict:
    if platform not in _cache:
        _cache[platform] = run_in_children(platform, [c.id for c in CASES], Path(__file__))
    return _cache[platform]


def check_result(case: Case, result: dict) -> None:
    """Raises AssertionError unless ``result`` is what ``case`` expects."""
    status = result["status"]
    if status == "crash":
        raise AssertionError(
            f"{case.id}: the child process died (exit {result['returncode']}) "
            f"in this call:\n{result['stderr']}"
        )
    if case.expect == OK:
        assert status == "ok", (
            f"{case.id}: expected success, got {result.get('type')}: {result.get('message')}"
        )
        assert result["bits_equal"], f"{case.id}: differs from the reference: {result['mismatch']}"
        return
    assert status == "error", (
        f"{case.id}: expected an error naming {case.expect}, the call succeeded"
    )
    assert result["type"] in ("JaxRuntimeError", "XlaRuntimeError", "ValueError", "TypeError"), (
        result
    )
    message = result["message"]
    for word in case.expect:
        assert any(w in message for w in word.split("|")), (
            f"{case.id}: expected the message to name {word!r}, got: {message}"
        )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cpu_handler(case):
    check_result(case, _results_for("cpu")[case.id])


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cuda_handler(case):
    reason = _gpu_reason()
    if reason:
        pytest.skip(reason)
    check_result(case, _results_for("gpu")[case.id])


def test_every_handler_error_names_its_target():
    """Errors the handlers return (not XLA's own) carry the target's name first."""
    results = _results_for("cpu")
    handler_errors = [
        (c, results[c.id])
        for c in CASES
        if results[c.id]["status"] == "error"
        and "dflash_target_kv_cache_update" in results[c.id]["message"]
    ]
    assert len(handler_errors) > len(CASES) // 2
    for case, result in handler_errors:
        target = SLOT_TARGET if case.contract == "slot" else PAGED_TARGET
        assert f"{target}: " in result["message"], (case.id, result["message"])


def test_a_crash_is_reported_as_the_case_that_crashed(tmp_path):
    """The runner itself: a child that dies in its second case fails that case only, and the
    cases after it still run."""
    script = tmp_path / "crashing_child.py"
    script.write_text(
        "import json, os, sys\n"
        "for i in sys.argv[2:]:\n"
        "    print(json.dumps({'start': i}), flush=True)\n"
        "    if i == 'b':\n"
        "        os.abort()\n"
        "    print(json.dumps({'id': i, 'status': 'ok', 'bits_equal': True}), flush=True)\n"
    )
    results = run_in_children("cpu", ["a", "b", "c"], script, timeout=60)
    assert results["a"]["status"] == "ok" and results["c"]["status"] == "ok"
    assert results["b"]["status"] == "crash" and results["b"]["returncode"] != 0


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2:])
