"""One implementation's checked pass, and what the run reports of it.

The checked pass: the prefill (paged contract; untimed, as the engine's), warm-up steps, the
decode steps collecting the deltas for the check, the read-back check, and last the reference
check. Its time is reported apart: collecting the deltas costs host time that an engine's step
does not pay. The headline (steps/s, the update's time) comes from the replays of
:mod:`jax_dflash.cli.replays`, run after every implementation's checked pass.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_dflash.cli import readback, replays
from jax_dflash.cli.formats import elements_per_byte
from jax_dflash.cli.steps import DeviceSteps, ProgressBar, StepCollector
from jax_dflash.cli.verify import Checks, Differences, differences
from jax_dflash.testing import compare_bits

LABELS = {"kernel": "dflash kernel", "baseline": "jnp baseline"}


@dataclasses.dataclass
class CheckedPass:
    steps: int
    seconds: float  # until the device finished the decode steps, fetches for the check excluded
    compile_seconds: float

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds


@dataclasses.dataclass
class ImplResult:
    """One implementation's run: the checked pass, the checks, and (once measured) the replays'
    step times and the update's time."""

    impl: str
    label: str
    checked: CheckedPass
    accepted_tokens: int
    update_bytes: int
    check: str  # "bit-exact", "differs" or "skipped"
    mismatched_elements: int | None
    max_ulp: int | None
    checked_elements: int | None
    readback: readback.ReadbackResult | None = None
    differences: Differences | None = None
    mismatched_by_layer: list[int] | None = None  # differing elements of each layer's pool
    # A dynamic format's scale pool, checked bit for bit beside the pool: its differing and
    # checked scales (None: a format without one).
    mismatched_scales: int | None = None
    checked_scales: int | None = None
    # What the element counts count: the pool's stored entries (an int4 pool's: its bytes).
    checked_unit: str = "elements"
    times: replays.StepTimes | None = None
    update: replays.UpdateTime | None = None

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
    def steps_per_s(self) -> float | None:
        return None if self.times is None else self.times.steps_per_s

    @property
    def accepted_tokens_per_s(self) -> float | None:
        if self.times is None:
            return None
        return self.accepted_tokens / (self.times.median * self.times.steps)

    def _per_step(self, seconds: float | None) -> float | None:
        """``seconds`` (per step) as a share of the median step."""
        if seconds is None or self.times is None:
            return None
        return seconds / self.times.median

    @property
    def update_share(self) -> float | None:
        """The update's share of the median step; None when not measured or below resolution."""
        return self._per_step(None if self.update is None else self.update.seconds)

    @property
    def update_share_resolution(self) -> float | None:
        return self._per_step(None if self.update is None else self.update.resolution)

    @property
    def update_gb_per_s(self) -> float | None:
        if self.update is None or self.update.seconds is None:
            return None
        return self.update_bytes / (self.update.seconds * self.checked.steps) / 1e9

    def as_dict(self) -> dict:
        out = {"impl": self.impl, "label": self.label, "steps": self.checked.steps}
        out.update(self._timing_dict())
        out.update(
            checked_pass={
                "seconds": self.checked.seconds,
                "steps_per_s": self.checked.steps_per_s,
            },
            compile_seconds=self.checked.compile_seconds,
            update_bytes=self.update_bytes,
            check=self.check,
            bit_exact_required=self.bit_exact_required,
            mismatched_elements=self.mismatched_elements,
            mismatched_elements_by_layer=self.mismatched_by_layer,
            max_ulp=self.max_ulp,
            checked_elements=self.checked_elements,
            checked_unit=self.checked_unit,
            mismatched_scales=self.mismatched_scales,
            checked_scales=self.checked_scales,
            differences=None if self.differences is None else self.differences.as_dict(),
            readback=None if self.readback is None else self.readback.as_dict(),
        )
        return out

    def _timing_dict(self) -> dict:
        t, u = self.times, self.update
        slowest, fastest = (None, None) if t is None else t.steps_per_s_range
        return {
            "steps_per_s": self.steps_per_s,
            "steps_per_s_slowest": slowest,
            "steps_per_s_fastest": fastest,
            "step_ms": None if t is None else t.median * 1e3,
            "replays": None if t is None else len(t.samples),
            "step_ms_samples": None if t is None else [round(x * 1e3, 6) for x in t.samples],
            "accepted_tokens_per_s": self.accepted_tokens_per_s,
            "update_method": None if u is None else u.method,
            "update_basis": None if u is None else u.basis,
            "update_ms_per_step": _scaled(u and u.seconds, 1e3),
            "update_resolution_ms": _scaled(u and u.resolution, 1e3),
            "update_below_resolution": None if u is None else u.below_resolution,
            "update_share": self.update_share,
            "update_share_resolution": self.update_share_resolution,
            "update_gb_per_s": self.update_gb_per_s,
            "update_note": None if u is None else u.note,
        }


