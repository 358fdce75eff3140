"""The Python side of the contract's one checker (``csrc/dflash/operands.cc``).

The rules (ranks, dims, dtypes, attributes, their relations, the messages) live in the core; the
CPU extension's ``check_call`` applies them to operands described as (dtype, dims). This module
only adapts: it describes Python operands (anything with ``.shape`` and ``.dtype``), checks that
the static attributes are Python values of the right type, and turns the core's parameters into
the one frozen dataclass (for every addressing form) that the op, the sharding rules and the
reference read. Runtime data
(positions, lengths, owners, page ids) is the kernels' business (SPEC.md, "Runtime data never
writes out of bounds").
"""

from __future__ import annotations

import dataclasses
import operator

import ml_dtypes
import numpy as np

from jax_dflash import _ext

_core = _ext.extension("cpu")
FORMS = _core.ADDRESSING_FORMS  # name -> its operands, FFI target, attributes
POOL_FORMATS = _core.POOL_FORMATS  # pool dtype name -> its scale granularity and saturation

DELTA_DTYPES = tuple(np.dtype(d) for d in (np.float16, ml_dtypes.bfloat16, np.float32))
POOL_DTYPES = tuple(np.dtype(getattr(ml_dtypes, n, n)) for n in POOL_FORMATS)
# Pool formats whose values are stored with k_scale and v_scale (each may take a scale pool
# instead).
SCALED_DTYPES = tuple(d for d in POOL_DTYPES if POOL_FORMATS[str(d)]["scales"] == "static")
# Pool formats stored with a scale pool only: int4, uint8 bytes [.., D/2], two elements each.
DYNAMIC_ONLY_DTYPES = tuple(d for d in POOL_DTYPES if POOL_FORMATS[str(d)]["scales"] == "dynamic")
INDEX_DTYPE = np.dtype(np.int32)

BASE_NAMES = {name: tuple(form["operands"]) for name, form in FORMS.items()}
SCALE_POOL_NAME = _core.SCALE_POOL_NAME  # per-token-head dynamic scales, in place of the two
# The keyword operands (the scale pool last: TensorRT's node, which reads the first three, has
# none).
EXTRA_NAMES = (*_core.SCALE_NAMES, _core.NORM_WEIGHT_NAME, SCALE_POOL_NAME)

INT64_MAX = 2**63 - 1


def takes_scales(pool_dtype) -> bool:
    """Whether a pool of this dtype is stored with ``k_scale`` and ``v_scale``."""
    return np.dtype(pool_dtype) in SCALED_DTYPES


@dataclasses.dataclass(frozen=True)
class Extras:
    """The optional operands: the pool's scales and the k-norm weight, as given."""

    scale_shape: tuple[int, ...] | None  # None: a pool format without scales
    scales_per_layer: bool
    k_norm: bool
    norm_weight_per_layer: bool
    # Whether the scales have one entry per KV head (``[H]`` or ``[layers, H]``, H > 1); a
    # per-tensor scale is ``[]``, ``[1]`` or ``[layers, 1]``.
    scales_per_head: bool = False
    # Whether the call has per-token-head dynamic scales (the ``scale_pool`` operand, the pool's
    # dims without D, updated in place as the call's second result).
    scale_pool: bool = False


@dataclasses.dataclass(frozen=True)
class CallShape:
    """The sizes of one checked update (SPEC.md's names), of any addressing form: the core's
    parameters, which are one set for every form. A size that ``form`` does not have is the
    core's value for it (0, or the one it implies: ``rope_seq_len`` is T in the token-major
    forms). ``num_layers`` is None when unbatched."""

    form: str
    num_layers: int | None
    num_kv_heads: int  # H
    head_dim: int  # D
    num_pages: int  # N
    page_size: int  # P
    rotary_dim: int  # R
    rope_per_layer: bool
    # Whether the index operands (starts and lengths, positions and owners, or the flat slots)
    # have a leading layers axis: a form's index operands share one layout.
    positions_per_layer: bool
    delta_dtype: np.dtype
    pool_dtype: np.dtype
    extras: Extras
    batch: int  # B: the sequences (slot form), the page table's rows (paged form)
    delta_len: int  # L
    tokens: int  # T
    pages_per_slot: int
    rope_batch: int  # Rb
    rope_seq_len: int  # S
    table_pages: int  # M
    table_per_layer: bool
    # The paged form's ring: every layer's, or one per layer (the layer-batched form).
    ring: bool | tuple[bool, ...] = False

    @property
    def dtype(self) -> np.dtype:
        """The pool's dtype (the stored one)."""
        return self.pool_dtype

    @property
    def fp8(self) -> bool:
        """Whether the pool format takes scales."""
        return takes_scales(self.pool_dtype)

    @property
    def k_norm(self) -> bool:
        return self.extras.k_norm

    @property
    def scale_shape(self) -> tuple[int, ...] | None:
        return self.extras.scale_shape

    @property
    def max_batch(self) -> int:
        """The pool's slots (0 for a form without ``pages_per_slot``)."""
        return self.num_pages // self.pages_per_slot if self.pages_per_slot else 0

    @property
    def slot_capacity(self) -> int:
        return self.pages_per_slot * self.page_size


