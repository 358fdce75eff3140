"""Runs an exported graph on CPU with ONNX's reference evaluator and this project's CPU kernel.

``onnx.reference.ReferenceEvaluator`` runs the standard ONNX nodes in NumPy; the
``DFlashTargetKVCacheUpdate`` nodes (domain ``trt.plugins``, both contracts, and Edge-LLM
0.11's ``trt_edgellm`` paged node) are run by the ``OpRun`` classes below, whose ``_run`` calls
the kernel of the JAX CPU custom calls itself (``jax_dflash._dflash_cpu.target_kv_cache_update``
and ``target_kv_cache_update_paged``), so an ONNX run and a JAX run of a graph use one kernel.

The nodes are checked as strictly as the TensorRT plugin checks them at build time: attribute
types and values, ``plugin_version``, unknown attributes, input counts, dtypes and shapes
(:func:`jax_dflash.interop.onnx.check_plugin_operands`). Errors name the attribute or input.

ONNX values are immutable, so a node writes into a copy of the pool and returns it; in TensorRT
the output aliases the pool input instead (``getAliasedInput(0) == 2``). A node with a scale pool
(attribute ``scale_pool = 1``) returns the updated copy of the scale pool too, as its second
output; it runs on the JAX op's CPU custom call (the same kernel: the raw entry takes no scale
pool).
"""

from __future__ import annotations

import numpy as np

from jax_dflash import _ext
from jax_dflash.interop import onnx as dflash_onnx

try:
    import onnx
    from onnx import AttributeProto
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "jax_dflash.interop.onnx_reference needs the 'onnx' package: from this repository, "
        f'pip install -e ".[onnx]" ({e})'
    ) from e

# bfloat16 and FP8 arrays cross into the extension as their bits, with the dtype named.
_BIT_VIEWS = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8}


def _bits(a: np.ndarray) -> np.ndarray:
    view = _BIT_VIEWS.get(a.dtype.name)
    return a if view is None else a.view(view)


def _contiguous(*arrays):
    # The raw entries refuse read-only arrays, inputs included (np.asarray of a jax.Array is
    # read-only): those are copied; the kernel writes only the pool's copy.
    return [None if a is None else np.require(a, requirements=("C", "W")) for a in arrays]


def run_update_kernel(
    k_delta,
    v_delta,
    past_key_value,
    rope_cos_sin,
    delta_start_positions,
    delta_lengths,
    *,
    pages_per_slot: int,
    **options,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The slot contract on the CPU kernel: returns an updated copy of ``past_key_value``.

    Operands as :func:`jax_dflash.target_kv_cache_update` (unbatched or layer-batched), checked
    by the same code as the JAX primitive, so errors read the same; ``options`` are
    :func:`run_form_kernel`'s (``k_scale``, ``v_scale``, ``k_norm_weight``, ``v_norm``,
    ``norm_eps``, ``scale_pool``: then ``(pool, scale_pool)`` is returned).
    """
    base = [k_delta, v_delta, past_key_value, rope_cos_sin, delta_start_positions, delta_lengths]
    return run_form_kernel("slot", base, pages_per_slot=pages_per_slot, **options)


def run_paged_update_kernel(
    k_delta,
    v_delta,
    past_key_value,
    rope_cos_sin,
    delta_positions,
    delta_token_to_sequence,
    kv_page_table,
    *,
    ring: bool | tuple[bool, ...] = False,
    **options,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The paged contract on the CPU kernel: returns an updated copy of ``past_key_value``.

    Operands as :func:`jax_dflash.target_kv_cache_update_paged` (unbatched or layer-batched,
    ``ring`` one bool or one per layer), checked by the same code as the JAX primitive;
    ``options`` as :func:`run_update_kernel`'s.
    """
    base = [k_delta, v_delta, past_key_value, rope_cos_sin, delta_positions]
    base += [delta_token_to_sequence, kv_page_table]
    return run_form_kernel("paged", base, ring=ring, **options)


# ---- the nodes -----------------------------------------------------------------------------------

