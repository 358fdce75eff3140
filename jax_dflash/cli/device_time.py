"""Device time of the kernels a piece of work launches, from a profiler trace.

On a CUDA GPU the profilers read CUPTI's kernel records: each kernel's own time on the device,
without the host's dispatch or the gaps between launches. JAX's profiler (``jax.profiler``)
comes first, as it needs nothing beyond JAX; ``torch.profiler`` second, as the benchmark uses it
(``bench/dflash_bench/timing.py``), where torch with CUDA is installed. A CPU has no such trace:
there the caller falls back to wall-clock time and says how finely that resolves.
"""

from __future__ import annotations

import pathlib
import tempfile
from collections.abc import Callable

# The name of this project's CUDA update kernel, as the profilers report it
# (``dflash::kernel::update_kernel<...>``, csrc/dflash/kv_update_kernel.cuh).
OP_KERNEL_NAME = "dflash::kernel::update_kernel"
# Records on a stream line that are not kernels: copies and fills.
NOT_KERNELS = ("Memcpy", "Memset")


def op_kernel(name: str) -> bool:
    """Whether a kernel of the trace is the op's own."""
    return OP_KERNEL_NAME in name


def has_trace(device) -> bool:
    """Whether a profiler can give ``device``'s kernel times (a CPU has no device trace)."""
    return device.platform != "cpu"


def kernel_seconds(run: Callable[[], None], device) -> tuple[dict[str, float] | None, str]:
    """``(seconds of device time by kernel name over one run(), "")``, or ``(None, why not)``
    where no profiler gives a device trace (no CUPTI, no kernel recorded)."""
    reasons = []
    for source in (_jax_trace, _torch_trace):
        times, why = source(run, device)
        if times:
            return times, ""
        reasons.append(why)
    return None, "; ".join(reasons)


def _device_plane_names(device) -> tuple[str, ...]:
    index = getattr(device, "local_hardware_id", None)
    return tuple(f"/device:GPU:{i}" for i in {device.id, index} if i is not None)


def trace_kernel_seconds(profile, plane_names: tuple[str, ...]) -> dict[str, float]:
    """Kernel seconds by name from a ``jax.profiler.ProfileData``: the records on the stream
    lines of the device's plane (the derived lines, "XLA Ops" and the like, repeat them). When
    no plane has one of ``plane_names``, the only GPU plane of the trace, if there is one."""
    planes = [p for p in profile.planes if p.name in plane_names]
    if not planes:
        gpus = [p for p in profile.planes if p.name.startswith("/device:GPU:")]
        planes = gpus if len(gpus) == 1 else []
    times: dict[str, float] = {}
    for plane in planes:
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for event in line.events:
                if not event.name.startswith(NOT_KERNELS):
                    times[event.name] = times.get(event.name, 0.0) + event.duration_ns * 1e-9
    return times


def _jax_trace(run, device) -> tuple[dict[str, float] | None, str]:
    import jax

    try:
        with tempfile.TemporaryDirectory(prefix="jax-dflash-trace-") as folder:
            with jax.profiler.trace(folder):
                run()
            path = next(pathlib.Path(folder).rglob("*.xplane.pb"), None)
            if path is None:
                return None, "jax.profiler wrote no trace"
            profile = jax.profiler.ProfileData.from_file(str(path))
            times = trace_kernel_seconds(profile, _device_plane_names(device))
    except Exception as e:  # noqa: BLE001 - no trace is a fallback, not a failure
        return None, f"jax.profiler: {type(e).__name__}: {e}"
    return times or None, "" if times else "jax.profiler recorded no kernel"


def _torch_trace(run, device) -> tuple[dict[str, float] | None, str]:
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None, "torch.profiler: torch is not installed"
    if not torch.cuda.is_available():
        return None, "torch.profiler: torch has no CUDA here"
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        times: dict[str, float] = {}
        for event in prof.key_averages():
            us = getattr(event, "self_device_time_total", 0.0)
            if us > 0 and not event.key.startswith(NOT_KERNELS):
                times[event.key] = times.get(event.key, 0.0) + us * 1e-6
    except Exception as e:  # noqa: BLE001 - no trace is a fallback, not a failure
        return None, f"torch.profiler: {type(e).__name__}: {e}"
    return times or None, "" if times else "torch.profiler recorded no kernel"
