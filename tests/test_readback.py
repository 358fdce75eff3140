"""The read-back check: attention over a correct pool passes within the rounding bound, and
one corrupted key or two swapped pages fail it (slot and paged pools, 16-bit and FP8)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_dflash.cli import readback, workload
from jax_dflash.cli.accept import parse_accept
from jax_dflash.cli.presets import PRESETS

pytest.importorskip("ml_dtypes", reason="bfloat16 and FP8 pools need ml_dtypes")


def _workload(contract, kv_dtype=None, window=None, steps=6):
    return workload.Workload(
        PRESETS["tiny"],
        batch=4,
        steps=steps,
        seed=3,
        accept=parse_accept("geometric:0.8", 8),
        device=jax.devices("cpu")[0],
        kv_dtype=kv_dtype,
        contract=contract,
        window=window,
    )


def _reference_pools(w):
    """The pools the kernel writes (the reference is bit-exact with it)."""
    return w.reference_pools(w.deltas("kernel"), "kernel")


CASES = [
    ("slot", None, None),
    ("paged", None, None),
    ("paged", "float8_e4m3fn", None),
    ("paged", None, 16),
    ("slot", "float8_e5m2", None),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(map(str, c)))
def good_run(request):
    contract, kv, window = request.param
    w = _workload(contract, kv, window, steps=10 if window else 6)
    return w, _reference_pools(w)


def test_a_correct_pool_passes(good_run):
    w, pools = good_run
    result = w.readback(jax.device_put(pools, w.device))
    assert result.passed, result.failure
    assert result.sequences > 0 and result.tokens > 0 and result.queries > 0
    # The differences are roundings, well inside the bound but not all zero.
    assert 0 < result.worst_score_ratio <= 1 and result.worst_output_ratio <= 1


def _views_tokens(w):
    views = w.readback_views()
    return [(v, i) for v in views for i in range(len(v.positions))]


def test_one_flipped_key_fails(good_run):
    w, pools = good_run
    rng = np.random.default_rng(0)
    view, i = _views_tokens(w)[int(rng.integers(len(_views_tokens(w))))]
    bad = pools.copy()
    layer = int(rng.integers(bad.shape[0]))
    page, row = int(view.k_pages[i]), int(view.rows[i])
    bad[layer, 0, page, row] = -bad[layer, 0, page, row]  # one stored token's key, negated
    result = w.readback(jax.device_put(bad, w.device))
    assert not result.passed
    assert f"layer {layer}" in result.failure and "scores" in result.failure


def test_two_swapped_pages_fail(good_run):
    w, pools = good_run
    views = w.readback_views()
    view = max(views, key=lambda v: len(set(v.k_pages.tolist())))
    pages = sorted(set(view.k_pages.tolist()))
    assert len(pages) >= 2, "the sampled sequence spans one page: the case needs two"
    a, b = pages[0], pages[-1]
    bad = pools.copy()
    bad[:, :, [a, b]] = bad[:, :, [b, a]]
    result = w.readback(jax.device_put(bad, w.device))
    assert not result.passed, "swapping two pages went unnoticed"


def test_the_rounding_bound_scales_with_the_pool_dtype():
    assert readback.unit_roundoff(np.float32) == 2.0**-24
    assert readback.unit_roundoff(np.float16) == 2.0**-11
    import ml_dtypes

    assert readback.unit_roundoff(ml_dtypes.bfloat16) == 2.0**-8
    assert readback.unit_roundoff(ml_dtypes.float8_e4m3fn) == 2.0**-4
    assert readback.half_smallest_subnormal(ml_dtypes.float8_e4m3fn) == 2.0**-10
