"""One implementation's timed, checked run, and what it measures.

The run: the prefill (paged contract; untimed, as the engine's), warm-up steps, the timed decode
steps (collecting the deltas for the check), the read-back check, then replays of the decode
steps with and without the update for the update's share, and last the reference check.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_dflash.cli import readback
from jax_dflash.cli.steps import DeviceSteps, ProgressBar, StepCollector
from jax_dflash.cli.verify import Checks
from jax_dflash.testing import compare_bits

# Timed replays of the decode steps, with and without the update, for the update's share:
# rounds alternate between the two until each has run this long (within the round limits);
# the best round of each counts, which drops the noise of a busy machine.
SHARE_SECONDS = 0.5
SHARE_ROUNDS = (2, 200)
LABELS = {"kernel": "dflash kernel", "baseline": "jnp baseline"}


@dataclasses.dataclass
class Timing:
    steps: int
    seconds: float  # the timed loop, fetches for the check excluded
    compile_seconds: float

    @property
    def step_seconds(self) -> float:
        return self.seconds / self.steps


@dataclasses.dataclass
class ImplResult:
    """One implementation's run: timing, derived rates and the checks."""

    impl: str
    label: str
    timing: Timing
    accepted_tokens: int
    update_bytes: int
    # Best per-step seconds of the step with and without the update (the same jitted step
    # minus the op), over the timed run and the replays.
    best_step_seconds: float | None
    best_step_without_update_seconds: float | None
    check: str  # "bit-exact", "differs" or "skipped"
    mismatched_elements: int | None
    max_ulp: int | None
    checked_elements: int | None
    readback: readback.ReadbackResult | None = None

    @property
    def bit_exact_required(self) -> bool:
        """The kernel must match the reference bit for bit; the jnp baseline is only reported
        (XLA may contract its RoPE products into FMAs, which rounds differently)."""
        return self.impl == "kernel"

    @property
    def failed(self) -> bool:
        bits = self.bit_exact_required and self.check == "differs"
        return bits or (self.readback is not None and not self.readback.passed)

    @property
    def steps_per_s(self) -> float:
        return 1.0 / self.timing.step_seconds

    @property
    def accepted_tokens_per_s(self) -> float:
        return self.accepted_tokens / self.timing.seconds

    @property
    def update_seconds_per_step(self) -> float | None:
        """The step's time minus the same step's time without the update (>= 0: a difference
        below the timing noise reads as 0)."""
        if self.best_step_without_update_seconds is None:
            return None
        return max(self.best_step_seconds - self.best_step_without_update_seconds, 0.0)

    @property
    def update_share(self) -> float | None:
        """``1 - (step without the update) / (step)``: both times are non-negative, so the share
        is at most 100% by construction (unlike timing the update alone, whose own launch and
        dispatch costs could add up to more than the step it is part of)."""
        u = self.update_seconds_per_step
        return None if u is None else u / self.best_step_seconds

    @property
    def update_gb_per_s(self) -> float | None:
        u = self.update_seconds_per_step
        if not u:
            return None
        return self.update_bytes / (u * self.timing.steps) / 1e9

    def as_dict(self) -> dict:
        return {
            "impl": self.impl,
            "label": self.label,
            "steps": self.timing.steps,
            "seconds": self.timing.seconds,
            "compile_seconds": self.timing.compile_seconds,
            "step_ms": self.timing.step_seconds * 1e3,
            "steps_per_s": self.steps_per_s,
            "accepted_tokens_per_s": self.accepted_tokens_per_s,
            "best_step_ms": _scaled(self.best_step_seconds, 1e3),
            "best_step_without_update_ms": _scaled(self.best_step_without_update_seconds, 1e3),
            "update_ms_per_step": _scaled(self.update_seconds_per_step, 1e3),
            "update_share": self.update_share,
            "update_gb_per_s": self.update_gb_per_s,
            "update_bytes": self.update_bytes,
            "check": self.check,
            "bit_exact_required": self.bit_exact_required,
            "mismatched_elements": self.mismatched_elements,
            "max_ulp": self.max_ulp,
            "checked_elements": self.checked_elements,
            "readback": None if self.readback is None else self.readback.as_dict(),
        }


def _scaled(x, factor):
    return None if x is None else x * factor


def replay_rounds(run_seconds: float) -> int:
    """Rounds of the update-share replays for a decode run that took ``run_seconds``."""
    low, high = SHARE_ROUNDS
    return int(np.clip(np.ceil(SHARE_SECONDS / max(run_seconds, 1e-9)), low, high))


