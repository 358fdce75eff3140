"""Multi-device partitioning: under ``jax.jit`` sharding the update runs per shard.

The pool's sharding decides. Three of its axes can be split, and each shard then runs the same
kernel on its own blocks, with no communication:

- the KV heads ``H`` (tensor parallel): every shard updates its heads of every slot;
- the slots, i.e. ``numPages`` in whole slots (data parallel): shard ``i`` of ``s`` holds slots
  ``[i * B/s, (i + 1) * B/s)`` and sequences ``[i * B/s, (i + 1) * B/s)``, so its local update
  is the global one restricted. This needs every slot in use (``B * pages_per_slot ==
  numPages``) and ``numPages / s`` a multiple of ``pages_per_slot``;
- the ``layers`` axis of the layer-batched form.

The other operands follow the pool: ``k_delta``/``v_delta`` split like it on ``B`` and ``H``,
the positions and lengths on ``B``, ``rope_cos_sin`` on its batch when ``Rb == B`` (replicated
otherwise; a replicated table is simply sliced). The output has the pool's sharding, and the
per-shard custom call still aliases the pool, so donation updates each shard in place.

What the op cannot follow:

- a pool split on its K/V plane dim, ``P`` or ``D``; pages split in pieces that are not whole
  slots; slots split while ``B * pages_per_slot != numPages``: an error when the program is
  compiled (``jax.jit(...).lower(...).compile()`` or the first call), a ``ValueError`` that XLA
  re-raises as ``jax.errors.JaxRuntimeError``, naming ``past_key_value``, its sharding, the dim
  and the fix. The pool is never gathered behind the caller's back.
- a small operand sharded against the pool (say ``k_delta`` split on ``D``, or on ``B`` while
  the pool's slots are replicated): it is resharded to follow the pool, with a ``UserWarning``
  naming it; that costs communication, never correctness. The output still has the pool's
  sharding.
- a ``shard_map`` that leaves some mesh axes automatic (``axis_names=...``): the op is not
  partitioned over those axes (XLA replicates its operands over them), with a ``UserWarning``.
  Under a fully manual ``shard_map`` (the default) each call simply updates its own blocks.

Machinery: ``jax.experimental.custom_partitioning`` with a Shardy sharding rule (and the GSPMD
callback for ``jax_use_shardy_partitioner=False``). The primitive keeps one lowering rule: on
a multi-device, non-manual axis context it lowers to the custom partitioning call, whose
per-shard body binds the same primitive in a fully manual context, where it lowers to the plain
FFI custom call (aliased pool). Tracing, abstract evaluation and the ``vmap`` rule are untouched.
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

from jax_dflash._shapes import ARG_NAMES, UpdateShape, check_update

try:  # JAX's own custom-partitioned ops (cuDNN attention) register themselves here too.
    from jax._src import dispatch as _dispatch
    from jax._src import sharding_impls as _sharding_impls
except ImportError:  # pragma: no cover
    _dispatch = _sharding_impls = None

POOL = 2  # operand index of past_key_value


@dataclasses.dataclass(frozen=True)
class Split:
    """The mesh axes each shardable dim is split over (``()``: not split)."""

    layers: tuple[str, ...] = ()
    slots: tuple[str, ...] = ()
    heads: tuple[str, ...] = ()


def partition_specs(
    *,
    batch_axis: str | tuple[str, ...] | None = None,
    head_axis: str | tuple[str, ...] | None = None,
    layer_axis: str | tuple[str, ...] | None = None,
    layered: bool = False,
    rope_batched: bool = False,
    rope_per_layer: bool = False,
    positions_per_layer: bool = False,
) -> tuple[PartitionSpec, ...]:
    """The ``PartitionSpec`` of each of the six operands (pool included) for a split.

    ``batch_axis`` splits the slots (pool ``numPages``) and the batch, ``head_axis`` the KV
    heads, ``layer_axis`` the layers of the layer-batched form (``layered=True``).
    ``rope_batched``: ``rope_cos_sin`` has ``Rb == B``. The output's spec is the pool's.
    """
    def axes(a):
        return () if a is None else ((a,) if isinstance(a, str) else tuple(a))

    if layer_axis is not None and not layered:
        raise ValueError("layer_axis: only the layer-batched form (layered=True) has a layers axis")
    split = Split(layers=axes(layer_axis), slots=axes(batch_axis), heads=axes(head_axis))
    return _specs(split, layered, rope_batched, rope_per_layer, positions_per_layer)


def _entry(axes: tuple[str, ...]):
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _specs(split: Split, layered, rope_batched, rope_per_layer, positions_per_layer):
    n = (_entry(split.layers),) if layered else ()
    b, h = _entry(split.slots), _entry(split.heads)
    delta = PartitionSpec(*n, b, None, h, None)
    pool = PartitionSpec(*n, None, b, None, h, None)
    rope = PartitionSpec(*(n if rope_per_layer else ()), b if rope_batched else None, None, None)
    positions = PartitionSpec(*(n if positions_per_layer else ()), b)
    return delta, delta, pool, rope, positions, positions


def _operand_specs(shape: UpdateShape, split: Split):
    return _specs(split, shape.num_layers is not None, shape.rope_batch == shape.batch,
                  shape.rope_per_layer, shape.positions_per_layer)


def _spec_axes(spec: PartitionSpec, ndim: int) -> list[tuple[str, ...]]:
    entries = list(spec) + [None] * (ndim - len(spec))
    return [
        () if e is None or e is PartitionSpec.UNCONSTRAINED
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


def plan_split(shape: UpdateShape, mesh, pool_sharding) -> Split:
    """Checks the pool's sharding and returns the split it asks for; ValueError if the op
    cannot follow it (naming the dim, the mesh axes and why)."""
    layered = shape.num_layers is not None
    lead = 1 if layered else 0
    dims = _dim_axes(pool_sharding, 5 + lead, "past_key_value")
    spec_txt = f"sharding {_spec_text(dims)}"
    for i, name in ((0, "K/V plane"), (2, "P"), (4, "D")):
        if dims[lead + i]:
            raise ValueError(
                f"past_key_value: {spec_txt} splits dim {lead + i} ({name}) over mesh axes "
                f"{dims[lead + i]}; the DFlash update can split only the KV heads "
                f"(dim {lead + 3}), the slots (dim {lead + 1}, in whole slots)"
                + (" and the layers (dim 0)" if layered else "")
                + "; replicate that dim"
            )
    split = Split(layers=dims[0] if layered else (), slots=dims[lead + 1], heads=dims[lead + 3])
    if split.layers and shape.num_layers % _shards(mesh, split.layers):
        raise ValueError(
            f"past_key_value: {spec_txt} splits {shape.num_layers} layers (dim 0) over "
            f"{_shards(mesh, split.layers)} shards, which does not divide them"
        )
    heads = _shards(mesh, split.heads)
    if shape.num_kv_heads % heads:
        raise ValueError(
            f"past_key_value: {spec_txt} splits H = {shape.num_kv_heads} (dim {lead + 3}) over "
            f"{heads} shards, which does not divide it"
        )
    slots = _shards(mesh, split.slots)
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


def _is_local_slice(given: list[tuple[str, ...]], wanted: list[tuple[str, ...]]) -> bool:
    """Whether going from ``given`` to ``wanted`` only slices locally (no communication)."""
    return all(w[: len(g)] == g for g, w in zip(given, wanted))


def _partition(primitive, pages_per_slot, mesh, arg_shapes, result_shape):
    del result_shape  # the result follows the pool
    shape = check_update(*arg_shapes, pages_per_slot)
    split = plan_split(shape, mesh, arg_shapes[POOL].sharding)
    specs = _operand_specs(shape, split)
    pool_txt = _spec_text(_spec_axes(specs[POOL], len(specs[POOL])))
    for i, (arg, spec) in enumerate(zip(arg_shapes, specs)):
        ndim = len(arg.shape)
        given = _dim_axes(arg.sharding, ndim, ARG_NAMES[i])
        if i != POOL and not _is_local_slice(given, _spec_axes(spec, ndim)):
            warnings.warn(
                f"{ARG_NAMES[i]}: sharding {_spec_text(given)} does not follow past_key_value's "
                f"{pool_txt}; the DFlash update reshards it to {spec} (communication)",
                stacklevel=2,
            )
    # Runs on each shard's blocks, in a fully manual context: the plain FFI call.
    local = functools.partial(primitive.bind, pages_per_slot=pages_per_slot)
    return mesh, local, NamedSharding(mesh, specs[POOL]), tuple(
        NamedSharding(mesh, s) for s in specs)


def _infer_sharding_from_operands(pages_per_slot, mesh, arg_shapes, result_shape):
    """GSPMD (``jax_use_shardy_partitioner=False``): the output takes the pool's sharding."""
    del result_shape
    shape = check_update(*arg_shapes, pages_per_slot)
    split = plan_split(shape, mesh, arg_shapes[POOL].sharding)
    return NamedSharding(mesh, _operand_specs(shape, split)[POOL])


