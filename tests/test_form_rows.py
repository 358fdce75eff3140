"""The Python layers read an addressing form from its descriptor row: the checked sizes, the
sharding specs and the ONNX node of a form come from the row (operand names, roles, dims,
attributes), so a new row needs no code of its own there. Checked on the three forms against
their own functions, and on a row that none of that code has seen."""

from __future__ import annotations

import ast
import inspect

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_dflash import _shapes, sharding
from jax_dflash.interop import onnx as dflash_onnx
from jax_dflash.testing import make_paged_problem, make_problem
from test_one_checker import _compares_dims

onnx = pytest.importorskip("onnx")

# A form no code knows by name: flat slots with a page table and the ring option.
UNSEEN = {
    "attributes": ("ring",),
    "cuda": False,
    "delta_rank": 3,
    "ffi_target": "dflash_target_kv_cache_update_unseen",
    "operand_dims": ("[T, H, D]", "[T, H, D]", "[2, N, P, H, D]", "[T, R]", "[T]", "[B, 2, M]"),
    "operand_roles": ("k_delta", "v_delta", "pool", "rope", "slot_index", "page_table"),
    "operands": (
        "k_delta",
        "v_delta",
        "past_key_value",
        "rope_cos_sin",
        "slot_mapping",
        "kv_page_table",
    ),
    "origin": "a test",
    "rope_rank": 2,
}


@pytest.fixture
def unseen(monkeypatch):
    monkeypatch.setitem(_shapes.FORMS, "unseen", UNSEEN)
    monkeypatch.setitem(_shapes.BASE_NAMES, "unseen", UNSEEN["operands"])
    return "unseen"


def test_one_shape_for_every_form():
    slot = make_problem(np.random.default_rng(0), batch=2, pages_per_slot=2)
    shape = _shapes.check_update(*slot.args(), slot.pages_per_slot)
    assert (shape.form, shape.batch, shape.pages_per_slot) == ("slot", 2, 2)
    assert shape == _shapes.check_form("slot", slot.args(), pages_per_slot=2)
    paged = make_paged_problem(np.random.default_rng(1))
    shape = _shapes.check_update_paged(*paged.args())
    assert shape.form == "paged" and shape.tokens == paged.args()[0].shape[0]
    assert shape == _shapes.check_form("paged", paged.args())
    with pytest.raises(TypeError, match="pages_per_slot: not an attribute of the paged form"):
        _shapes.check_form("paged", paged.args(), pages_per_slot=2)
    with pytest.raises(TypeError, match="pages_per_slot: expected a static Python int"):
        _shapes.check_form("slot", slot.args())  # required


def test_the_public_specs_are_the_rows():
    assert sharding.partition_specs(
        batch_axis="dp", head_axis="tp", rope_batched=True
    ) == sharding.form_partition_specs("slot", batch_axis="dp", head_axis="tp", rope_batched=True)
    assert sharding.paged_partition_specs(
        head_axis="tp", layer_axis="pp", layered=True, table_per_layer=True
    ) == sharding.form_partition_specs(
        "paged", head_axis="tp", layer_axis="pp", layered=True, table_per_layer=True
    )
    specs = sharding.form_partition_specs(
        "slot_mapping", head_axis="tp", layer_axis="pp", layered=True, positions_per_layer=True
    )
    delta = P("pp", None, "tp", None)
    assert specs == (
        delta,
        delta,
        P("pp", None, None, None, "tp", None),
        P(None, None),
        P("pp", None),
    )
    with pytest.raises(ValueError, match="batch_axis: the slot_mapping form"):
        sharding.form_partition_specs("slot_mapping", batch_axis="dp")


def test_a_checked_slot_mapping_call_gets_the_rows_specs():
    rng = np.random.default_rng(2)
    k = rng.standard_normal((3, 4, 2, 8)).astype(np.float16)
    pool = np.zeros((3, 2, 5, 4, 2, 8), np.float16)
    rope = np.zeros((4, 8), np.float32)
    slots = np.zeros((3, 4), np.int32)
    shape = _shapes.check_update_slots(k, k, pool, rope, slots)
    split = sharding.Split(layers=("pp",), heads=("tp",))
    assert sharding.operand_specs(shape, split) == sharding.form_partition_specs(
        "slot_mapping", head_axis="tp", layer_axis="pp", layered=True, positions_per_layer=True
    )


def test_the_named_nodes_are_the_rows():
    assert dflash_onnx.make_update_node(pages_per_slot=2, k_norm=True) == (
        dflash_onnx.make_form_node("slot", pages_per_slot=2, k_norm=True)
    )
    assert dflash_onnx.make_paged_update_node(ring=True) == (
        dflash_onnx.make_form_node("paged", ring=True)
    )
    assert dflash_onnx.make_slots_update_node(fp8_pool=True) == (
        dflash_onnx.make_form_node("slot_mapping", fp8_pool=True)
    )
    with pytest.raises(TypeError, match="ring: not an attribute of the slot_mapping node"):
        dflash_onnx.make_form_node("slot_mapping", ring=True)


def test_a_row_no_code_has_seen(unseen):
    """Specs and node from the row alone: heads split where its dims say H, the page table and
    the slots per layer by their roles, ``ring`` written as the plugin's flag, ``form`` named."""
    specs = sharding.form_partition_specs(
        unseen,
        head_axis="tp",
        layer_axis="pp",
        layered=True,
        positions_per_layer=True,
        scales="head",
    )
    delta = P("pp", None, "tp", None)
    pool = P("pp", None, None, None, "tp", None)
    table = P(None, None, None)
    assert specs == (delta, delta, pool, P(None, None), P("pp", None), table, P("tp"), P("tp"))
    with pytest.raises(ValueError, match="batch_axis: the unseen form"):
        sharding.form_partition_specs(unseen, batch_axis="dp")

    node = dflash_onnx.make_form_node(unseen, ring=True, k_norm=True)
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attributes["form"] == b"unseen" and attributes["ring"] == 1
    assert list(node.input) == [*UNSEEN["operands"], "k_norm_weight"]
    assert "ring" not in {a.name for a in dflash_onnx.make_form_node(unseen).attribute}
    with pytest.raises(TypeError, match="pages_per_slot: not an attribute of the unseen node"):
        dflash_onnx.make_form_node(unseen, pages_per_slot=2)


def test_the_node_checks_of_any_form_hold_no_dimension_rule():
    """The plugin's checks of a form's node are the core's, as check_plugin_operands' are."""
    assert _compares_dims(ast.parse(inspect.getsource(dflash_onnx.check_form_operands))) == []