def run_impl(
    steps: DeviceSteps,
    checks: Checks,
    impl: str,
    *,
    check: bool = True,
    measure_update: bool = True,
    progress: bool = True,
    check_readback: bool = True,
) -> ImplResult:
    """The timed, checked run of one implementation; then (``measure_update``) replays of the
    decode steps with and without the update, for the update's share."""
    plan, label = steps.plan, LABELS[impl]
    compiled, compile_seconds = steps.compiled(impl, True)
    collector = StepCollector() if check else None
    pools, seconds = _timed_run(
        steps, compiled, collector, ProgressBar(plan.steps, label, enabled=progress)
    )
    timing = Timing(plan.steps, seconds, compile_seconds)
    actual = np.array(pools) if check else None  # a copy: the replays write into the device pool
    rb = checks.readback(pools) if check_readback else None
    best, best_without = timing.step_seconds, None
    if measure_update:
        best, best_without = _share_replays(steps, impl, pools, seconds, best)
    del pools  # the reference check needs no device pool: let it go before it runs
    verdict, mismatches, max_ulp, elements = "skipped", None, None, None
    if check:
        mismatches, max_ulp, elements = _reference_check(checks, collector, actual, impl)
        verdict = "bit-exact" if mismatches == 0 else "differs"
    return ImplResult(
        impl,
        label,
        timing,
        plan.accepted_tokens,
        plan.update_bytes,
        best,
        best_without,
        verdict,
        mismatches,
        max_ulp,
        elements,
        rb,
    )


def _timed_run(steps: DeviceSteps, compiled, collector, bar: ProgressBar):
    """The prefill, the warm-up and the timed decode steps: (the pools after them, seconds)."""
    plan = steps.plan
    first = plan.prefill_steps
    state = steps.state(steps.fresh_pools(), 0)
    if first:  # the prompt cache: untimed, as the engine's prefill
        state, _ = steps.loop(compiled, state, 0, first, collector=collector)
    pools = steps.warm_up(compiled, state[0])
    state, seconds = steps.loop(
        compiled, steps.state(pools, first), first, plan.steps, collector=collector, bar=bar
    )
    if plan.plan is None:
        final_positions = np.asarray(state[2])
        expected_positions = plan.schedule.starts + plan.schedule.totals
        if not np.array_equal(final_positions, expected_positions):
            raise AssertionError(  # a bug of this simulation, not of the op
                f"positions after the run: expected {expected_positions}, got {final_positions}"
            )
    return state[0], seconds


def _share_replays(steps: DeviceSteps, impl: str, pools, seconds: float, best: float):
    """Replays of the decode steps without and with the update, alternating: (best step
    seconds with, without the update). Keeps no pool when it returns."""
    plan = steps.plan
    compiled, _ = steps.compiled(impl, True)
    without, _ = steps.compiled(impl, False)
    first, n = plan.prefill_steps, plan.steps
    best_without = None
    for _ in range(replay_rounds(seconds)):
        state, s = steps.loop(without, steps.state(pools, first), first, n)
        pools = state[0]
        best_without = s / n if best_without is None else min(best_without, s / n)
        state, s = steps.loop(compiled, steps.state(pools, first), first, n)
        pools = state[0]
        best = min(best, s / n)
    return best, min(best_without, best)


def _reference_check(checks: Checks, collector: StepCollector, actual, impl: str):
    """(mismatched elements, max ulp, elements) of the run's pools against the reference."""
    collector.flush()
    expected = checks.reference_pools(collector.steps, impl)
    collector.steps.clear()  # the deltas are spent: free them before the comparison
    mismatches, max_ulp = compare_bits(actual, expected)
    return mismatches, max_ulp, expected.size


def estimate_seconds(steps: DeviceSteps, impl: str, *, timed_steps: int = 3):
    """``(estimated seconds of run_impl(impl), seconds per step)`` from a few timed steps on a
    scratch pool, compilation excluded."""
    plan = steps.plan
    compiled, compile_s = steps.compiled(impl, True)
    pools = steps.warm_up(compiled, steps.fresh_pools())
    state = steps.state(pools, plan.prefill_steps)
    n = max(1, min(timed_steps, plan.steps))
    _, seconds = steps.loop(compiled, state, plan.prefill_steps, n)
    per_step = seconds / n
    total_steps = plan.prefill_steps + plan.steps * (1 + 2 * replay_rounds(per_step * plan.steps))
    return compile_s + per_step * total_steps, per_step
