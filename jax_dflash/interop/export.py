"""Export to ONNX: jax2onnx plugins for the two update primitives, and a ``to_onnx`` helper.

jax2onnx traces a JAX function to a jaxpr and lowers each equation through a registry of
plugins keyed by primitive name. The plugins here lower each update to one node of
:mod:`jax_dflash.interop.onnx`, which TensorRT's ONNX parser maps to this project's plugin:

* ``dflash_target_kv_cache_update`` (slot contract) to the node of
  :func:`~jax_dflash.interop.onnx.make_update_node` (domain ``trt.plugins``, ``pages_per_slot``
  and the norm options as attributes);
* ``dflash_target_kv_cache_update_paged`` to the node of
  :func:`~jax_dflash.interop.onnx.make_paged_update_node`: Edge-LLM 0.11's field-less
  ``trt_edgellm`` node when no extension is used, otherwise the ``trt.plugins`` node with
  ``ring``/``k_norm``/``v_norm``/``norm_eps`` as attributes.

The extras (FP8 scales, the k-norm weight) become extra node inputs, a per-tensor scale reshaped
from ``[]`` to TensorRT's ``[1]``. Everything else in the function is exported by jax2onnx's
own plugins as standard ONNX. The plugin's build-time rules (pages of 128 tokens, an e4m3 FP8
pool, the unbatched form) are checked during the export, so a graph that exports builds.

Needs the ``export`` extra (from this repository: ``pip install -e ".[export]"``). The minimal
set is jax2onnx installed with ``--no-deps`` plus ``onnx`` and ``onnx-ir``: jax2onnx declares
flax, equinox, orbax, onnxruntime and more, which this export never uses (see the Makefile).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from jax_dflash.interop import onnx as dflash_onnx
from jax_dflash.ops import target_kv_cache_update_p, target_kv_cache_update_paged_p

# The ONNX opset of the standard nodes: the lowest at which jax2onnx 0.17 exports valid graphs
# (below 18 it emits ReduceMean with axes as an input); TensorRT 10's parser reads it.
OPSET = 18
PLUGIN_DOMAIN_VERSION = dflash_onnx.PLUGIN_DOMAIN_VERSION  # for the "trt.plugins" domain
EDGE_LLM_DOMAIN_VERSION = dflash_onnx.EDGE_LLM_DOMAIN_VERSION  # for the "trt_edgellm" domain


def _jax2onnx():
    try:
        import jax2onnx
        import onnx_ir
        from jax2onnx.plugins import plugin_system
    except ImportError as e:
        raise ImportError(
            "jax_dflash.interop.export needs jax2onnx and onnx-ir: from this repository, "
            'pip install -e ".[export]" and pip install --no-deps "jax2onnx>=0.17.1,<0.18" (the '
            f"extra leaves jax2onnx out: it declares packages the export never imports); got: {e}"
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


class _Aval:
    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)


def _node_for(
    eqn,
    names: tuple[str, ...],
    *,
    paged: bool,
    fp8_pool: bool,
    inputs: list[str],
    output: str,
    name: str,
):
    """The ONNX node of one update equation, after the plugin's build-time checks."""
    params = eqn.params
    avals = [var.aval for var in eqn.invars]
    if len(avals[2].shape) != 5:
        raise NotImplementedError(
            "jax_dflash.interop.export: the TensorRT plugin node takes the unbatched form, "
            "past_key_value [2, numPages, P, H, D]; got past_key_value of shape "
            f"{tuple(avals[2].shape)} (the layer-batched form). Export one update per layer (a "
            "Python loop over layers) instead of jax.vmap over layers."
        )
    k_norm = bool(params.get("k_norm", False))
    # The plugin takes scales of shape [1] or [H]; a [] scale is exported reshaped to [1].
    checked = [
        _Aval((1,), a.dtype) if n in dflash_onnx.SCALE_INPUTS and not a.shape else a
        for n, a in zip(names, avals)
    ]
    try:
        dflash_onnx.check_plugin_operands(
            paged, checked, k_norm=k_norm, pages_per_slot=params.get("pages_per_slot")
        )
    except (TypeError, ValueError) as e:
        raise type(e)(
            f"jax_dflash.interop.export: the update cannot be a TensorRT plugin node: {e}"
        ) from e
    v_norm = bool(params.get("v_norm", False))
    # norm_eps is written only when a norm uses it.
    norm_eps = (
        params.get("norm_eps", dflash_onnx.DEFAULT_NORM_EPS)
        if k_norm or v_norm
        else dflash_onnx.DEFAULT_NORM_EPS
    )
    options = dict(fp8_pool=fp8_pool, k_norm=k_norm, v_norm=v_norm, norm_eps=norm_eps, name=name)
    if paged:
        return dflash_onnx.make_paged_update_node(
            inputs, output, ring=bool(params.get("ring", False)), **options
        )
    return dflash_onnx.make_update_node(
        inputs, output, pages_per_slot=params["pages_per_slot"], **options
    )


