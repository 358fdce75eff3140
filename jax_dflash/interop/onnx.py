"""The ONNX nodes that TensorRT's ONNX parser maps to this project's plugin.

TensorRT's parser turns a node whose op type it does not know into a plugin layer: it looks up
the creator named by the op type, with the version and namespace given by the node attributes
``plugin_version`` and ``plugin_namespace`` (default ``"1"`` and ``""``), and passes the other
attributes as plugin fields (ints as INT32, floats as FLOAT32). One op type,
``DFlashTargetKVCacheUpdate``, serves every addressing form of SPEC.md; its inputs and
attributes are the form's row in the core's table (:func:`make_form_node`):

* the slot contract (Edge-LLM 0.10): domain ``trt.plugins``, attributes ``plugin_version``,
  ``plugin_namespace``, ``pages_per_slot`` (and ``k_norm``/``v_norm``/``norm_eps`` when used);
* the paged contract (Edge-LLM 0.11), two spellings:

  - with no extension (no ring, no norm, no FP8 pool) and the default namespace: Edge-LLM 0.11's
    own node, domain ``trt_edgellm`` (imported at version 23), the seven inputs, no attributes,
    a drop-in for the node Edge-LLM exports;
  - otherwise: domain ``trt.plugins`` with ``plugin_version``, ``plugin_namespace`` and the
    extensions in use as attributes (``ring``, ``k_norm``, ``v_norm`` as 0/1, ``norm_eps``);
* every other form (the slot mapping): domain ``trt.plugins``, the attribute ``form`` naming it
  (the plugin tells only Edge-LLM's two contracts apart by their inputs), its own attributes,
  ``plugin_version``, ``plugin_namespace`` and the norms in use.

Extra inputs follow the base ones, in this order: ``k_scale``, ``v_scale`` (float32 ``[1]`` or
``[H]``) when the pool has static scales (float8_e4m3fn, TensorRT's kFP8, or int8, its kINT8), or
``scale_pool`` (float32 ``[2, N, 128, H]``, per-token-head scales) in their place with the
attribute ``scale_pool = 1`` (int8, float8_e4m3fn, or int4: uint8 ``[2, N, 128, H, D/2]``, which
takes a scale pool only); then ``k_norm_weight`` (``[D]``, the delta dtype) when ``k_norm`` is on.
The output ``present_key_value`` is the pool, aliased to ``past_key_value`` by the plugin; with a
scale pool a second output, ``present_scale_pool``, is the scale pool, aliased to it.

:func:`check_plugin_operands` holds the plugin's build-time rules (page size 128, the dtypes
TensorRT has, the unbatched form); the reference runtime and the export apply them too.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np

from jax_dflash import _shapes
from jax_dflash.contract import DEFAULT_NORM_EPS, PLUGIN_NAME, PLUGIN_VERSION

PLUGIN_DOMAIN = "trt.plugins"  # custom-op domain; TensorRT's parser matches the op type
PLUGIN_DOMAIN_VERSION = 1
EDGE_LLM_DOMAIN = "trt_edgellm"  # the domain of Edge-LLM's own exported plugin nodes
EDGE_LLM_DOMAIN_VERSION = 23  # the paged node's since_version in that domain
OUTPUT_NAME = "present_key_value"
SCALE_OUTPUT_NAME = "present_scale_pool"  # the second output, with a scale pool

SLOT_INPUTS = _shapes.BASE_NAMES["slot"]
PAGED_INPUTS = _shapes.BASE_NAMES["paged"]
SCALE_INPUTS = _shapes.EXTRA_NAMES[:2]
NORM_WEIGHT_INPUT = _shapes.EXTRA_NAMES[2]
SCALE_POOL_INPUT = _shapes.SCALE_POOL_NAME

TRT_TOKENS_PER_PAGE = 128  # P in the TensorRT contracts
INT32_MAX = 2**31 - 1  # plugin fields are INT32
DELTA_DTYPES = ("float16", "bfloat16", "float32")
# The pool formats TensorRT has (its kFP8 is e4m3; int4 is uint8 bytes), from the core's
# descriptors.
TRT_POOL_DTYPES = tuple(name for name, f in _shapes.POOL_FORMATS.items() if f["tensorrt"])
FP8_POOL_DTYPES = tuple(str(d) for d in _shapes.SCALED_DTYPES)
_ONNX_TYPES = {
    "float16": "FLOAT16",
    "bfloat16": "BFLOAT16",
    "float32": "FLOAT",
    "float8_e4m3fn": "FLOAT8E4M3FN",
    "int8": "INT8",
    "uint8": "UINT8",
}


def _onnx():
    try:
        import onnx
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(
            "jax_dflash.interop.onnx needs the 'onnx' package: from this repository, "
            f'pip install -e ".[onnx]" ({e})'
        ) from e
    return onnx


# ---- attribute checks (the plugin's field rules) -------------------------------------------------


def check_int32_attribute(value, name: str, *, minimum: int) -> int:
    """A Python/NumPy int (not bool, not float) in ``[minimum, INT32_MAX]``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{name}: expected an int in [{minimum}, {INT32_MAX}] (an INT32 plugin field), "
            f"got {type(value).__name__} {value!r}"
        )
    value = operator.index(value)
    if not minimum <= value <= INT32_MAX:
        raise ValueError(
            f"{name}: expected an int in [{minimum}, {INT32_MAX}] (an INT32 plugin field), "
            f"got {value}"
        )
    return value


