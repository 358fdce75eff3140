"""The ONNX nodes and graphs that TensorRT's ONNX parser maps to the plugin, checked with
onnx.checker: the slot node, Edge-LLM 0.11's paged node and the paged node with extensions."""

from __future__ import annotations

import pytest

onnx = pytest.importorskip(
    "onnx", reason="the 'onnx' package is not installed (pip install -e \".[onnx]\")"
)

from onnx import TensorProto  # noqa: E402

from jax_dflash.interop import onnx as dflash_onnx  # noqa: E402

SLOT_INPUTS = [
    "k_delta",
    "v_delta",
    "past_key_value",
    "rope_cos_sin",
    "delta_start_positions",
    "delta_lengths",
]
PAGED_INPUTS = [
    "k_delta",
    "v_delta",
    "past_key_value",
    "rope_cos_sin",
    "delta_positions",
    "delta_token_to_sequence",
    "kv_page_table",
]
MODEL_ARGS = dict(
    num_kv_heads=8, head_dim=128, num_pages=16, pages_per_slot=2, rotary_dim=128, rope_seq_len=256
)
PAGED_ARGS = dict(
    num_kv_heads=8, head_dim=128, num_pages=16, rotary_dim=64, max_pages_per_sequence=4
)
ELEM = {
    "float16": TensorProto.FLOAT16,
    "bfloat16": TensorProto.BFLOAT16,
    "float32": TensorProto.FLOAT,
    "float8_e4m3fn": TensorProto.FLOAT8E4M3FN,
}


def _attributes(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _shape(value_info):
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def _elem(value_info):
    return value_info.type.tensor_type.elem_type


def _check_round_trip(model):
    onnx.checker.check_model(model, full_check=True)
    # As it reaches TensorRT's parser: serialized.
    again = onnx.load_model_from_string(model.SerializeToString())
    onnx.checker.check_model(again, full_check=True)


# ---- the slot node -------------------------------------------------------------------------------


def test_slot_node_is_the_plugin_with_its_attributes():
    node = dflash_onnx.make_update_node(pages_per_slot=3, plugin_namespace="dflash")
    assert node.op_type == "DFlashTargetKVCacheUpdate"
    assert node.domain == "trt.plugins"
    assert list(node.input) == SLOT_INPUTS
    assert list(node.output) == ["present_key_value"]
    assert _attributes(node) == {
        "plugin_version": b"1",
        "plugin_namespace": b"dflash",
        "pages_per_slot": 3,
    }


def test_slot_node_with_norms_and_fp8_extras():
    node = dflash_onnx.make_update_node(
        pages_per_slot=2, fp8_pool=True, k_norm=True, v_norm=True, norm_eps=1e-5
    )
    assert list(node.input) == [*SLOT_INPUTS, "k_scale", "v_scale", "k_norm_weight"]
    attributes = _attributes(node)
    assert attributes.pop("norm_eps") == pytest.approx(1e-5, rel=1e-7)  # stored as float32
    assert attributes == {
        "plugin_version": b"1",
        "plugin_namespace": b"",
        "pages_per_slot": 2,
        "k_norm": 1,
        "v_norm": 1,
    }


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_slot_model_passes_the_checker_with_typed_inputs(dtype):
    model = dflash_onnx.make_update_model(**MODEL_ARGS, dtype=dtype)
    _check_round_trip(model)
    graph = model.graph
    assert [i.name for i in graph.input] == SLOT_INPUTS
    elem = ELEM[dtype]
    assert [_elem(i) for i in graph.input] == [
        elem,
        elem,
        elem,
        TensorProto.FLOAT,
        TensorProto.INT32,
        TensorProto.INT32,
    ]
    assert _shape(graph.input[0]) == ["B", "L", 8, 128]
    assert _shape(graph.input[2]) == [2, 16, 128, 8, 128]
    assert _shape(graph.input[3]) == [1, 256, 128]
    assert _shape(graph.input[4]) == ["B"]
    (output,) = graph.output
    assert output.name == "present_key_value"
    assert _elem(output) == elem and _shape(output) == [2, 16, 128, 8, 128]
    (node,) = graph.node
    assert node.op_type == "DFlashTargetKVCacheUpdate" and _attributes(node)["pages_per_slot"] == 2
    assert {o.domain: o.version for o in model.opset_import} == {"": 17, "trt.plugins": 1}


def test_slot_model_fp8_pool_with_per_head_scales_and_k_norm():
    model = dflash_onnx.make_update_model(
        **MODEL_ARGS,
        dtype="bfloat16",
        pool_dtype="float8_e4m3fn",
        per_head_scales=True,
        k_norm=True,
    )
    _check_round_trip(model)
    inputs = {i.name: i for i in model.graph.input}
    assert list(inputs) == [*SLOT_INPUTS, "k_scale", "v_scale", "k_norm_weight"]
    assert _elem(inputs["past_key_value"]) == TensorProto.FLOAT8E4M3FN
    assert _elem(inputs["k_delta"]) == TensorProto.BFLOAT16
    assert _shape(inputs["k_scale"]) == _shape(inputs["v_scale"]) == [8]
    assert _elem(inputs["k_scale"]) == TensorProto.FLOAT
    assert _shape(inputs["k_norm_weight"]) == [128]
    assert _elem(inputs["k_norm_weight"]) == TensorProto.BFLOAT16
    assert _elem(model.graph.output[0]) == TensorProto.FLOAT8E4M3FN
    assert list(model.graph.node[0].input) == list(inputs)


def test_slot_model_static_shapes_and_per_sequence_rope():
    model = dflash_onnx.make_update_model(
        **{**MODEL_ARGS, "rope_seq_len": "S"},
        batch=4,
        delta_len=16,
        rope_batch=4,
        plugin_namespace="ns",
    )
    _check_round_trip(model)
    assert _shape(model.graph.input[0]) == [4, 16, 8, 128]
    assert _shape(model.graph.input[3]) == [4, "S", 128]
    assert _attributes(model.graph.node[0])["plugin_namespace"] == b"ns"


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"dtype": "int8"}, ValueError, "dtype: expected one of"),
        ({"pool_dtype": "float8_e5m2"}, ValueError, "pool_dtype: expected one of .*e4m3"),
        (
            {"num_pages": 15},
            ValueError,
            "num_pages: expected a multiple of pages_per_slot = 2, got 15",
        ),
        (
            {"rotary_dim": 127},
            ValueError,
            "rotary_dim: expected an even int <= head_dim = 128, got 127",
        ),
        ({"rotary_dim": 130}, ValueError, "rotary_dim"),
        ({"rope_batch": 3}, ValueError, "rope_batch: expected 1 or batch"),
        ({"pages_per_slot": 0}, ValueError, "pages_per_slot"),
        ({"pages_per_slot": 2.0}, TypeError, "pages_per_slot"),
        (
            {"pages_per_slot": 2**31, "num_pages": 2**32},
            ValueError,
            r"pages_per_slot: expected an int in \[1, 2147483647\]",
        ),
        ({"head_dim": -1}, ValueError, "head_dim: expected an int >= 0"),
        ({"page_size": 64}, ValueError, "page_size: expected 128"),
        ({"rope_seq_len": 257}, ValueError, "rope_seq_len: expected at most the slot capacity"),
        ({"batch": 9}, ValueError, "batch: expected at most the pool's 8 slots"),
        ({"per_head_scales": True}, ValueError, "per_head_scales: only a pool with static scales"),
        ({"norm_eps": 1e-5}, ValueError, "norm_eps: only used with k_norm or v_norm"),
        ({"k_norm": True, "norm_eps": 0.0}, ValueError, "norm_eps: expected a finite float > 0"),
        ({"k_norm": 1}, TypeError, "k_norm: expected a bool"),
    ],
)
def test_slot_model_rejects_bad_arguments_naming_them(change, error, match):
    with pytest.raises(error, match=match):
        dflash_onnx.make_update_model(**{**MODEL_ARGS, **change})


