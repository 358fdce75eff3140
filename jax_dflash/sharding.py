"""Multi-device partitioning: under ``jax.jit`` sharding every update runs per shard.

The pool's sharding decides. Each shard runs the same kernel on its own blocks, with no
communication, when the pool is split on:

- the KV heads ``H`` (tensor parallel), every form: every shard updates its heads;
- the ``layers`` axis of the layer-batched form, every form (a per-layer ``ring`` must then
  be the same on every shard's layers);
- the slots, slot contract only: ``numPages`` in whole slots (data parallel). Shard ``i`` of
  ``s`` holds slots ``[i * B/s, (i + 1) * B/s)`` and sequences ``[i * B/s, (i + 1) * B/s)``, so
  its local update is the global one restricted. This needs every slot in use (``B *
  pages_per_slot == numPages``) and ``numPages / s`` a multiple of ``pages_per_slot``.

The paged contract and the slot mapping cannot split the pages: a page table or a flat slot may
send any token to any page.

The other operands follow the pool: ``k_delta``/``v_delta`` split like it on layers, ``B`` (slot)
and ``H``; the positions and lengths on ``B`` (slot); ``rope_cos_sin`` on its batch when ``Rb ==
B``; per-head scales (``[H]``, ``[layers, H]``) on the heads; every ``[layers, ...]`` operand on
the layers; a ``scale_pool`` (per-token-head dynamic scales, the pool's dims without ``D``) like
the pool without ``D``; everything else is replicated. The output has the pool's sharding (the
scale pool's result its own), and the per-shard custom call still aliases the pool (and the
scale pool), so donation updates each shard in place.

These rules read the form's descriptor row, not its name: an operand's spec follows its dims
(``"[B, L, H, D]"``: ``H`` on the heads, ``B`` and ``N`` on the slots) and its role (whether it
has a layers axis); the pages split in whole slots for a form with ``pages_per_slot``.
:func:`form_partition_specs` gives any form's specs.

What the op cannot follow:

- any other split of the pool (its K/V plane dim, ``P``, ``D``; pages in pieces that are not
  whole slots; slots while ``B * pages_per_slot != numPages``; any page split in the paged
  contract): a ``ValueError`` naming ``past_key_value``, its sharding, the dim and the fix. When
  the pool's sharding is visible while lowering (a ``jax.jit`` argument, or the result of a
  ``with_sharding_constraint``) it is raised from ``jax.jit(...).lower(...)`` itself; otherwise
  the partitioner raises it when the program is compiled, and XLA re-raises it as
  ``jax.errors.JaxRuntimeError``. The pool is never gathered behind the caller's back.
- a small operand sharded against the pool (say ``k_delta`` split on ``D``): it is resharded to
  follow the pool, with a ``UserWarning`` naming it; that costs communication, never
  correctness. The output still has the pool's sharding.
- a ``shard_map`` that leaves some mesh axes automatic (``axis_names=...``): the op is not
  partitioned over those axes (XLA replicates its operands over them), with a ``UserWarning``.
  Under a fully manual ``shard_map`` (the default) each call simply updates its own blocks.

Machinery: ``jax.experimental.custom_partitioning`` with a Shardy sharding rule (and the GSPMD
callback for ``jax_use_shardy_partitioner=False``). Each primitive keeps one lowering rule: on a
multi-device, non-manual axis context it lowers to the custom partitioning call, whose per-shard
body binds the same primitive in a fully manual context, where it lowers to the plain FFI custom
call (aliased pool). Tracing, abstract evaluation and the ``vmap`` rules are untouched.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence

from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from jax_dflash._shapes import FORMS, CallShape, check_operands, operand_names

try:  # JAX's own custom-partitioned ops (cuDNN attention) register themselves here too.
    from jax._src import dispatch as _dispatch
    from jax._src import sharding_impls as _sharding_impls
except ImportError:  # pragma: no cover
    _dispatch = _sharding_impls = None

try:  # reading the pool's sharding while lowering; without it the partitioner reports
    from jax._src.lib.mlir import ir as _ir
    from jax._src.lib.mlir.dialects import sdy as _sdy
except ImportError:  # pragma: no cover
    _ir = _sdy = None

POOL = 2  # operand index of past_key_value


@dataclasses.dataclass(frozen=True)
class Split:
    """The mesh axes each shardable dim is split over (``()``: not split)."""

    layers: tuple[str, ...] = ()
    slots: tuple[str, ...] = ()
    heads: tuple[str, ...] = ()


def _axes(a) -> tuple[str, ...]:
    return () if a is None else ((a,) if isinstance(a, str) else tuple(a))


def _entry(axes: tuple[str, ...]):
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _extra_specs(split: Split, layered, scales, scales_per_layer, k_norm, norm_weight_per_layer):
    n = (_entry(split.layers),) if layered else ()
    h = _entry(split.heads)
    out = []
    if scales is not None:
        if scales not in ("tensor", "head"):
            raise ValueError(f"scales: expected None, 'tensor' or 'head', got {scales!r}")
        lead = n if scales_per_layer else ()
        scale = PartitionSpec(*lead, h) if scales == "head" else PartitionSpec(*lead)
        out += [scale, scale]
    if k_norm:
        out.append(PartitionSpec(*(n if norm_weight_per_layer else ())))
    return tuple(out)


def partition_specs(
    *,
    batch_axis: str | tuple[str, ...] | None = None,
    head_axis: str | tuple[str, ...] | None = None,
    layer_axis: str | tuple[str, ...] | None = None,
    layered: bool = False,
    rope_batched: bool = False,
    rope_per_layer: bool = False,
    positions_per_layer: bool = False,
    scales: str | None = None,
    scales_per_layer: bool = False,
    k_norm: bool = False,
    norm_weight_per_layer: bool = False,
) -> tuple[PartitionSpec, ...]:
    """The ``PartitionSpec`` of each operand of the slot contract (pool included), in order.

    ``batch_axis`` splits the slots (pool ``numPages``) and the batch, ``head_axis`` the KV
    heads, ``layer_axis`` the layers of the layer-batched form (``layered=True``).
    ``rope_batched``: ``rope_cos_sin`` has ``Rb == B``. ``scales`` ('tensor' or 'head', for an
    FP8 pool) appends the specs of ``k_scale`` and ``v_scale``, ``k_norm`` the weight's. The
    output's spec is the pool's.
    """
    return form_partition_specs(
        "slot",
        batch_axis=batch_axis,
        head_axis=head_axis,
        layer_axis=layer_axis,
        layered=layered,
        rope_batched=rope_batched,
        rope_per_layer=rope_per_layer,
        positions_per_layer=positions_per_layer,
        scales=scales,
        scales_per_layer=scales_per_layer,
        k_norm=k_norm,
        norm_weight_per_layer=norm_weight_per_layer,
    )


def paged_partition_specs(
    *,
    head_axis: str | tuple[str, ...] | None = None,
    layer_axis: str | tuple[str, ...] | None = None,
    layered: bool = False,
    rope_per_layer: bool = False,
    positions_per_layer: bool = False,
    table_per_layer: bool = False,
    scales: str | None = None,
    scales_per_layer: bool = False,
    k_norm: bool = False,
    norm_weight_per_layer: bool = False,
) -> tuple[PartitionSpec, ...]:
    """The ``PartitionSpec`` of each operand of the paged contract, in order (as
    :func:`partition_specs`; the paged pool splits on heads and layers only)."""
    return form_partition_specs(
        "paged",
        head_axis=head_axis,
        layer_axis=layer_axis,
        layered=layered,
        rope_per_layer=rope_per_layer,
        positions_per_layer=positions_per_layer,
        table_per_layer=table_per_layer,
        scales=scales,
        scales_per_layer=scales_per_layer,
        k_norm=k_norm,
        norm_weight_per_layer=norm_weight_per_layer,
    )


def form_partition_specs(
    form: str,
    *,
    batch_axis: str | tuple[str, ...] | None = None,
    head_axis: str | tuple[str, ...] | None = None,
    layer_axis: str | tuple[str, ...] | None = None,
    layered: bool = False,
    rope_batched: bool = False,
    rope_per_layer: bool = False,
    positions_per_layer: bool = False,
    table_per_layer: bool = False,
    scales: str | None = None,
    scales_per_layer: bool = False,
    k_norm: bool = False,
    norm_weight_per_layer: bool = False,
) -> tuple[PartitionSpec, ...]:
    """The ``PartitionSpec`` of each operand of the addressing form ``form`` ('slot', 'paged',
    'slot_mapping', ...), in order, read from its row (as :func:`partition_specs`).

    ``batch_axis`` needs a form whose pages split in whole slots (one with ``pages_per_slot``);
    ``positions_per_layer`` covers the form's index operands (starts and lengths, positions and
    owners, flat slots), ``table_per_layer`` its page table. ``scales='pool'`` gives the
    ``scale_pool`` operand's spec (the pool's without ``D``) in place of the static scales'.
    """
    if form not in FORMS:
        raise ValueError(f"form: expected one of {list(FORMS)}, got {form!r}")
    if layer_axis is not None and not layered:
        raise ValueError("layer_axis: only the layer-batched form (layered=True) has a layers axis")
    if batch_axis is not None and not _splits_slots(form):
        raise ValueError(
            f"batch_axis: the {form} form addresses any page from any token, so its pool "
            "cannot be split on the pages; split it on the KV heads and the layers only"
        )
    split = Split(layers=_axes(layer_axis), slots=_axes(batch_axis), heads=_axes(head_axis))
    layouts = dict(
        rope_per_layer=rope_per_layer,
        positions_per_layer=positions_per_layer,
        table_per_layer=table_per_layer,
    )
    base = _base_specs(form, split, layered, layouts, rope_batched)
    if scales == "pool":
        return base + _scale_pool_specs(base, split, layered, k_norm, norm_weight_per_layer)
    return base + _extra_specs(
        split, layered, scales, scales_per_layer, k_norm, norm_weight_per_layer
    )


def _scale_pool_specs(base, split: Split, layered, k_norm, norm_weight_per_layer):
    """The extras of a call with a scale pool: its spec (the pool's without ``D``: a row's scale
    lives on the shard of its row), then the weight's."""
    pool = tuple(base[POOL])
    return (PartitionSpec(*pool[:-1]),) + _extra_specs(
        split, layered, None, False, k_norm, norm_weight_per_layer
    )