def check_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_norm_eps(value, name: str = "norm_eps") -> float:
    """A FLOAT32 plugin field: the core's rule on norm_eps; returned as the float32 value."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.floating, np.integer)
    ):
        raise TypeError(f"{name}: expected a float > 0, got {type(value).__name__} {value!r}")
    return float(np.float32(_shapes.check_norm_eps(float(value))))


def _flags(*, k_norm, v_norm, norm_eps) -> tuple[bool, bool, float | None]:
    """Checked norm flags, and the eps to write (None when no norm is on)."""
    k_norm, v_norm = check_flag(k_norm, "k_norm"), check_flag(v_norm, "v_norm")
    eps = check_norm_eps(norm_eps)
    if not (k_norm or v_norm):
        if eps != float(np.float32(DEFAULT_NORM_EPS)):
            raise ValueError(
                f"norm_eps: only used with k_norm or v_norm (both are off), got {norm_eps!r}"
            )
        return k_norm, v_norm, None
    return k_norm, v_norm, eps


def _int32_field(value, name: str) -> int:
    return check_int32_attribute(value, name, minimum=1)


def _flag_field(value, name: str) -> int | None:
    return 1 if check_flag(value, name) else None


# How each form attribute becomes a plugin field (the row says which attributes a form has): its
# writer (the value to write, None to leave the field out) and its value when not given (None:
# required). The plugin's own fields (version, namespace, norms) are every form's.
_FORM_FIELDS = {
    "pages_per_slot": (_int32_field, None),  # INT32 > 0
    "ring": (_flag_field, False),  # 1 when on, absent when off
}

# The forms the plugin tells apart by k_delta's rank (Edge-LLM's two contracts): their nodes
# carry no ``form`` field, so that a node Edge-LLM exports reads as ours. A node of any other form
# names it in the plugin's ``form`` field.
UNNAMED_FORMS = ("slot", "paged")


def _form_fields(form: str, given: dict) -> dict:
    """The plugin fields of ``form``'s node: ``form`` (unless the rank tells it), then its
    attributes as written; TypeError for an attribute the form does not take."""
    names = _shapes.FORMS[form]["attributes"]
    for attribute in given:
        if attribute not in names:
            raise TypeError(
                f"{attribute}: not an attribute of the {form} node (it takes "
                f"{', '.join(names) or 'none'})"
            )
    fields = {} if form in UNNAMED_FORMS else {"form": form}
    for attribute in names:
        write, default = _FORM_FIELDS[attribute]
        value = write(given.get(attribute, default), attribute)
        if value is not None:
            fields[attribute] = value
    return fields


def _scale_flags(fp8_pool, scale_pool) -> tuple[bool, bool]:
    """Checked ``fp8_pool`` (static k_scale, v_scale inputs) and ``scale_pool`` (a scale pool
    input in their place): one or the other."""
    fp8_pool, scale_pool = check_flag(fp8_pool, "fp8_pool"), check_flag(scale_pool, "scale_pool")
    if fp8_pool and scale_pool:
        raise ValueError(
            "scale_pool: per-token-head scales (the scale_pool input) replace the static "
            "k_scale and v_scale (fp8_pool); expected one or the other, got both"
        )
    return fp8_pool, scale_pool


def form_inputs(
    form: str, *, fp8_pool: bool = False, k_norm: bool = False, scale_pool: bool = False
) -> tuple[str, ...]:
    """The input names of ``form``'s node, in order: the base inputs, then the extras in use
    (``fp8_pool``: k_scale, v_scale, for any pool with static scales; ``scale_pool``: the scale
    pool in their place)."""
    base = _shapes.BASE_NAMES[form]
    scales = SCALE_INPUTS if fp8_pool else (SCALE_POOL_INPUT,) if scale_pool else ()
    return (*base, *scales, *((NORM_WEIGHT_INPUT,) if k_norm else ()))


def node_inputs(
    paged: bool, *, fp8_pool: bool = False, k_norm: bool = False, scale_pool: bool = False
) -> tuple[str, ...]:
    """The input names of the slot or paged node: :func:`form_inputs`."""
    form = "paged" if paged else "slot"
    return form_inputs(form, fp8_pool=fp8_pool, k_norm=k_norm, scale_pool=scale_pool)


def _outputs(output, scale_pool: bool, scale_output) -> list[str]:
    """The node's outputs: the pool's, then the scale pool's with a scale pool."""
    names = [output, scale_output] if scale_pool else [output]
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"output: expected a non-empty name, got {name!r}")
    return names