def test_slot_node_rejects_a_wrong_number_of_input_names():
    with pytest.raises(ValueError, match="inputs: expected 8 names"):
        dflash_onnx.make_update_node(SLOT_INPUTS, pages_per_slot=2, fp8_pool=True)


# ---- the paged node: Edge-LLM 0.11's, and ours with extensions ----------------------------------


def test_paged_node_is_edge_llm_0_11s_node():
    node = dflash_onnx.make_paged_update_node()
    assert node.op_type == "DFlashTargetKVCacheUpdate"
    assert node.domain == "trt_edgellm"
    assert list(node.input) == PAGED_INPUTS
    assert list(node.output) == ["present_key_value"]
    # No attributes: the parser creates the plugin version "1" in namespace "", no fields.
    assert list(node.attribute) == []


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_edge_llm_model_passes_the_checker(dtype):
    model = dflash_onnx.make_paged_update_model(**PAGED_ARGS, dtype=dtype)
    _check_round_trip(model)
    graph = model.graph
    assert [i.name for i in graph.input] == PAGED_INPUTS
    elem = ELEM[dtype]
    assert [_elem(i) for i in graph.input] == [
        elem,
        elem,
        elem,
        TensorProto.FLOAT,
        TensorProto.INT32,
        TensorProto.INT32,
        TensorProto.INT32,
    ]
    assert _shape(graph.input[0]) == ["T", 8, 128]
    assert _shape(graph.input[2]) == [2, 16, 128, 8, 128]
    assert _shape(graph.input[3]) == ["T", 64]
    assert _shape(graph.input[4]) == _shape(graph.input[5]) == ["T"]
    assert _shape(graph.input[6]) == ["B", 2, 4]
    (output,) = graph.output
    assert output.name == "present_key_value"
    assert _elem(output) == elem and _shape(output) == [2, 16, 128, 8, 128]
    (node,) = graph.node
    assert (node.op_type, node.domain, list(node.attribute)) == (
        "DFlashTargetKVCacheUpdate",
        "trt_edgellm",
        [],
    )
    assert {o.domain: o.version for o in model.opset_import} == {"": 17, "trt_edgellm": 23}