def _splits_slots(form: str) -> bool:
    """Whether ``form``'s pool can be split on its pages: in whole slots, when the form gives
    each sequence a fixed range of pages (its ``pages_per_slot``). Through a page table or flat
    slots any token may land on any page."""
    return "pages_per_slot" in FORMS[form]["attributes"]


# Which of the checked call's layouts gives each role a leading layers axis in the layer-batched
# form; the deltas and the pool always have one. A form's index operands share one layout.
_ALWAYS_PER_LAYER = ("k_delta", "v_delta", "pool")
_LAYOUT_OF_ROLE = {
    "rope": "rope_per_layer",
    "index": "positions_per_layer",
    "slot_index": "positions_per_layer",
    "page_table": "table_per_layer",
}


def _dim_entry(dim: str, split: Split, rope_batched: bool):
    """The spec entry of one of the row's dims: ``H`` follows the heads; the batch ``B`` and the
    pool's pages ``N`` follow the slots (split only for a form that splits in whole slots);
    ``Rb`` follows them too when it is ``B``, one rope table per sequence. Every other dim is
    whole on each shard."""
    if dim == "H":
        return _entry(split.heads)
    if dim in ("B", "N") or (dim == "Rb" and rope_batched):
        return _entry(split.slots)
    return None


def _base_specs(form: str, split: Split, layered: bool, layouts: dict, rope_batched: bool):
    """The specs of ``form``'s base operands from its row: each operand's dims (``"[B, L, H,
    D]"``), after the layers axis where its role has one."""
    n = (_entry(split.layers),) if layered else ()
    row = FORMS[form]
    specs = []
    for role, dims in zip(row["operand_roles"], row["operand_dims"]):
        per_layer = role in _ALWAYS_PER_LAYER or layouts.get(_LAYOUT_OF_ROLE[role], False)
        entries = [_dim_entry(d, split, rope_batched) for d in dims.strip("[]").split(", ")]
        specs.append(PartitionSpec(*(n if per_layer else ()), *entries))
    return tuple(specs)


