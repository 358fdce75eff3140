"""The contract has one checker: the core's (``csrc/dflash/operands.cc``).

``tests/test_bad_shapes_everywhere.py`` sends one table of bad calls through every entry point
and requires each to refuse them naming the operand. This file shows why they agree: the Python
entry points (the JAX op, eager and traced, the NumPy reference, the ONNX node's checks) reach
the core through ``_dflash_cpu.check_call`` and hold no dimension rule of their own, and the
plugin's checks hand every dim to ``params_from_operands``.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import jax
import numpy as np
import pytest

import jax_dflash
from jax_dflash import _shapes, lowering, ops, reference
from jax_dflash.interop import onnx as dflash_onnx

ROOT = Path(__file__).resolve().parents[1]


class _Spy:
    """The CPU extension with its check_call counted, every other attribute passed through."""

    def __init__(self, core):
        self.core, self.calls = core, []

    def check_call(self, form, operands, **attrs):
        self.calls.append(form)
        return self.core.check_call(form, operands, **attrs)

    def __getattr__(self, name):
        return getattr(self.core, name)


@pytest.fixture
def spy(monkeypatch):
    spy = _Spy(_shapes._core)
    monkeypatch.setattr(_shapes, "_core", spy)
    return spy


def _slot_args(pages=4, page_size=128):
    k = np.zeros((2, 3, 2, 8), np.float16)
    pool = np.zeros((2, pages, page_size, 2, 8), np.float16)
    rope = np.zeros((1, 16, 8), np.float32)
    return [k, k, pool, rope, np.zeros(2, np.int32), np.zeros(2, np.int32)]


def test_every_python_entry_point_asks_the_core(spy):
    args = _slot_args()
    jax_dflash.target_kv_cache_update(*args, pages_per_slot=2)
    assert spy.calls and set(spy.calls) == {"slot"}, "the eager op did not ask the core"
    jax.jit(lambda *a: jax_dflash.target_kv_cache_update(*a, pages_per_slot=2)).lower(*args)
    assert len(spy.calls) >= 2, "abstract evaluation did not ask the core"
    count = len(spy.calls)
    reference.target_kv_cache_update(*args, pages_per_slot=2)
    assert len(spy.calls) > count, "the reference did not ask the core"
    count = len(spy.calls)
    dflash_onnx.check_plugin_operands(False, args, pages_per_slot=2)
    assert len(spy.calls) > count, "the ONNX node's checks did not ask the core"


def test_a_rule_changed_in_the_core_changes_every_python_entry_point(spy, monkeypatch):
    """With the core refusing everything, every Python entry point refuses, with its message."""

    def refuse(form, operands, **attrs):
        raise ValueError(f"past_key_value: refused by the core ({form})")

    monkeypatch.setattr(spy, "check_call", refuse)
    args = _slot_args(pages=6)  # a call no earlier test traced or cached
    entry_points = {
        "op": lambda: jax_dflash.target_kv_cache_update(*args, pages_per_slot=3),
        "reference": lambda: reference.target_kv_cache_update(*args, pages_per_slot=3),
        "onnx": lambda: dflash_onnx.check_plugin_operands(False, args, pages_per_slot=3),
    }
    for call in entry_points.values():
        with pytest.raises(ValueError, match="refused by the core"):
            call()


def _compares_dims(tree: ast.AST) -> list[str]:
    """Comparisons whose operands read an operand's shape (``.shape``, ``.ndim``, ``_dims``)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for part in ast.walk(node):
            is_shape = isinstance(part, ast.Attribute) and part.attr in ("shape", "ndim")
            is_dims = isinstance(part, ast.Call) and getattr(part.func, "id", "") == "_dims"
            if is_shape or is_dims:
                found.append(ast.unparse(node))
                break
    return found


@pytest.mark.parametrize(
    "source",
    [
        inspect.getsource(_shapes),
        inspect.getsource(dflash_onnx.check_plugin_operands),
        inspect.getsource(ops.target_kv_cache_update),
        inspect.getsource(ops.target_kv_cache_update_paged),
    ],
    ids=["_shapes", "onnx.check_plugin_operands", "ops.slot", "ops.paged"],
)
def test_the_python_side_holds_no_dimension_rule(source):
    tree = ast.parse(source)
    assert _compares_dims(tree) == []
    # Nor an error about a shape of its own: those messages are the core's.
    shape_errors = [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Raise) and re.search(r"\b(shape|rank|dims?)\b", ast.unparse(node))
    ]
    assert shape_errors == []


def test_the_plugin_hands_every_dim_to_the_core():
    checks = (ROOT / "trt_plugin" / "DFlashPluginChecks.cpp").read_text()
    # tensorBytes (a tensor's size for the workspace) guards its own product, not the contract.
    start = checks.index("int64_t tensorBytes(")
    checks = checks[:start] + checks[checks.index("\n}\n", start) :]
    # A rule on a dim's value: `.d[i] ==`, `.d[2] != 128` and the like. The dims are only copied
    # into the core's TensorDescs and printed.
    rules = [
        line.strip()
        for line in checks.splitlines()
        if re.search(r"\.d\[[^\]]+\]\s*(==|!=|<=|>=|<|>)", line) and "kUnknownDim ?" not in line
    ]
    assert rules == []
    body = checks[checks.index("std::string checkCall(") :]
    assert "params_from_operands(" in body[: body.index("\nstd::string checkProfile(")]


def test_the_descriptors_name_the_operands_everywhere():
    """The operand names of the Python API, the ONNX node and the FFI ABI are the core's."""
    forms = _shapes.FORMS
    assert dflash_onnx.SLOT_INPUTS == forms["slot"]["operands"]
    assert dflash_onnx.PAGED_INPUTS == forms["paged"]["operands"]
    slot_parameters = list(inspect.signature(jax_dflash.target_kv_cache_update).parameters)
    paged_parameters = list(inspect.signature(jax_dflash.target_kv_cache_update_paged).parameters)
    assert tuple(slot_parameters[:6]) == forms["slot"]["operands"]
    assert tuple(paged_parameters[:7]) == forms["paged"]["operands"]
    assert lowering.SLOT_TARGET == forms["slot"]["ffi_target"]
    assert lowering.PAGED_TARGET == forms["paged"]["ffi_target"]


@pytest.mark.parametrize(
    "pool_dims, message",
    [
        ((2, None, 128, 2, 64), r"rope_cos_sin: length S must be <= the slot capacity"),
        ((2, 4, None, 2, 64), r"pages_per_slot: pages_per_slot \* P overflows int64"),
    ],
)
def test_build_time_sizes_near_int64_max(pool_dims, message):
    """TensorRT's build time: one dim unknown and S = INT64_MAX. The sizes the checker fills in
    for the unknown dims are formed without signed overflow, and the verdict names the rule."""
    s = 2**63 - 1
    operands = [
        ("float16", (2, 4, 2, 64)),
        ("float16", (2, 4, 2, 64)),
        ("float16", pool_dims),
        ("float32", (1, s, 64)),
        ("int32", (2,)),
        ("int32", (2,)),
    ]
    with pytest.raises(ValueError, match=message):
        _shapes._core.check_call("slot", operands, pages_per_slot=2, norm_eps=1e-6, tensorrt=True)