def _input_list(inputs, expected: tuple[str, ...]) -> list[str]:
    inputs = list(expected if inputs is None else inputs)
    if len(inputs) != len(expected):
        raise ValueError(
            f"inputs: expected {len(expected)} names for {list(expected)}, got {inputs}"
        )
    for name, given in zip(expected, inputs):
        # An empty name is ONNX's "optional input left out": every input of this node is needed.
        if not isinstance(given, str) or not given:
            raise ValueError(f"inputs: expected a non-empty name for {name}, got {given!r}")
    return inputs


# ---- nodes -------------------------------------------------------------------------------------


def make_form_node(
    form: str,
    inputs: Sequence[str] | None = None,
    output: str = OUTPUT_NAME,
    *,
    fp8_pool: bool = False,
    k_norm: bool = False,
    v_norm: bool = False,
    norm_eps: float = DEFAULT_NORM_EPS,
    name: str | None = None,
    plugin_namespace: str = "",
    scale_pool: bool = False,
    scale_output: str = SCALE_OUTPUT_NAME,
    **attributes,
):
    """The node of the addressing form ``form`` (its row's inputs and attributes): an
    ``onnx.NodeProto``, domain ``trt.plugins``.

    ``inputs`` are the names of the form's base inputs, then k_scale, v_scale when ``fp8_pool``
    (a pool with static scales: float8_e4m3fn or int8) or scale_pool when ``scale_pool``, then
    k_norm_weight when ``k_norm`` (default: those names). With ``scale_pool`` the node has a
    second output, ``scale_output``, and the attribute ``scale_pool = 1``. Attributes: ``plugin_version``,
    ``plugin_namespace``, ``form`` (the plugin's field that names the form; not for slot and
    paged, which the plugin tells apart by k_delta's rank), the form's attributes (ints as
    INT32 fields, flags as 1 when on), and ``k_norm``/``v_norm`` (1) and ``norm_eps`` when a norm
    is on.
    """
    _onnx()  # a clear ImportError without the extra
    if form not in _shapes.FORMS:
        raise ValueError(f"form: expected one of {list(_shapes.FORMS)}, got {form!r}")
    k_norm, v_norm, eps = _flags(k_norm=k_norm, v_norm=v_norm, norm_eps=norm_eps)
    fp8_pool, scale_pool = _scale_flags(fp8_pool, scale_pool)
    expected = form_inputs(form, fp8_pool=fp8_pool, k_norm=k_norm, scale_pool=scale_pool)
    inputs = _input_list(inputs, expected)
    outputs = _outputs(output, scale_pool, scale_output)
    namespace = _namespace(plugin_namespace)
    fields = _form_fields(form, attributes)
    if scale_pool:
        fields["scale_pool"] = 1
    return _plugin_node(inputs, outputs, name, namespace, k_norm, v_norm, eps, **fields)


def make_update_node(
    inputs: Sequence[str] | None = None,
    output: str = OUTPUT_NAME,
    *,
    pages_per_slot: int,
    fp8_pool: bool = False,
    k_norm: bool = False,
    v_norm: bool = False,
    norm_eps: float = DEFAULT_NORM_EPS,
    name: str | None = None,
    plugin_namespace: str = "",
    scale_pool: bool = False,
    scale_output: str = SCALE_OUTPUT_NAME,
):
    """The slot-contract node (Edge-LLM 0.10): an ``onnx.NodeProto``, domain ``trt.plugins``.

    ``inputs`` are the names of k_delta, v_delta, past_key_value, rope_cos_sin,
    delta_start_positions and delta_lengths, then k_scale, v_scale when ``fp8_pool``, then
    k_norm_weight when ``k_norm`` (default: those names). Attributes: ``plugin_version``,
    ``plugin_namespace``, ``pages_per_slot``, and ``k_norm``/``v_norm`` (1) and ``norm_eps``
    when a norm is on; ``scale_pool`` as :func:`make_form_node`'s.
    """
    return make_form_node(
        "slot",
        inputs,
        output,
        pages_per_slot=pages_per_slot,
        fp8_pool=fp8_pool,
        scale_pool=scale_pool,
        scale_output=scale_output,
        k_norm=k_norm,
        v_norm=v_norm,
        norm_eps=norm_eps,
        name=name,
        plugin_namespace=plugin_namespace,
    )


def _namespace(plugin_namespace) -> str:
    if not isinstance(plugin_namespace, str):
        raise TypeError(
            f"plugin_namespace: expected a str, got {type(plugin_namespace).__name__} "
            f"{plugin_namespace!r}"
        )
    return plugin_namespace