def _scaled(x, factor):
    return None if x is None else x * factor


def run_impl(
    steps: DeviceSteps,
    checks: Checks,
    impl: str,
    *,
    check: bool = True,
    progress: bool = True,
    check_readback: bool = True,
) -> ImplResult:
    """The checked pass of one implementation (see the module docstring)."""
    plan, label = steps.plan, LABELS[impl]
    compiled, compile_seconds = steps.compiled(impl, True)
    collector = StepCollector() if check else None
    bar = ProgressBar(plan.steps, f"{label}, checked pass", enabled=progress)
    pools, seconds = _timed_run(steps, compiled, collector, bar)
    # A host copy: the read-back reads the device's (a dynamic format's scale pool too).
    actual = None
    if check:
        actual = tuple(np.array(a) for a in pools) if plan.dynamic else np.array(pools)
    rb = checks.readback(pools) if check_readback else None
    del pools  # the reference check needs no device pool: let it go before it runs
    result = ImplResult(
        impl,
        label,
        CheckedPass(plan.steps, seconds, compile_seconds),
        plan.accepted_tokens,
        plan.update_bytes,
        "skipped",
        None,
        None,
        None,
        rb,
    )
    if check:
        _reference_check(checks, collector, actual, result)
    return result


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


def _reference_check(checks: Checks, collector: StepCollector, actual, result: ImplResult):
    """The run's pools against the reference, into ``result``."""
    collector.flush()
    expected = checks.reference_pools(collector.steps, result.impl)
    collector.steps.clear()  # the deltas are spent: free them before the comparison
    scales_mismatched = 0
    if isinstance(expected, tuple):  # a dynamic format: the scale pool is checked too
        (actual, actual_scales), (expected, expected_scales) = actual, expected
        scales_mismatched = compare_bits(actual_scales, expected_scales)[0]
        result.mismatched_scales = scales_mismatched
        result.checked_scales = expected_scales.size
    mismatches, max_ulp = compare_bits(actual, expected)
    if elements_per_byte(checks.plan.pool_dtype_name) > 1:
        result.checked_unit = "bytes (two int4 elements each)"
    result.check = "bit-exact" if mismatches + scales_mismatched == 0 else "differs"
    result.mismatched_elements, result.max_ulp = mismatches, max_ulp
    result.checked_elements = expected.size
    # Layer by layer: layers differ in their kind of pages and ring (a mixed draft).
    result.mismatched_by_layer = [
        mismatches and compare_bits(a, e)[0] for a, e in zip(actual, expected)
    ]
    if scales_mismatched:  # a layer's differing scales count with its elements
        result.mismatched_by_layer = [
            n + compare_bits(a, e)[0]
            for n, a, e in zip(result.mismatched_by_layer, actual_scales, expected_scales)
        ]
    if mismatches:
        result.differences = differences(actual, expected)


def measure(steps: DeviceSteps, results: list[ImplResult], *, progress: bool = True) -> None:
    """The replays of every result's implementation, interleaved, into the results."""
    measured = replays.measure(steps, [r.impl for r in results], progress=progress)
    for r in results:
        r.times, r.update = measured[r.impl]


def estimate_seconds(steps: DeviceSteps, impl: str, *, timed_steps: int = 3):
    """``(estimated seconds of impl's checked pass and its share of the replays, seconds per
    step)`` from a few timed steps on a scratch pool, compilation excluded."""
    plan = steps.plan
    compiled, compile_s = steps.compiled(impl, True)
    pools = steps.warm_up(compiled, steps.fresh_pools())
    state = steps.state(pools, plan.prefill_steps)
    n = max(1, min(timed_steps, plan.steps))
    _, seconds = steps.loop(compiled, state, plan.prefill_steps, n)
    per_step = seconds / n
    variants = 1 if steps.device.platform != "cpu" else 2  # a CPU also replays it without
    rounds = 1 + replays.replay_rounds(per_step * plan.steps)  # the warm-up round too
    total_steps = plan.prefill_steps + plan.steps * (1 + variants * rounds)
    return compile_s + per_step * total_steps, per_step
