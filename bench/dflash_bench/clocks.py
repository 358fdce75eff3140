"""The GPU's SM clock and power draw during the run (nvidia-smi), and which results were
measured below the run's top clock."""

from __future__ import annotations

import datetime
import os
import shutil
import statistics
import subprocess
import tempfile


class GpuClocks:
    """The GPU's SM clock and power draw, sampled by ``nvidia-smi`` (a read-only query) every
    ``period_ms`` while the benchmark runs, so that each result can say at which clock it was
    measured: under a sustained load the H200 holds its power limit (700 W) by lowering the SM
    clock, and kernels with more arithmetic per byte slow down more than copies
    (BENCHMARKS.md, "Power"). ``start()`` returns why sampling is off, or None."""

    QUERY = "timestamp,clocks.sm,power.draw"

    def __init__(self, period_ms: int = 100):
        self.period_ms = period_ms
        self._proc = None
        self._log = None

    def start(self) -> str | None:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return "nvidia-smi is not on PATH"
        self._log = tempfile.TemporaryFile(mode="w+")
        command = [exe, f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits"]
        command += ["-i", self.gpu, "-lms", str(self.period_ms)]
        try:
            self._proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.DEVNULL)
        except OSError as e:  # found but not runnable here: the run goes on without clocks
            self._log.close()
            self._log = None
            return f"nvidia-smi could not be started ({e})"
        return None

    @property
    def gpu(self) -> str:
        return sampled_gpu(os.environ.get("CUDA_VISIBLE_DEVICES"))

    def samples(self) -> list[tuple[float, float, float]]:
        """(epoch seconds, SM MHz, watts) of every sample so far."""
        if self._log is None:
            return []
        self._log.flush()
        self._log.seek(0)
        return parse_clock_samples(self._log.read().splitlines())

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._proc = None


def sampled_gpu(visible: str | None) -> str:
    """The GPU nvidia-smi should sample (its ``-i``): the one the benchmark runs on, the first
    of ``CUDA_VISIBLE_DEVICES`` (an index or a UUID; nvidia-smi itself ignores that variable and
    would print a line per GPU of the host), else GPU 0."""
    first = (visible or "").split(",")[0].strip()
    return first or "0"


def parse_clock_samples(lines: list[str]) -> list[tuple[float, float, float]]:
    """nvidia-smi's ``timestamp, clocks.sm, power.draw`` lines (csv, no header, no units; the
    timestamp in this machine's local time, as ``time.time()`` counts) -> (epoch seconds, SM
    MHz, watts). Lines that are not such a sample (a last one cut short, [N/A]) are left out."""
    out = []
    for line in lines:
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
            out.append((stamp.timestamp(), float(parts[1]), float(parts[2])))
        except ValueError:
            continue
    return out


def clocks_during(
    windows: list[tuple[float, float]], samples: list[tuple[float, float, float]]
) -> dict | None:
    """The clock samples taken inside ``windows`` (one contender's measurements): how many, the
    lowest and the median SM clock, the highest power draw. None when no sample fell in them
    (a measurement is shorter than the sampling period at small settings)."""
    inside = [(mhz, watts) for t, mhz, watts in samples if any(a <= t <= b for a, b in windows)]
    if not inside:
        return None
    mhz = [m for m, _ in inside]
    return {
        "samples": len(inside),
        "sm_mhz_min": min(mhz),
        "sm_mhz_median": statistics.median(mhz),
        "power_w_max": max(w for _, w in inside),
    }


def _below_top_clock(results: dict) -> tuple[float | None, list[tuple[str, str, dict]]]:
    """The highest median SM clock of the run's results, and the (shape, contender, clocks) of
    every result measured at a lower median: the ones a power or thermal limit slowed down."""
    measured = [
        (e["name"], name, c["clocks"])
        for e in results["shapes"]
        for name, c in e["contenders"].items()
        if c.get("clocks")
    ]
    if not measured:
        return None, []
    top = max(k["sm_mhz_median"] for _, _, k in measured)
    return top, [(shape, name, k) for shape, name, k in measured if k["sm_mhz_median"] < top]


def clock_notes(results: dict) -> list[str]:
    """One line per contender measured at a median SM clock below the highest median of the run."""
    top, slow = _below_top_clock(results)
    return [
        f"{shape} {name}: SM clock median {k['sm_mhz_median']:.0f} MHz (min {k['sm_mhz_min']:.0f}, "
        f"{k['samples']} samples) against {top:.0f} MHz, power up to {k['power_w_max']:.0f} W"
        for shape, name, k in slow
    ]


def mark_clock_limited(results: dict) -> None:
    """Marks each target of a shape in which a contender was measured below the run's highest
    median SM clock (``clock_limited``: the contenders' names), so that a target met or missed
    under a power limit says so where it is printed."""
    by_shape: dict[str, list[str]] = {}
    for shape, name, _ in _below_top_clock(results)[1]:
        by_shape.setdefault(shape, []).append(name)
    for t in results["targets"]:
        shape = t["target"].split(":", 1)[0]
        if shape in by_shape:
            t["clock_limited"] = by_shape[shape]
