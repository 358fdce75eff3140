"""How contenders are timed: jitted chains timed from the host, CUDA graphs replayed between
CUDA events, host loops on the CPU; and the interleaved measurement of a shape's contenders."""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable

from dflash_bench.clocks import GpuClocks, clocks_during


class Skip(Exception):
    """A contender that cannot run here; the message says why."""


@dataclasses.dataclass(frozen=True)
class Settings:
    backend: str
    chain: int  # updates per jitted call / per CUDA graph
    baseline_chain: int  # the same for the (much slower to compile) straightforward JAX version
    repeats: int
    min_time: float  # seconds per measurement at least


@dataclasses.dataclass
class Prepared:
    """A contender set up for one shape and checked, ready to be timed.

    ``run(calls)`` -> seconds for ``calls`` back-to-back calls of ``updates_per_call`` updates
    each; ``info`` goes into the result as is; ``finish(result)``, when given, adds what only
    the timing runs reveal (host dispatch time of the JAX contenders). ``inputs`` holds what
    ``run`` reads without referencing it (the buffers a captured CUDA graph replays on)."""

    run: Callable[[int], float]
    updates_per_call: int
    info: dict
    finish: Callable[[dict], None] | None = None
    inputs: object = None


def calibrate(run: Callable[[int], float], min_time: float) -> int:
    """Calls per measurement so that one lasts at least ``min_time``, found in the steady state.

    One call is not a good estimate: the first calls of a jitted chain on GPU are many times
    slower than the steady state, and a single host-timed call also pays for filling the
    pipeline. So the count grows until a measurement lasts a quarter of ``min_time``."""
    run(2)  # warm-up (compiles, JITs, first-touch)
    calls = 1
    while True:
        seconds = run(calls)
        if seconds >= min_time / 4 or calls >= 1 << 20:
            return max(1, math.ceil(calls * min_time / max(seconds, 1e-9)))
        calls *= 4


def _failure(e: Exception) -> dict:
    return {"status": "error", "reason": f"{type(e).__name__}: {e}"}


def _measure_in_turns(prepared: dict[str, Prepared], calls: dict, repeats: int, out: dict):
    """``repeats`` rounds over the calibrated contenders, the order rotated by one each round:
    (seconds per update of each measurement, wall-clock spans of the measurements) by name.
    A contender that raises gets its error in ``out`` and is left out of later rounds."""
    names = [n for n in prepared if n in calls]
    samples = {n: [] for n in names}
    windows = {n: [] for n in names}
    for r in range(repeats if names else 0):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if name in out:
                continue  # failed in an earlier round
            p = prepared[name]
            try:
                start = time.time()
                seconds = p.run(calls[name])
                windows[name].append((start, time.time()))
            except Exception as e:  # noqa: BLE001 - one failing contender must not end the run
                out[name] = _failure(e)
                continue
            samples[name].append(seconds / (calls[name] * p.updates_per_call))
    return samples, windows


def time_interleaved(
    prepared: dict[str, Prepared], settings: Settings, clocks: GpuClocks | None = None
) -> dict[str, dict]:
    """Times every prepared contender ``settings.repeats`` times, interleaved.

    Each contender is warmed up and calibrated (calls per measurement, so that one lasts at
    least ``min_time``); then the measurements go round the contenders, the order rotated by
    one each round, so that every contender is timed in every position. A contender timed on
    its own right after its setup can measure slow for reasons that have nothing to do with it
    (BENCHMARKS.md, "How the benchmark times"). Median seconds per update over the repeats.
    With ``clocks``, each result also gets ``clocks``: the GPU's clock samples taken during its
    own measurements (``clocks_during``)."""
    calls, out = {}, {}
    for name, p in prepared.items():
        try:
            calls[name] = calibrate(p.run, settings.min_time)
        except Exception as e:  # noqa: BLE001 - one failing contender must not end the run
            out[name] = _failure(e)
    samples, windows = _measure_in_turns(prepared, calls, settings.repeats, out)
    clock_samples = clocks.samples() if clocks is not None else []
    for name in samples:
        if name in out:
            continue
        us = [x * 1e6 for x in samples[name]]
        result = dict(prepared[name].info)
        result.update(
            {
                "us": statistics.median(us),
                "us_min": min(us),
                "us_max": max(us),
                "samples_us": [round(x, 4) for x in us],
                "updates_per_measurement": calls[name] * prepared[name].updates_per_call,
            }
        )
        if clocks is not None:
            result["clocks"] = clocks_during(windows[name], clock_samples)
        if prepared[name].finish is not None:
            prepared[name].finish(result)
        out[name] = result
    return out