_ATTRIBUTE_TYPES = {
    "plugin_version": AttributeProto.STRING,
    "plugin_namespace": AttributeProto.STRING,
    "pages_per_slot": AttributeProto.INT,
    "ring": AttributeProto.INT,
    "k_norm": AttributeProto.INT,
    "v_norm": AttributeProto.INT,
    "norm_eps": AttributeProto.FLOAT,
    "form": AttributeProto.STRING,
    "scale_pool": AttributeProto.INT,
}
_COMMON_ATTRIBUTES = (
    "plugin_version",
    "plugin_namespace",
    "k_norm",
    "v_norm",
    "norm_eps",
    "scale_pool",
)
_SLOT_ATTRIBUTES = frozenset((*_COMMON_ATTRIBUTES, "pages_per_slot"))
_PAGED_ATTRIBUTES = frozenset((*_COMMON_ATTRIBUTES, "ring"))


def run_form_kernel(
    form: str,
    base,
    *,
    k_scale=None,
    v_scale=None,
    k_norm_weight=None,
    v_norm: bool = False,
    norm_eps: float = dflash_onnx.DEFAULT_NORM_EPS,
    scale_pool=None,
    **attributes,
):
    """The addressing form ``form`` on the CPU kernel (its raw entry by form name): returns an
    updated copy of the pool. ``base`` are the form's base operands in its row's order;
    ``attributes`` the form's (``pages_per_slot``, ``ring``); checked by the same code as the
    JAX primitive. With ``scale_pool`` returns ``(pool, scale_pool)``, updated copies, from the
    JAX op on the CPU (:func:`_run_with_scale_pool`)."""
    from jax_dflash._shapes import check_form

    if scale_pool is not None:
        return _run_with_scale_pool(
            form, base, scale_pool, k_norm_weight, v_norm=v_norm, norm_eps=norm_eps, **attributes
        )

    *base, k_scale, v_scale, weight = _contiguous(*base, k_scale, v_scale, k_norm_weight)
    check_form(form, base, k_scale=k_scale, v_scale=v_scale, k_norm_weight=weight, **attributes)
    k, pool = base[0], base[2]
    present = pool.copy()
    # _bits leaves the index and rope operands as they are: it views only the 8/16-bit floats.
    operands = [_bits(present if i == 2 else x) for i, x in enumerate(base)]
    _ext.extension("cpu").update(
        form,
        operands,
        k_scale,
        v_scale,
        None if weight is None else _bits(weight),
        v_norm=bool(v_norm),
        norm_eps=float(norm_eps),
        delta_dtype=k.dtype.name,
        pool_dtype=pool.dtype.name,
        **attributes,
    )
    return present


# The JAX op of each form (its CPU custom call runs the kernel the raw entries run).
_FORM_OPS = {
    "slot": "target_kv_cache_update",
    "paged": "target_kv_cache_update_paged",
    "slot_mapping": "target_kv_cache_update_slots",
}


def _run_with_scale_pool(form, base, scale_pool, k_norm_weight, **options):
    """``(pool, scale_pool)`` of a call with per-token-head scales: the JAX op of ``form`` on
    the CPU device, on copies (its checks are the core's, as the raw entry's)."""
    import contextlib

    import jax

    import jax_dflash

    op = getattr(jax_dflash, _FORM_OPS[form])
    # int64 slots stay int64 (JAX refuses to narrow them).
    wide = any(np.asarray(x).dtype == np.int64 for x in base)
    with jax.enable_x64(True) if wide else contextlib.nullcontext():
        with jax.default_device(jax.devices("cpu")[0]):
            pool, scales = op(
                *[np.array(x) for x in base],
                scale_pool=np.array(scale_pool),
                k_norm_weight=None if k_norm_weight is None else np.array(k_norm_weight),
                **options,
            )
    return np.array(pool), np.array(scales)


