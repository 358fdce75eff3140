"""The draft-side step as a DFlash engine writes it, in one jitted function.

Target features of the accepted tokens (the target's hidden states of a few layers,
concatenated) -> the draft's feature projection ``fc`` and its RMSNorm -> every draft layer's
k and v projections as ONE matmul -> the update, with the fused k-norm and the pool dtype's
scales, all layers in one launch (layer-batched, pool donated). The features of a token are a
pure function of ``(stream, position)`` (a PRNG draw), so any token's keys and values can be
recomputed later without the cache (the read-back check does that).

The unfused variants: ``fused_norm=False`` runs the k-norm in jnp and then the op; the
baseline (``--compare``) is what a JAX user writes without this project: jnp RMSNorm, jnp
RoPE, FP8 rounding by ``astype`` after a jnp saturation, and one ``.at[].set`` per layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_dflash.contract import DEFAULT_NORM_EPS

# Calibration headroom of the FP8 scales: the amax of the calibration data maps to half the
# format's largest value, so a later token up to twice as large still does not saturate.
FP8_HEADROOM = 2.0
CALIBRATION_TOKENS = 256
CALIBRATION_STREAM = 2**30  # a feature stream no sequence or prompt uses
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "int8": 127.0}


class DraftWeights(NamedTuple):
    """The draft's weights that the step reads (device arrays, delta dtype)."""

    fc: jax.Array  # [features, hidden]
    hidden_norm: jax.Array  # [hidden]
    kv_proj: jax.Array  # [hidden, layers * 2 * H * D]: every layer's k_proj then v_proj
    k_norm: jax.Array  # [layers, D]
    seed: jax.Array  # uint32 seed of the target features


@dataclasses.dataclass(frozen=True)
class Geometry:
    layers: int
    heads: int
    head_dim: int
    rotary_dim: int
    feature_size: int
    hidden_size: int
    norm_eps: float = DEFAULT_NORM_EPS  # the draft's rms_norm_eps: its hidden norm and k-norm


def random_weights(rng: np.random.Generator, g: Geometry, dtype) -> dict[str, np.ndarray]:
    """Host weights with unit-scale outputs (fan-in scaled normals); norm weights near 1."""

    def normal(shape, fan_in):
        return (rng.standard_normal(shape, np.float32) / np.sqrt(fan_in)).astype(dtype)

    return dict(
        fc=normal((g.feature_size, g.hidden_size), g.feature_size),
        hidden_norm=(1.0 + 0.1 * rng.standard_normal(g.hidden_size, np.float32)).astype(dtype),
        kv_proj=normal((g.hidden_size, g.layers * 2 * g.heads * g.head_dim), g.hidden_size),
        k_norm=(1.0 + 0.1 * rng.standard_normal((g.layers, g.head_dim), np.float32)).astype(dtype),
    )


def rms_norm(x, weight=None, eps=DEFAULT_NORM_EPS):
    """HF RMSNorm: normalize in float32, round to the input dtype, times the weight in it."""
    xf = x.astype(jnp.float32)
    u = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return u if weight is None else u * weight.astype(x.dtype)