# ---- static attributes: Python values of the right type (their rules are the core's) ----------


def check_int_attr(name: str, value, *, maximum: int = INT64_MAX) -> int:
    """A static Python int in ``[1, maximum]`` (a NumPy integer is accepted, a bool is not)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            f"{name}: expected a static Python int > 0, got {type(value).__name__} {value!r}"
        )
    value = operator.index(value)
    if value <= 0:
        raise ValueError(f"{name}: expected an int > 0, got {value}")
    if value > maximum:
        raise ValueError(
            f"{name}: expected an int <= {maximum} (it is an int64 attribute), got {value}"
        )
    return value


def check_pages_per_slot(pages_per_slot) -> int:
    return check_int_attr("pages_per_slot", pages_per_slot)


def check_bool_attr(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a static bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_ring_attr(ring) -> bool | tuple[bool, ...]:
    """``ring``: a static bool (every layer), or a tuple or list of static bools, one per layer
    of the layer-batched form (the core checks the count against the pool's layers)."""
    if isinstance(ring, (bool, np.bool_)):
        return bool(ring)
    if not isinstance(ring, (tuple, list)):
        raise TypeError(
            "ring: expected a static bool, or a tuple of static bools (one per layer), got "
            f"{type(ring).__name__} {ring!r}"
        )
    for layer, entry in enumerate(ring):
        if not isinstance(entry, (bool, np.bool_)):
            raise TypeError(
                f"ring: expected a static bool per layer, got {type(entry).__name__} {entry!r} "
                f"for layer {layer}"
            )
    return tuple(bool(entry) for entry in ring)


def check_norm_eps(norm_eps) -> float:
    """A static Python float; the core decides whether its value is valid (finite, > 0 and a
    normal float32)."""
    if isinstance(norm_eps, (bool, np.bool_)) or not isinstance(
        norm_eps, (int, float, np.integer, np.floating)
    ):
        raise TypeError(
            f"norm_eps: expected a static Python float > 0, got {type(norm_eps).__name__} "
            f"{norm_eps!r}"
        )
    _core.check_norm_eps(float(norm_eps))
    return float(norm_eps)


# The static value each form attribute takes in the Python API (the row says which a form has;
# their rules are the core's): its check, and its value when not given (None: required).
_ATTRIBUTE_CHECKS = {
    "pages_per_slot": (check_pages_per_slot, None),
    "ring": (check_ring_attr, False),
}


def form_attributes(form: str, given: dict) -> dict:
    """``form``'s attributes (its row's) as checked Python values, each given or its default;
    TypeError for an attribute the form does not take or a required one left out."""
    names = FORMS[form]["attributes"]
    for name in given:
        if name not in names:
            raise TypeError(
                f"{name}: not an attribute of the {form} form (it takes "
                f"{', '.join(names) or 'none'})"
            )
    checked = {}
    for name in names:
        check, default = _ATTRIBUTE_CHECKS[name]
        checked[name] = check(given.get(name, default))
    return checked


# ---- operands -> the core's checker -> sizes ---------------------------------------------------


def _describe(name, x) -> tuple[str, tuple]:
    try:
        return str(np.dtype(x.dtype)), tuple(None if d is None else int(d) for d in x.shape)
    except (AttributeError, TypeError):
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}") from None