def operand_specs(shape: CallShape, split: Split) -> tuple[PartitionSpec, ...]:
    """Every operand's spec (the extras included) for a checked shape and a planned split."""
    layered = shape.num_layers is not None
    extras = shape.extras
    scales = (
        None if extras.scale_shape is None else ("head" if extras.scales_per_head else "tensor")
    )
    layouts = dict(
        rope_per_layer=shape.rope_per_layer,
        positions_per_layer=shape.positions_per_layer,
        table_per_layer=shape.table_per_layer,
    )
    rope_batched = shape.rope_batch == shape.batch
    base = _base_specs(shape.form, split, layered, layouts, rope_batched)
    if extras.scale_pool:
        return base + _scale_pool_specs(
            base, split, layered, extras.k_norm, extras.norm_weight_per_layer
        )
    return base + _extra_specs(
        split, layered, scales, extras.scales_per_layer, extras.k_norm, extras.norm_weight_per_layer
    )


def _result_shardings(shape: CallShape, mesh, specs):
    """The pool's sharding, and with a scale pool the list [pool, scale pool] (the structure of
    the primitive's results)."""
    pool = NamedSharding(mesh, specs[POOL])
    if not shape.extras.scale_pool:
        return pool
    return [pool, NamedSharding(mesh, specs[len(FORMS[shape.form]["operands"])])]


