"""The ONNX node and graph that TensorRT's ONNX parser maps to the plugin, checked with onnx.checker."""

from __future__ import annotations

import pytest

onnx = pytest.importorskip("onnx", reason="the 'onnx' package is not installed")

from onnx import TensorProto  # noqa: E402

from jax_dflash.interop import onnx as dflash_onnx  # noqa: E402
from jax_dflash._shapes import ARG_NAMES  # noqa: E402

MODEL_ARGS = dict(num_kv_heads=8, head_dim=128, num_pages=16, pages_per_slot=2, rotary_dim=128,
                  rope_seq_len=256)


def _attributes(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _shape(value_info):
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def test_node_is_the_plugin_with_its_attributes():
    node = dflash_onnx.make_update_node(pages_per_slot=3, plugin_namespace="dflash")
    assert node.op_type == "DFlashTargetKVCacheUpdate"
    assert node.domain == "trt.plugins"
    assert list(node.input) == list(ARG_NAMES)
    assert list(node.output) == ["present_key_value"]
    assert _attributes(node) == {
        "plugin_version": b"1", "plugin_namespace": b"dflash", "pages_per_slot": 3,
    }


@pytest.mark.parametrize("dtype, elem", [("float16", TensorProto.FLOAT16),
                                         ("bfloat16", TensorProto.BFLOAT16),
                                         ("float32", TensorProto.FLOAT)])
def test_model_passes_the_checker_with_typed_inputs(dtype, elem):
    model = dflash_onnx.make_update_model(**MODEL_ARGS, dtype=dtype)
    onnx.checker.check_model(model, full_check=True)
    graph = model.graph
    assert [i.name for i in graph.input] == list(ARG_NAMES)
    types = [i.type.tensor_type.elem_type for i in graph.input]
    assert types == [elem, elem, elem, TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT32]
    assert _shape(graph.input[0]) == ["B", "L", 8, 128]
    assert _shape(graph.input[2]) == [2, 16, 128, 8, 128]
    assert _shape(graph.input[3]) == [1, 256, 128]
    assert _shape(graph.input[4]) == ["B"]
    (output,) = graph.output
    assert output.name == "present_key_value"
    assert output.type.tensor_type.elem_type == elem
    assert _shape(output) == [2, 16, 128, 8, 128]
    (node,) = graph.node
    assert node.op_type == "DFlashTargetKVCacheUpdate" and _attributes(node)["pages_per_slot"] == 2
    domains = {o.domain: o.version for o in model.opset_import}
    assert domains == {"": 17, "trt.plugins": 1}
    # Round trip through bytes, as it reaches TensorRT's parser.
    again = onnx.load_model_from_string(model.SerializeToString())
    onnx.checker.check_model(again)


def test_model_static_shapes_and_per_sequence_rope():
    model = dflash_onnx.make_update_model(**{**MODEL_ARGS, "rope_seq_len": "S"}, batch=4, delta_len=16,
                                          rope_batch=4, plugin_namespace="ns")
    onnx.checker.check_model(model, full_check=True)
    assert _shape(model.graph.input[0]) == [4, 16, 8, 128]
    assert _shape(model.graph.input[3]) == [4, "S", 128]
    assert _attributes(model.graph.node[0])["plugin_namespace"] == b"ns"


@pytest.mark.parametrize("change, error, match", [
    ({"dtype": "int8"}, ValueError, "dtype: expected one of"),
    ({"num_pages": 15}, ValueError, "num_pages: expected a multiple of pages_per_slot = 2, got 15"),
    ({"rotary_dim": 127}, ValueError, "rotary_dim: expected an even int <= head_dim = 128, got 127"),
    ({"rotary_dim": 130}, ValueError, "rotary_dim"),
    ({"rope_batch": 3}, ValueError, "rope_batch: expected 1 or batch"),
    ({"pages_per_slot": 0}, ValueError, "pages_per_slot"),
    ({"pages_per_slot": 2.0}, TypeError, "pages_per_slot"),
    ({"head_dim": -1}, ValueError, "head_dim: expected an int >= 0"),
])
def test_model_rejects_bad_arguments_naming_them(change, error, match):
    with pytest.raises(error, match=match):
        dflash_onnx.make_update_model(**{**MODEL_ARGS, **change})
