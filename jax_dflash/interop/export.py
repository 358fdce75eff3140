"""Export to ONNX: a jax2onnx plugin for the update primitive, and a ``to_onnx`` helper.

jax2onnx traces a JAX function to a jaxpr and lowers each equation through a registry of
plugins keyed by primitive name. The plugin here lowers ``dflash_target_kv_cache_update`` to
exactly the node of :func:`jax_dflash.interop.onnx.make_update_node` (op type
``DFlashTargetKVCacheUpdate``, domain ``trt.plugins``, attributes ``plugin_version``,
``plugin_namespace`` and ``pages_per_slot``, the six inputs in SPEC.md's order), which
TensorRT's ONNX parser maps to this project's plugin. Everything else in the function is
exported by jax2onnx's own plugins as standard ONNX.

Needs the ``export`` extra. The minimal set is jax2onnx installed with ``--no-deps`` plus
``onnx`` and ``onnx-ir``: jax2onnx declares flax, equinox, orbax, onnxruntime and more, which
this export never uses (see the Makefile).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from jax_dflash.interop import onnx as dflash_onnx
from jax_dflash._shapes import ARG_NAMES
from jax_dflash.ops import target_kv_cache_update_p

# The ONNX opset of the standard nodes: the lowest at which jax2onnx 0.17 exports valid graphs
# (below 18 it emits ReduceMean with axes as an input); TensorRT 10's parser reads it.
OPSET = 18
PLUGIN_DOMAIN_VERSION = 1  # opset version declared for the "trt.plugins" domain


def _jax2onnx():
    try:
        import jax2onnx
        import onnx_ir
        from jax2onnx.plugins import plugin_system
    except ImportError as e:
        raise ImportError(
            "jax_dflash.interop.export needs jax2onnx and onnx-ir: pip install onnx onnx-ir and "
            f"pip install --no-deps 'jax2onnx>=0.17.1' (or jax-dflash[export]); got: {e}"
        ) from e
    return jax2onnx, onnx_ir, plugin_system


def _node_attributes(node) -> dict[str, Any]:
    """The attributes of an ``onnx.NodeProto`` as Python values (strings decoded)."""
    import onnx

    values = {}
    for attribute in node.attribute:
        value = onnx.helper.get_attribute_value(attribute)
        values[attribute.name] = value.decode() if isinstance(value, bytes) else value
    return values


@functools.cache
def register_jax2onnx_plugin() -> None:
    """Registers the lowering of ``dflash_target_kv_cache_update`` with jax2onnx (once)."""
    _, ir, plugin_system = _jax2onnx()

    @plugin_system.register_primitive(
        jaxpr_primitive=target_kv_cache_update_p.name,
        component=dflash_onnx.PLUGIN_NAME,
        context="primitives.jax_dflash",
        since="0.1.0",
        onnx=[{"component": dflash_onnx.PLUGIN_NAME, "doc": "SPEC.md (jax-dflash)"}],
        testcases=[],  # tested in tests/test_cross_runtime.py
    )
    class TargetKVCacheUpdatePlugin(plugin_system.PrimitiveLeafPlugin):
        """One ``DFlashTargetKVCacheUpdate`` node per update; no decomposition."""

        def lower(self, ctx: Any, eqn: Any) -> None:
            pool_aval = eqn.invars[2].aval
            if len(pool_aval.shape) != 5:
                raise NotImplementedError(
                    "jax_dflash.interop.export: the TensorRT plugin node takes the unbatched form, "
                    "past_key_value [2, numPages, P, H, D]; got past_key_value of shape "
                    f"{tuple(pool_aval.shape)} (the layer-batched form). Export one update "
                    "per layer (a Python loop over layers) instead of jax.vmap over layers."
                )
            inputs = [
                ctx.get_value_for_var(var, name_hint=ctx.fresh_name(arg_name))
                for var, arg_name in zip(eqn.invars, ARG_NAMES)
            ]
            out_spec = ctx.get_value_for_var(
                eqn.outvars[0], name_hint=ctx.fresh_name(dflash_onnx.OUTPUT_NAME)
            )
            output_name = out_spec.name or ctx.fresh_name(dflash_onnx.OUTPUT_NAME)
            # Build the node with make_update_node and copy it, so the two cannot drift.
            node = dflash_onnx.make_update_node(
                [value.name or "" for value in inputs],
                output_name,
                pages_per_slot=eqn.params["pages_per_slot"],
                name=ctx.fresh_name(dflash_onnx.PLUGIN_NAME),
            )
            result = getattr(ctx.builder, node.op_type)(
                *inputs,
                _domain=node.domain,
                _version=PLUGIN_DOMAIN_VERSION,
                _outputs=[output_name],
                **_node_attributes(node),
            )
            result.producer().name = node.name
            result.type = ir.TensorType(inputs[2].dtype)
            result.shape = ir.Shape([int(d) for d in pool_aval.shape])
            ctx.bind_value_for_var(eqn.outvars[0], result)
            ctx.builder.graph.opset_imports.setdefault(node.domain, PLUGIN_DOMAIN_VERSION)

    del TargetKVCacheUpdatePlugin  # kept alive by jax2onnx's registry


class _DropMissingFrameworkWarnings(logging.Filter):
    """Drops jax2onnx's "Skipping import of <plugin> ... No module named 'flax'" warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "No module named" not in record.getMessage()


