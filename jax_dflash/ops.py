"""The public JAX API: the two update primitives (slot and paged contracts) and their rules.

Abstract evaluation checks every shape and dtype (``jax_dflash._shapes``); the lowering is an XLA
FFI custom call whose output aliases the pool operand (``jax_dflash.lowering``); the batching
rules turn a ``vmap`` over layers into the layer-batched form, which the kernels run as one
launch; ``jax_dflash.sharding`` partitions both under ``jax.jit`` sharding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching

from jax_dflash import lowering, sharding
from jax_dflash._shapes import (
    FORMS,
    INDEX_DTYPE,
    check_bool_attr,
    check_form,
    check_norm_eps,
    check_operands,
    check_pages_per_slot,
    check_ring_attr,
    takes_scales,
)
from jax_dflash.contract import DEFAULT_NORM_EPS

POOL_OPERAND = lowering.POOL_OPERAND

try:  # whether no transformation is active (then an eager call may skip the bind machinery)
    from jax._src.core import trace_state_clean as _trace_state_clean
except ImportError:  # pragma: no cover
    _trace_state_clean = None

target_kv_cache_update_p = Primitive("dflash_target_kv_cache_update")
target_kv_cache_update_paged_p = Primitive("dflash_target_kv_cache_update_paged")
target_kv_cache_update_slots_p = Primitive("dflash_target_kv_cache_update_slots")


def _dynamic_primitive(name: str) -> Primitive:
    """A form's call with per-token-head dynamic scales: two results, the pool and the scale
    pool, each aliasing its operand."""
    primitive = Primitive(f"{name}_scale_pool")
    primitive.multiple_results = True
    return primitive


target_kv_cache_update_scale_pool_p = _dynamic_primitive(target_kv_cache_update_p.name)
target_kv_cache_update_paged_scale_pool_p = _dynamic_primitive(target_kv_cache_update_paged_p.name)
target_kv_cache_update_slots_scale_pool_p = _dynamic_primitive(target_kv_cache_update_slots_p.name)


# ---- operand handling shared by both contracts -----------------------------------------------


def _index_operand(name, x):
    """Index operands must already be int32 arrays: with ``jax_enable_x64`` off, converting an
    int64 array (or a list NumPy makes int64) would silently narrow it, so a start of 2**32 + 1
    would become 1."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not hasattr(x, "shape"):
        raise TypeError(
            f"{name}: expected an int32 array, got {type(x).__name__} (wrap it in "
            "np.asarray(..., np.int32) or jnp.asarray(..., jnp.int32) yourself)"
        )
    if np.dtype(dtype) != INDEX_DTYPE:
        why = (
            " (it is not converted: with jax_enable_x64 off that would silently narrow it)"
            if np.issubdtype(dtype, np.integer)
            else " (it is not converted: indices are integers)"
        )
        raise TypeError(f"{name}: expected dtype int32, got {np.dtype(dtype)}{why}")
    return x


