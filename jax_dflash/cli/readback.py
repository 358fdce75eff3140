"""The read-back check: does attention over the cache equal attention without one?

For a sample of sequences, plain-jnp attention of draft queries over the keys and values read
from the pool (through the slot layout or the page table, dequantized with the scales) is
compared with the same attention over keys and values recomputed from the sequence's features
(norm, RoPE, no cache, float32). The two differ only by roundings, bounded per element:

- a key channel: 2 ulps of the delta dtype (the fused norm may differ from the jnp one by one,
  SPEC.md "Fused norms"; one more for recomputing the projection), doubled through RoPE's
  channel pairs (``|cos|, |sin| <= 1``); then the store: half an ulp of the pool dtype
  (relative), half its smallest subnormal times the scale (absolute), and any saturation
  past the FP8 format's largest value;
- a value channel: 1 ulp of the delta dtype (recomputation), then the same store error.

With ``e`` those bounds, a score ``s_j = q . k_j / sqrt(D)`` is off by at most
``b_j = sum_i |q_i| e_ji / sqrt(D)`` (plus float32 dot-product rounding); the scores are checked
against ``b_j`` token by token, which catches one wrong key. The softmax moves each weight by a
factor within ``exp(+-2 max b)``, so the output ``o = sum_j p_j v_j`` is off by at most
``exp(4 max b) * sum_j p_j ((b_j + mean_p b) |v_j - o| + e_v,j)`` (the first term is the
weights' shift acting on the values' spread around ``o``, the second the values' own error),
plus float32 rounding of the sums. Queries: a few random ones (a draft's queries) and sharp
"probe" queries aimed at sampled positions (``q = beta sqrt(D) k_j / |k_j|^2`` scores token
``j`` at ``beta`` and puts most of the weight on it), so that a wrong value at a probed position
moves an output by far more than the bound; a wrong key anywhere shows in the scores.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

PROBE_SHARPNESS = 8.0  # the probed token's score; the others' stay near 0
F32_U = 2.0**-24


def unit_roundoff(dtype) -> float:
    """Half the distance from 1 to the next value: the relative error of round-to-nearest."""
    return float(jnp.finfo(dtype).eps) / 2


def half_smallest_subnormal(dtype) -> float:
    return float(jnp.finfo(dtype).smallest_subnormal) / 2


@dataclasses.dataclass
class SequenceView:
    """Where a sequence's cached tokens are: one entry per visible position."""

    label: str
    positions: np.ndarray  # [n]
    streams: np.ndarray  # [n] feature stream of each token
    k_pages: np.ndarray  # [n] page in plane 0
    v_pages: np.ndarray  # [n] page in plane 1 (the table's V id minus N)
    rows: np.ndarray  # [n]


def slot_view(label, b, start, end, pages_per_slot, page_size, stream) -> SequenceView:
    pos = np.arange(start, end, dtype=np.int64)
    pages = b * pages_per_slot + pos // page_size
    return SequenceView(label, pos, np.full(pos.shape, stream), pages, pages, pos % page_size)


def paged_view(label, table_row, positions, streams, page_size, num_pages, ring) -> SequenceView:
    """``table_row`` ``[2, M]``; positions must be held by the table (the window, with ring)."""
    pos = np.asarray(positions, np.int64)
    i = pos // page_size
    if ring:
        i = i % table_row.shape[1]
    return SequenceView(
        label,
        pos,
        np.asarray(streams),
        table_row[0, i].astype(np.int64),
        table_row[1, i].astype(np.int64) - num_pages,
        pos % page_size,
    )


@dataclasses.dataclass
class ReadbackResult:
    passed: bool
    sequences: int
    tokens: int
    queries: int
    worst_score_ratio: float  # largest |score difference| / its bound
    worst_output_ratio: float
    failure: str | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _stored_error(y, y_err, pool_dtype, scale):
    """Bound on |dequantized stored - y| given |kernel's y - y| <= y_err (float32 arrays)."""
    u = unit_roundoff(pool_dtype)
    tiny = half_smallest_subnormal(pool_dtype)
    scale = 1.0 if scale is None else scale
    reach = jnp.abs(y) + y_err
    err = y_err + u * reach + tiny * jnp.abs(scale)
    if jnp.issubdtype(pool_dtype, jnp.floating) and jnp.finfo(pool_dtype).bits == 8:
        top = float(jnp.finfo(pool_dtype).max) * jnp.abs(scale)
        err = err + jnp.maximum(reach - top, 0.0)  # saturation
    return err


