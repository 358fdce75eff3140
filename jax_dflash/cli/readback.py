"""The read-back check: does attention over the cache equal attention without one?

For a sample of sequences, plain-jnp attention of draft queries over the keys and values read
from the pool (``jax_dflash.gather_kv_rows`` at the pages and rows the slot layout or the page
table gives, dequantized with the static or dynamic scales) is
compared with the same attention over keys and values recomputed from the sequence's features
(norm, RoPE, no cache, float32). The two differ only by roundings, bounded per element:

- a key channel: 2 ulps of the delta dtype (the fused norm may differ from the jnp one by one,
  SPEC.md "Fused norms"; one more for recomputing the projection), doubled through RoPE's
  channel pairs (``|cos|, |sin| <= 1``); then the store: half an ulp of the pool dtype
  (relative), half its smallest subnormal times the scale (absolute), and any saturation
  past the format's largest value; for int8 and int4, half a step times the scale (the row's own
  scale for a dynamic format), and any saturation past 127 or 7 steps;
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

Each query has a position and attends as its layer does: a full layer's causally (keys at
positions ``<= q``), a sliding-window layer's to the keys in ``(q - window, q]``. Query
positions are ones whose whole window the pool still holds; the random ones include the newest
position and the oldest such one, whose windows together cover every key the layer holds.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

PROBE_SHARPNESS = 8.0  # the probed token's score; the others' stay near 0
UNWINDOWED = np.iinfo(np.int32).max  # a full layer's window: every earlier position
F32_U = 2.0**-24


def unit_roundoff(dtype) -> float:
    """Half the distance from 1 to the next value: the relative error of round-to-nearest."""
    return float(jnp.finfo(dtype).eps) / 2


def half_smallest_subnormal(dtype) -> float:
    return float(jnp.finfo(dtype).smallest_subnormal) / 2


@dataclasses.dataclass
class SequenceView:
    """Where a sequence's cached tokens are: one entry per position, per layer where the layers
    hold different pages (a draft mixing windowed and full layers)."""

    label: str
    positions: np.ndarray  # [n], ascending
    streams: np.ndarray  # [n] feature stream of each token
    k_pages: np.ndarray  # [layers, n] page in plane 0 (0 where the layer holds no page)
    v_pages: np.ndarray  # [layers, n] page in plane 1 (the table's V id minus N)
    rows: np.ndarray  # [n]
    held_from: tuple[int, ...]  # per layer: the first position its pages hold
    windows: tuple[int | None, ...]  # per layer: its sliding window, None: full (causal)


def slot_view(label, b, start, end, pages_per_slot, page_size, stream, layers) -> SequenceView:
    pos = np.arange(start, end, dtype=np.int64)
    pages = np.broadcast_to(b * pages_per_slot + pos // page_size, (layers, len(pos)))
    return SequenceView(
        label,
        pos,
        np.full(pos.shape, stream),
        pages,
        pages,
        pos % page_size,
        (start,) * layers,
        (None,) * layers,
    )


def paged_view(
    label, table_rows, positions, streams, page_size, num_pages, *, rings, held_from, windows
) -> SequenceView:
    """``table_rows`` ``[layers, 2, M]``: each layer's table row of the sequence; ``rings``,
    ``held_from`` and ``windows`` one per layer. Layer ``l`` must hold the positions from
    ``held_from[l]`` on; it reads page 0 for older ones, which its queries never see."""
    pos = np.asarray(positions, np.int64)
    k_pages = np.zeros((len(rings), len(pos)), np.int64)
    v_pages = np.zeros_like(k_pages)
    for layer, (row, ring, start) in enumerate(zip(table_rows, rings, held_from)):
        i = pos // page_size
        if ring:
            i = i % row.shape[1]
        held = pos >= start
        k_pages[layer] = np.where(held, row[0, i], 0)
        v_pages[layer] = np.where(held, row[1, i] - num_pages, 0)
    return SequenceView(
        label, pos, np.asarray(streams), k_pages, v_pages, pos % page_size, held_from, windows
    )


def query_positions(view: SequenceView, layer: int, picks: np.ndarray, rng, count: int):
    """``[count + len(picks)]`` positions of a layer's queries: the newest position, the oldest
    whose window the layer holds whole, random ones between, then for each probed token the
    newest query that sees it."""
    last = int(view.positions[-1])
    start, window = view.held_from[layer], view.windows[layer]
    oldest = start if window is None or start == 0 else min(start + window - 1, last)
    random = [last, oldest][:count]
    random += rng.integers(oldest, last + 1, max(0, count - 2)).tolist()
    probed = view.positions[picks]
    reach = probed if window is None else probed + window - 1
    probes = np.full(len(picks), last) if window is None else np.minimum(reach, last)
    return np.concatenate([np.asarray(random, np.int64), probes])


@dataclasses.dataclass
class ReadbackResult:
    passed: bool
    sequences: int
    tokens: int
    queries: int
    worst_score_ratio: float  # largest |score difference| / its bound
    worst_output_ratio: float
    failure: str | None = None
    # Largest |output over the pool - output recomputed in float32|, relative to the largest
    # recomputed output magnitude: the format's error as attention sees it.
    output_error: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _stored_error(y, y_err, pool_dtype, scale):
    """Bound on |dequantized stored - y| given |kernel's y - y| <= y_err (float32 arrays);
    ``scale`` broadcasts against ``y`` (per head, or per token and head)."""
    from jax_dflash._shapes import POOL_FORMATS

    integer = jnp.issubdtype(pool_dtype, jnp.integer)  # int8, int4 (uint8 bytes)
    u = 0.0 if integer else unit_roundoff(pool_dtype)
    tiny = 0.5 if integer else half_smallest_subnormal(pool_dtype)  # int8, int4: half a step
    scale = 1.0 if scale is None else scale
    reach = jnp.abs(y) + y_err
    err = y_err + u * reach + tiny * jnp.abs(scale)
    row = POOL_FORMATS[str(jnp.dtype(pool_dtype))]
    if row["scales"] != "none":  # the format's largest magnitude: 127, 7, FP8's largest finite
        top = float(row["max_finite"]) * jnp.abs(scale)
        err = err + jnp.maximum(reach - top, 0.0)  # saturation
    return err


def _attention(q, k, v, mask):
    """``q`` [Q, H, D], ``k``/``v`` [n, H, D] float32 -> scores [Q, H, n], weights, outputs;
    each query attends to the tokens of its row of ``mask`` [Q, n]."""
    d = q.shape[-1]
    mask = mask[:, None, :]
    scores = jnp.einsum("qhd,nhd->qhn", q, k) / jnp.sqrt(jnp.float32(d))
    scores = jnp.where(mask, scores, 0.0)
    top = jnp.where(mask, scores, -jnp.inf).max(-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(scores - top), 0.0)
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
    scale_pool=None,
    rng: np.random.Generator,
    random_queries: int = 4,
    probes: int = 8,
) -> ReadbackResult:
    """Read-back check of ``views`` over the layer-batched ``pools`` (device array).

    ``recompute(streams, positions, at_least)`` returns float32 ``(normed_keys, keys, values)``, each
    ``[layers, n_padded, H, D]`` with ``n_padded >= n`` (padding to a few sizes keeps the
    compilations few): the k-normed keys before RoPE, after RoPE, and the values.
    ``scale_pool``: a dynamic format's scales (in place of ``k_scale``/``v_scale``)."""
    device = next(iter(pools.devices()))  # everything the check reads goes where the pool is

    def put(x):
        return jax.device_put(x, device)

    worst_s = worst_o = 0.0
    error = magnitude = 0.0
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
        picks = np.stack([_probed(view, layer, rng, probes) for layer in range(layers)])
        q_pos = np.stack(
            [
                query_positions(view, layer, picks[layer], rng, random_queries)
                for layer in range(layers)
            ]
        )
        windows = [UNWINDOWED if w is None else w for w in view.windows]
        pad = n_padded - n
        kp, vp = (
            put(np.pad(a, ((0, 0), (0, pad))).astype(np.int32))
            for a in (view.k_pages, view.v_pages)
        )
        rows, k_pos = (
            put(np.pad(a, (0, pad)).astype(np.int32)) for a in (view.rows, view.positions)
        )
        scales = None if k_scale is None else (put(k_scale), put(v_scale))
        rs, ro, where_s, where_o, err, mag = _check_view(
            pools,
            scale_pool,
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
            k_pos,
            put(q_pos.astype(np.int32)),
            put(np.asarray(windows, np.int32)),
            put(np.asarray(view.held_from, np.int32)),
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
        error, magnitude = max(error, float(np.max(err))), max(magnitude, float(np.max(mag)))
        queries += layers * (random_queries + picks.shape[1])
        tokens += n
    return ReadbackResult(
        failure is None,
        len(views),
        tokens,
        queries,
        worst_s,
        worst_o,
        failure,
        error / magnitude if magnitude > 0 else error,
    )


def _probed(view: SequenceView, layer: int, rng, probes: int) -> np.ndarray:
    """Indices of the tokens a layer's probe queries aim at: among those the layer holds."""
    held = np.flatnonzero(view.positions >= view.held_from[layer])
    return rng.choice(held, size=probes, replace=len(held) < probes)


@functools.partial(jax.jit, static_argnames=("rotary_dim", "u_delta", "pool_dtype"))
def _check_view(
    pools,
    scale_pool,
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
    k_pos,
    q_pos,
    windows,
    held_from,
    *,
    rotary_dim,
    u_delta,
    pool_dtype,
):
    """Per layer: the worst score and output differences relative to their bounds, where
    the worst ones are (``[query, head, token]`` / ``[query, head]``), and the largest output
    difference and output magnitude."""
    from jax_dflash.read import gather_kv_rows

    rows = jnp.broadcast_to(rows[None], kp.shape)
    static = {} if scales is None else dict(k_scale=scales[0], v_scale=scales[1])
    k_stored, v_stored, _ = gather_kv_rows(
        pools, kp, vp, rows, scale_pool=scale_pool, **static
    )  # [layers, n, H, D] float32
    ks = vs = None
    if scales is not None:
        ks, vs = scales[0][:, None, :, None], scales[1][:, None, :, None]
    if scale_pool is not None:  # each row's own scale bounds its rounding
        layers = jnp.arange(pools.shape[0])[:, None]
        ks = scale_pool[layers, 0, kp, rows][..., None]
        vs = scale_pool[layers, 1, vp, rows][..., None]
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
    layer = functools.partial(_check_layer, mask=mask, k_pos=k_pos)
    return jax.vmap(layer)(
        k_stored, v_stored, k_ref, v_ref, ek, ev, q_random, picks, q_pos, windows, held_from
    )


def _check_layer(
    k_stored,
    v_stored,
    k_ref,
    v_ref,
    ek,
    ev,
    q_random,
    picks,
    q_pos,
    window,
    held_from,
    *,
    mask,
    k_pos,
):
    n = mask.sum()
    # Which keys each query attends to: its layer's window (or causal) among those held.
    qp, kp = q_pos[:, None], k_pos[None, :]
    sees = mask[None] & (kp <= qp) & (kp > qp - window) & (kp >= held_from)  # [Q, n]
    head_dim = k_ref.shape[-1]
    root_d = jnp.sqrt(jnp.float32(head_dim))
    probe = k_ref[picks]  # [probes, H, D]
    norm2 = jnp.maximum((probe * probe).sum(-1, keepdims=True), 1e-30)
    q = jnp.concatenate([q_random, PROBE_SHARPNESS * probe / norm2 * root_d], 0)
    s_ref, p_ref, o_ref = _attention(q, k_ref, v_ref, sees)
    s, _, o = _attention(q, k_stored, v_stored, sees)
    aq = jnp.abs(q)
    b = (
        jnp.einsum("qhd,nhd->qhn", aq, ek)
        + 2 * head_dim * F32_U * jnp.einsum("qhd,nhd->qhn", aq, jnp.abs(k_ref))
    ) / root_d
    b = jnp.where(sees[:, None, :], b, 0.0)  # a key a query does not see bounds nothing
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
    return rs.max(), ro.max(), where_s, where_o, jnp.abs(o - o_ref).max(), jnp.abs(o_ref).max()
