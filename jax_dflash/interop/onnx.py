"""The ONNX node that TensorRT's ONNX parser maps to this project's plugin.

TensorRT's parser turns a node whose op type it does not know into a plugin layer: it looks up
the creator named by the op type, with the version and namespace given by the node attributes
``plugin_version`` and ``plugin_namespace``, and passes the remaining attributes as plugin
fields. The node here has the six inputs of SPEC.md in order and one output (the aliased pool).
"""

from __future__ import annotations

from collections.abc import Sequence

from jax_dflash._shapes import ARG_NAMES, check_pages_per_slot

PLUGIN_NAME = "DFlashTargetKVCacheUpdate"
PLUGIN_VERSION = "1"
PLUGIN_DOMAIN = "trt.plugins"  # custom-op domain; TensorRT's parser matches the op type
OUTPUT_NAME = "present_key_value"


def _onnx():
    try:
        import onnx
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError("jax_dflash.interop.onnx needs the 'onnx' package: pip install jax-dflash[onnx]") from e
    return onnx


def make_update_node(
    inputs: Sequence[str] = ARG_NAMES,
    output: str = OUTPUT_NAME,
    *,
    pages_per_slot: int,
    name: str | None = None,
    plugin_namespace: str = "",
):
    """An ``onnx.NodeProto`` for the plugin: op type ``DFlashTargetKVCacheUpdate``.

    ``inputs`` are the names of k_delta, v_delta, past_key_value, rope_cos_sin,
    delta_start_positions and delta_lengths, in that order.
    """
    onnx = _onnx()
    inputs = list(inputs)
    if len(inputs) != len(ARG_NAMES):
        raise ValueError(f"inputs: expected {len(ARG_NAMES)} names {ARG_NAMES}, got {inputs}")
    return onnx.helper.make_node(
        PLUGIN_NAME,
        inputs=inputs,
        outputs=[output],
        name=name or PLUGIN_NAME,
        domain=PLUGIN_DOMAIN,
        plugin_version=PLUGIN_VERSION,
        plugin_namespace=plugin_namespace,
        pages_per_slot=check_pages_per_slot(pages_per_slot),
    )


TRT_TOKENS_PER_PAGE = 128  # P in the TensorRT contract
_ONNX_TYPES = {"float16": "FLOAT16", "bfloat16": "BFLOAT16", "float32": "FLOAT"}


def _dim(value, what: str):
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{what}: expected a positive int or a non-empty symbolic name, got ''")
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what}: expected an int >= 0 or a symbolic name (str), got {value!r}")
    return value


def make_update_model(
    *,
    num_kv_heads: int,
    head_dim: int,
    num_pages: int,
    pages_per_slot: int,
    rotary_dim: int,
    rope_seq_len: int | str,
    batch: int | str = "B",
    delta_len: int | str = "L",
    rope_batch: int | str = 1,
    dtype: str = "float16",
    page_size: int = TRT_TOKENS_PER_PAGE,
    plugin_namespace: str = "",
    opset: int = 17,
    graph_name: str = "dflash_target_kv_cache_update",
):
    """A one-node ``onnx.ModelProto`` that TensorRT's ONNX parser maps to the plugin.

    Inputs (typed): ``k_delta``, ``v_delta`` ``[batch, delta_len, num_kv_heads, head_dim]`` and
    ``past_key_value`` ``[2, num_pages, page_size, num_kv_heads, head_dim]`` in ``dtype``
    (float16, bfloat16 or float32); ``rope_cos_sin`` ``[rope_batch, rope_seq_len, rotary_dim]``
    float32; ``delta_start_positions``, ``delta_lengths`` ``[batch]`` int32. Output
    ``present_key_value``: the pool's shape and dtype (aliased to ``past_key_value`` by the
    plugin). String dimensions are symbolic (dynamic in TensorRT); ``rope_batch`` is 1 or
    ``batch``. The model imports the default opset ``opset`` and the plugin domain.
    """
    _onnx()  # a clear ImportError without the extra
    from onnx import TensorProto, helper

    pages_per_slot = check_pages_per_slot(pages_per_slot)
    if dtype not in _ONNX_TYPES:
        raise ValueError(f"dtype: expected one of {sorted(_ONNX_TYPES)}, got {dtype!r}")
    heads, dim = _dim(num_kv_heads, "num_kv_heads"), _dim(head_dim, "head_dim")
    pages, page = _dim(num_pages, "num_pages"), _dim(page_size, "page_size")
    rotary = _dim(rotary_dim, "rotary_dim")
    b, length = _dim(batch, "batch"), _dim(delta_len, "delta_len")
    seq, rb = _dim(rope_seq_len, "rope_seq_len"), _dim(rope_batch, "rope_batch")
    if rb not in (1, b):
        raise ValueError(f"rope_batch: expected 1 or batch ({b!r}), got {rb!r}")
    if isinstance(pages, int) and pages % pages_per_slot:
        raise ValueError(
            f"num_pages: expected a multiple of pages_per_slot = {pages_per_slot}, got {pages}"
        )
    if isinstance(rotary, int) and isinstance(dim, int) and (rotary % 2 or rotary > dim):
        raise ValueError(f"rotary_dim: expected an even int <= head_dim = {dim}, got {rotary}")

    elem = getattr(TensorProto, _ONNX_TYPES[dtype])
    pool_shape = [2, pages, page, heads, dim]
    shapes = {
        "k_delta": (elem, [b, length, heads, dim]),
        "v_delta": (elem, [b, length, heads, dim]),
        "past_key_value": (elem, pool_shape),
        "rope_cos_sin": (TensorProto.FLOAT, [rb, seq, rotary]),
        "delta_start_positions": (TensorProto.INT32, [b]),
        "delta_lengths": (TensorProto.INT32, [b]),
    }
    inputs = [helper.make_tensor_value_info(name, *shapes[name]) for name in ARG_NAMES]
    output = helper.make_tensor_value_info(OUTPUT_NAME, elem, pool_shape)
    node = make_update_node(
        ARG_NAMES, OUTPUT_NAME, pages_per_slot=pages_per_slot, plugin_namespace=plugin_namespace
    )
    graph = helper.make_graph([node], graph_name, inputs, [output])
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(PLUGIN_DOMAIN, 1)],
        producer_name="jax_dflash",
    )
    # The oldest IR version that carries the opset: what TensorRT's (older) parser reads best.
    model.ir_version = helper.find_min_ir_version_for([helper.make_opsetid("", opset)])
    return model