def _attention(q, k, v, mask):
    """``q`` [Q, H, D], ``k``/``v`` [n, H, D] float32 -> scores [Q, H, n], weights, outputs;
    tokens outside ``mask`` get no weight."""
    d = q.shape[-1]
    scores = jnp.einsum("qhd,nhd->qhn", q, k) / jnp.sqrt(jnp.float32(d))
    scores = jnp.where(mask, scores, 0.0)
    p = jnp.where(mask, jnp.exp(scores - scores.max(-1, keepdims=True)), 0.0)
    p = p / p.sum(-1, keepdims=True)
    return scores, p, jnp.einsum("qhn,nhd->qhd", p, v)


def check_sequences(
    pools,
    views: list[SequenceView],
    recompute: Callable,
    *,
    delta_dtype,
    rotary_dim: int,
    k_scale=None,
    v_scale=None,
    rng: np.random.Generator,
    random_queries: int = 4,
    probes: int = 8,
) -> ReadbackResult:
    """Read-back check of ``views`` over the layer-batched ``pools`` (device array).

    ``recompute(streams, positions, at_least)`` returns float32 ``(normed_keys, keys, values)``, each
    ``[layers, n_padded, H, D]`` with ``n_padded >= n`` (padding to a few sizes keeps the
    compilations few): the k-normed keys before RoPE, after RoPE, and the values."""
    device = next(iter(pools.devices()))  # everything the check reads goes where the pool is

    def put(x):
        return jax.device_put(x, device)

    worst_s = worst_o = 0.0
    tokens = queries = 0
    failure = None
    longest = max((len(v.positions) for v in views), default=0)  # one padded size: one compile
    for view in views:
        n = len(view.positions)
        if n == 0:
            continue
        x, k_ref, v_ref = (put(a) for a in recompute(view.streams, view.positions, longest))
        layers, n_padded, heads, head_dim = k_ref.shape
        mask = np.arange(n_padded) < n
        q_random = rng.standard_normal((layers, random_queries, heads, head_dim), np.float32)
        picks = np.stack([rng.choice(n, size=probes, replace=n < probes) for _ in range(layers)])
        kp, vp, rows = (
            put(np.pad(a, (0, n_padded - n)).astype(np.int32))
            for a in (view.k_pages, view.v_pages, view.rows)
        )
        scales = None if k_scale is None else (put(k_scale), put(v_scale))
        rs, ro, where_s, where_o = _check_view(
            pools,
            kp,
            vp,
            rows,
            scales,
            x,
            k_ref,
            v_ref,
            put(q_random),
            put(picks),
            put(mask),
            rotary_dim=rotary_dim,
            u_delta=unit_roundoff(delta_dtype),
            pool_dtype=jnp.dtype(pools.dtype),
        )
        rs, ro = np.asarray(rs), np.asarray(ro)  # per layer
        for layer in range(layers):
            if (
                rs[layer] > 1 or ro[layer] > 1 or not np.isfinite(rs[layer] + ro[layer])
            ) and failure is None:
                bad_s = not rs[layer] <= 1
                if bad_s:
                    _, h, t = (int(i) for i in np.asarray(where_s)[layer])
                    where = f"position {int(view.positions[t])}, head {h}"
                else:
                    _, h = (int(i) for i in np.asarray(where_o)[layer])
                    where = f"head {h}"
                failure = (
                    f"{view.label}, layer {layer}: attention "
                    f"{'scores' if bad_s else 'outputs'} over the pool differ from the "
                    f"recomputed ones beyond the rounding bound ({where}; "
                    f"{max(rs[layer], ro[layer]):.3g} x the bound)"
                )
        worst_s, worst_o = max(worst_s, float(rs.max())), max(worst_o, float(ro.max()))
        queries += layers * (random_queries + picks.shape[1])
        tokens += n
    return ReadbackResult(failure is None, len(views), tokens, queries, worst_s, worst_o, failure)


