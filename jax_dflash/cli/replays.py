"""The headline timing of ``run``: interleaved, repeated replays of each implementation's decode
steps, nothing collected, after the checked passes; and the update's time in the step.

A replay runs the plan's decode steps from their start on one scratch device pool. A round
replays every variant once (each implementation's step, and where the update is timed by wall
clock the same step without it), the order rotated by one each round, so that no variant always
runs first or after the same one; the first round only warms up and sizes the rest. steps/s is
decode steps over the seconds until the device has finished them (the checked pass and the
progress bar count the same way); the headline is the median over the rounds, the spread the
slowest and the fastest replay.

The update's time in the step: on a device with a profiler trace, device time (the op's kernels
for the kernel; for the jnp pipeline, which has no op, the kernel time the update adds to the
step). Elsewhere (a CPU), the step's time minus the same step's without the update, paired per
round, as the median over the rounds, with a resolution of two standard errors of that median:
below it the update is reported as below it, never as zero.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from jax_dflash.cli import device_time
from jax_dflash.cli.steps import DeviceSteps, ProgressBar

# Rounds continue until each variant has replayed for about this long, within the round limits.
MEASURE_SECONDS = 1.0
ROUNDS = (3, 200)
# Decode steps replayed under the profiler (a trace of every step is not needed for a mean).
PROFILED_STEPS = 64
TIMER_SECONDS = time.get_clock_info("perf_counter").resolution


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """Seconds per step of an implementation's replays, one sample per round."""

    steps: int  # decode steps per replay
    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return float(np.median(self.samples))

    @property
    def steps_per_s(self) -> float:
        return 1.0 / self.median

    @property
    def steps_per_s_range(self) -> tuple[float, float]:
        """The slowest and the fastest replay, in steps/s."""
        return 1.0 / max(self.samples), 1.0 / min(self.samples)


@dataclasses.dataclass(frozen=True)
class UpdateTime:
    """The update's seconds per step, and how they were measured."""

    method: str  # "device" or "wall-clock"
    basis: str  # what was timed
    seconds: float | None  # None: below the resolution
    resolution: float | None = None  # wall clock: the seconds per step it resolves
    note: str = ""  # wall clock: why there was no device time

    @property
    def below_resolution(self) -> bool:
        return self.seconds is None


def replay_rounds(variant_seconds: float) -> int:
    """Timed rounds when one replay of a variant takes ``variant_seconds``."""
    low, high = ROUNDS
    return int(np.clip(np.ceil(MEASURE_SECONDS / max(variant_seconds, 1e-9)), low, high))


def replay(steps: DeviceSteps, compiled, pools, count: int | None = None):
    """The plan's decode steps (the first ``count``) from their start: (pools, seconds)."""
    first = steps.plan.prefill_steps
    n = steps.plan.steps if count is None else count
    state, seconds = steps.loop(compiled, steps.state(pools, first), first, n)
    return state[0], seconds


def wall_clock_update(with_update, without_update, steps: int, note: str) -> UpdateTime:
    """The update's time from per-round step seconds with and without it (paired by round)."""
    d = np.asarray(with_update) - np.asarray(without_update)
    median = float(np.median(d))
    mad = float(np.median(np.abs(d - median)))
    # A normal's standard deviation is 1.4826 MADs; its median's standard error is
    # sqrt(pi / 2) standard deviations over sqrt(samples).
    error = 1.4826 * math.sqrt(math.pi / 2) * mad / math.sqrt(len(d))
    resolution = max(2 * error, TIMER_SECONDS / steps)
    seconds = median if median > resolution else None
    return UpdateTime(
        "wall-clock", "step minus the step without the update", seconds, resolution, note
    )


def measure(steps: DeviceSteps, impls: list[str], *, progress: bool = True) -> dict:
    """``{impl: (StepTimes, UpdateTime)}`` from the interleaved replays (see the module)."""
    n = steps.plan.steps
    pools = steps.fresh_pools()
    device, notes = {}, {}
    for impl in impls:
        update, notes[impl], pools = _device_update(steps, impl, pools)
        if update is not None:
            device[impl] = update
    variants = [(impl, True) for impl in impls]
    variants += [(impl, False) for impl in impls if impl not in device]
    samples = _rounds(steps, variants, pools, progress)
    out = {}
    for impl in impls:
        times = StepTimes(n, tuple(samples[impl, True]))
        update = device.get(impl) or wall_clock_update(
            samples[impl, True], samples[impl, False], n, notes[impl]
        )
        out[impl] = (times, update)
    return out


def _rounds(steps: DeviceSteps, variants: list, pools, progress: bool) -> dict:
    """Per-step seconds of each variant, one per timed round; a warm-up round first."""
    compiled = {v: steps.compiled(*v)[0] for v in variants}
    samples: dict = {v: [] for v in variants}
    n = steps.plan.steps

    def one_round(r: int, keep: bool) -> None:
        nonlocal pools
        shift = r % len(variants)
        for v in variants[shift:] + variants[:shift]:
            pools, seconds = replay(steps, compiled[v], pools)
            if keep:
                samples[v].append(seconds / n)

    start = time.perf_counter()
    one_round(0, keep=False)
    rounds = replay_rounds((time.perf_counter() - start) / len(variants))
    bar = ProgressBar(rounds, "timing: interleaved replays", enabled=progress, unit="rounds")
    start = time.perf_counter()
    for r in range(rounds):
        one_round(r, keep=True)
        bar.update(r + 1, time.perf_counter() - start)
    return samples


def _device_update(steps: DeviceSteps, impl: str, pools):
    """(the update's device time or None, why not, pools) from profiled replays."""
    if not device_time.has_trace(steps.device):
        return None, "a CPU has no device trace", pools
    n = min(steps.plan.steps, PROFILED_STEPS)
    kernels, why, pools = _profile(steps, steps.compiled(impl, True)[0], pools, n)
    if kernels is None:
        return None, why, pools
    op = sum(t for name, t in kernels.items() if device_time.op_kernel(name))
    if impl == "kernel" and op > 0:
        return UpdateTime("device", "the op's kernels", op / n), "", pools
    without, why, pools = _profile(steps, steps.compiled(impl, False)[0], pools, n)
    if without is None:
        return None, why, pools
    added = (sum(kernels.values()) - sum(without.values())) / n
    if added <= 0:
        return None, "the device trace showed no kernel time for the update", pools
    return UpdateTime("device", "kernel time the update adds to the step", added), "", pools


def _profile(steps: DeviceSteps, compiled, pools, n: int):
    """(kernel seconds by name over ``n`` replayed steps or None, why not, pools)."""
    holder = [pools]

    def run() -> None:
        holder[0], _ = replay(steps, compiled, holder[0], n)

    run()  # the first execution of an executable is no sample of it
    kernels, why = device_time.kernel_seconds(run, steps.device)
    return kernels, why, holder[0]