def host_timed(step, state: dict, args: tuple, chain: int, backend: str) -> Prepared:
    """A jitted ``step(carried, *args) -> carried`` called back to back, timed from the host
    up to ``block_until_ready`` (async dispatch keeps the device busy meanwhile)."""
    dispatch = []  # host seconds per call spent dispatching (the GPU runs behind it)

    def run(calls: int) -> float:
        import jax

        carried = state["carried"]
        jax.block_until_ready(carried)
        t0 = time.perf_counter()
        for _ in range(calls):
            carried = step(carried, *args)
        dispatched = time.perf_counter() - t0
        jax.block_until_ready(carried)
        elapsed = time.perf_counter() - t0
        state["carried"] = carried
        dispatch.append(dispatched / calls)
        return elapsed

    def finish(result: dict) -> None:
        # Wall time is device time only while the host dispatches faster than the GPU runs: when
        # dispatching a call takes most of its time, the number is host-bound (an upper bound).
        timed = dispatch[-len(result["samples_us"]) :]  # the measurements, not the calibration
        host_us = statistics.median(timed) / chain * 1e6
        result["host_dispatch_us"] = host_us
        result["host_bound"] = host_us >= 0.8 * result["us"]
        kernels = kernel_device_us(run, chain)
        if kernels is not None:
            result["kernels_us"] = kernels

    return Prepared(run, chain, {"chain": chain}, finish if backend == "gpu" else None)


def kernel_device_us(run: Callable[[int], float], updates: int) -> dict[str, float] | None:
    """µs of device time per update of each kernel that one ``run(1)`` launches, by kernel name,
    from the CUDA profiling interface (CUPTI, through torch.profiler): what the kernels take
    themselves, without the gaps between launches. None without torch's CUDA profiler."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(1)
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", 0.0)
        if us > 0:
            times[event.key] = times.get(event.key, 0.0) + us / updates
    return times or None


def warm_up_calls(chain: int) -> range:
    """The ``i`` of the calls ``cuda_graph`` makes before its capture, in order."""
    return range(min(chain, 3))


def cuda_graph(torch, enqueue: Callable[[int], None], chain: int, info: dict) -> Prepared:
    """Captures ``enqueue(i)`` for i < chain into one CUDA graph, replays timed with events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in warm_up_calls(chain):
            enqueue(i)
    torch.cuda.current_stream().wait_stream(side)
    gc.collect()  # JAX frees the buffers of earlier contenders now, not during the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # Thread-local: JAX's own threads (frees, event polling) may call CUDA during the capture; in
    # torch's default global mode such a call invalidates the capture and leaves JAX's stream in
    # an error state (seen on the H200 at the 5-layer shape).
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for i in range(chain):
            enqueue(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run(calls: int) -> float:
        start.record()
        for _ in range(calls):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    # The graph replays on the buffers enqueue's closure holds: they must outlive it.
    return Prepared(run, chain, {**info, "chain": chain}, inputs=enqueue)


def host_loop(fn: Callable[[int], None], chain: int, info: dict) -> Prepared:
    """``fn(i)`` for i < chain per call, timed with ``time.perf_counter`` (CPU contenders)."""

    def run(calls: int) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            for i in range(chain):
                fn(i)
        return time.perf_counter() - t0

    return Prepared(run, chain, {**info, "chain": chain})