def _lower(ctx: Any, eqn: Any, *, paged: bool) -> None:
    _, ir, _ = _jax2onnx()
    pool_aval = eqn.invars[2].aval
    fp8_pool = np.dtype(pool_aval.dtype).name in dflash_onnx.FP8_POOL_DTYPES
    names = dflash_onnx.node_inputs(
        paged, fp8_pool=fp8_pool, k_norm=bool(eqn.params.get("k_norm", False))
    )
    if len(names) != len(eqn.invars):
        raise ValueError(
            f"jax_dflash.interop.export: expected {len(names)} operands {list(names)}, got "
            f"{len(eqn.invars)}"
        )
    inputs = [
        ctx.get_value_for_var(var, name_hint=ctx.fresh_name(name))
        for var, name in zip(eqn.invars, names)
    ]
    out_spec = ctx.get_value_for_var(
        eqn.outvars[0], name_hint=ctx.fresh_name(dflash_onnx.OUTPUT_NAME)
    )
    output_name = out_spec.name or ctx.fresh_name(dflash_onnx.OUTPUT_NAME)
    # Checked before any node is added; the node is onnx.py's, copied: one source for both.
    node = _node_for(
        eqn,
        names,
        paged=paged,
        fp8_pool=fp8_pool,
        inputs=[v.name or "" for v in inputs],
        output=output_name,
        name=ctx.fresh_name(dflash_onnx.PLUGIN_NAME),
    )
    for i, (name, var) in enumerate(zip(names, eqn.invars)):
        if name in dflash_onnx.SCALE_INPUTS and not var.aval.shape:
            inputs[i] = _as_vector(ctx, ir, inputs[i], name)
    version = dflash_onnx.domain_version(node.domain)
    result = getattr(ctx.builder, node.op_type)(
        *inputs,
        _domain=node.domain,
        _version=version,
        _outputs=[output_name],
        **_node_attributes(node),
    )
    result.producer().name = node.name
    result.type = ir.TensorType(inputs[2].dtype)
    result.shape = ir.Shape([int(d) for d in pool_aval.shape])
    ctx.bind_value_for_var(eqn.outvars[0], result)
    ctx.builder.graph.opset_imports.setdefault(node.domain, version)


def _as_vector(ctx, ir, scalar, name: str):
    """A float32 ``[]`` value reshaped to ``[1]`` (TensorRT's per-tensor scale)."""
    shape = ctx.builder.Constant(
        _outputs=[ctx.fresh_name(f"{name}_shape")],
        value=ir.tensor(np.array([1], np.int64)),
    )
    shape.type = ir.TensorType(ir.DataType.INT64)
    shape.shape = ir.Shape([1])
    vector = ctx.builder.Reshape(scalar, shape, _outputs=[ctx.fresh_name(f"{name}_1")])
    vector.type = ir.TensorType(ir.DataType.FLOAT)
    vector.shape = ir.Shape([1])
    return vector


@functools.cache
def register_jax2onnx_plugin() -> None:
    """Registers the lowerings of both update primitives with jax2onnx (once)."""
    _, _, plugin_system = _jax2onnx()

    for primitive, paged in (
        (target_kv_cache_update_p, False),
        (target_kv_cache_update_paged_p, True),
    ):

        @plugin_system.register_primitive(
            jaxpr_primitive=primitive.name,
            component=f"{dflash_onnx.PLUGIN_NAME}{'Paged' if paged else ''}",
            context="primitives.jax_dflash",
            since="0.1.0",
            onnx=[{"component": dflash_onnx.PLUGIN_NAME, "doc": "SPEC.md (jax-dflash)"}],
            testcases=[],  # tested in tests/test_cross_runtime.py and tests/test_onnx_paged.py
        )
        class UpdatePlugin(plugin_system.PrimitiveLeafPlugin):
            """One ``DFlashTargetKVCacheUpdate`` node per update; no decomposition."""

            def lower(self, ctx: Any, eqn: Any, paged=paged) -> None:
                _lower(ctx, eqn, paged=paged)

        del UpdatePlugin  # kept alive by jax2onnx's registry


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
    """Exports ``fn`` to an ``onnx.ModelProto``; each update becomes a TensorRT plugin node.

    Args:
      fn: a JAX function; each call of :func:`jax_dflash.target_kv_cache_update` or
        :func:`jax_dflash.target_kv_cache_update_paged` in it (unbatched form) becomes one
        ``DFlashTargetKVCacheUpdate`` node (see the module docstring for which domain), the
        rest standard ONNX.
      inputs: one ``jax.ShapeDtypeStruct`` (or array) per positional argument of ``fn``, with
        static shapes (the plugin reads the pool's geometry off its shape).
      model_name, input_names, output_names, opset: passed to ``jax2onnx.to_onnx``.

    The graph's output aliases the pool input in TensorRT (``getAliasedInput(0) == 2``); in
    ONNX it is an ordinary output, a new value (see :mod:`jax_dflash.interop.onnx_reference`).

    Raises:
      NotImplementedError: for the layer-batched form (``jax.vmap`` over layers).
      TypeError, ValueError: for an update the plugin cannot build (pages of other than 128
        tokens, a float8_e5m2 pool), naming the operand.
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