# Shardy factor names of each operand's dims (the last ``rank`` apply). Only the pool and the
# output share factors: the output keeps the pool's sharding, and a small operand never pushes
# its own sharding onto the pool (``_partition`` reshards it to follow the pool instead).
_FACTORS = (
    ("kn", "kb", "kl", "kh", "kd"),
    ("vn", "vb", "vl", "vh", "vd"),
    ("n", "two", "pages", "p", "h", "d"),
    ("rn", "rb", "s", "r"),
    ("sn", "sb"),
    ("ln", "lb"),
)


def _sharding_rule(pages_per_slot, mesh, operand_types, result_types):
    del pages_per_slot, mesh, result_types
    operands = [
        " ".join(names[len(names) - len(t.shape):]) for names, t in zip(_FACTORS, operand_types)
    ]
    return f"{', '.join(operands)} -> {operands[POOL]}"


def _needs_partitioning(axis_context) -> bool:
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
                f"jax_dflash.target_kv_cache_update inside a shard_map that leaves mesh axes "
                f"{tuple(sorted(auto))} automatic: the update is not partitioned over them, so "
                "XLA replicates its operands over those axes (an all-gather where they are "
                "split). Make every mesh axis manual (the shard_map default) to avoid that.",
                stacklevel=2,
            )
    return False