def _plugin_node(inputs, outputs, name, namespace, k_norm, v_norm, eps, **fields):
    """Our plugin's node (domain ``trt.plugins``): ``plugin_version``, ``plugin_namespace``, the
    form's fields, and the norms in use (``k_norm``/``v_norm`` = 1, ``norm_eps`` when a norm is
    on)."""
    attributes = dict(plugin_version=PLUGIN_VERSION, plugin_namespace=namespace, **fields)
    for flag, on in (("k_norm", k_norm), ("v_norm", v_norm)):
        if on:
            attributes[flag] = 1
    if eps is not None:
        attributes["norm_eps"] = eps
    return _onnx().helper.make_node(
        PLUGIN_NAME,
        inputs=inputs,
        outputs=outputs,
        name=name or PLUGIN_NAME,
        domain=PLUGIN_DOMAIN,
        **attributes,
    )


def uses_edge_llm_node(
    *, ring=False, fp8_pool=False, k_norm=False, v_norm=False, plugin_namespace="", scale_pool=False
) -> bool:
    """Whether a paged update is spelled as Edge-LLM 0.11's field-less ``trt_edgellm`` node."""
    return not (ring or fp8_pool or k_norm or v_norm or scale_pool) and plugin_namespace == ""


def make_paged_update_node(
    inputs: Sequence[str] | None = None,
    output: str = OUTPUT_NAME,
    *,
    ring: bool = False,
    fp8_pool: bool = False,
    k_norm: bool = False,
    v_norm: bool = False,
    norm_eps: float = DEFAULT_NORM_EPS,
    name: str | None = None,
    plugin_namespace: str = "",
    scale_pool: bool = False,
    scale_output: str = SCALE_OUTPUT_NAME,
):
    """The paged-contract node (Edge-LLM 0.11): an ``onnx.NodeProto``.

    ``inputs`` are the names of k_delta, v_delta, past_key_value, rope_cos_sin,
    delta_positions, delta_token_to_sequence and kv_page_table, then k_scale, v_scale when
    ``fp8_pool``, then k_norm_weight when ``k_norm`` (default: those names).

    Without ring, norms, an FP8 pool or a namespace this is Edge-LLM 0.11's node: domain
    ``trt_edgellm``, no attributes. Otherwise domain ``trt.plugins`` with ``plugin_version``,
    ``plugin_namespace`` and the extensions in use (``ring``/``k_norm``/``v_norm`` = 1,
    ``norm_eps`` when a norm is on, ``scale_pool``): :func:`make_form_node`'s.
    """
    onnx = _onnx()
    ring = check_flag(ring, "ring")
    k_norm, v_norm, _ = _flags(k_norm=k_norm, v_norm=v_norm, norm_eps=norm_eps)
    fp8_pool, scale_pool = _scale_flags(fp8_pool, scale_pool)
    plugin_namespace = _namespace(plugin_namespace)
    expected = form_inputs("paged", fp8_pool=fp8_pool, k_norm=k_norm, scale_pool=scale_pool)
    inputs = _input_list(inputs, expected)
    if uses_edge_llm_node(
        ring=ring,
        fp8_pool=fp8_pool,
        k_norm=k_norm,
        v_norm=v_norm,
        plugin_namespace=plugin_namespace,
        scale_pool=scale_pool,
    ):
        return onnx.helper.make_node(
            PLUGIN_NAME,
            inputs=inputs,
            outputs=[output],
            name=name or PLUGIN_NAME,
            domain=EDGE_LLM_DOMAIN,
        )
    return make_form_node(
        "paged",
        inputs,
        output,
        ring=ring,
        fp8_pool=fp8_pool,
        scale_pool=scale_pool,
        scale_output=scale_output,
        k_norm=k_norm,
        v_norm=v_norm,
        norm_eps=norm_eps,
        name=name,
        plugin_namespace=plugin_namespace,
    )


def make_slots_update_node(
    inputs: Sequence[str] | None = None,
    output: str = OUTPUT_NAME,
    *,
    fp8_pool: bool = False,
    k_norm: bool = False,
    v_norm: bool = False,
    norm_eps: float = DEFAULT_NORM_EPS,
    name: str | None = None,
    plugin_namespace: str = "",
    scale_pool: bool = False,
    scale_output: str = SCALE_OUTPUT_NAME,
):
    """The slot-mapping node (vLLM's flat slots): domain ``trt.plugins``, the attribute
    ``form = "slot_mapping"`` (the plugin's field that names the form), ``plugin_version``,
    ``plugin_namespace`` and the extensions in use. ``inputs`` are the names of k_delta,
    v_delta, past_key_value, rope_cos_sin and slot_mapping, then k_scale, v_scale when
    ``fp8_pool``, then k_norm_weight when ``k_norm`` (default: those names)."""
    return make_form_node(
        "slot_mapping",
        inputs,
        output,
        fp8_pool=fp8_pool,
        scale_pool=scale_pool,
        scale_output=scale_output,
        k_norm=k_norm,
        v_norm=v_norm,
        norm_eps=norm_eps,
        name=name,
        plugin_namespace=plugin_namespace,
    )