def check_call(
    form: str,
    operands,
    *,
    pages_per_slot=0,
    ring=False,
    k_norm=False,
    v_norm=False,
    norm_eps=1e-6,
    tensorrt=False,
    scale_pool=False,
) -> dict:
    """The core's checker on ``operands`` (the FFI order: base operands, then the extras that
    are present); returns its parameters, or raises TypeError/ValueError naming the operand.
    ``scale_pool``: the operand after the base ones is the per-token-head scale pool."""
    names = operand_names(form, None, k_norm, count=len(operands), scale_pool=scale_pool)
    names += ("operand",) * (len(operands) - len(names))
    described = [_describe(n, x) for n, x in zip(names, operands)]
    return _core.check_call(
        form,
        described,
        pages_per_slot=pages_per_slot,
        ring=ring,
        k_norm=k_norm,
        v_norm=v_norm,
        norm_eps=norm_eps,
        tensorrt=tensorrt,
        scale_pool=scale_pool,
    )


def _extras(p: dict, shapes: dict) -> Extras:
    scale_shape = shapes.get("k_scale")
    return Extras(
        scale_shape=scale_shape,
        scales_per_layer=p["scale_per_layer"],
        k_norm=p["k_norm"],
        norm_weight_per_layer=p["weight_per_layer"],
        scales_per_head=bool(scale_shape) and p["scale_heads"] > 1,
        scale_pool=p["scale_pool"],
    )


def _present(base, k_scale, v_scale, k_norm_weight, scale_pool=None) -> list:
    """The FFI operand list of the keyword arguments given. The two scales are one keyword pair
    of the Python API: given together or not at all. ``scale_pool`` goes where they go (the core
    refuses a call with both)."""
    if (k_scale is None) != (v_scale is None):
        given, missing = ("k_scale", "v_scale") if v_scale is None else ("v_scale", "k_scale")
        raise ValueError(
            f"{missing}: {given} is given, so {missing} is expected too (a pool format with "
            "scales takes both), got None"
        )
    extras = (k_scale, v_scale, scale_pool, k_norm_weight)
    return [*base, *(x for x in extras if x is not None)]


def check_form(
    form: str,
    base,
    *,
    k_scale=None,
    v_scale=None,
    k_norm_weight=None,
    scale_pool=None,
    tensorrt=False,
    **attributes,
) -> CallShape:
    """Checks a call of the addressing form ``form``: its base operands in the row's order
    (anything with .shape and .dtype), the extras by keyword and the form's attributes (as
    :func:`form_attributes`); returns their sizes. The shapes are SPEC.md's, including the
    layer-batched form; ``tensorrt`` adds TensorRT's profile of the contract (SPEC.md, "The
    TensorRT plugin contract")."""
    if form not in FORMS:
        raise ValueError(f"form: expected one of {list(FORMS)}, got {form!r}")
    attributes = form_attributes(form, attributes)
    operands = _present(base, k_scale, v_scale, k_norm_weight, scale_pool)
    k_norm, dynamic = k_norm_weight is not None, scale_pool is not None
    p = check_call(
        form, operands, k_norm=k_norm, tensorrt=tensorrt, scale_pool=dynamic, **attributes
    )
    names = operand_names(form, None, k_norm, count=len(operands), scale_pool=dynamic)
    shapes = {n: tuple(x.shape) for n, x in zip(names, operands)}
    return CallShape(
        form=form,
        num_layers=p["num_layers"] if p["layered"] else None,
        num_kv_heads=p["num_kv_heads"],
        head_dim=p["head_dim"],
        num_pages=p["num_pages"],
        page_size=p["page_size"],
        rotary_dim=p["rotary_dim"],
        rope_per_layer=p["rope_per_layer"],
        positions_per_layer=p["positions_per_layer"],
        delta_dtype=np.dtype(operands[0].dtype),
        pool_dtype=np.dtype(operands[2].dtype),
        extras=_extras(p, shapes),
        batch=p["batch"],
        delta_len=p["delta_len"],
        tokens=p["num_tokens"],
        pages_per_slot=p["pages_per_slot"],
        rope_batch=p["rope_batch"],
        rope_seq_len=p["rope_seq_len"],
        table_pages=p["table_pages"],
        table_per_layer=p["table_per_layer"],
        ring=p.get("ring", False),
    )


# The checks of the three forms by their positional signatures (the reference, the ONNX runtime
# and the tests call them so); a new form needs no such function: check_form takes it by name.