def register_lowerings(
    primitive, local_lowering: Callable[[str], Callable], platforms: Sequence[str]
) -> None:
    """Registers ``primitive``'s lowering for each platform: the per-shard FFI call
    (``local_lowering(platform)``) wrapped in JAX's custom partitioning."""
    def update(k_delta, v_delta, past_key_value, rope_cos_sin, delta_start_positions,
               delta_lengths, pages_per_slot):
        return primitive.bind(k_delta, v_delta, past_key_value, rope_cos_sin,
                              delta_start_positions, delta_lengths, pages_per_slot=pages_per_slot)

    partitioned = custom_partitioning(update, static_argnums=(6,))
    partitioned.def_partition(
        partition=functools.partial(_partition, primitive),
        infer_sharding_from_operands=_infer_sharding_from_operands,
        sharding_rule=_sharding_rule,
    )
    lower_partitioned = mlir.lower_fun(partitioned, multiple_results=False)

    if _dispatch is not None:
        # The partitioned lowering needs the device assignment (custom_partitioning does too).
        _dispatch.prim_requires_devices_during_lowering.add(primitive)

    for platform in platforms:
        lower_local = local_lowering(platform)

        def rule(ctx, *operands, pages_per_slot, lower_local=lower_local):
            if _needs_partitioning(ctx.module_context.axis_context):
                return lower_partitioned(ctx, *operands, pages_per_slot=pages_per_slot)
            return lower_local(ctx, *operands, pages_per_slot=pages_per_slot)

        mlir.register_lowering(primitive, rule, platform=platform)