def check_form_operands(
    form: str, operands: Sequence, *, k_norm: bool = False, scale_pool: bool = False, **attributes
):
    """Operands of a ``form`` node (anything with .shape and .dtype: its inputs in order) against
    the plugin's rules: the core's, with TensorRT's profile; returns the sizes. ``attributes``
    are the form's (``pages_per_slot`` for the slot contract); ``scale_pool``: the input after
    the base ones is the scale pool (the node's attribute ``scale_pool = 1``)."""
    base = len(_shapes.BASE_NAMES[form])
    operands = list(operands)
    names = _shapes.operand_names(form, None, k_norm, count=len(operands), scale_pool=scale_pool)
    if len(operands) < base or len(names) != len(operands):
        # The core's count message names every operand the form takes.
        _shapes.check_call(
            form, operands, k_norm=k_norm, tensorrt=True, scale_pool=scale_pool, **attributes
        )
    extras = dict(zip(names[base:], operands[base:]))
    return _shapes.check_form(form, operands[:base], **extras, tensorrt=True, **attributes)


def domain_version(domain: str) -> int:
    """The opset version a model declares for the node's domain."""
    return EDGE_LLM_DOMAIN_VERSION if domain == EDGE_LLM_DOMAIN else PLUGIN_DOMAIN_VERSION


# ---- the plugin's build-time rules on operands ---------------------------------------------------


def _dtype_name(x) -> str:
    return np.dtype(x.dtype).name


def _dims(x) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def check_plugin_operands(
    paged: bool,
    operands: Sequence,
    *,
    k_norm: bool = False,
    pages_per_slot: int | None = None,
    scale_pool: bool = False,
):
    """Checks operands (anything with .shape and .dtype) against the plugin's rules; returns
    their sizes (:func:`jax_dflash._shapes.check_update` / ``check_update_paged``).

    ``operands`` are the node's inputs in order (base, then k_scale, v_scale for a pool with
    static scales or scale_pool with ``scale_pool``, then k_norm_weight when ``k_norm``);
    ``pages_per_slot`` is required for the slot contract.
    The rules are the core's, with TensorRT's profile of the contract (the unbatched form, pages
    of 128 tokens, kFP8 = e4m3, scales ``[1]`` or ``[H]``): the checker the plugin runs.
    """
    if paged:
        return check_form_operands("paged", operands, k_norm=k_norm, scale_pool=scale_pool)
    if pages_per_slot is None:
        raise TypeError("pages_per_slot: expected an int > 0 for the slot contract, got None")
    return check_form_operands(
        "slot", operands, k_norm=k_norm, pages_per_slot=pages_per_slot, scale_pool=scale_pool
    )


# ---- one-node models -----------------------------------------------------------------------------


def _dim(value, what: str):
    if isinstance(value, str):
        if not value:
            raise ValueError(
                f"{what}: expected a positive int or a non-empty symbolic name, got ''"
            )
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{what}: expected an int >= 0 or a symbolic name (str), got {value!r}")
    return int(value)


def _dtypes(dtype, pool_dtype) -> tuple[str, str]:
    if dtype not in DELTA_DTYPES:
        raise ValueError(f"dtype: expected one of {list(DELTA_DTYPES)}, got {dtype!r}")
    pool_dtype = dtype if pool_dtype is None else pool_dtype
    if pool_dtype not in TRT_POOL_DTYPES:
        raise ValueError(
            f"pool_dtype: expected one of {list(TRT_POOL_DTYPES)} (TensorRT's kFP8 is e4m3), "
            f"got {pool_dtype!r}"
        )
    return dtype, pool_dtype


def _check_page_size(page_size) -> int:
    if page_size != TRT_TOKENS_PER_PAGE or isinstance(page_size, bool):
        raise ValueError(
            f"page_size: expected {TRT_TOKENS_PER_PAGE} (TensorRT's tokens per page), "
            f"got {page_size!r}"
        )
    return TRT_TOKENS_PER_PAGE


def _check_rotary(rotary, dim):
    if isinstance(rotary, int) and isinstance(dim, int) and (rotary % 2 or rotary > dim):
        raise ValueError(f"rotary_dim: expected an even int <= head_dim = {dim}, got {rotary}")


def _extra_value_infos(
    helper,
    TensorProto,
    *,
    fp8_pool,
    k_norm,
    per_head_scales,
    heads,
    dim,
    delta_elem,
    scale_pool_shape=None,
):
    infos = []
    if scale_pool_shape is not None:
        if per_head_scales:
            raise ValueError(
                "per_head_scales: a scale pool holds per-token-head scales; static per-head "
                "scales are for a pool without one"
            )
        infos.append(
            helper.make_tensor_value_info(SCALE_POOL_INPUT, TensorProto.FLOAT, scale_pool_shape)
        )
    elif fp8_pool:
        scale_shape = [heads] if per_head_scales else [1]
        infos += [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, scale_shape) for n in SCALE_INPUTS
        ]
    elif per_head_scales:
        raise ValueError(
            f"per_head_scales: only a pool with static scales (pool_dtype one of "
            f"{list(FP8_POOL_DTYPES)} in TensorRT) takes k_scale and v_scale"
        )
    if k_norm:
        infos.append(helper.make_tensor_value_info(NORM_WEIGHT_INPUT, delta_elem, [dim]))
    return infos


