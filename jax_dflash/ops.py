"""The public JAX API: the ``dflash_target_kv_cache_update`` primitive and its rules.

Abstract evaluation checks every shape and dtype (``_shapes.check_update``); the lowering is an
XLA FFI custom call whose output aliases the pool operand; the batching rule turns a ``vmap``
over layers into the layer-batched form, which the kernels run as one launch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching

from jax_dflash import _ext, sharding
from jax_dflash._shapes import check_pages_per_slot, check_update

POOL_OPERAND = 2  # past_key_value; output 0 aliases it

target_kv_cache_update_p = Primitive("dflash_target_kv_cache_update")


def target_kv_cache_update(
    k_delta: jax.Array,
    v_delta: jax.Array,
    past_key_value: jax.Array,
    rope_cos_sin: jax.Array,
    delta_start_positions: jax.Array,
    delta_lengths: jax.Array,
    *,
    pages_per_slot: int,
) -> jax.Array:
    """Writes the accepted tokens' keys (with RoPE) and values into the paged KV pool.

    Args:
      k_delta: ``[B, L, H, D]`` float16, bfloat16 or float32 keys of the accepted tokens
        (k-normed, no RoPE yet).
      v_delta: ``[B, L, H, D]``, the values, same dtype.
      past_key_value: ``[2, numPages, P, H, D]`` paged pool, plane 0 = K, plane 1 = V, same dtype.
        Slot ``b`` owns pages ``[b * pages_per_slot, (b + 1) * pages_per_slot)``.
      rope_cos_sin: ``[Rb, S, R]`` float32, ``Rb`` 1 or B; row ``pos`` holds ``R/2`` cosines then
        ``R/2`` sines (rotate-half RoPE on the first ``R`` channels; ``R`` even, ``<= D``).
      delta_start_positions: ``[B]`` int32, the position of each sequence's first new token.
      delta_lengths: ``[B]`` int32, how many of the ``L`` tokens are real (the rest is padding).
      pages_per_slot: static int > 0; ``numPages % pages_per_slot == 0``, ``B <= numPages /
        pages_per_slot`` and ``S <= pages_per_slot * P``.

    Returns:
      ``present_key_value``: the pool with, for each ``b, t < delta_lengths[b]`` whose position
      ``pos = delta_start_positions[b] + t`` lies in ``[0, pages_per_slot * P)``, the rotated key
      and the value written at page ``b * pages_per_slot + pos // P``, row ``pos % P``
      (keys past ``S`` are written unrotated). Every other element is unchanged. See SPEC.md.

    Layer-batched form: with a leading ``layers`` axis on ``k_delta``/``v_delta``
    (``[layers, B, L, H, D]``) and the pool (``[layers, 2, numPages, P, H, D]``), and optionally
    on ``rope_cos_sin`` (``[layers, Rb, S, R]``) and the positions/lengths (``[layers, B]``), all
    layers are updated by one kernel launch. ``jax.vmap`` over this function produces that form.

    In place: the pool is an aliased operand of the custom call. Under
    ``jax.jit(..., donate_argnums=...)`` with the pool donated, the update is done in the pool's
    own buffer and the compiled program holds no copy of it. Without donation XLA must keep the
    caller's pool intact, so it copies the pool first (one pool-sized copy per call).

    Sharded: under ``jax.jit`` with ``NamedSharding`` operands, a pool split on its KV heads,
    in whole slots (then ``B * pages_per_slot == numPages``) and/or on layers is updated per
    shard with no communication; the output keeps the pool's sharding. Other splits of the pool
    are a compile-time error. See ``jax_dflash.sharding``.

    Raises:
      TypeError, ValueError: at trace time, naming the argument, what was expected and what was
        given. Runtime data (positions, lengths) is never trusted: values that point outside the
        slot write nothing.
    """
    return target_kv_cache_update_p.bind(
        k_delta, v_delta, past_key_value, rope_cos_sin, delta_start_positions, delta_lengths,
        # Checked before binding: primitive caches treat 2.0 and 2 as the same parameter.
        pages_per_slot=check_pages_per_slot(pages_per_slot),
    )


@target_kv_cache_update_p.def_abstract_eval
def _abstract_eval(k_delta, v_delta, past_key_value, rope_cos_sin, starts, lengths, *,
                   pages_per_slot):
    check_update(k_delta, v_delta, past_key_value, rope_cos_sin, starts, lengths, pages_per_slot)
    return jax.core.ShapedArray(past_key_value.shape, past_key_value.dtype)


def _impl(*args, **params):
    return jax.jit(functools.partial(target_kv_cache_update_p.bind, **params))(*args)


target_kv_cache_update_p.def_impl(_impl)


def _lowering(platform):
    def rule(ctx, *operands, pages_per_slot):
        _ext.ensure_registered(platform)
        lower = jax.ffi.ffi_lowering(
            _ext.FFI_TARGET, operand_output_aliases={POOL_OPERAND: 0}
        )
        return lower(ctx, *operands, pages_per_slot=np.int64(pages_per_slot))

    return rule


# Per shard under jax.jit sharding (custom partitioning), the plain FFI call otherwise.
sharding.register_lowerings(target_kv_cache_update_p, _lowering, platforms=("cpu", "cuda"))


# ---- batching: vmap over layers becomes the layer-batched form ---------------------------------

# Rank of each operand in the unbatched form; one more means a per-layer operand.
_BASE_RANKS = (4, 4, 5, 3, 1, 1)


def _batching_rule(args, dims, *, pages_per_slot):
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    args = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims)]
    mapped = [d is not None for d in dims]
    already_layered = args[POOL_OPERAND].ndim == 6 if not mapped[POOL_OPERAND] else (
        args[POOL_OPERAND].ndim == 7)
    if already_layered:
        return _nested_batching(args, mapped, size, pages_per_slot)

    out = []
    for i, (x, m) in enumerate(zip(args, mapped)):
        if i < 3 and not m:
            # k, v and the pool are always per layer: give them the layer axis.
            x = jnp.broadcast_to(x, (size, *x.shape))
        if i in (4, 5) and mapped[4] != mapped[5]:
            # positions and lengths share one layout.
            x = x if m else jnp.broadcast_to(x, (size, *x.shape))
        out.append(x)
    result = target_kv_cache_update_p.bind(*out, pages_per_slot=pages_per_slot)
    return result, 0


def _nested_batching(args, mapped, size, pages_per_slot):
    """vmap over an already layer-batched call: fold both axes into one layer axis."""
    layers = (args[POOL_OPERAND].shape[1] if mapped[POOL_OPERAND]
              else args[POOL_OPERAND].shape[0])
    out = []
    for i, (x, m) in enumerate(zip(args, mapped)):
        per_layer_rank = _BASE_RANKS[i] + 1
        if not m:
            x = jnp.broadcast_to(x, (size, *x.shape))
        # x is [size, ...]; make its inner part per layer, then fold.
        if x.ndim - 1 < per_layer_rank:
            x = jnp.broadcast_to(x[:, None], (size, layers, *x.shape[1:]))
        out.append(x.reshape(size * layers, *x.shape[2:]))
    result = target_kv_cache_update_p.bind(*out, pages_per_slot=pages_per_slot)
    return result.reshape(size, layers, *result.shape[1:]), 0


batching.primitive_batchers[target_kv_cache_update_p] = _batching_rule
