"""Parity with z-lab's own DFlash model code (PyPI ``dflash`` 0.1.0): an oracle written by
someone else.

``tests/helpers/zlab_oracle.py`` runs z-lab's ``dflash_generate`` on tiny random float32 Qwen3
models and records, after every draft step, the draft's HF cache (cropped back to the context)
and what the step wrote into it. Each step's context writes are replayed here through the main
job's pipeline (``jax_dflash.cli.pipeline``) and through each addressing form of the op (slot
contract, paged contract with a scattered page table, the layer-batched form), with the fused
k-norm (the draft layer's ``k_norm`` weight and epsilon) and the draft's rope table, into a pool
poisoned with a NaN payload. After every step the whole pool is compared with the cache:

- values bit for bit (the op copies them; the pipeline recomputes the projections, see below);
- keys within ``KEY_ULPS`` float32 ulps of the pair norm ``hypot(k[i], k[i + R/2])`` (which
  RoPE preserves): the op and HF compute the same RMS norm in a different order (the op's sum
  is the butterfly of SPEC.md, HF's is ``pow(2).mean()`` and ``torch.rsqrt``), so ``inv_rms``
  differs by a few ulps; RoPE is then the same products and sums on both sides (HF's
  ``k * cos + rotate_half(k) * sin``, no FMA), and a rotated channel's error is bounded by the
  pair's, not its own magnitude (``x1 * c - x2 * s`` may cancel);
- every row the step did not address (the rest of the pool, other slots and pages, padding,
  positions not yet reached) still holds the poison, bit for bit.

The negative tests run the same replay with one thing wrong and assert that the comparison
fails.

On two cores: ~5 s to import torch and transformers, ~2 s for z-lab's run, ~5 s for the rest
(mostly jit compiles). Needs torch, transformers 5 and dflash (``make oracle`` installs them; otherwise the module skips, unless
``DFLASH_REQUIRE_ORACLE=1`` makes a missing dependency an error).
"""

from __future__ import annotations

import functools
import importlib
import os

import numpy as np
import pytest

_INSTALL = 'make oracle, or: pip install ".[oracle]" && pip install --no-deps dflash==0.1.0'


def _unavailable(why):
    """Skips the module, or fails it where the oracle must run (``make oracle`` sets
    ``DFLASH_REQUIRE_ORACLE=1``, so that a broken install cannot pass as a skip)."""
    message = f"the z-lab oracle cannot run: {why} ({_INSTALL})"
    if os.environ.get("DFLASH_REQUIRE_ORACLE") == "1":
        raise RuntimeError(message)
    pytest.skip(message, allow_module_level=True)


def _import(module):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        _unavailable(f"{module} does not import ({e})")


_import("torch")
_transformers = _import("transformers")
if int(_transformers.__version__.split(".")[0]) < 5:
    _unavailable(f"dflash 0.1.0 needs transformers 5, found {_transformers.__version__}")
_import("dflash.model")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_dflash  # noqa: E402
from helpers import zlab_oracle as zlab  # noqa: E402
from jax_dflash.cli import pipeline  # noqa: E402
from jax_dflash.contract import DEFAULT_NORM_EPS  # noqa: E402
from jax_dflash.testing import assert_bits_equal  # noqa: E402