def check_update(
    k_delta,
    v_delta,
    past_key_value,
    rope_cos_sin,
    delta_start_positions,
    delta_lengths,
    pages_per_slot,
    *,
    k_scale=None,
    v_scale=None,
    k_norm_weight=None,
    scale_pool=None,
    tensorrt=False,
) -> CallShape:
    """:func:`check_form` of the slot contract."""
    base = [k_delta, v_delta, past_key_value, rope_cos_sin, delta_start_positions, delta_lengths]
    extras = dict(
        k_scale=k_scale, v_scale=v_scale, k_norm_weight=k_norm_weight, scale_pool=scale_pool
    )
    return check_form("slot", base, **extras, tensorrt=tensorrt, pages_per_slot=pages_per_slot)


def check_update_paged(
    k_delta,
    v_delta,
    past_key_value,
    rope_cos_sin,
    delta_positions,
    delta_token_to_sequence,
    kv_page_table,
    *,
    k_scale=None,
    v_scale=None,
    k_norm_weight=None,
    scale_pool=None,
    ring=False,
    tensorrt=False,
) -> CallShape:
    """:func:`check_form` of the paged contract."""
    base = [k_delta, v_delta, past_key_value, rope_cos_sin]
    base += [delta_positions, delta_token_to_sequence, kv_page_table]
    extras = dict(
        k_scale=k_scale, v_scale=v_scale, k_norm_weight=k_norm_weight, scale_pool=scale_pool
    )
    return check_form("paged", base, **extras, ring=ring, tensorrt=tensorrt)


def check_update_slots(
    k_delta,
    v_delta,
    past_key_value,
    rope_cos_sin,
    slot_mapping,
    *,
    k_scale=None,
    v_scale=None,
    k_norm_weight=None,
    scale_pool=None,
    tensorrt=False,
) -> CallShape:
    """:func:`check_form` of the slot mapping."""
    base = [k_delta, v_delta, past_key_value, rope_cos_sin, slot_mapping]
    extras = dict(
        k_scale=k_scale, v_scale=v_scale, k_norm_weight=k_norm_weight, scale_pool=scale_pool
    )
    return check_form("slot_mapping", base, **extras, tensorrt=tensorrt)


# ---- a bound primitive's operand list: the base operands, then the extras ----------------------


def operand_names(
    form: str, pool_dtype, k_norm: bool, *, count: int | None = None, scale_pool: bool = False
):
    """The names of a call's operands in order (SPEC.md's FFI ABI): the form's base operands,
    then ``scale_pool`` with per-token-head scales, or else ``k_scale, v_scale`` when the pool
    takes scales (given by ``pool_dtype``, or when ``pool_dtype`` is None by ``count``), then
    ``k_norm_weight`` with ``k_norm``."""
    names = BASE_NAMES[form]
    if scale_pool:
        names += (SCALE_POOL_NAME,)
    scaled = not scale_pool and (
        takes_scales(pool_dtype)
        if pool_dtype is not None
        else count is not None and count - len(names) - k_norm == 2
    )
    if scaled:
        names += tuple(_core.SCALE_NAMES)
    if k_norm:
        names += (_core.NORM_WEIGHT_NAME,)
    return names


def split_operands(operands, form: str, k_norm: bool, scale_pool: bool = False):
    """``(base operands, {k_scale, v_scale, scale_pool, k_norm_weight})`` of a primitive's operand
    list."""
    base = len(BASE_NAMES[form])
    names = operand_names(form, None, k_norm, count=len(operands), scale_pool=scale_pool)
    extras = dict(zip(names[base:], operands[base:]))
    return list(operands[:base]), {name: extras.get(name) for name in EXTRA_NAMES}


def check_operands(operands, form: str, params: dict) -> CallShape:
    """The checks of ``form`` on a primitive's operands and params."""
    scale_pool = params.get("scale_pool", False)
    base, extras = split_operands(operands, form, params["k_norm"], scale_pool)
    if len(operands) < len(BASE_NAMES[form]):  # names what is missing
        check_call(form, operands, k_norm=params["k_norm"], scale_pool=scale_pool)
    attributes = {name: params[name] for name in FORMS[form]["attributes"]}
    return check_form(form, base, **extras, **attributes)