def _model(helper, node, graph_name, inputs, output, opset):
    outputs = output if isinstance(output, list) else [output]
    graph = helper.make_graph([node], graph_name, inputs, outputs)
    model = helper.make_model(
        graph,
        opset_imports=[
            helper.make_opsetid("", opset),
            helper.make_opsetid(node.domain, domain_version(node.domain)),
        ],
        producer_name="jax_dflash",
    )
    # The oldest IR version that carries the opset: what TensorRT's (older) parser reads best.
    model.ir_version = helper.find_min_ir_version_for([helper.make_opsetid("", opset)])
    return model


# Long: one ONNX model built input by input (value infos, node, graph); read in order.
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
    pool_dtype: str | None = None,
    per_head_scales: bool = False,
    scale_pool: bool = False,
    k_norm: bool = False,
    v_norm: bool = False,
    norm_eps: float = DEFAULT_NORM_EPS,
    page_size: int = TRT_TOKENS_PER_PAGE,
    plugin_namespace: str = "",
    opset: int = 17,
    graph_name: str = "dflash_target_kv_cache_update",
):
    """A one-node slot-contract ``onnx.ModelProto`` that TensorRT's ONNX parser maps to the plugin.

    Inputs (typed): ``k_delta``, ``v_delta`` ``[batch, delta_len, num_kv_heads, head_dim]`` in
    ``dtype`` (float16, bfloat16 or float32); ``past_key_value``
    ``[2, num_pages, 128, num_kv_heads, head_dim]`` in ``pool_dtype`` (default ``dtype``; or
    float8_e4m3fn or int8, then ``k_scale``, ``v_scale`` float32 ``[1]``, or ``[num_kv_heads]``
    with ``per_head_scales``, or with ``scale_pool`` the input ``scale_pool`` float32 ``[2,
    num_pages, 128, num_kv_heads]`` and the output ``present_scale_pool``; uint8 is int4, last
    dim ``head_dim / 2``, with ``scale_pool`` only); ``rope_cos_sin`` ``[rope_batch, rope_seq_len, rotary_dim]`` float32;
    ``delta_start_positions``, ``delta_lengths`` ``[batch]`` int32; ``k_norm_weight``
    ``[head_dim]`` in ``dtype`` when ``k_norm``. Output ``present_key_value``: the pool's shape and
    dtype. String dimensions are symbolic (dynamic in TensorRT). The plugin's rules are checked
    where the sizes are ints: ``rope_batch`` 1 or ``batch``, ``batch`` at most the pool's slots,
    ``rope_seq_len`` at most the slot capacity ``pages_per_slot * 128``.
    """
    _onnx()  # a clear ImportError without the extra
    from onnx import TensorProto, helper

    dtype, pool_dtype = _dtypes(dtype, pool_dtype)
    _check_page_size(page_size)
    fp8_pool, scale_pool = _pool_scales(pool_dtype, scale_pool)
    node = make_update_node(
        scale_pool=scale_pool,
        pages_per_slot=pages_per_slot,
        fp8_pool=fp8_pool,
        k_norm=k_norm,
        v_norm=v_norm,
        norm_eps=norm_eps,
        plugin_namespace=plugin_namespace,
    )
    pages_per_slot = int(pages_per_slot)
    heads, dim = _dim(num_kv_heads, "num_kv_heads"), _dim(head_dim, "head_dim")
    pages, rotary = _dim(num_pages, "num_pages"), _dim(rotary_dim, "rotary_dim")
    b, length = _dim(batch, "batch"), _dim(delta_len, "delta_len")
    seq, rb = _dim(rope_seq_len, "rope_seq_len"), _dim(rope_batch, "rope_batch")
    if rb not in (1, b):
        raise ValueError(f"rope_batch: expected 1 or batch ({b!r}), got {rb!r}")
    if isinstance(pages, int) and pages % pages_per_slot:
        raise ValueError(
            f"num_pages: expected a multiple of pages_per_slot = {pages_per_slot}, got {pages}"
        )
    if isinstance(pages, int) and isinstance(b, int) and b > pages // pages_per_slot:
        raise ValueError(
            f"batch: expected at most the pool's {pages // pages_per_slot} slots (num_pages "
            f"{pages} / pages_per_slot {pages_per_slot}), got {b}"
        )
    capacity = pages_per_slot * TRT_TOKENS_PER_PAGE
    if isinstance(seq, int) and seq > capacity:
        raise ValueError(
            f"rope_seq_len: expected at most the slot capacity pages_per_slot * 128 = {capacity}, "
            f"got {seq}"
        )
    _check_rotary(rotary, dim)

    elem = getattr(TensorProto, _ONNX_TYPES[dtype])
    pool_elem = getattr(TensorProto, _ONNX_TYPES[pool_dtype])
    pool_shape = [2, pages, TRT_TOKENS_PER_PAGE, heads, _pool_dim(pool_dtype, dim)]
    shapes = {
        "k_delta": (elem, [b, length, heads, dim]),
        "v_delta": (elem, [b, length, heads, dim]),
        "past_key_value": (pool_elem, pool_shape),
        "rope_cos_sin": (TensorProto.FLOAT, [rb, seq, rotary]),
        "delta_start_positions": (TensorProto.INT32, [b]),
        "delta_lengths": (TensorProto.INT32, [b]),
    }
    extras = dict(
        fp8_pool=fp8_pool,
        k_norm=bool(k_norm),
        heads=heads,
        dim=dim,
        delta_elem=elem,
        per_head_scales=check_flag(per_head_scales, "per_head_scales"),
        scale_pool_shape=pool_shape[:-1] if scale_pool else None,
    )
    return _typed_model(helper, TensorProto, node, SLOT_INPUTS, shapes, extras, graph_name, opset)