PAGE = 16
PAGES_PER_SLOT = 5  # 80 positions a sequence: more than the run writes (73)
CAPACITY = PAGE * PAGES_PER_SLOT
SLOTS = 2  # the z-lab sequence is slot / sequence 1; sequence 0 writes nothing
SEQUENCE = 1
WIDTH = max(zlab.PROMPT_TOKENS, zlab.BLOCK_SIZE)  # the widest step: the prompt
# A quiet NaN that no arithmetic produces (the op's canonical NaN is 0x7FC00000).
POISON = np.uint32(0x7FC0FFEE)
F32_ULP = 2.0**-23  # float32 ulp of 1: ulp(x) <= F32_ULP * |x|
# The op's keys against z-lab's cache: measured at most 2.3 ulps (of the pair norm) here; 8
# leaves room for other CPUs' torch kernels (another summation order in the mean) and is still
# below what the smallest wrong input tested gives (epsilon 1e-5 for 1e-6: ~65 ulps).
KEY_ULPS = 8
# The pipeline computes fc -> hidden_norm -> k/v projections itself, in XLA, whose float32 dot
# products sum in another order than torch's, and the k-norm then rescales the keys' error:
# measured at most 81 ulps (keys, of the pair norm) and 14 (values, of the head's RMS) here;
# 512 ulps (6e-5 relative) is far below any wrong input's error (over 10^6 ulps).
PIPELINE_ULPS = 512
# jax_dflash.rope_cos_sin's table against the draft's (HF computes the angle in float32): at
# most (position + 2) float32 ulps apart (test_project_rope_table_is_hf_up_to_float32_angles;
# 16 ulps measured at positions below 80). A rotation moved by d in cos and in sin moves a pair
# by up to 2 d of its norm.
TABLE_KEY_ULPS = KEY_ULPS + 2 * (CAPACITY + 1)


@pytest.fixture(scope="module")
def trace():
    return zlab.run()


def _poisoned(shape):
    return np.full(shape, POISON, np.uint32).view(np.float32)


def _pair_scale(k, rotary_dim):
    """Per element: the norm of its RoPE pair (channels ``i`` and ``i + R/2``), float64."""
    k = k.astype(np.float64)
    half = rotary_dim // 2
    pair = np.hypot(k[..., :half], k[..., half:rotary_dim])
    return np.concatenate([pair, pair, np.abs(k[..., rotary_dim:])], axis=-1)


def _head_rms(v):
    v = v.astype(np.float64)
    return np.broadcast_to(np.sqrt(np.mean(v * v, axis=-1, keepdims=True)), v.shape)


def _assert_close(what, actual, expected, scale, ulps):
    err = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    bad = ~(err <= ulps * F32_ULP * scale)  # NaN (an unwritten row) is bad too
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        worst = np.nanmax(err / scale) / F32_ULP if np.isfinite(err).all() else float("nan")
        raise AssertionError(
            f"{what}: {bad.sum()} of {bad.size} elements beyond {ulps} ulps (worst "
            f"{worst:.3g} ulps); first at {i}: {actual[i]!r} != {expected[i]!r}"
        )


def _max_ulps(actual, expected, scale):
    return float(np.max(np.abs(actual.astype(np.float64) - expected) / scale) / F32_ULP)


def check_pool(pool, step, layer, k_rows, v_rows, *, key_ulps, value_ulps=0):
    """The layer's pool ``[2, N, P, H, D]`` against the cache after ``step``: position ``p``
    of the sequence lives at flat row ``k_rows[p]`` of plane 0 (``v_rows[p]`` of plane 1), with
    the cached key within ``key_ulps`` and the value bit for bit (or within ``value_ulps``);
    every other row holds the poison. Raises AssertionError naming what differs."""
    cache_k, cache_v = step.cache_k[layer], step.cache_v[layer]
    end = cache_k.shape[0]
    heads, dim = cache_k.shape[1:]
    k_pool = pool[0].reshape(-1, heads, dim)
    v_pool = pool[1].reshape(-1, heads, dim)
    written_v = v_rows[:end]
    expected_v = _poisoned(v_pool.shape)
    if value_ulps:
        _assert_close(
            f"values, layer {layer}", v_pool[written_v], cache_v, _head_rms(cache_v), value_ulps
        )
        expected_v[written_v] = v_pool[written_v]  # then only the poison is checked bitwise
    else:
        expected_v[written_v] = cache_v
    assert_bits_equal(v_pool, expected_v)
    written_k = k_rows[:end]
    _assert_close(
        f"keys, layer {layer}", k_pool[written_k], cache_k, _pair_scale(cache_k, dim), key_ulps
    )
    untouched = np.ones(k_pool.shape[0], bool)
    untouched[written_k] = False
    assert_bits_equal(k_pool[untouched], _poisoned(k_pool[untouched].shape))