def _slot_operand(name, x):
    """Flat slots may be int32 or int64; an int64 array is taken only where JAX keeps it int64
    (jax_enable_x64 on): otherwise jit would narrow it, and a slot past 2^31 would land elsewhere."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not hasattr(x, "shape"):
        raise TypeError(f"{name}: expected an int32 or int64 array, got {type(x).__name__}")
    dtype = np.dtype(dtype)
    if dtype == np.int64 and not jax.config.jax_enable_x64:
        raise TypeError(
            f"{name}: expected int32 (or int64 with jax_enable_x64 on), got int64 with "
            "jax_enable_x64 off (it is not converted: that would silently narrow it)"
        )
    if dtype not in (np.int32, np.int64):
        raise TypeError(f"{name}: expected dtype int32 or int64, got {dtype}")
    return x


def _array_operand(name, x):
    if hasattr(x, "dtype") and hasattr(x, "shape"):
        return x
    if isinstance(x, (list, tuple)):
        return np.asarray(x)  # its dtype is then checked like any other
    raise TypeError(f"{name}: expected an array, got {type(x).__name__}")


def _scale_operand(name, x):
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a float32 scale, got {type(x).__name__} {x!r}")
    if isinstance(x, (int, float)):
        return np.float32(x)  # a Python number is a per-tensor scale
    return _array_operand(name, x)


def _delta_operands(k_delta, v_delta, past_key_value, rope_cos_sin) -> list:
    """The operands every form starts with, as arrays (their dtypes and shapes are the core's)."""
    names = ("k_delta", "v_delta", "past_key_value", "rope_cos_sin")
    operands = (k_delta, v_delta, past_key_value, rope_cos_sin)
    return [_array_operand(n, x) for n, x in zip(names, operands)]


def _extra_operands(k_scale, v_scale, k_norm_weight, scale_pool=None) -> tuple:
    """The optional operands as given: a Python number is a per-tensor scale."""
    k_scale, v_scale = _scale_operand("k_scale", k_scale), _scale_operand("v_scale", v_scale)
    if k_norm_weight is not None:
        k_norm_weight = _array_operand("k_norm_weight", k_norm_weight)
    if scale_pool is not None:
        scale_pool = _array_operand("scale_pool", scale_pool)
    return k_scale, v_scale, k_norm_weight, scale_pool


def _extras(past_key_value, k_scale, v_scale, k_norm_weight, scale_pool=None) -> list:
    """The operands after the base ones, in the FFI order: the scales (a pool format with
    scales: the static pair, or the scale pool), the weight."""
    out = []
    if scale_pool is not None:
        out.append(scale_pool)
    elif takes_scales(past_key_value.dtype):
        out += [k_scale, v_scale]
    if k_norm_weight is not None:
        out.append(k_norm_weight)
    return out


class _Aval:
    """An operand's shape and dtype, for the checks."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


def _signature(x):
    return None if x is None else (tuple(x.shape), np.dtype(x.dtype))


def _check_cached(form, attributes: dict, base, extras):
    """The form's checks, cached per operand shapes and dtypes: an eager call in a decode loop
    checks the same signature every step."""
    _check_signature(
        form,
        tuple(sorted(attributes.items())),
        tuple(map(_signature, base)),
        tuple(map(_signature, extras)),
    )


@functools.lru_cache(maxsize=256)
def _check_signature(form, attributes, base, extras):
    base = [_Aval(*sig) for sig in base]
    k_scale, v_scale, k_norm_weight, scale_pool = (
        None if sig is None else _Aval(*sig) for sig in extras
    )
    check_form(
        form,
        base,
        k_scale=k_scale,
        v_scale=v_scale,
        k_norm_weight=k_norm_weight,
        scale_pool=scale_pool,
        **dict(attributes),
    )


def _update(form, base, extras, attributes: dict, params: dict):
    """Checks and binds one call of ``form``: ``extras`` are the keyword operands as given
    (k_scale, v_scale, k_norm_weight, scale_pool). With ``scale_pool`` the call's primitive has
    two results, returned as ``(pool, scale_pool)``."""
    k_scale, v_scale, k_norm_weight, scale_pool = _extra_operands(*extras)
    _check_cached(form, attributes, base, (k_scale, v_scale, k_norm_weight, scale_pool))
    operands = [*base, *_extras(base[POOL_OPERAND], k_scale, v_scale, k_norm_weight, scale_pool)]
    plain, dynamic = _FORM_PRIMITIVE[form]
    if scale_pool is None:
        return _bind(plain, operands, params)
    pool, scales = _bind(dynamic, operands, dict(params, scale_pool=True))
    return pool, scales


def _norm_params(k_norm_weight, v_norm, norm_eps) -> dict:
    return dict(
        k_norm=k_norm_weight is not None,
        v_norm=check_bool_attr("v_norm", v_norm),
        norm_eps=check_norm_eps(norm_eps),
    )


# ---- the slot contract -----------------------------------------------------------------------


# Long: its docstring is the API's reference (every operand's shape, dtype and rule).
def target_kv_cache_update(
    k_delta: jax.Array,
    v_delta: jax.Array,
    past_key_value: jax.Array,
    rope_cos_sin: jax.Array,
    delta_start_positions: jax.Array,
    delta_lengths: jax.Array,
    *,
    pages_per_slot: int,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    k_norm_weight: jax.Array | None = None,
    norm_eps: float = DEFAULT_NORM_EPS,
    v_norm: bool = False,
    scale_pool: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Writes the accepted tokens' keys (with RoPE) and values into the paged KV pool (the slot
    contract, TensorRT Edge-LLM 0.10).

    Args:
      k_delta: ``[B, L, H, D]`` float16, bfloat16 or float32 keys of the accepted tokens
        (no RoPE yet), row-major.
      v_delta: ``[B, L, H, D]``, the values, same dtype as ``k_delta``.
      past_key_value: ``[2, numPages, P, H, D]`` pool, plane 0 = K, plane 1 = V; float16,
        bfloat16, float32, float8_e4m3fn, float8_e5m2 or int8 (any delta dtype with any pool
        dtype); or an int4 pool, uint8 ``[2, numPages, P, H, D/2]`` with two 4-bit elements per
        byte (element ``2j`` in the low nibble), which takes ``scale_pool`` only (SPEC.md, "int4
        pools").
        Slot ``b`` owns pages ``[b * pages_per_slot, (b + 1) * pages_per_slot)``.
      rope_cos_sin: ``[Rb, S, R]`` float32, ``Rb`` 1 or B; row ``pos`` holds ``R/2`` cosines then
        ``R/2`` sines (rotate-half RoPE on the first ``R`` channels; ``R`` even, ``<= D``).
      delta_start_positions: ``[B]`` int32, the position of each sequence's first new token.
      delta_lengths: ``[B]`` int32, how many of the ``L`` tokens are real (the rest is padding).
        Index operands must be int32 arrays already (they are never converted).
      pages_per_slot: static int > 0; ``numPages % pages_per_slot == 0``, ``B <= numPages /
        pages_per_slot`` and ``S <= pages_per_slot * P``.
      k_scale, v_scale: float32 ``[]`` (or ``[1]``) per tensor or ``[H]`` per KV head, both the
        same shape; required for an FP8 pool, an error otherwise. A Python float is a per-tensor
        scale. The stored byte is ``fp8(y * (1 / scale))``, saturating (SPEC.md, "FP8 pools").
      k_norm_weight: ``[D]`` in the delta dtype: turns on the fused RMS norm of each key head
        before RoPE (HF ``RMSNorm`` with this weight).
      norm_eps: static float > 0, the norms' epsilon (used as float32).
      v_norm: static bool: a weightless RMS norm of each value head.
      scale_pool: float32 ``[2, numPages, P, H]`` (the pool's dims without ``D``): per-token-head
        dynamic scales of an int8, float8_e4m3fn or float8_e5m2 pool (required for an int4
        pool, ``qmax = 7``), in place of ``k_scale`` and ``v_scale`` (giving both is an
        error). Each written row (plane, token, head) gets
        ``s = max_j |y_j| / qmax`` at its place in ``scale_pool``, its elements stored as
        ``y / s`` in the pool's conversion (SPEC.md, "Dynamic scales"); rows not written keep
        their scales. Updated in place like the pool (donate both).

    Returns:
      ``present_key_value``: the pool with, for each ``b, t < delta_lengths[b]`` whose position
      ``pos = delta_start_positions[b] + t`` lies in ``[0, pages_per_slot * P)``, the rotated key
      and the value written at page ``b * pages_per_slot + pos // P``, row ``pos % P``
      (keys past ``S`` are written unrotated). Every other element is unchanged. See SPEC.md.
      With ``scale_pool``: ``(present_key_value, present_scale_pool)``.

    Layer-batched form: with a leading ``layers`` axis on ``k_delta``/``v_delta``
    (``[layers, B, L, H, D]``) and the pool (``[layers, 2, numPages, P, H, D]``), and optionally
    on ``rope_cos_sin`` (``[layers, Rb, S, R]``), the positions/lengths (``[layers, B]``, both or
    neither), the scales (``[layers, 1]`` or ``[layers, H]``) and ``k_norm_weight``
    (``[layers, D]``), all layers are updated by one kernel launch. ``jax.vmap`` over this
    function produces that form.

    In place: the pool is an aliased operand of the custom call. Under
    ``jax.jit(..., donate_argnums=...)`` with the pool donated, the update is done in the pool's
    own buffer and the compiled program holds no copy of it. Without donation XLA must keep the
    caller's pool intact, so it copies the pool first (one pool-sized copy per call).

    Sharded: under ``jax.jit`` with ``NamedSharding`` operands, a pool split on its KV heads,
    in whole slots (then ``B * pages_per_slot == numPages``) and/or on layers is updated per
    shard with no communication; the output keeps the pool's sharding. Other splits of the pool
    are an error. See ``jax_dflash.sharding``.

    Raises:
      TypeError, ValueError: at trace time, naming the argument, what was expected and what was
        given. Runtime data (positions, lengths) is never trusted: values that point outside the
        slot write nothing.
    """
    base = [
        *_delta_operands(k_delta, v_delta, past_key_value, rope_cos_sin),
        _index_operand("delta_start_positions", delta_start_positions),
        _index_operand("delta_lengths", delta_lengths),
    ]
    # Checked before binding (so nothing is converted first); primitive caches treat 2.0 and 2
    # as the same parameter, so the static values are normalised too.
    pages_per_slot = check_pages_per_slot(pages_per_slot)
    params = _norm_params(k_norm_weight, v_norm, norm_eps)
    attributes = dict(pages_per_slot=pages_per_slot)
    extras = (k_scale, v_scale, k_norm_weight, scale_pool)
    return _update("slot", base, extras, attributes, dict(attributes, **params))


def target_kv_cache_update_paged(
    k_delta: jax.Array,
    v_delta: jax.Array,
    past_key_value: jax.Array,
    rope_cos_sin: jax.Array,
    delta_positions: jax.Array,
    delta_token_to_sequence: jax.Array,
    kv_page_table: jax.Array,
    *,
    ring: bool | tuple[bool, ...] = False,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    k_norm_weight: jax.Array | None = None,
    norm_eps: float = DEFAULT_NORM_EPS,
    v_norm: bool = False,
    scale_pool: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Writes token-major ragged keys (with RoPE) and values into the pool through a page table
    (the paged contract, TensorRT Edge-LLM 0.11).

    Args:
      k_delta: ``[T, H, D]`` float16, bfloat16 or float32 keys, one row per token (no RoPE yet).
      v_delta: ``[T, H, D]``, the values, same dtype as ``k_delta``.
      past_key_value: ``[2, N, P, H, D]`` pool, plane 0 = K, plane 1 = V; float16, bfloat16,
        float32, float8_e4m3fn, float8_e5m2 or int8; or int4, uint8 ``[2, N, P, H, D/2]`` (with
        ``scale_pool``), as in :func:`target_kv_cache_update`.
      rope_cos_sin: ``[T, R]`` float32, token-aligned: row ``t`` (``R/2`` cosines then ``R/2``
        sines) always rotates token ``t``'s key (``R`` even, ``<= D``). ``jax_dflash.gather_rope``
        builds it from a ``[Rb, S, R]`` table.
      delta_positions: ``[T]`` int32, the absolute position of token ``t`` (negative: nothing is
        written).
      delta_token_to_sequence: ``[T]`` int32, the sequence owning token ``t`` (-1, or anything
        outside ``[0, B)``: padding). ``jax_dflash.token_positions`` builds both from per-sequence
        starts and lengths.
      kv_page_table: ``[B, 2, M]`` int32, ``M <= N``: ``[b, 0, i]`` is the K page of sequence
        ``b``'s ``i``-th page of ``P`` tokens, valid in ``[0, N)``; ``[b, 1, i]`` its V page,
        valid in ``[N, 2N)`` (V ids offset by ``N``). ``jax_dflash.identity_page_table`` gives the
        slot layout. Index operands must be int32 arrays already (they are never converted).
      ring: static bool: page slot ``(p // P) % M`` instead of ``p // P`` (a sliding window of
        ``M`` pages per sequence; without it ``p // P >= M`` writes nothing). In the
        layer-batched form also a tuple of static bools, one per layer: layer ``l`` takes the
        ring where ``ring[l]`` is true, so the sliding-window and full layers of one draft are
        written by one launch (a bool is every layer's).
      k_scale, v_scale, k_norm_weight, norm_eps, v_norm, scale_pool: as in
        :func:`target_kv_cache_update` (with ``scale_pool`` the result is
        ``(present_key_value, present_scale_pool)``).

    Returns:
      ``present_key_value``: the pool with, for each token whose owner ``b`` is in ``[0, B)``,
      position ``p >= 0``, page slot ``i`` in ``[0, M)`` and page ids ``kp = table[b, 0, i]`` in
      ``[0, N)`` and ``vp = table[b, 1, i]`` in ``[N, 2N)``, the rotated key written at
      ``[0, kp, p % P]`` and the value at ``[1, vp - N, p % P]``. Every other element is
      unchanged. Two tokens addressing one row store an unspecified one of them. See SPEC.md.

    Layer-batched form: a leading ``layers`` axis on ``k_delta``/``v_delta`` (``[layers, T, H,
    D]``) and the pool, optionally on ``rope_cos_sin`` (``[layers, T, R]``), positions/owners
    (``[layers, T]``, both or neither), the table (``[layers, B, 2, M]``), the scales and the
    weight, and a per-layer ``ring``; one launch. ``jax.vmap`` produces it (the vmapped call's
    bool ``ring`` then holds for every layer).

    In place and donation: as in :func:`target_kv_cache_update`. Sharded: the pool may be split
    on its KV heads and on layers only (the table addresses any page, so the pages cannot be
    split); see ``jax_dflash.sharding``.

    Raises:
      TypeError, ValueError: at trace time, naming the argument, what was expected and what was
        given. Runtime data (positions, owners, page ids) is never trusted.
    """
    base = [
        *_delta_operands(k_delta, v_delta, past_key_value, rope_cos_sin),
        _index_operand("delta_positions", delta_positions),
        _index_operand("delta_token_to_sequence", delta_token_to_sequence),
        _index_operand("kv_page_table", kv_page_table),
    ]
    params = dict(ring=check_ring_attr(ring), **_norm_params(k_norm_weight, v_norm, norm_eps))
    extras = (k_scale, v_scale, k_norm_weight, scale_pool)
    return _update("paged", base, extras, dict(ring=params["ring"]), params)


def target_kv_cache_update_slots(
    k_delta: jax.Array,
    v_delta: jax.Array,
    past_key_value: jax.Array,
    rope_cos_sin: jax.Array,
    slot_mapping: jax.Array,
    *,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    k_norm_weight: jax.Array | None = None,
    norm_eps: float = DEFAULT_NORM_EPS,
    v_norm: bool = False,
    scale_pool: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Writes token-major keys (with RoPE) and values through a flat slot per token (the slot
    mapping of vLLM's ``reshape_and_cache_flash``, SGLang's ``out_cache_loc``).

    Args:
      k_delta, v_delta: ``[T, H, D]`` float16, bfloat16 or float32 (the same dtype).
      past_key_value: ``[2, N, P, H, D]`` pool; ``pool[0]`` and ``pool[1]`` are vLLM's
        ``[num_blocks, block_size, H, D]`` K and V caches (an int4 pool: uint8
        ``[2, N, P, H, D/2]`` with ``scale_pool``, as in :func:`target_kv_cache_update`).
      rope_cos_sin: ``[T, R]`` float32, token-aligned (row ``t`` rotates token ``t``'s key).
      slot_mapping: ``[T]`` int32 or int64 (int64 with ``jax_enable_x64`` on): token ``t``
        lands at ``pool[:, s // P, s % P]`` with ``s = slot_mapping[t]``; ``s < 0`` or
        ``s >= N * P`` writes nothing (neither plane). Slots are never narrowed.
      k_scale, v_scale, k_norm_weight, norm_eps, v_norm, scale_pool: as in
        :func:`target_kv_cache_update` (with ``scale_pool`` the result is
        ``(present_key_value, present_scale_pool)``).

    Returns:
      ``present_key_value``: the pool with every addressed row written, the rest unchanged. Of
      tokens with one slot, the last one's rows are stored on CPU; on a GPU each element is one of
      theirs (SPEC.md, "The slot-mapping form"). The layer-batched form (a leading layers axis,
      ``slot_mapping`` shared or ``[layers, T]``) is one launch; ``jax.vmap`` produces it. Runs on
      CPU; its CUDA kernel is not written yet.
    """
    base = [
        *_delta_operands(k_delta, v_delta, past_key_value, rope_cos_sin),
        _slot_operand("slot_mapping", slot_mapping),
    ]
    params = _norm_params(k_norm_weight, v_norm, norm_eps)
    extras = (k_scale, v_scale, k_norm_weight, scale_pool)
    return _update("slot_mapping", base, extras, {}, params)


# ---- abstract evaluation ---------------------------------------------------------------------


def _abstract_eval_for(form):
    def abstract_eval(*operands, **params):
        check_operands(operands, form, params)
        pool = operands[POOL_OPERAND]
        result = jax.core.ShapedArray(pool.shape, pool.dtype)
        if not params.get("scale_pool", False):
            return result
        scales = operands[len(FORMS[form]["operands"])]  # the first extra
        return [result, jax.core.ShapedArray(scales.shape, scales.dtype)]

    return abstract_eval


# ---- eager calls: one jitted callable per primitive and params --------------------------------


@functools.cache
def _jitted(primitive, params: tuple):
    # jax.jit caches compilations per callable: a fresh callable per call would retrace and
    # recompile every time, so the callable is cached per params.
    return jax.jit(functools.partial(primitive.bind, **dict(params)))


def _call_jitted(primitive, operands, params):
    fn = _jitted(primitive, tuple(sorted(params.items())))
    if jax.config.jax_disable_jit:
        # The op exists only as a compiled call; under disable_jit the jitted callable would
        # bind the primitive again, which lands here again.
        with jax.disable_jit(False):
            return fn(*operands)
    return fn(*operands)


def _bind(primitive, operands, params):
    if _trace_state_clean is not None and _trace_state_clean():
        # Eager: what bind would reach through the eval trace and the impl rule, directly.
        return _call_jitted(primitive, operands, params)
    return primitive.bind(*operands, **params)


def _impl_for(primitive):
    def impl(*operands, **params):
        return _call_jitted(primitive, operands, params)

    return impl


# ---- batching: vmap over layers becomes the layer-batched form ---------------------------------

# Kind of each operand, from the form's descriptor: "always" (k, v, pool: per layer in the layered
# form), an int n (shared rank n, per layer n + 1), "scale" (shared [] / [1] / [H], per layer
# [layers, 1] / [layers, H]). The form's index operands share one layout (both shared or both per
# layer), as do the scales.
_BASE_POOL_RANK = 5


def _base_kinds(form: str) -> tuple:
    descriptor = FORMS[form]
    return tuple(
        "always" if role in ("k_delta", "v_delta", "pool") else dims.count(",") + 1
        for role, dims in zip(descriptor["operand_roles"], descriptor["operand_dims"])
    )


def _index_group(form: str) -> tuple[int, ...]:
    return tuple(i for i, role in enumerate(FORMS[form]["operand_roles"]) if role == "index")


def _kinds(base_kinds, n_operands, scaled, k_norm, scale_pool=False):
    kinds = list(base_kinds)
    if scale_pool:  # the pool's dims without D: per layer in the layered form, like the pool
        kinds.append("always")
    elif scaled:
        kinds += ["scale", "scale"]
    if k_norm:
        kinds.append(1)
    assert len(kinds) == n_operands, (kinds, n_operands)
    return kinds


def _as_per_layer(x, kind, size):
    """``x`` (shared form, unbatched) broadcast to ``[size, ...]`` per layer."""
    if kind == "scale":
        x = jnp.reshape(x, (1, x.size if x.ndim else 1))
        return jnp.broadcast_to(x, (size, x.shape[1]))
    return jnp.broadcast_to(x, (size, *x.shape))


def _batching_rule_for(primitive, form: str):
    base_kinds, base = _base_kinds(form), len(FORMS[form]["operands"])
    groups = (_index_group(form),)

    def rule(args, dims, **params):
        size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
        args = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims)]
        mapped = [d is not None for d in dims]
        pool = args[POOL_OPERAND]
        dynamic = params.get("scale_pool", False)
        scaled = takes_scales(pool.dtype) and not dynamic
        kinds = _kinds(base_kinds, len(args), scaled, params["k_norm"], dynamic)
        groups_all = list(groups) + ([(base, base + 1)] if scaled else [])
        inner_pool_rank = pool.ndim - mapped[POOL_OPERAND]
        if inner_pool_rank == _BASE_POOL_RANK + 1:
            return _nested(primitive, args, mapped, kinds, size, params)
        if isinstance(params.get("ring"), tuple):
            # Per-layer rings on one layer's call (a hand-bound primitive): the core's refusal.
            inner = [_Aval(x.shape[1:] if m else x.shape, x.dtype) for x, m in zip(args, mapped)]
            check_operands(inner, form, params)

        per_layer = [m or k == "always" for m, k in zip(mapped, kinds)]
        for group in groups_all:
            if any(per_layer[i] for i in group):
                for i in group:
                    per_layer[i] = True
        out = []
        for x, m, pl, kind in zip(args, mapped, per_layer, kinds):
            if m:
                if kind == "scale" and x.ndim == 1:
                    x = x[:, None]  # a per-layer scalar scale is [layers, 1]
            elif pl:
                x = _as_per_layer(x, kind, size)
            out.append(x)
        result = primitive.bind(*out, **params)
        return result, [0] * len(result) if primitive.multiple_results else 0

    return rule


def _nested(primitive, args, mapped, kinds, size, params):
    """vmap over an already layer-batched call: fold both axes into one layer axis."""
    pool = args[POOL_OPERAND]
    layers = pool.shape[1] if mapped[POOL_OPERAND] else pool.shape[0]
    out = []
    for x, m, kind in zip(args, mapped, kinds):
        if not m:
            x = jnp.broadcast_to(x, (size, *x.shape))
        inner_rank = x.ndim - 1
        if kind == "scale":
            if inner_rank < 2:  # shared [] / [1] / [H] -> [size, layers, 1 or H]
                x = jnp.reshape(x, (size, 1, x[0].size if inner_rank else 1))
                x = jnp.broadcast_to(x, (size, layers, x.shape[2]))
        elif kind != "always" and inner_rank == kind:  # shared -> per layer
            x = jnp.broadcast_to(x[:, None], (size, layers, *x.shape[1:]))
        out.append(x.reshape(size * layers, *x.shape[2:]))
    if isinstance(params.get("ring"), tuple):  # layer s * layers + l is layer l of its call
        params = dict(params, ring=params["ring"] * size)
    result = primitive.bind(*out, **params)
    if primitive.multiple_results:
        return [r.reshape(size, layers, *r.shape[1:]) for r in result], [0] * len(result)
    return result.reshape(size, layers, *result.shape[1:]), 0


# ---- each form's primitive: its rules, registered alike ---------------------------------------

# Each form's primitives: its plain call, and its call with per-token-head dynamic scales.
_FORM_PRIMITIVES = (
    (
        "slot",
        target_kv_cache_update_p,
        target_kv_cache_update_scale_pool_p,
        target_kv_cache_update,
    ),
    (
        "paged",
        target_kv_cache_update_paged_p,
        target_kv_cache_update_paged_scale_pool_p,
        target_kv_cache_update_paged,
    ),
    (
        "slot_mapping",
        target_kv_cache_update_slots_p,
        target_kv_cache_update_slots_scale_pool_p,
        target_kv_cache_update_slots,
    ),
)
_FORM_PRIMITIVE = {form: (plain, dynamic) for form, plain, dynamic, _ in _FORM_PRIMITIVES}
for _form, _plain, _dynamic, _public in _FORM_PRIMITIVES:
    for _primitive in (_plain, _dynamic):
        _primitive.def_abstract_eval(_abstract_eval_for(_form))
        _primitive.def_impl(_impl_for(_primitive))
        # Per shard under jax.jit sharding (custom partitioning), the plain FFI call otherwise.
        sharding.register_lowerings(
            _primitive,
            lowering.lowering_for(_form, scale_pool=_primitive is _dynamic),
            platforms=("cpu", "cuda"),
            contract=_form,
            op_name=_public.__name__,
        )
        batching.primitive_batchers[_primitive] = _batching_rule_for(_primitive, _form)