def _typed_model(helper, TensorProto, node, names, shapes, extras, graph_name, opset):
    """The one-node model of ``node``: its inputs ``names`` typed by ``shapes`` (name -> (element
    type, dims), the pool's among them), the extras, and the output typed as the pool."""
    inputs = [helper.make_tensor_value_info(name, *shapes[name]) for name in names]
    inputs += _extra_value_infos(helper, TensorProto, **extras)
    outputs = [helper.make_tensor_value_info(OUTPUT_NAME, *shapes["past_key_value"])]
    if extras.get("scale_pool_shape") is not None:
        outputs.append(
            helper.make_tensor_value_info(
                SCALE_OUTPUT_NAME, TensorProto.FLOAT, extras["scale_pool_shape"]
            )
        )
    return _model(helper, node, graph_name, inputs, outputs, opset)


def _pool_scales(pool_dtype: str, scale_pool) -> tuple[bool, bool]:
    """``(fp8_pool, scale_pool)`` of a model's pool: static k_scale, v_scale for a pool with
    static scales unless ``scale_pool``; int4 (uint8) takes a scale pool only."""
    scale_pool = check_flag(scale_pool, "scale_pool")
    fmt = _shapes.POOL_FORMATS[pool_dtype]
    if scale_pool and fmt["scales"] == "none":
        raise ValueError(
            f"scale_pool: a {pool_dtype} pool takes no scale pool (only pool formats with scales "
            f"do: {[n for n in TRT_POOL_DTYPES if _shapes.POOL_FORMATS[n]['scales'] != 'none']})"
        )
    if not scale_pool and fmt["scales"] == "dynamic":
        raise ValueError(
            f"scale_pool: an {fmt['name']} pool ({pool_dtype} [2, N, 128, H, D/2]) is stored with "
            "per-token-head dynamic scales only: expected scale_pool=True, got False"
        )
    return fmt["scales"] == "static" and not scale_pool, scale_pool


def _pool_dim(pool_dtype: str, dim):
    """The pool's last dim: D, or D / per_byte for a packed pool (int4: D / 2, D even)."""
    per = _shapes.POOL_FORMATS[pool_dtype]["per_byte"]
    if per == 1:
        return dim
    if isinstance(dim, int):
        if dim % per:
            raise ValueError(
                f"head_dim: an {_shapes.POOL_FORMATS[pool_dtype]['name']} pool packs {per} "
                f"elements per byte, so head_dim must be a multiple of {per}, got {dim}"
            )
        return dim // per
    return f"{dim}/{per}"