def _slot_rows(slot):
    """Flat pool rows of the slot contract's positions ``0 .. CAPACITY - 1``."""
    return slot * CAPACITY + np.arange(CAPACITY)


def _table_rows(table):
    """Flat K and V rows of positions ``0 .. CAPACITY - 1`` under a ``[2, M]`` page table whose
    V ids are already made 0-based (the contract's ids minus N)."""
    p = np.arange(CAPACITY)
    return table[0][p // PAGE] * PAGE + p % PAGE, table[1][p // PAGE] * PAGE + p % PAGE


def _rope(trace, theta=None):
    """The draft's own cos/sin table, or ``jax_dflash.rope_cos_sin`` with ``theta``."""
    if theta is None:
        return jnp.asarray(trace.rope_table[:, :CAPACITY])
    return jax_dflash.rope_cos_sin(CAPACITY, zlab.HEAD_DIM, theta=theta)


def _garbage(rng, shape):
    """Padding deltas: finite values unlike any key or value, so a stray write shows."""
    return (100.0 + rng.standard_normal(shape)).astype(np.float32)


# ---- the run itself ------------------------------------------------------------------------------


def test_run_accepts_several_tokens_per_step(trace):
    produced = trace.produced
    assert trace.steps[0].length == zlab.PROMPT_TOKENS
    assert sum(s.length for s in trace.steps) == trace.steps[-1].cache_k.shape[1]
    assert max(produced) == zlab.BLOCK_SIZE, produced  # a whole block accepted
    assert sum(n >= 3 for n in produced) >= 3, produced  # several steps of 2+ drafted tokens
    assert min(produced) == 1, produced  # and rejections: lengths vary
    assert trace.steps[-1].cache_k.shape[1] < CAPACITY


def test_cache_is_rotate_half_rope_of_the_k_norm(trace):
    """The oracle's own reading, in float64: the cached key is RMSNorm (draft weight, eps) of
    the recorded ``k_proj`` output, rotated rotate-half with the draft's table; the value is
    the ``v_proj`` output itself. This is what the replays below give the op."""
    last = trace.steps[-1]
    end = last.cache_k.shape[1]
    k = trace.k_proj[:, :end].astype(np.float64)
    normed = k / np.sqrt(np.mean(k * k, axis=-1, keepdims=True) + trace.norm_eps)
    normed *= trace.k_norm_weight[:, None, None, :]
    half = zlab.HEAD_DIM // 2
    c = trace.rope_table[0, :end, None, :half]
    s = trace.rope_table[0, :end, None, half:]
    x1, x2 = normed[..., :half], normed[..., half:]
    rotated = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    scale = _pair_scale(last.cache_k, zlab.HEAD_DIM)
    assert _max_ulps(last.cache_k, rotated, scale) < KEY_ULPS
    assert_bits_equal(last.cache_v, trace.v_proj[:, :end])


# ---- (a) the main job's pipeline -----------------------------------------------------------------


def _pipeline_weights(trace):
    layers = zlab.DRAFT_LAYERS
    kv = np.stack([trace.k_proj_weight, trace.v_proj_weight], axis=1)  # [layers, 2, hidden, HD]
    kv_proj = np.moveaxis(kv, 2, 0).reshape(zlab.HIDDEN, layers * 2 * zlab.KV_HEADS * zlab.HEAD_DIM)
    return pipeline.DraftWeights(
        fc=jnp.asarray(trace.fc),
        hidden_norm=jnp.asarray(trace.hidden_norm),
        kv_proj=jnp.asarray(kv_proj),
        k_norm=jnp.asarray(trace.k_norm_weight),
        seed=jnp.uint32(0),
    )


def _recorded_features(trace):
    """A stand-in for ``pipeline.features``: the target features z-lab gave the draft for
    (stream 0, position), zeros elsewhere (padding, never written)."""
    table = jnp.asarray(trace.features)

    def features(seed, streams, positions, size, dtype):
        valid = (streams == 0) & (positions >= 0) & (positions < table.shape[0])
        rows = table[jnp.clip(positions, 0, table.shape[0] - 1)]
        return jnp.where(valid[:, None], rows, 0).astype(dtype)

    return features


@pytest.mark.parametrize("contract", ["slot", "paged"])
def test_pipeline_step_matches_zlab_cache(trace, contract, monkeypatch):
    """``pipeline.make_step`` (the kernel, fused k-norm, all layers in one launch) fed z-lab's
    target features: every step's pools against z-lab's cache. The pipeline computes fc,
    hidden_norm and the k/v projections itself, in XLA, so keys and values are compared within
    ``PIPELINE_ULPS``; what it adds on top (k-norm, RoPE, addressing) is what the op tests below
    check bit for bit (values) and within ``KEY_ULPS`` (keys)."""
    assert trace.norm_eps == DEFAULT_NORM_EPS, "the pipeline's norms use the default norm_eps"
    monkeypatch.setattr(pipeline, "features", _recorded_features(trace))
    g = pipeline.Geometry(
        layers=zlab.DRAFT_LAYERS,
        heads=zlab.KV_HEADS,
        head_dim=zlab.HEAD_DIM,
        rotary_dim=zlab.HEAD_DIM,
        feature_size=trace.features.shape[1],
        hidden_size=zlab.HIDDEN,
    )
    steps = trace.steps
    lengths = np.array([s.length for s in steps] + [0], np.int32)
    starts = np.array([s.start for s in steps] + [0], np.int32)
    if contract == "slot":
        spec = pipeline.StepSpec(
            "slot", g, batch=1, block_size=WIDTH, pages_per_slot=PAGES_PER_SLOT
        )
        consts = pipeline.Constants(
            _pipeline_weights(trace), _rope(trace), None, None, lengths[:, None], *[None] * 4
        )
        num_pages = PAGES_PER_SLOT
        k_rows = v_rows = _slot_rows(0)
    else:
        num_pages = PAGES_PER_SLOT + 3  # pages the table does not name stay poisoned
        spec = pipeline.StepSpec("paged", g, batch=1, block_size=WIDTH)
        positions, owners = jax_dflash.token_positions(starts[:, None], lengths[:, None], WIDTH)
        rng = np.random.default_rng(3)
        k_pages = rng.permutation(num_pages)[:PAGES_PER_SLOT]
        v_pages = rng.permutation(num_pages)[:PAGES_PER_SLOT] + num_pages
        table = np.stack([k_pages, v_pages])[None].astype(np.int32)  # [B=1, 2, M]
        tables = np.broadcast_to(table, (len(lengths), *table.shape))
        consts = pipeline.Constants(
            _pipeline_weights(trace),
            _rope(trace),
            None,
            None,
            None,
            positions,
            owners,
            jnp.zeros_like(owners),
            jnp.asarray(tables),
        )
        k_rows, v_rows = _table_rows(table[0] - np.array([[0], [num_pages]]))
    # The pipeline's own projections in full float32, as torch computes them: on a GPU, XLA's
    # default matmul precision is TF32, which is what this comparison would otherwise see.
    step_fn = jax.jit(
        jax.default_matmul_precision("highest")(pipeline.make_step(spec, "kernel")),
        donate_argnums=0,
    )
    pools = jnp.asarray(_poisoned((g.layers, 2, num_pages, PAGE, g.heads, g.head_dim)))
    state = (pools, jnp.int32(0), jnp.zeros(1, jnp.int32))
    if contract == "paged":
        state = state[:2]
    for step in steps:
        state, _ = step_fn(state, consts)
        host = np.asarray(state[0])
        for layer in range(g.layers):
            check_pool(
                host[layer],
                step,
                layer,
                k_rows,
                v_rows,
                key_ulps=PIPELINE_ULPS,
                value_ulps=PIPELINE_ULPS,
            )


# ---- (b) the op's addressing forms ---------------------------------------------------------------


@functools.cache
def _slot_op(norm_eps):
    update = functools.partial(
        jax_dflash.target_kv_cache_update, pages_per_slot=PAGES_PER_SLOT, norm_eps=norm_eps
    )
    return jax.jit(update, donate_argnums=2)


def replay_slot(
    trace, *, rope=None, k_norm_weight=None, norm_eps=None, offset=0, extra_length=0, key_ulps
):
    """Each step's context, per layer, through the slot contract (sequence in slot 1, slot 0
    with length 0, padding garbage), checked against the cache after every step."""
    rope = _rope(trace) if rope is None else rope
    weights = trace.k_norm_weight if k_norm_weight is None else k_norm_weight
    op = _slot_op(trace.norm_eps if norm_eps is None else norm_eps)
    rng = np.random.default_rng(1)
    shape = (2, SLOTS * PAGES_PER_SLOT, PAGE, zlab.KV_HEADS, zlab.HEAD_DIM)
    pools = [jnp.asarray(_poisoned(shape)) for _ in range(zlab.DRAFT_LAYERS)]
    rows = _slot_rows(SEQUENCE)
    for step in trace.steps:
        span = slice(step.start, step.start + step.length)
        starts = np.array([7, step.start + offset], np.int32)
        lengths = np.array([0, step.length + extra_length], np.int32)
        for layer in range(zlab.DRAFT_LAYERS):
            k = _garbage(rng, (SLOTS, WIDTH, zlab.KV_HEADS, zlab.HEAD_DIM))
            v = _garbage(rng, k.shape)
            k[SEQUENCE, : step.length] = trace.k_proj[layer, span]
            v[SEQUENCE, : step.length] = trace.v_proj[layer, span]
            pools[layer] = op(
                k,
                v,
                pools[layer],
                rope,
                starts,
                lengths,
                k_norm_weight=jnp.asarray(weights[layer]),
            )
            check_pool(np.asarray(pools[layer]), step, layer, rows, rows, key_ulps=key_ulps)


def test_slot_contract_matches_zlab_cache(trace):
    replay_slot(trace, key_ulps=KEY_ULPS)


def _page_tables(num_pages, layers):
    """Per layer a ``[B, 2, M]`` table: scattered K pages and V pages (ids + N), different per
    layer and per sequence, some pool pages named by no table."""
    rng = np.random.default_rng(2)
    tables = []
    for _ in range(layers):
        k = rng.permutation(num_pages)[: SLOTS * PAGES_PER_SLOT].reshape(SLOTS, PAGES_PER_SLOT)
        v = rng.permutation(num_pages)[: SLOTS * PAGES_PER_SLOT].reshape(SLOTS, PAGES_PER_SLOT)
        tables.append(np.stack([k, v + num_pages], axis=1))
    return np.stack(tables).astype(np.int32)


@pytest.mark.parametrize("layered", [False, True], ids=["per-layer", "layer-batched"])
def test_paged_contract_matches_zlab_cache(trace, layered):
    """The paged contract through a scattered page table: tokens built by
    ``jax_dflash.token_positions`` (sequence 1; sequence 0 has none), rope rows by
    ``gather_rope``. Layer-batched: all layers in one call, per-layer tables and k-norm weights
    (the form ``vmap`` produces and the pipeline runs)."""
    layers = zlab.DRAFT_LAYERS
    num_pages = SLOTS * PAGES_PER_SLOT + 3
    tables = _page_tables(num_pages, layers)
    rope_table = _rope(trace)
    shape = (2, num_pages, PAGE, zlab.KV_HEADS, zlab.HEAD_DIM)
    pools = jnp.asarray(_poisoned((layers, *shape)))
    rng = np.random.default_rng(4)
    op = functools.partial(jax_dflash.target_kv_cache_update_paged, norm_eps=trace.norm_eps)
    op = jax.jit(op, donate_argnums=2)
    rows = [_table_rows(t[SEQUENCE] - np.array([[0], [num_pages]])) for t in tables]
    for step in trace.steps:
        span = slice(step.start, step.start + step.length)
        starts = np.array([3, step.start], np.int32)
        lengths = np.array([0, step.length], np.int32)
        positions, owners = jax_dflash.token_positions(starts, lengths, WIDTH)
        rope = jax_dflash.gather_rope(rope_table, positions, owners)
        k = _garbage(rng, (layers, SLOTS, WIDTH, zlab.KV_HEADS, zlab.HEAD_DIM))
        v = _garbage(rng, k.shape)
        k[:, SEQUENCE, : step.length] = trace.k_proj[:, span]
        v[:, SEQUENCE, : step.length] = trace.v_proj[:, span]
        k = k.reshape(layers, SLOTS * WIDTH, *k.shape[3:])
        v = v.reshape(k.shape)
        weights = jnp.asarray(trace.k_norm_weight)
        if layered:
            pools = op(k, v, pools, rope, positions, owners, tables, k_norm_weight=weights)
        else:
            pools = jnp.stack(
                [
                    op(k[i], v[i], pools[i], rope, positions, owners, tables[i], k_norm_weight=w)
                    for i, w in enumerate(weights)
                ]
            )
        host = np.asarray(pools)
        for layer in range(layers):
            check_pool(host[layer], step, layer, *rows[layer], key_ulps=KEY_ULPS)


def test_project_rope_table_is_hf_up_to_float32_angles(trace):
    """``jax_dflash.rope_cos_sin`` (float64 angles, rounded once) against the draft's own table
    (HF: ``inv_freq`` and ``position * inv_freq`` in float32, then cos/sin): they differ by
    HF's angle rounding, under ``position * 2^-23`` plus a float32 rounding, so keys written
    with the project's table sit within that rotation of z-lab's cache."""
    ours = np.asarray(_rope(trace, theta=trace.rope_theta))[0]
    theirs = trace.rope_table[0, :CAPACITY]
    diff = np.abs(ours.astype(np.float64) - theirs)
    positions = np.arange(CAPACITY)[:, None]
    assert np.all(diff <= (positions + 2) * F32_ULP), diff.max() / F32_ULP
    assert diff.max() > 0  # they are different tables: the other replays use HF's bits
    replay_slot(trace, rope=_rope(trace, theta=trace.rope_theta), key_ulps=TABLE_KEY_ULPS)


# ---- the comparison can fail ---------------------------------------------------------------------

WRONG = {
    "position offset +1": dict(offset=1),
    "position offset -1": dict(offset=-1),
    "rope theta x2": dict(theta=2.0),
    "rope theta of the target": dict(theta=zlab.TARGET_ROPE_THETA / zlab.DRAFT_ROPE_THETA),
    "k-norm weight of ones": dict(k_norm_weight="ones"),
    "k-norm weight of the other layer": dict(k_norm_weight="swapped"),
    "norm eps 1e-5": dict(norm_eps=1e-5),
    "length -1": dict(extra_length=-1),
    "length +1": dict(extra_length=1),
}


@pytest.mark.parametrize("wrong", list(WRONG))
def test_wrong_input_is_detected(trace, wrong):
    """The slot replay with one input wrong fails the comparison, under the tolerance its
    correct counterpart passes with (the rope-theta cases build their table with
    ``rope_cos_sin``, as test_project_rope_table_is_hf_up_to_float32_angles does)."""
    kwargs = dict(WRONG[wrong])
    key_ulps = KEY_ULPS
    if "theta" in kwargs:
        theta = trace.rope_theta * kwargs.pop("theta")
        kwargs["rope"] = _rope(trace, theta=theta)
        key_ulps = TABLE_KEY_ULPS
    weight = kwargs.get("k_norm_weight")
    if weight == "ones":
        kwargs["k_norm_weight"] = np.ones_like(trace.k_norm_weight)
    elif weight == "swapped":
        kwargs["k_norm_weight"] = trace.k_norm_weight[::-1].copy()
    with pytest.raises(AssertionError, match="differ bitwise|beyond"):
        replay_slot(trace, key_ulps=key_ulps, **kwargs)
