"""The run's workload on the tiny preset: slot and paged contracts, every pool dtype, the fused
and unfused norm and a sliding window, each bit-exact with the NumPy reference and passing the
read-back check; the update's share is a share; the baseline pipeline is reported, not
required to be bit-exact."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_dflash import reference
from jax_dflash.cli import workload
from jax_dflash.cli.accept import parse_accept
from jax_dflash.cli.presets import KV_DTYPES, PRESETS

pytest.importorskip("ml_dtypes", reason="bfloat16 and FP8 pools need ml_dtypes")

TINY = PRESETS["tiny"]


def gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def _run(
    contract,
    kv_dtype=None,
    *,
    window=None,
    fused_norm=True,
    steps=6,
    dtype=None,
    device=None,
    impl="kernel",
    measure_update=False,
    seed=5,
):
    w = workload.Workload(
        TINY,
        batch=4,
        steps=steps,
        seed=seed,
        accept=parse_accept("geometric:0.8", 8),
        device=device or jax.devices("cpu")[0],
        dtype=dtype,
        kv_dtype=kv_dtype,
        contract=contract,
        window=window,
        fused_norm=fused_norm,
    )
    return w, w.run(impl, progress=False, measure_update=measure_update)


@pytest.mark.parametrize("contract", ["slot", "paged"])
@pytest.mark.parametrize("kv", list(KV_DTYPES))
def test_every_pool_dtype_is_bit_exact_and_reads_back(contract, kv):
    w, r = _run(contract, KV_DTYPES[kv])
    assert w.pool_dtype_name == KV_DTYPES[kv]
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
def test_update_share_is_a_share(contract):
    _, r = _run(contract, measure_update=True)
    assert r.best_step_without_update_seconds <= r.best_step_seconds
    assert 0.0 <= r.update_share <= 1.0
    assert r.update_seconds_per_step == pytest.approx(
        r.best_step_seconds - r.best_step_without_update_seconds
    )


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
    w = workload.Workload(
        TINY,
        batch=2,
        steps=4,
        seed=0,
        accept=parse_accept("fixed:2", 8),
        device=jax.devices("cpu")[0],
        contract="paged",
    )
    seconds, per_step = w.estimate_seconds("baseline")
    assert per_step > 0 and seconds >= per_step * w.steps


@pytest.mark.skipif(not gpu_devices(), reason="no GPU in this JAX: runs on the H200")
@pytest.mark.parametrize("contract", ["slot", "paged"])
@pytest.mark.parametrize("kv", ["bf16", "e4m3"])
def test_gpu_runs_are_bit_exact(contract, kv):
    _, r = _run(
        contract,
        KV_DTYPES[kv],
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
    w = workload.Workload(
        preset,
        batch=3,
        steps=5,
        seed=2,
        accept=parse_accept("uniform", 8),
        device=jax.devices("cpu")[0],
        kv_dtype="float8_e4m3fn",
        contract=contract,
    )
    r = w.run("kernel", progress=False, measure_update=False)
    assert w.rope.shape == (1, preset.slot_capacity, 16)
    assert r.check == "bit-exact" and r.readback.passed, r.readback.failure
