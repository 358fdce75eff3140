"""The run's workload on the tiny preset: slot and paged contracts, every pool dtype, the fused
and unfused norm and a sliding window, each bit-exact with the NumPy reference and passing the
read-back check; the update's share is a share; the baseline pipeline is reported, not
required to be bit-exact."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_dflash import reference
from jax_dflash.cli import replays, workload
from jax_dflash.cli.accept import parse_accept
from jax_dflash.cli.presets import DTYPE_ALIASES, POOL_DTYPE_NAMES, PRESETS

pytest.importorskip("ml_dtypes", reason="bfloat16 and FP8 pools need ml_dtypes")

TINY = PRESETS["tiny"]


def gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def tiny_workload(contract="slot", *, batch=4, steps=6, seed=5, accept="geometric:0.8", **kw):
    """A Workload of the tiny preset on the CPU unless ``device``; ``kw``: dtype, kv_dtype,
    window, fused_norm, preset."""
    return workload.Workload(
        kw.pop("preset", TINY),
        batch=batch,
        steps=steps,
        seed=seed,
        accept=parse_accept(accept, 8),
        device=kw.pop("device", None) or jax.devices("cpu")[0],
        contract=contract,
        **kw,
    )


def _run(contract, kv_dtype=None, *, impl="kernel", **kw):
    w = tiny_workload(contract, kv_dtype=kv_dtype, **kw)
    return w, w.run(impl, progress=False)


@pytest.mark.parametrize("contract", ["slot", "paged"])
@pytest.mark.parametrize("kv", POOL_DTYPE_NAMES)
def test_every_pool_dtype_is_bit_exact_and_reads_back(contract, kv):
    w, r = _run(contract, kv)
    assert w.pool_dtype_name == kv
    assert r.check == "bit-exact", f"{r.mismatched_elements} elements differ"
    assert r.checked_elements == int(np.prod(w.pool_shape))
    assert r.readback.passed, r.readback.failure
    assert r.readback.tokens > 0 and not r.failed


@pytest.mark.parametrize("contract", ["slot", "paged"])
def test_unfused_norm_is_bit_exact_too(contract):
    _, r = _run(contract, "float8_e4m3fn", fused_norm=False, dtype="float16")
    assert r.check == "bit-exact" and r.readback.passed, r.readback.failure


def test_a_sliding_window_wraps_its_ring_pages_and_stays_bit_exact():
    w, r = _run("paged", "float8_e5m2", window=16, steps=14)
    assert w.plan.ring and w.plan.ring_page_reuses > 0
    assert r.check == "bit-exact" and r.readback.passed, r.readback.failure


def test_paged_run_starts_and_finishes_sequences_from_shared_prompts():
    w, r = _run("paged", steps=24)
    plan = w.plan
    assert plan.sequences_finished > 0 and plan.sequences_started > w.batch
    assert plan.shared_page_references > len(plan.prompts) and w.prefill_steps > 0
    assert r.check == "bit-exact" and r.readback.passed


@pytest.mark.parametrize("contract", ["slot", "paged"])
def test_update_share_is_a_share_or_below_its_resolution(contract):
    w, r = _run(contract)
    assert r.times is None and r.steps_per_s is None  # the checked pass is not the headline
    w.measure([r], progress=False)
    u = r.update
    assert u.method == "wall-clock" and u.note == "a CPU has no device trace"
    assert u.resolution > 0
    if u.below_resolution:
        assert r.update_share is None and r.update_share_resolution > 0
    else:
        assert u.seconds > u.resolution and 0.0 < r.update_share <= 1.0


def test_the_pools_must_match_the_reference_bit_for_bit(monkeypatch):
    real = reference.target_kv_cache_update_paged

    def one_bit_off(*args, **kwargs):
        out = real(*args, **kwargs)
        out.view(np.uint8).flat[0] ^= 1
        return out

    monkeypatch.setattr(reference, "target_kv_cache_update_paged", one_bit_off)
    _, r = _run("paged", "float8_e4m3fn")
    assert r.check == "differs" and r.failed and r.mismatched_elements >= 1


def test_baseline_pipeline_is_reported_and_reads_back():
    _, r = _run("paged", "float8_e4m3fn", impl="baseline")
    assert r.check in ("bit-exact", "differs") and not r.bit_exact_required
    assert r.readback.passed, r.readback.failure  # within the rounding bound all the same


def test_estimate_of_the_baseline():
    w = tiny_workload("paged", batch=2, steps=4, seed=0, accept="fixed:2")
    seconds, per_step = w.estimate_seconds("baseline")
    # The checked pass, and at least the fewest rounds of replays with and without the update.
    assert per_step > 0 and seconds >= per_step * w.steps * (1 + 2 * replays.ROUNDS[0])


@pytest.mark.skipif(not gpu_devices(), reason="no GPU in this JAX: runs on the H200")
@pytest.mark.parametrize("contract", ["slot", "paged"])
@pytest.mark.parametrize("kv", ["bf16", "e4m3"])
def test_gpu_runs_are_bit_exact(contract, kv):
    _, r = _run(
        contract,
        DTYPE_ALIASES[kv],
        device=gpu_devices()[0],
        window=16 if contract == "paged" else None,
        steps=12,
    )
    assert r.check == "bit-exact" and r.readback.passed, r.readback.failure


@pytest.mark.parametrize("contract", ["slot", "paged"])
def test_partial_rope_as_in_qwen35(contract):
    """RoPE on the first R < D channels (Qwen3.5's partial rotary): the rest pass through."""
    import dataclasses

    preset = dataclasses.replace(TINY, rotary_dim=16)
    w = tiny_workload(
        contract,
        batch=3,
        steps=5,
        seed=2,
        accept="uniform",
        kv_dtype="float8_e4m3fn",
        preset=preset,
    )
    r = w.run("kernel", progress=False)
    assert w.rope.shape == (1, preset.slot_capacity, 16)
    assert r.check == "bit-exact" and r.readback.passed, r.readback.failure