def run_slots_update_kernel(
    k_delta, v_delta, past_key_value, rope_cos_sin, slot_mapping, **options
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The slot-mapping form on the CPU kernel: :func:`run_form_kernel`, the options as
    :func:`run_paged_update_kernel`'s but ``ring``."""
    base = [k_delta, v_delta, past_key_value, rope_cos_sin, slot_mapping]
    return run_form_kernel("slot_mapping", base, **options)


def _attribute_text(attribute) -> str:
    value = onnx.helper.get_attribute_value(attribute)
    kind = AttributeProto.AttributeType.Name(attribute.type)
    return f"a {kind} attribute {value!r}"


def _read_attributes(node, allowed: frozenset, contract: str) -> dict:
    """The node's attributes as Python values, each of the type the plugin's field has."""
    values = {}
    for attribute in node.attribute:
        name = attribute.name
        if name not in allowed:
            expected = sorted(allowed) if allowed else "none (Edge-LLM's node has no attributes)"
            raise ValueError(
                f"{name}: not an attribute of the {contract} node (expected {expected}), got "
                f"{_attribute_text(attribute)}"
            )
        if attribute.type != _ATTRIBUTE_TYPES[name]:
            wanted = AttributeProto.AttributeType.Name(_ATTRIBUTE_TYPES[name])
            raise TypeError(
                f"{name}: expected an attribute of type {wanted}, got {_attribute_text(attribute)}"
            )
        value = onnx.helper.get_attribute_value(attribute)
        values[name] = value.decode() if isinstance(value, bytes) else value

    version = values.get("plugin_version", dflash_onnx.PLUGIN_VERSION)  # the parser's default
    if version != dflash_onnx.PLUGIN_VERSION:
        raise ValueError(
            f"plugin_version: expected {dflash_onnx.PLUGIN_VERSION!r}, got {version!r}"
        )
    for flag in ("ring", "k_norm", "v_norm", "scale_pool"):
        if flag in values:
            if values[flag] not in (0, 1):
                raise ValueError(f"{flag}: expected 0 or 1, got {values[flag]}")
            values[flag] = bool(values[flag])
    if "norm_eps" in values:
        values["norm_eps"] = dflash_onnx.check_norm_eps(values["norm_eps"])
    if "pages_per_slot" in values:
        values["pages_per_slot"] = dflash_onnx.check_int32_attribute(
            values["pages_per_slot"], "pages_per_slot", minimum=1
        )
    return values


class NodeTypeError(TypeError):
    """A dtype or attribute-type error of a ``DFlashTargetKVCacheUpdate`` node."""


def _kernel_options(extras: list, attributes: dict) -> dict:
    """The kernel's keywords from a checked node's extra inputs (``k_scale, v_scale`` when
    present, or ``scale_pool`` with the attribute, then ``k_norm_weight`` with ``k_norm``; a
    ``[1]`` scale is the scalar) and its attributes."""
    k_norm = attributes.get("k_norm", False)
    k_scale = v_scale = scale_pool = None
    if attributes.get("scale_pool", False):
        scale_pool = extras[0]
    elif len(extras) - k_norm == 2:
        k_scale, v_scale = (s.reshape(()) if s.shape == (1,) else s for s in extras[:2])
    return dict(
        k_scale=k_scale,
        v_scale=v_scale,
        scale_pool=scale_pool,
        k_norm_weight=extras[-1] if k_norm else None,
        v_norm=attributes.get("v_norm", False),
        norm_eps=attributes.get("norm_eps", dflash_onnx.DEFAULT_NORM_EPS),
    )


class _TargetKVCacheUpdate(OpRun):
    """The plugin node on the CPU kernel; subclasses name the domain (see ``_node_class``)."""

    op_domain = ""
    edge_llm = False

    def run(self, *args, **kwargs):
        try:
            return super().run(*args, **kwargs)
        except TypeError as e:
            # OpRun.run replaces a TypeError from _run with a generic one; keep the node's own.
            if isinstance(e.__cause__, NodeTypeError):
                raise e.__cause__ from None
            raise

    def _run(self, *inputs, **_attributes):  # attributes are read, typed, from the node
        node = self.onnx_node
        try:
            result = self._update(list(inputs))
            outputs = result if isinstance(result, tuple) else (result,)
            if len(outputs) != len(node.output):
                raise ValueError(
                    f"outputs: expected {len(outputs)} ({', '.join(self._output_names(outputs))})"
                    f", got {len(node.output)}: {list(node.output)}"
                )
            return outputs
        except (TypeError, ValueError) as e:
            where = f"{dflash_onnx.PLUGIN_NAME} node {node.name!r} (domain {node.domain!r}): {e}"
            raise (NodeTypeError if isinstance(e, TypeError) else ValueError)(where) from e

    @staticmethod
    def _output_names(outputs) -> list[str]:
        names = [dflash_onnx.OUTPUT_NAME, dflash_onnx.SCALE_OUTPUT_NAME]
        return names[: len(outputs)]

    def _update(self, inputs: list):
        node = self.onnx_node
        for i, (name, value) in enumerate(zip(node.input, inputs)):
            if value is None:
                raise ValueError(f"input {i} ({name!r}): expected a tensor, got none")
        if not inputs:
            raise ValueError("k_delta: expected the node's inputs, got none")
        k_rank = np.ndim(inputs[0])
        form = next(
            (onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "form"), None
        )
        if form is not None and not self.edge_llm:
            return self._update_form(inputs, form.decode() if isinstance(form, bytes) else form)
        if self.edge_llm:
            paged = True
        elif k_rank in (3, 4):
            paged = k_rank == 3  # the plugin tells the contracts apart by k_delta's rank
        else:
            raise ValueError(
                "k_delta: expected rank 4 [B, L, H, D] (slot contract) or rank 3 [T, H, D] "
                f"(paged contract), got shape {np.shape(inputs[0])}"
            )
        if self.edge_llm:
            attributes = _read_attributes(node, frozenset(), "Edge-LLM 0.11 (trt_edgellm)")
        elif paged:
            attributes = _read_attributes(node, _PAGED_ATTRIBUTES, "paged-contract")
        else:
            attributes = _read_attributes(node, _SLOT_ATTRIBUTES, "slot-contract")
            if "pages_per_slot" not in attributes:
                raise ValueError(
                    "pages_per_slot: expected the attribute pages_per_slot (an INT in [1, "
                    f"{dflash_onnx.INT32_MAX}]) on the slot-contract node, got none"
                )
        k_norm = attributes.get("k_norm", False)
        dflash_onnx.check_plugin_operands(
            paged,
            inputs,
            k_norm=k_norm,
            pages_per_slot=attributes.get("pages_per_slot"),
            scale_pool=attributes.get("scale_pool", False),
        )

        base = len(dflash_onnx.PAGED_INPUTS if paged else dflash_onnx.SLOT_INPUTS)
        options = _kernel_options(inputs[base:], attributes)
        if paged:
            return run_paged_update_kernel(
                *inputs[:base], ring=attributes.get("ring", False), **options
            )
        return run_update_kernel(
            *inputs[:base], pages_per_slot=attributes["pages_per_slot"], **options
        )

    def _update_form(self, inputs: list, form: str) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """A node whose ``form`` attribute names its addressing form (the plugin's field): any
        form of the core's table but slot and paged, whose nodes are told apart by their inputs."""
        named = [f for f in dflash_onnx._shapes.FORMS if f not in dflash_onnx.UNNAMED_FORMS]
        if form not in named:
            raise ValueError(
                f"form: expected {' or '.join(map(repr, named))} (slot and paged nodes name no "
                f"form), got {form!r}"
            )
        form_attributes = dflash_onnx._shapes.FORMS[form]["attributes"]
        allowed = frozenset((*_COMMON_ATTRIBUTES, "form", *form_attributes))
        attributes = _read_attributes(self.onnx_node, allowed, form.replace("_", "-"))
        own = {name: attributes[name] for name in form_attributes if name in attributes}
        k_norm = attributes.get("k_norm", False)
        scale_pool = attributes.get("scale_pool", False)
        dflash_onnx.check_form_operands(form, inputs, k_norm=k_norm, scale_pool=scale_pool, **own)
        base = len(dflash_onnx._shapes.BASE_NAMES[form])
        options = _kernel_options(inputs[base:], attributes)
        return run_form_kernel(form, inputs[:base], **options, **own)


def _node_class(qualname: str, domain: str, edge_llm: bool) -> type:
    # ReferenceEvaluator matches a class by (op_domain, class name): the name is the op type.
    return type(
        dflash_onnx.PLUGIN_NAME,
        (_TargetKVCacheUpdate,),
        {
            "op_domain": domain,
            "edge_llm": edge_llm,
            "__module__": __name__,
            "__qualname__": qualname,
        },
    )


DFlashTargetKVCacheUpdate = _node_class(
    "DFlashTargetKVCacheUpdate", dflash_onnx.PLUGIN_DOMAIN, edge_llm=False
)
EdgeLLMTargetKVCacheUpdate = _node_class(
    "EdgeLLMTargetKVCacheUpdate", dflash_onnx.EDGE_LLM_DOMAIN, edge_llm=True
)
NODE_CLASSES = (DFlashTargetKVCacheUpdate, EdgeLLMTargetKVCacheUpdate)


def reference_evaluator(model, **kwargs) -> ReferenceEvaluator:
    """A ``ReferenceEvaluator`` for ``model`` that runs the ``DFlashTargetKVCacheUpdate`` nodes."""
    new_ops = [*NODE_CLASSES, *kwargs.pop("new_ops", ())]
    return ReferenceEvaluator(model, new_ops=new_ops, **kwargs)
