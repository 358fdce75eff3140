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
        raise ImportError("jax_dflash.onnx needs the 'onnx' package: pip install jax-dflash[onnx]") from e
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