def _spec_axes(spec: PartitionSpec, ndim: int) -> list[tuple[str, ...]]:
    entries = list(spec) + [None] * (ndim - len(spec))
    return [
        ()
        if e is None or e is PartitionSpec.UNCONSTRAINED
        else ((e,) if isinstance(e, str) else tuple(e))
        for e in entries
    ]


def _dim_axes(sharding, ndim: int, name: str) -> list[tuple[str, ...]]:
    """The mesh axes each dim of an operand is split over."""
    if sharding is None:
        return [()] * ndim
    if isinstance(sharding, NamedSharding):
        return _spec_axes(sharding.spec, ndim)
    if sharding.is_fully_replicated:
        return [()] * ndim
    raise ValueError(
        f"{name}: expected a NamedSharding (jax.sharding.Mesh axes) to partition the DFlash "
        f"update, got {sharding}"
    )


def _spec_text(dims: list[tuple[str, ...]]) -> str:
    return str(PartitionSpec(*map(_entry, dims)))


def _shards(mesh, axes: Sequence[str]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def plan_split(shape: CallShape, mesh, pool_sharding) -> Split:
    """Checks the pool's sharding and returns the split it asks for; ValueError if the op
    cannot follow it (naming the dim, the mesh axes and why)."""
    layered = shape.num_layers is not None
    lead = 1 if layered else 0
    dims = _dim_axes(pool_sharding, 5 + lead, "past_key_value")
    return _plan_dims(shape, dims, lambda axes: _shards(mesh, axes))


def _plan_dims(shape, dims, shards: Callable | None) -> Split:
    """The split of pool ``dims`` (mesh axes per dim). ``shards`` maps axes to a shard count;
    None when the mesh sizes are not known (then only the dims are checked)."""
    # Forms whose pages do not split in whole slots (a page table or flat slots may send any
    # token to any page): heads and layers only.
    paged = not _splits_slots(shape.form)
    layered = shape.num_layers is not None
    lead = 1 if layered else 0
    spec_txt = f"sharding {_spec_text(dims)}"
    if shards is not None:  # a mesh axis of size 1 splits nothing: it is replication
        dims = [tuple(a for a in axes if shards((a,)) != 1) for axes in dims]
    allowed = (
        f"the KV heads (dim {lead + 3})"
        + ("" if paged else f", the slots (dim {lead + 1}, in whole slots)")
        + (" and the layers (dim 0)" if layered else "")
    )
    forbidden = [(0, "K/V plane"), (2, "P"), (4, "D")] + ([(1, "numPages")] if paged else [])
    for i, name in forbidden:
        if dims[lead + i]:
            why = (
                ": the page table may send any token to any page, so the pages cannot be split"
                if paged and i == 1
                else ""
            )
            raise ValueError(
                f"past_key_value: {spec_txt} splits dim {lead + i} ({name}) over mesh axes "
                f"{dims[lead + i]}{why}; the DFlash "
                f"{'paged ' if paged else ''}update can split only {allowed}; replicate "
                f"dim {lead + i}"
            )
    split = Split(
        layers=dims[0] if layered else (),
        slots=() if paged else dims[lead + 1],
        heads=dims[lead + 3],
    )
    if shards is None:
        return split
    if split.layers and shape.num_layers % shards(split.layers):
        raise ValueError(
            f"past_key_value: {spec_txt} splits {shape.num_layers} layers (dim 0) over "
            f"{shards(split.layers)} shards, which does not divide them"
        )
    if split.layers:
        _shard_ring(shape, shards(split.layers), spec_txt)
    heads = shards(split.heads)
    if shape.num_kv_heads % heads:
        raise ValueError(
            f"past_key_value: {spec_txt} splits H = {shape.num_kv_heads} (dim {lead + 3}) over "
            f"{heads} shards, which does not divide it"
        )
    slots = 1 if paged else shards(split.slots)
    if slots > 1:
        where = f"splits numPages = {shape.num_pages} (dim {lead + 1}) over {slots} shards"
        if shape.num_pages % (slots * shape.pages_per_slot):
            raise ValueError(
                f"past_key_value: {spec_txt} {where}: that is not a whole number of slots per "
                f"shard (pages_per_slot = {shape.pages_per_slot}); split the slots, not pages"
            )
        if shape.batch * shape.pages_per_slot != shape.num_pages:
            raise ValueError(
                f"past_key_value: {spec_txt} {where}, which needs every slot in use "
                f"(B * pages_per_slot == numPages) so that shard i's sequences are its own slots; "
                f"got B = {shape.batch}, pages_per_slot = {shape.pages_per_slot}, numPages = "
                f"{shape.num_pages}: pad the batch to {shape.max_batch} or replicate dim {lead + 1}"
            )
    return split


def _shard_ring(shape, shards: int, spec_txt: str = ""):
    """The ``ring`` each of ``shards`` layer shards runs with: its slice of a per-layer ring,
    which must be the same slice on every shard (each shard runs the same call, and its ring
    is static); a bool as it is."""
    ring = getattr(shape, "ring", False)
    if not isinstance(ring, tuple):
        return ring
    per = len(ring) // shards
    pieces = [ring[i * per : (i + 1) * per] for i in range(shards)]
    differ = [i for i, piece in enumerate(pieces) if piece != pieces[0]]
    if differ:
        raise ValueError(
            f"past_key_value: {spec_txt} splits {len(ring)} layers (dim 0) over {shards} shards "
            f"whose per-layer rings differ (ring {ring}: {pieces[0]} on shard 0, "
            f"{pieces[differ[0]]} on shard {differ[0]}); every shard runs one call with a static "
            "ring, so order the layers to give each shard the same rings, or replicate dim 0"
        )
    return pieces[0]


def _is_local_slice(given: list[tuple[str, ...]], wanted: list[tuple[str, ...]]) -> bool:
    """Whether going from ``given`` to ``wanted`` only slices locally (no communication)."""
    return all(w[: len(g)] == g for g, w in zip(given, wanted))


def _partition(primitive, contract, params, mesh, arg_shapes, result_shape):
    del result_shape  # the result follows the pool
    params = dict(params)
    shape = check_operands(arg_shapes, contract, params)
    split = plan_split(shape, mesh, arg_shapes[POOL].sharding)
    specs = operand_specs(shape, split)
    names = operand_names(
        contract, shape.pool_dtype, shape.k_norm, scale_pool=shape.extras.scale_pool
    )
    pool_txt = _spec_text(_spec_axes(specs[POOL], len(specs[POOL])))
    if split.layers and "ring" in params:  # each shard's layers take their own rings
        params["ring"] = _shard_ring(shape, _shards(mesh, split.layers), f"sharding {pool_txt}")
    for i, (arg, spec) in enumerate(zip(arg_shapes, specs)):
        ndim = len(arg.shape)
        given = _dim_axes(arg.sharding, ndim, names[i])
        if i != POOL and not _is_local_slice(given, _spec_axes(spec, ndim)):
            warnings.warn(
                f"{names[i]}: sharding {_spec_text(given)} does not follow past_key_value's "
                f"{pool_txt}; the DFlash update reshards it to {spec} (communication)",
                stacklevel=2,
            )

    # Runs on each shard's blocks, in a fully manual context: the plain FFI call.
    def local(*operands):
        return primitive.bind(*operands, **params)

    return (
        mesh,
        local,
        _result_shardings(shape, mesh, specs),
        tuple(NamedSharding(mesh, s) for s in specs),
    )


def _infer_sharding_from_operands(contract, params, mesh, arg_shapes, result_shape):
    """GSPMD (``jax_use_shardy_partitioner=False``): the output takes the pool's sharding (the
    scale pool's result the scale pool's)."""
    del result_shape
    shape = check_operands(arg_shapes, contract, dict(params))
    split = plan_split(shape, mesh, arg_shapes[POOL].sharding)
    return _result_shardings(shape, mesh, operand_specs(shape, split))


def _sharding_rule(contract, params, mesh, operand_types, result_types):
    """Shardy factors: only the pool and the output share them. The output keeps the pool's
    sharding, and a small operand never pushes its own sharding onto the pool (``_partition``
    reshards it to follow the pool instead)."""
    del params, mesh
    operands = [
        " ".join(f"o{i}d{j}" for j in range(len(t.shape))) for i, t in enumerate(operand_types)
    ]
    if len(result_types) == 1:
        return f"{', '.join(operands)} -> {operands[POOL]}"
    # A scale pool (the first extra) shares the pool's factors but D: a row's scale lives where
    # the row does.
    scales = len(FORMS[contract]["operands"])
    operands[scales] = " ".join(f"o{POOL}d{j}" for j in range(len(operand_types[scales].shape)))
    return f"{', '.join(operands)} -> {operands[POOL]}, {operands[scales]}"


def _needs_partitioning(axis_context, op_name: str) -> bool:
    """True on a multi-device context the partitioner still has to split; False on one device
    or under a fully manual ``shard_map``, where each call already sees its own blocks."""
    if _sharding_impls is None:  # pragma: no cover
        return False
    if isinstance(axis_context, _sharding_impls.ShardingContext):
        return axis_context.num_devices > 1
    if isinstance(axis_context, _sharding_impls.SPMDAxisContext):
        auto = set(axis_context.mesh.axis_names) - set(axis_context.manual_axes)
        if auto:
            # custom_partitioning sees no mesh there (only "replicated"): do not pretend.
            warnings.warn(
                f"jax_dflash.{op_name} inside a shard_map that leaves mesh axes "
                f"{tuple(sorted(auto))} automatic: the update is not partitioned over them, so "
                "XLA replicates its operands over those axes (an all-gather where they are "
                "split). Make every mesh axis manual (the shard_map default) to avoid that.",
                stacklevel=2,
            )
    return False


# ---- the pool's sharding where lowering already knows it ----------------------------------------


def _is_block_argument(value) -> bool:
    if isinstance(value, _ir.BlockArgument):
        return True
    check = getattr(_ir.BlockArgument, "isinstance", None)  # older MLIR bindings
    return bool(check and check(value))


def _visible_pool_dims(value, ndim: int) -> list[tuple[str, ...]] | None:
    """The mesh axes of each dim of the pool's Shardy sharding, when the pool value is a
    function argument carrying one or a sharding constraint's result; None otherwise."""
    if _ir is None or _sdy is None:  # pragma: no cover
        return None
    try:
        attr = None
        if isinstance(value, (list, tuple)):
            if len(value) != 1:
                return None
            value = value[0]
        if _is_block_argument(value):
            arg = value if isinstance(value, _ir.BlockArgument) else _ir.BlockArgument(value)
            func = arg.owner.owner
            if "arg_attrs" not in func.attributes:
                return None
            arg_attrs = _ir.DictAttr(_ir.ArrayAttr(func.attributes["arg_attrs"])[arg.arg_number])
            if "sdy.sharding" in arg_attrs:
                attr = arg_attrs["sdy.sharding"]
        else:
            owner = value.owner
            if getattr(owner, "name", None) == "sdy.sharding_constraint":
                attr = owner.attributes["sharding"]
        if attr is None:
            return None
        sharding = _sdy.TensorShardingAttr(attr)
        dims = [
            tuple(_sdy.AxisRefAttr(a).name for a in _sdy.DimensionShardingAttr(d).axes)
            for d in sharding.dimension_shardings
        ]
    except Exception:  # noqa: BLE001 - an IR shape this reader does not know: the partitioner checks
        return None
    return dims if len(dims) == ndim else None


def _mesh_sizes(axis_context) -> dict[str, int] | None:
    mesh = getattr(axis_context, "abstract_mesh", None)
    try:
        return dict(zip(mesh.axis_names, mesh.axis_sizes)) if mesh is not None else None
    except AttributeError:  # pragma: no cover
        return None


def _check_visible_pool_sharding(ctx, contract, params, operands) -> None:
    """Raises the partitioner's ValueError while lowering, when the pool's sharding is in the
    IR already: it then reaches the caller as itself, not inside an XLA error."""
    avals = ctx.avals_in
    dims = _visible_pool_dims(operands[POOL], len(avals[POOL].shape))
    if dims is None:
        return
    shape = check_operands(avals, contract, params)
    sizes = _mesh_sizes(ctx.module_context.axis_context)
    shards = None
    if sizes is not None and all(a in sizes for d in dims for a in d):

        def shards(axes):
            return math.prod(sizes[a] for a in axes)

    _plan_dims(shape, dims, shards)


def register_lowerings(
    primitive,
    local_lowering: Callable[[str], Callable],
    platforms: Sequence[str],
    *,
    contract: str,
    op_name: str | None = None,
) -> None:
    """Registers ``primitive``'s lowering for each platform: the per-shard FFI call
    (``local_lowering(platform)``) wrapped in JAX's custom partitioning. ``contract`` names an
    addressing form of the core's table (which checks and sharding rules apply); ``op_name`` is
    the public function that binds ``primitive``, for messages (default: the primitive's name)."""
    if contract not in FORMS:
        raise ValueError(f"contract: expected one of {list(FORMS)}, got {contract!r}")

    def update(params, *operands):
        return primitive.bind(*operands, **dict(params))

    partitioned = custom_partitioning(update, static_argnums=(0,))
    partitioned.def_partition(
        partition=functools.partial(_partition, primitive, contract),
        infer_sharding_from_operands=functools.partial(_infer_sharding_from_operands, contract),
        sharding_rule=functools.partial(_sharding_rule, contract),
    )

    def lower_partitioned_fn(*operands, params):
        return partitioned(params, *operands)

    lower_partitioned = mlir.lower_fun(
        lower_partitioned_fn, multiple_results=primitive.multiple_results
    )

    if _dispatch is not None:
        # The partitioned lowering needs the device assignment (custom_partitioning does too).
        _dispatch.prim_requires_devices_during_lowering.add(primitive)

    op_name = primitive.name if op_name is None else op_name
    for platform in platforms:
        lower_local = local_lowering(platform)

        def rule(ctx, *operands, lower_local=lower_local, **params):
            if _needs_partitioning(ctx.module_context.axis_context, op_name):
                _check_visible_pool_sharding(ctx, contract, params, operands)
                return lower_partitioned(ctx, *operands, params=tuple(sorted(params.items())))
            return lower_local(ctx, *operands, **params)

        try:
            # Lowered inline, not in a function cached per avals: the pool operand is then the
            # program's own argument (or constraint), whose sharding the check above can read.
            mlir.register_lowering(primitive, rule, platform=platform, cacheable=False)
        except TypeError:  # pragma: no cover - a jax without the flag
            mlir.register_lowering(primitive, rule, platform=platform)
