"""The run's host-memory estimate against the peak it really reaches: ``jax-dflash run`` in a
subprocess (on the CPU backend, where the device's memory is the host's), its estimate from the
``--json`` summary, its peak resident memory from ``getrusage(RUSAGE_CHILDREN)`` of a wrapper
process that runs nothing else. The estimate must cover the peak, and not by more than twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Runs its arguments and prints the peak resident KiB of its children: only the command's.
WRAPPER = (
    "import resource, subprocess, sys; "
    "status = subprocess.run(sys.argv[1:]).returncode; "
    "print(status, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)
# The small preset, whose pools and check deltas outweigh the runtime (in float32 more so): the
# estimate's parts are what is tested, not its constant.
SMALL = ("--preset", "small", "--no-progress")
FP32 = ("--dtype", "float32")

if sys.platform != "linux":
    pytest.skip("ru_maxrss is in KiB on Linux; elsewhere its unit differs", allow_module_level=True)


def _estimate_and_peak(tmp_path, *argv) -> tuple[int, int, dict]:
    summary_path = tmp_path / "summary.json"
    command = [sys.executable, "-m", "jax_dflash", "run", *argv, "--json", str(summary_path)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", WRAPPER, *command],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,  # not the checkout, whose source folder would shadow the installed package
        timeout=300,
    )
    status, peak_kib = (int(x) for x in done.stdout.split()[-2:])
    assert status == 0, done.stderr
    memory = json.loads(summary_path.read_text())["host_memory"]
    return memory["estimated_peak_bytes"], peak_kib * 1024, memory


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param((*FP32, "--steps", "20"), id="slot"),
        pytest.param((*FP32, "--steps", "300"), id="slot-deltas"),
        pytest.param((*FP32, "--steps", "20", "--no-check"), id="slot-no-check"),
        pytest.param(
            (*FP32, "--contract", "paged", "--steps", "150", "--compare"), id="paged-compare"
        ),
        # int4: half a byte per element and a float32 scale per head and plane.
        pytest.param((*FP32, "--steps", "20", "--kv-dtype", "int4"), id="slot-int4"),
        # bfloat16: the baseline's scatters run in float32 on a CPU (copies of the whole pool).
        pytest.param(("--steps", "4", "--compare"), id="slot-bf16-compare"),
    ],
)
def test_the_estimate_covers_the_measured_peak_within_twice(tmp_path, argv):
    estimate, peak, memory = _estimate_and_peak(tmp_path, *SMALL, *argv)
    mib = {name: round(size / 2**20) for name, size in memory["parts"].items()}
    detail = f"estimate {estimate / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB; parts {mib}"
    assert peak <= estimate <= 2 * peak, detail
    assert estimate == sum(memory["parts"].values())
    assert memory["limit_bytes"] > estimate  # the guard let it run