@pytest.mark.parametrize(
    "options, attributes",
    [
        ({"ring": True}, {"ring": 1}),
        ({"k_norm": True}, {"k_norm": 1, "norm_eps": pytest.approx(1e-6, rel=1e-7)}),
        (
            {"v_norm": True, "norm_eps": 1e-5},
            {"v_norm": 1, "norm_eps": pytest.approx(1e-5, rel=1e-7)},
        ),
        ({"fp8_pool": True}, {}),
        ({"plugin_namespace": "ns"}, {}),
    ],
)
def test_paged_node_with_an_extension_uses_the_plugin_domain(options, attributes):
    node = dflash_onnx.make_paged_update_node(**options)
    assert node.op_type == "DFlashTargetKVCacheUpdate" and node.domain == "trt.plugins"
    expected = {
        "plugin_version": b"1",
        "plugin_namespace": options.get("plugin_namespace", "").encode(),
        **attributes,
    }
    assert _attributes(node) == expected
    extras = (["k_scale", "v_scale"] if options.get("fp8_pool") else []) + (
        ["k_norm_weight"] if options.get("k_norm") else []
    )
    assert list(node.input) == [*PAGED_INPUTS, *extras]


def test_paged_model_with_every_extension():
    model = dflash_onnx.make_paged_update_model(
        **PAGED_ARGS,
        tokens=64,
        batch=3,
        dtype="float16",
        pool_dtype="float8_e4m3fn",
        ring=True,
        k_norm=True,
        v_norm=True,
    )
    _check_round_trip(model)
    inputs = {i.name: i for i in model.graph.input}
    assert list(inputs) == [*PAGED_INPUTS, "k_scale", "v_scale", "k_norm_weight"]
    assert _shape(inputs["k_delta"]) == [64, 8, 128]
    assert _shape(inputs["kv_page_table"]) == [3, 2, 4]
    assert _shape(inputs["k_scale"]) == [1]
    assert _elem(inputs["past_key_value"]) == TensorProto.FLOAT8E4M3FN
    (node,) = model.graph.node
    assert node.domain == "trt.plugins"
    assert {k: v for k, v in _attributes(node).items() if k != "norm_eps"} == {
        "plugin_version": b"1",
        "plugin_namespace": b"",
        "ring": 1,
        "k_norm": 1,
        "v_norm": 1,
    }
    assert {o.domain: o.version for o in model.opset_import} == {"": 17, "trt.plugins": 1}


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"dtype": "float64"}, ValueError, "dtype: expected one of"),
        ({"pool_dtype": "float8_e5m2"}, ValueError, "pool_dtype: expected one of"),
        ({"page_size": 64}, ValueError, "page_size: expected 128"),
        (
            {"max_pages_per_sequence": 17},
            ValueError,
            r"max_pages_per_sequence: expected at most num_pages = 16 \(M <= N\), got 17",
        ),
        ({"max_pages_per_sequence": 0}, ValueError, "max_pages_per_sequence: expected an int >= 1"),
        ({"rotary_dim": 129}, ValueError, "rotary_dim: expected an even int <= head_dim"),
        ({"ring": "yes"}, TypeError, "ring: expected a bool"),
        (
            {"tokens": ""},
            ValueError,
            "tokens: expected a positive int or a non-empty symbolic name",
        ),
        ({"plugin_namespace": 3}, TypeError, "plugin_namespace: expected a str"),
    ],
)
def test_paged_model_rejects_bad_arguments_naming_them(change, error, match):
    with pytest.raises(error, match=match):
        dflash_onnx.make_paged_update_model(**{**PAGED_ARGS, **change})


def test_int32_attribute_range():
    assert dflash_onnx.check_int32_attribute(2**31 - 1, "pages_per_slot", minimum=1) == 2**31 - 1
    with pytest.raises(ValueError, match="pages_per_slot: expected an int in"):
        dflash_onnx.check_int32_attribute(2**31, "pages_per_slot", minimum=1)
    with pytest.raises(TypeError, match="pages_per_slot: .* got bool True"):
        dflash_onnx.check_int32_attribute(True, "pages_per_slot", minimum=1)


def test_node_attributes_and_inputs_are_judged_as_the_plugin_reads_them():
    """pages_per_slot is an INT32 plugin field at any size (never called an int64 attribute), and
    every input needs a name: an empty one is ONNX's "optional input left out"."""
    for too_large in (2**31, 2**63):
        with pytest.raises(ValueError, match=r"pages_per_slot: .*\(an INT32 plugin field\)"):
            dflash_onnx.make_update_node(pages_per_slot=too_large)
    inputs = list(dflash_onnx.SLOT_INPUTS)
    inputs[3] = ""
    with pytest.raises(ValueError, match="inputs: expected a non-empty name for rope_cos_sin"):
        dflash_onnx.make_update_node(inputs, pages_per_slot=2)
    with pytest.raises(ValueError, match="inputs: expected a non-empty name for kv_page_table"):
        dflash_onnx.make_paged_update_node([*dflash_onnx.PAGED_INPUTS[:6], ""])
