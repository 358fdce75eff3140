"""Export to ONNX: a jax2onnx plugin for the update primitive, and a ``to_onnx`` helper.

``jax2onnx`` traces a JAX function to a jaxpr and lowers each equation through a registry of
plugins keyed by primitive name. The plugin here lowers ``dflash_target_kv_cache_update`` to
exactly the node of :func:`jax_dflash.onnx.make_update_node` (op type
``DFlashTargetKVCacheUpdate``, domain ``trt.plugins``, attributes ``plugin_version``,
``plugin_namespace`` and ``pages_per_slot``, the six inputs in SPEC.md's order), which
TensorRT's ONNX parser maps to this project's plugin; everything else in the function is
exported by jax2onnx's own plugins as standard ONNX.

Needs the ``export`` extra: ``pip install jax-dflash[export]`` (see pyproject.toml for the
minimal set; jax2onnx itself is installed with ``--no-deps``, because its declared
dependencies pull in flax, equinox, orbax, onnxruntime and more that this export never uses).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from jax_dflash import onnx as dflash_onnx
from jax_dflash.ops import target_kv_cache_update_p

OPSET = 23  # the default ONNX opset of jax2onnx 0.17
PLUGIN_DOMAIN_VERSION = 1


def _jax2onnx():
    try:
        import jax2onnx
        import onnx_ir
        from jax2onnx.plugins import plugin_system
    except ImportError as e:
        raise ImportError(
            "jax_dflash.export needs jax2onnx and onnx-ir: pip install jax-dflash[export] "
            f"(or: pip install onnx onnx-ir && pip install --no-deps jax2onnx): {e}"
        ) from e
    return jax2onnx, onnx_ir, plugin_system


@functools.cache
def register_jax2onnx_plugin() -> None:
    """Registers the lowering of ``dflash_target_kv_cache_update`` with jax2onnx (once)."""
    _, ir, plugin_system = _jax2onnx()

    @plugin_system.register_primitive(
        jaxpr_primitive=target_kv_cache_update_p.name,
        component=dflash_onnx.PLUGIN_NAME,
        context="primitives.jax_dflash",
        since="0.1.0",
        onnx=[{"component": dflash_onnx.PLUGIN_NAME, "doc": "SPEC.md"}],
        testcases=[],  # tested in tests/test_cross_runtime.py
    )
    class TargetKVCacheUpdatePlugin(plugin_system.PrimitiveLeafPlugin):
        """Lowers the update to the TensorRT plugin node (one node, no decomposition)."""

        def lower(self, ctx: Any, eqn: Any) -> Any:
            pool_var = eqn.invars[2]
            if len(pool_var.aval.shape) != 5:
                raise NotImplementedError(
                    "jax_dflash.export: the TensorRT plugin node takes the unbatched form "
                    "(past_key_value [2, numPages, P, H, D]); got the layer-batched form "
                    f"with past_key_value of shape {pool_var.aval.shape}. Export one layer per "
                    "call (a Python loop over layers), not jax.vmap over layers."
                )
            inputs = [
                ctx.get_value_for_var(var, name_hint=ctx.fresh_name(arg_name))
                for var, arg_name in zip(eqn.invars, dflash_onnx.ARG_NAMES)
            ]
            out_var = eqn.outvars[0]
            out_spec = ctx.get_value_for_var(
                out_var, name_hint=ctx.fresh_name(dflash_onnx.OUTPUT_NAME)
            )
            output_name = out_spec.name or ctx.fresh_name(dflash_onnx.OUTPUT_NAME)
            reference = dflash_onnx.make_update_node(
                [v.name or "" for v in inputs],
                output_name,
                pages_per_slot=eqn.params["pages_per_slot"],
                name=ctx.fresh_name(dflash_onnx.PLUGIN_NAME),
            )
            # The node's attributes come from make_update_node, so the two cannot drift.
            attributes = {a.name: _attribute_value(a) for a in reference.attribute}
            result = getattr(ctx.builder, reference.op_type)(
                *inputs,
                _domain=reference.domain,
                _version=PLUGIN_DOMAIN_VERSION,
                _outputs=[output_name],
                **attributes,
            )
            result.producer().name = reference.name
            result.type = ir.TensorType(inputs[2].dtype)
            result.shape = ir.Shape(tuple(int(d) for d in pool_var.aval.shape))
            ctx.builder.graph.opset_imports.setdefault(reference.domain, PLUGIN_DOMAIN_VERSION)
            return result

    del TargetKVCacheUpdatePlugin  # registered by the decorator


def _attribute_value(attribute):
    import onnx

    return onnx.helper.get_attribute_value(attribute).decode() if (
        attribute.type == onnx.AttributeProto.STRING
    ) else onnx.helper.get_attribute_value(attribute)


def to_onnx(
    fn,
    inputs: Sequence[Any],
    *,
    model_name: str = "dflash_draft_update",
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    opset: int = OPSET,
):
    """Exports ``fn`` to an ``onnx.ModelProto`` with jax2onnx, our op as the TensorRT node.

    Args:
      fn: a JAX function; its uses of :func:`jax_dflash.target_kv_cache_update` (unbatched
        form) become ``DFlashTargetKVCacheUpdate`` nodes, the rest standard ONNX.
      inputs: one ``jax.ShapeDtypeStruct`` (or array) per positional argument of ``fn``;
        shapes are static (the plugin recovers ``maxBatch`` and ``cap`` from the pool's dims).
      model_name, input_names, output_names, opset: passed to ``jax2onnx.to_onnx``.
    """
    jax2onnx, _, _ = _jax2onnx()
    register_jax2onnx_plugin()
    return jax2onnx.to_onnx(
        fn,
        list(inputs),
        model_name=model_name,
        opset=opset,
        input_names=None if input_names is None else list(input_names),
        output_names=None if output_names is None else list(output_names),
    )