@contextlib.contextmanager
def _without_absent_framework_patches(plugin_system) -> Iterator[None]:
    """Leaves out, for one conversion, jax2onnx patches of modules that are not installed.

    jax2onnx 0.17.1 binds, for each jax.nn plugin, patches of the flax.linen aliases of that
    function, and a conversion fails if flax cannot be imported. A module that is not installed
    cannot be used by the function being exported, so its patches are dropped here (and the
    plugins restored afterwards); with flax installed this changes nothing.
    """
    from jax2onnx.plugins._patching import _resolve

    quiet = _DropMissingFrameworkWarnings()
    logger = logging.getLogger(plugin_system.__name__)
    logger.addFilter(quiet)
    try:
        plugin_system.import_all_plugins()
    finally:
        logger.removeFilter(quiet)

    def importable(spec) -> bool:
        if not isinstance(spec.target, str):
            return True
        try:
            _resolve(spec.target)
            return True
        except ImportError:
            return False

    replaced = {}  # plugin class -> its own binding_specs (None if inherited)
    for plugin in list(plugin_system.PLUGIN_REGISTRY.values()):
        cls = type(plugin)
        if not isinstance(plugin, plugin_system.PrimitiveLeafPlugin) or cls in replaced:
            continue
        specs = cls.binding_specs()
        kept = [spec for spec in specs if importable(spec)]
        if len(kept) != len(specs):
            replaced[cls] = cls.__dict__.get("binding_specs")
            cls.binding_specs = classmethod(lambda _cls, kept=kept: list(kept))
    try:
        yield
    finally:
        for cls, original in replaced.items():
            if original is None:
                del cls.binding_specs
            else:
                cls.binding_specs = original


def to_onnx(
    fn,
    inputs: Sequence[Any],
    *,
    model_name: str = "dflash_draft_update",
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    opset: int = OPSET,
):
    """Exports ``fn`` to an ``onnx.ModelProto``; the update becomes the TensorRT plugin node.

    Args:
      fn: a JAX function; each call of :func:`jax_dflash.target_kv_cache_update` in it
        (unbatched form) becomes one ``DFlashTargetKVCacheUpdate`` node (domain
        ``trt.plugins``), the rest standard ONNX.
      inputs: one ``jax.ShapeDtypeStruct`` (or array) per positional argument of ``fn``, with
        static shapes (the plugin reads ``maxBatch`` and the slot capacity off the pool's shape).
      model_name, input_names, output_names, opset: passed to ``jax2onnx.to_onnx``.

    The graph's output aliases the pool input in TensorRT (``getAliasedInput(0) == 2``); in
    ONNX it is an ordinary output, a new value (see :mod:`jax_dflash.onnx_reference`).
    """
    import jax

    jax2onnx, _, plugin_system = _jax2onnx()
    register_jax2onnx_plugin()
    try:
        with _without_absent_framework_patches(plugin_system):
            return jax2onnx.to_onnx(
                fn,
                list(inputs),
                model_name=model_name,
                opset=opset,
                input_names=None if input_names is None else list(input_names),
                output_names=None if output_names is None else list(output_names),
            )
    finally:
        # jax2onnx traces with jnp functions patched to its own primitives; jitted functions
        # traced during the export would otherwise be reused from JAX's caches afterwards and
        # fail to compile ("MLIR translation rule for primitive 'jax.numpy.matmul' not found").
        jax.clear_caches()