def _mix(h):
    """murmur3's 32-bit finalizer: every input bit reaches every output bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def features(seed, streams, positions, size: int, dtype):
    """``[T, size]`` target features of the tokens ``(stream, position)``: a hash of the
    stream, position and channel mapped to a unit-variance uniform value (cheap to compile and
    to run, and the same wherever it is computed)."""
    s = _mix(jnp.maximum(streams, 0).astype(jnp.uint32) * jnp.uint32(0x9E3779B1) ^ seed)
    p = _mix(jnp.maximum(positions, 0).astype(jnp.uint32) + s)
    c = jnp.arange(size, dtype=jnp.uint32) * jnp.uint32(0x27D4EB2F)
    h = _mix(p[:, None] ^ c[None, :])
    u = (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)  # [0, 1), exact
    return ((u - 0.5) * jnp.float32(np.sqrt(12.0))).astype(dtype)


def project(w: DraftWeights, streams, positions, g: Geometry):
    """Features -> fc -> hidden norm -> all layers' k/v in one matmul: ``[layers, T, H, D]``
    keys (not yet k-normed, no RoPE) and values, in the delta dtype."""
    dtype = w.fc.dtype
    x = features(w.seed, streams, positions, g.feature_size, dtype)
    h = jnp.matmul(x, w.fc, preferred_element_type=jnp.float32).astype(dtype)
    h = rms_norm(h, w.hidden_norm, g.norm_eps)
    kv = jnp.matmul(h, w.kv_proj, preferred_element_type=jnp.float32).astype(dtype)
    kv = kv.reshape(-1, g.layers, 2, g.heads, g.head_dim)
    k = jnp.moveaxis(kv[:, :, 0], 1, 0)
    v = jnp.moveaxis(kv[:, :, 1], 1, 0)
    return k, v


def k_normed(w: DraftWeights, k, eps=DEFAULT_NORM_EPS):
    return rms_norm(k, w.k_norm[:, None, None, :], eps)


# ---- FP8 scales ---------------------------------------------------------------------------------


def calibrate_scales(w: DraftWeights, g: Geometry, pool_dtype: str):
    """Per layer and KV head ``k_scale``, ``v_scale`` (float32 ``[layers, H]``) from the amax of
    calibration tokens' k-normed keys (RoPE can only move a value within its channel pair's
    norm, so the pair norm bounds the rotated key) and values, with ``FP8_HEADROOM``."""
    n = CALIBRATION_TOKENS
    streams = jnp.full((n,), CALIBRATION_STREAM, jnp.int32)
    k, v = project(w, streams, jnp.arange(n, dtype=jnp.int32), g)
    k = k_normed(w, k, g.norm_eps).astype(jnp.float32)
    half = g.rotary_dim // 2
    pair = jnp.sqrt(k[..., :half] ** 2 + k[..., half : g.rotary_dim] ** 2)
    k_amax = jnp.maximum(
        jnp.max(pair, axis=(1, 3)),
        jnp.max(jnp.abs(k[..., g.rotary_dim :]), axis=(1, 3), initial=0.0),
    )
    v_amax = jnp.max(jnp.abs(v.astype(jnp.float32)), axis=(1, 3))
    top = FP8_MAX[pool_dtype] / FP8_HEADROOM

    def scale(amax):
        return jnp.where(amax > 0, amax / top, 1.0).astype(jnp.float32)

    return scale(k_amax), scale(v_amax)


# ---- the steps ----------------------------------------------------------------------------------


class Constants(NamedTuple):
    """Everything a step reads and nobody writes (device arrays)."""

    weights: DraftWeights
    rope: jax.Array  # [1, S, R] float32
    k_scale: jax.Array | None  # [layers, H] float32 (FP8 pools)
    v_scale: jax.Array | None
    # Per-step addressing, stacked over the steps; one more row of padding for warm-up steps.
    lengths: jax.Array | None  # slot: [steps + 1, B]
    positions: jax.Array | None  # paged: [steps + 1, T]
    owners: jax.Array | None  # paged: [steps + 1, T]
    streams: jax.Array | None  # paged: [steps + 1, T]
    tables: jax.Array | None  # paged: [steps + 1, B, 2, M]


@dataclasses.dataclass(frozen=True)
class StepSpec:
    contract: str  # "slot" or "paged"
    geometry: Geometry
    batch: int
    block_size: int
    pages_per_slot: int | None = None  # slot
    ring: bool | tuple[bool, ...] = False  # paged: the op's ring, or one per layer (mixed)
    fused_norm: bool = True
    fp8: bool = False  # static per-head scales (FP8 and int8 pools)
    dynamic: bool = False  # a scale pool: the step's pools are (pool, scale_pool)


def _row(x, i):
    last = x.shape[0] - 1
    return jax.lax.dynamic_index_in_dim(x, jnp.minimum(i, last), keepdims=False)


def _slot_tokens(spec: StepSpec, positions):
    """Slot contract: token ``t`` of sequence ``b`` at ``positions[b] + t``; stream ``b``."""
    t = jnp.arange(spec.block_size, dtype=jnp.int32)
    pos = (positions[:, None] + t[None, :]).reshape(-1)
    streams = jnp.repeat(jnp.arange(spec.batch, dtype=jnp.int32), spec.block_size)
    return streams, pos


def _scale_kwargs(spec: StepSpec, consts: Constants) -> dict:
    return dict(k_scale=consts.k_scale, v_scale=consts.v_scale) if spec.fp8 else {}


def kernel_update(spec: StepSpec) -> Callable:
    """``(consts, pools, k, v, addressing) -> pools``: the op, fused or after a jnp k-norm."""
    import jax_dflash

    def update(consts: Constants, pools, k, v, addr):
        extra = _scale_kwargs(spec, consts)
        if spec.dynamic:
            pools, extra["scale_pool"] = pools
        if spec.fused_norm:
            extra.update(k_norm_weight=consts.weights.k_norm, norm_eps=spec.geometry.norm_eps)
        if spec.contract == "slot":
            positions, lengths = addr
            shape = (spec.geometry.layers, spec.batch, spec.block_size, *k.shape[2:])
            return jax_dflash.target_kv_cache_update(
                k.reshape(shape),
                v.reshape(shape),
                pools,
                consts.rope,
                positions,
                lengths,
                pages_per_slot=spec.pages_per_slot,
                **extra,
            )
        positions, owners, table = addr
        rope = jax_dflash.gather_rope(consts.rope, positions, owners)
        return jax_dflash.target_kv_cache_update_paged(
            k, v, pools, rope, positions, owners, table, ring=spec.ring, **extra
        )

    return update


def _quantize(y, pool_dtype, inv_scale):
    """What a JAX user writes for an FP8 cache: scale, saturate in jnp, ``astype``; for an
    int8 one: scale, round, clip to +-127."""
    if inv_scale is None:
        return y.astype(pool_dtype)
    if jnp.dtype(pool_dtype) == jnp.int8:
        return jnp.clip(jnp.round(y * inv_scale), -127, 127).astype(pool_dtype)
    top = float(jnp.finfo(pool_dtype).max)
    return jnp.clip(y * inv_scale, -top, top).astype(pool_dtype)


def rope_jnp(k, rows, rotary_dim):
    """Rotate-half RoPE in jnp on the first ``rotary_dim`` channels of ``k`` ``[..., T, H, D]``
    with token-aligned rows ``[..., T, R]`` (``R/2`` cosines then ``R/2`` sines)."""
    half = rotary_dim // 2
    c, s = rows[..., None, :half], rows[..., None, half:rotary_dim]
    x1, x2 = k[..., :half], k[..., half:rotary_dim]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, k[..., rotary_dim:]], -1)


def baseline_update(spec: StepSpec) -> Callable:
    """The unfused update in jnp: RoPE, quantization and a ``.at[].set`` per layer."""
    g = spec.geometry

    def update(consts: Constants, pools, k, v, addr):
        num_pages, page_size = pools.shape[2], pools.shape[3]
        rope = consts.rope[0]
        seq_len = rope.shape[0]
        if spec.contract == "slot":
            positions, lengths = addr
            t = jnp.arange(spec.block_size, dtype=jnp.int32)
            pos = (positions[:, None] + t[None, :]).reshape(-1)
            cap = spec.pages_per_slot * page_size
            valid = (t[None, :] < lengths[:, None]).reshape(-1) & (pos >= 0) & (pos < cap)
            slot = jnp.repeat(jnp.arange(spec.batch, dtype=jnp.int32), spec.block_size)
            k_row = v_row = jnp.where(valid, slot * cap + pos, num_pages * page_size)
        else:
            pos, owners, table = addr
            if isinstance(spec.ring, tuple):  # a table and a ring per layer
                per_layer = [
                    _paged_rows(pos, owners, table[n], ring, num_pages, page_size)
                    for n, ring in enumerate(spec.ring)
                ]
                k_row, v_row = (jnp.stack(r) for r in zip(*per_layer))
            else:
                k_row, v_row = _paged_rows(pos, owners, table, spec.ring, num_pages, page_size)
        rows = rope[jnp.clip(pos, 0, seq_len - 1)] * ((pos >= 0) & (pos < seq_len))[:, None]
        k = k_normed(consts.weights, k, g.norm_eps)  # jnp RMSNorm, as the model code does
        y = rope_jnp(k.astype(jnp.float32), rows[None], g.rotary_dim)
        inv_k = inv_v = None
        if spec.fp8:
            inv_k = (1.0 / consts.k_scale)[:, None, :, None]
            inv_v = (1.0 / consts.v_scale)[:, None, :, None]
        k_q = _quantize(y, pools.dtype, inv_k)
        v_q = _quantize(v.astype(jnp.float32) if spec.fp8 else v, pools.dtype, inv_v)
        flat = pools.reshape(g.layers, 2, num_pages * page_size, g.heads, g.head_dim)
        k_row, v_row = (jnp.broadcast_to(r, (g.layers, r.shape[-1])) for r in (k_row, v_row))
        for layer in range(g.layers):
            flat = flat.at[layer, 0, k_row[layer]].set(k_q[layer], mode="drop")
            flat = flat.at[layer, 1, v_row[layer]].set(v_q[layer], mode="drop")
        return flat.reshape(pools.shape)

    return update


def _paged_rows(pos, owners, table, ring: bool, num_pages: int, page_size: int):
    """The flat pool rows ``[T]`` of the tokens' keys and values through a ``[B, 2, M]`` table,
    ``num_pages * page_size`` (dropped by the scatter) where the paged contract writes nothing."""
    batch, _, table_pages = table.shape
    i = pos // page_size
    if ring:
        i = i % table_pages
    ok = (owners >= 0) & (owners < batch) & (pos >= 0) & (i < table_pages)
    o, ii = jnp.clip(owners, 0, batch - 1), jnp.clip(i, 0, table_pages - 1)
    kp, vp = table[o, 0, ii], table[o, 1, ii] - num_pages
    ok &= (kp >= 0) & (kp < num_pages) & (vp >= 0) & (vp < num_pages)
    row = pos % page_size
    k_row = jnp.where(ok, kp * page_size + row, num_pages * page_size)
    v_row = jnp.where(ok, vp * page_size + row, num_pages * page_size)
    return k_row, v_row


IMPLEMENTATIONS = {"kernel": kernel_update, "baseline": baseline_update}


def norms_in_step(spec: StepSpec, impl: str) -> bool:
    """Whether the k-norm runs in the step before the update (the kernel without the fused
    norm); otherwise it is part of the update (the fused op, or the jnp baseline's)."""
    return impl == "kernel" and not spec.fused_norm


def make_step(spec: StepSpec, impl: str, *, with_update: bool = True) -> Callable:
    """One decoding step ``(state, consts) -> (state, (k, v))``. ``with_update=False`` is the
    same step minus the update (the pools pass through), which times the update's share.

    State: slot ``(pools, step, positions)``, paged ``(pools, step)``. The outputs are the
    deltas the update was given (keys not yet normed unless the step norms them)."""
    g = spec.geometry
    update = IMPLEMENTATIONS[impl](spec)
    norm_first = norms_in_step(spec, impl)

    def step(state, consts: Constants):
        pools, i = state[0], state[1]
        if spec.contract == "slot":
            positions = state[2]
            lengths = _row(consts.lengths, i)
            streams, token_pos = _slot_tokens(spec, positions)
            addr = (positions, lengths)
            rest = (positions + lengths,)
        else:
            token_pos, owners = _row(consts.positions, i), _row(consts.owners, i)
            streams = _row(consts.streams, i)
            addr = (token_pos, owners, _row(consts.tables, i))
            rest = ()
        k, v = project(consts.weights, streams, token_pos, g)
        if norm_first:
            k = k_normed(consts.weights, k, g.norm_eps)
        # Materialise the deltas before the update: without the barrier XLA may fuse the
        # projection into a jnp update and skip the rounding to the delta dtype.
        k, v = jax.lax.optimization_barrier((k, v))
        if with_update:
            pools = update(consts, pools, k, v, addr)
        return (pools, i + 1, *rest), (k, v)

    return step