# Long: one ONNX model built input by input (value infos, node, graph); read in order.
def make_paged_update_model(
    *,
    num_kv_heads: int,
    head_dim: int,
    num_pages: int,
    rotary_dim: int,
    max_pages_per_sequence: int | str,
    tokens: int | str = "T",
    batch: int | str = "B",
    dtype: str = "float16",
    pool_dtype: str | None = None,
    per_head_scales: bool = False,
    scale_pool: bool = False,
    ring: bool = False,
    k_norm: bool = False,
    v_norm: bool = False,
    norm_eps: float = DEFAULT_NORM_EPS,
    page_size: int = TRT_TOKENS_PER_PAGE,
    plugin_namespace: str = "",
    opset: int = 17,
    graph_name: str = "dflash_target_kv_cache_update_paged",
):
    """A one-node paged-contract ``onnx.ModelProto`` (Edge-LLM 0.11) for TensorRT's ONNX parser.

    Inputs (typed): ``k_delta``, ``v_delta`` ``[tokens, num_kv_heads, head_dim]`` in ``dtype``
    (float16, bfloat16 or float32); ``past_key_value`` ``[2, num_pages, 128, num_kv_heads,
    head_dim]`` in ``pool_dtype`` (default ``dtype``; pools with scales and ``scale_pool`` as
    :func:`make_update_model`'s);
    ``rope_cos_sin`` ``[tokens, rotary_dim]`` float32; ``delta_positions``,
    ``delta_token_to_sequence`` ``[tokens]`` int32; ``kv_page_table`` ``[batch, 2,
    max_pages_per_sequence]`` int32 (``max_pages_per_sequence <= num_pages``);
    ``k_norm_weight`` ``[head_dim]`` in ``dtype`` when ``k_norm``. Output
    ``present_key_value``. The node is :func:`make_paged_update_node`'s: Edge-LLM's field-less
    ``trt_edgellm`` node unless an extension or a namespace is used.
    """
    _onnx()
    from onnx import TensorProto, helper

    dtype, pool_dtype = _dtypes(dtype, pool_dtype)
    _check_page_size(page_size)
    fp8_pool, scale_pool = _pool_scales(pool_dtype, scale_pool)
    node = make_paged_update_node(
        scale_pool=scale_pool,
        ring=ring,
        fp8_pool=fp8_pool,
        k_norm=k_norm,
        v_norm=v_norm,
        norm_eps=norm_eps,
        plugin_namespace=plugin_namespace,
    )
    heads, dim = _dim(num_kv_heads, "num_kv_heads"), _dim(head_dim, "head_dim")
    pages, rotary = _dim(num_pages, "num_pages"), _dim(rotary_dim, "rotary_dim")
    t, b = _dim(tokens, "tokens"), _dim(batch, "batch")
    m = _dim(max_pages_per_sequence, "max_pages_per_sequence")
    if isinstance(m, int) and m == 0:
        raise ValueError(
            "max_pages_per_sequence: expected an int >= 1 (M, the page table's last dim), got 0"
        )
    if isinstance(m, int) and isinstance(pages, int) and m > pages:
        raise ValueError(
            f"max_pages_per_sequence: expected at most num_pages = {pages} (M <= N), got {m}"
        )
    _check_rotary(rotary, dim)

    elem = getattr(TensorProto, _ONNX_TYPES[dtype])
    pool_elem = getattr(TensorProto, _ONNX_TYPES[pool_dtype])
    pool_shape = [2, pages, TRT_TOKENS_PER_PAGE, heads, _pool_dim(pool_dtype, dim)]
    shapes = {
        "k_delta": (elem, [t, heads, dim]),
        "v_delta": (elem, [t, heads, dim]),
        "past_key_value": (pool_elem, pool_shape),
        "rope_cos_sin": (TensorProto.FLOAT, [t, rotary]),
        "delta_positions": (TensorProto.INT32, [t]),
        "delta_token_to_sequence": (TensorProto.INT32, [t]),
        "kv_page_table": (TensorProto.INT32, [b, 2, m]),
    }
    extras = dict(
        fp8_pool=fp8_pool,
        k_norm=bool(k_norm),
        heads=heads,
        dim=dim,
        delta_elem=elem,
        per_head_scales=check_flag(per_head_scales, "per_head_scales"),
        scale_pool_shape=pool_shape[:-1] if scale_pool else None,
    )
    return _typed_model(helper, TensorProto, node, PAGED_INPUTS, shapes, extras, graph_name, opset)


def make_node_model(node, operands: Sequence, *, opset: int = 17, graph_name: str = "update"):
    """A one-node ``onnx.ModelProto`` around ``node``, its inputs typed from ``operands``.

    ``operands`` (anything with .shape and .dtype, e.g. the NumPy arrays to feed) are matched
    to ``node.input`` in order; the output has the pool's (``operands[2]``) type. For running a
    node on captured arrays with :mod:`jax_dflash.interop.onnx_reference`.
    """
    onnx = _onnx()
    helper = onnx.helper
    operands = list(operands)
    if len(operands) != len(node.input):
        raise ValueError(
            f"operands: expected one per node input {list(node.input)}, got {len(operands)}"
        )

    def elem(x):
        return helper.np_dtype_to_tensor_dtype(np.dtype(x.dtype))

    inputs = [
        helper.make_tensor_value_info(name, elem(x), list(_dims(x)))
        for name, x in zip(node.input, operands)
    ]
    pool = operands[2]
    outputs = [helper.make_tensor_value_info(node.output[0], elem(pool), list(_dims(pool)))]
    if len(node.output) > 1:  # present_scale_pool: typed as the input after the base ones
        named = [helper.get_attribute_value(a) for a in node.attribute if a.name == "form"]
        form = named[0].decode() if named else "slot" if len(_dims(operands[0])) == 4 else "paged"
        base = len(_shapes.BASE_NAMES.get(form, ()))
        if not base or len(operands) <= base:
            raise ValueError(
                f"operands: the node has a second output ({node.output[1]!r}) but no input after "
                f"the {form!r} form's base inputs to type it from"
            )
        scales = operands[base]
        outputs.append(
            helper.make_tensor_value_info(node.output[1], elem(scales), list(_dims(scales)))
        )
    return _model(helper, node, graph_name, inputs, outputs, opset)
