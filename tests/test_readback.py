"""The read-back check: attention over a correct pool passes within the rounding bound, and
one corrupted key or two swapped pages fail it (slot and paged pools, 16-bit and FP8, a
sliding window on every layer or on some: a windowed layer's queries see their window)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_dflash.cli import readback, workload
from jax_dflash.cli.accept import parse_accept
from jax_dflash.cli.presets import PRESETS

pytest.importorskip("ml_dtypes", reason="bfloat16 and FP8 pools need ml_dtypes")


def _workload(contract, kv_dtype=None, window=None, steps=6, preset="tiny"):
    p = PRESETS[preset]
    return workload.Workload(
        p,
        batch=4,
        steps=steps,
        seed=3,
        accept=parse_accept("geometric:0.8", 8),
        device=jax.devices("cpu")[0],
        kv_dtype=kv_dtype,
        contract=contract,
        window=window,
        window_layers=p.window_layers,
    )


def _reference_pools(w):
    """The pools the kernel writes (the reference is bit-exact with it)."""
    return w.reference_pools(w.deltas("kernel"), "kernel")


CASES = [
    ("slot", None, None, "tiny"),
    ("paged", None, None, "tiny"),
    ("paged", "float8_e4m3fn", None, "tiny"),
    ("paged", None, 16, "tiny"),
    ("slot", "float8_e5m2", None, "tiny"),
    ("paged", None, 16, "tiny-w16"),
    ("paged", "float8_e4m3fn", 16, "tiny-w16"),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(map(str, c)))
def good_run(request):
    contract, kv, window, preset = request.param
    w = _workload(contract, kv, window, steps=14 if window else 6, preset=preset)
    return w, _reference_pools(w)


def test_a_correct_pool_passes(good_run):
    w, pools = good_run
    result = w.readback(jax.device_put(pools, w.device))
    assert result.passed, result.failure
    assert result.sequences > 0 and result.tokens > 0 and result.queries > 0
    # The differences are roundings, well inside the bound but not all zero.
    assert 0 < result.worst_score_ratio <= 1 and result.worst_output_ratio <= 1


def _views_tokens(w, layer):
    """The (view, token) pairs that ``layer`` holds."""
    views = w.readback_views()
    return [
        (v, i)
        for v in views
        for i in range(len(v.positions))
        if v.positions[i] >= v.held_from[layer]
    ]


def test_one_flipped_key_fails(good_run):
    w, pools = good_run
    rng = np.random.default_rng(0)
    bad = pools.copy()
    layer = int(rng.integers(bad.shape[0]))
    tokens = _views_tokens(w, layer)
    view, i = tokens[int(rng.integers(len(tokens)))]
    page, row = int(view.k_pages[layer, i]), int(view.rows[i])
    bad[layer, 0, page, row] = -bad[layer, 0, page, row]  # one stored token's key, negated
    result = w.readback(jax.device_put(bad, w.device))
    assert not result.passed
    assert f"layer {layer}" in result.failure and "scores" in result.failure


def test_two_swapped_pages_fail(good_run):
    w, pools = good_run
    views = w.readback_views()
    view = max(views, key=lambda v: len(set(v.k_pages[0].tolist())))
    pages = sorted(set(view.k_pages[0].tolist()))
    assert len(pages) >= 2, "the sampled sequence spans one page: the case needs two"
    a, b = pages[0], pages[-1]
    bad = pools.copy()
    bad[:, :, [a, b]] = bad[:, :, [b, a]]
    result = w.readback(jax.device_put(bad, w.device))
    assert not result.passed, "swapping two pages went unnoticed"


def test_every_held_key_is_seen_by_a_query_of_its_layer():
    """Whichever key a layer holds, one of its queries attends to it: the newest query's
    window and the oldest whole window's cover what a ring holds; a full layer's newest query
    sees every key."""
    w = _workload("paged", window=16, steps=14, preset="tiny-w16")
    rng = np.random.default_rng(5)
    windowed_and_long = 0
    for view in w.readback_views():
        for layer, window in enumerate(view.windows):
            q = readback.query_positions(view, layer, np.zeros(0, int), rng, 4)
            held = view.positions[view.positions >= view.held_from[layer]]
            lo = -np.inf if window is None else q[:, None] - window
            seen = ((held[None] <= q[:, None]) & (held[None] > lo)).any(0)
            assert seen.all(), (view.label, layer)
            windowed_and_long += window is not None and view.held_from[layer] > 0
    assert windowed_and_long, "no sampled sequence outgrew its window: the case needs one"


def test_a_windowed_layers_queries_have_their_whole_window_held():
    """A windowed layer's query at q attends to (q - window, q]: every such position of the
    sequence is one its ring still holds (probes included)."""
    w = _workload("paged", window=16, steps=14, preset="tiny-w16")
    rng = np.random.default_rng(6)
    for view in w.readback_views():
        for layer, window in enumerate(view.windows):
            picks = rng.choice(np.flatnonzero(view.positions >= view.held_from[layer]), 3)
            q = readback.query_positions(view, layer, picks, rng, 4)
            assert (q <= view.positions[-1]).all() and (q >= view.held_from[layer]).all()
            if window is not None:
                assert (np.maximum(q - window + 1, 0) >= view.held_from[layer]).all()
                # each probe's query sees its probed token
                probed = view.positions[picks]
                assert ((probed <= q[-3:]) & (probed > q[-3:] - window)).all()