@functools.partial(jax.jit, static_argnames=("rotary_dim", "u_delta", "pool_dtype"))
def _check_view(
    pools,
    kp,
    vp,
    rows,
    scales,
    x,
    k_ref,
    v_ref,
    q_random,
    picks,
    mask,
    *,
    rotary_dim,
    u_delta,
    pool_dtype,
):
    """Per layer: the worst score and output differences relative to their bounds, and where
    the worst ones are (``[query, head, token]`` / ``[query, head]``)."""
    k_stored = pools[:, 0, kp, rows].astype(jnp.float32)  # [layers, n, H, D]
    v_stored = pools[:, 1, vp, rows].astype(jnp.float32)
    ks = vs = None
    if scales is not None:
        ks, vs = scales[0][:, None, :, None], scales[1][:, None, :, None]
        k_stored, v_stored = k_stored * ks, v_stored * vs
    # Error bounds of the cached keys and values (see the module docstring).
    half = rotary_dim // 2
    ex = 4 * u_delta * jnp.abs(x)
    pair = ex[..., :half] + ex[..., half:rotary_dim]
    ey = jnp.concatenate([pair, pair, ex[..., rotary_dim:]], -1)
    swapped = jnp.concatenate([x[..., half:rotary_dim], x[..., :half], x[..., rotary_dim:]], -1)
    ey = ey + 4 * F32_U * (jnp.abs(x) + jnp.abs(swapped))
    ek = _stored_error(k_ref, ey, pool_dtype, ks)
    ev = _stored_error(v_ref, 2 * u_delta * jnp.abs(v_ref), pool_dtype, vs)
    # Padding tokens: zero keys, values and bounds, and no attention weight (below).
    keep = mask[None, :, None, None]
    k_stored, v_stored, k_ref, v_ref, ek, ev = (
        jnp.where(keep, a, 0.0) for a in (k_stored, v_stored, k_ref, v_ref, ek, ev)
    )
    layer = functools.partial(_check_layer, mask=mask)
    return jax.vmap(layer)(k_stored, v_stored, k_ref, v_ref, ek, ev, q_random, picks)


def _check_layer(k_stored, v_stored, k_ref, v_ref, ek, ev, q_random, picks, *, mask):
    n = mask.sum()
    head_dim = k_ref.shape[-1]
    root_d = jnp.sqrt(jnp.float32(head_dim))
    probe = k_ref[picks]  # [probes, H, D]
    norm2 = jnp.maximum((probe * probe).sum(-1, keepdims=True), 1e-30)
    q = jnp.concatenate([q_random, PROBE_SHARPNESS * probe / norm2 * root_d], 0)
    s_ref, p_ref, o_ref = _attention(q, k_ref, v_ref, mask)
    s, _, o = _attention(q, k_stored, v_stored, mask)
    aq = jnp.abs(q)
    b = (
        jnp.einsum("qhd,nhd->qhn", aq, ek)
        + 2 * head_dim * F32_U * jnp.einsum("qhd,nhd->qhn", aq, jnp.abs(k_ref))
    ) / root_d
    b_mean = (p_ref * b).sum(-1, keepdims=True)
    pw = jnp.swapaxes(p_ref, 1, 2)[..., None]  # [Q, n, H, 1]
    bw = jnp.swapaxes(b + b_mean, 1, 2)[..., None]
    spread = jnp.abs(v_ref[None] - o_ref[:, None])  # [Q, n, H, D]
    growth = jnp.exp(4 * b.max())
    tol = growth * ((pw * bw * spread).sum(1) + (pw * ev[None]).sum(1))
    tol = tol + 4 * n * F32_U * jnp.abs(v_ref).max(0)[None]
    # NaN differences count as failures (ratio inf).
    rs = jnp.where(jnp.isnan(s), jnp.inf, jnp.abs(s - s_ref) / jnp.maximum(b, 1e-30))
    ro = jnp.where(jnp.isnan(o), jnp.inf, jnp.abs(o - o_ref) / jnp.maximum(tol, 1e-30))
    where_s = jnp.stack(jnp.unravel_index(jnp.argmax(rs), rs.shape))
    where_o = jnp.stack(jnp.unravel_index(jnp.argmax(ro), ro.shape))[:2]
    return rs.max(), ro.max(), where_s, where_o
