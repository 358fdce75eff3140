"""The op across processes: 2 jax.distributed processes on localhost, 2 CPU devices each.

Each process (tests/_multihost_worker.py) joins the job, builds the same slot-sharded pool over
the 4 global devices (one slot per device), runs the donated update under jax.jit and checks its
addressable shards bit for bit against the NumPy reference; the test checks what both saw: every
slot checked once, the pool's sharding kept, and no collective in the compiled program.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "_multihost_worker.py"
PROCESSES, LOCAL_DEVICES = 2, 2
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_job(tmp_path: Path) -> list[dict]:
    coordinator = f"127.0.0.1:{_free_port()}"
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={LOCAL_DEVICES}",
        # The workers import jax_dflash as this process does (an installed package or the
        # checkout), not from their own working directory.
        PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
    )
    procs, logs = [], []
    for i in range(PROCESSES):
        log = open(tmp_path / f"worker{i}.log", "w+")  # closed below
        logs.append(log)
        cmd = [
            sys.executable,
            str(WORKER),
            coordinator,
            str(PROCESSES),
            str(i),
            str(tmp_path / f"worker{i}.json"),
        ]
        procs.append(
            subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
        )
    timed_out = []
    try:
        for i, proc in enumerate(procs):
            try:
                proc.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                timed_out.append(i)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read()[-4000:])
        log.close()
    if timed_out:
        pytest.fail(f"workers {timed_out} ran past {TIMEOUT_S} s; output:\n" + "\n".join(outputs))
    results = []
    for i, proc in enumerate(procs):
        path = tmp_path / f"worker{i}.json"
        if proc.returncode != 0 or not path.exists():
            pytest.fail(f"worker {i} exited {proc.returncode} without a result:\n{outputs[i]}")
        results.append(json.loads(path.read_text()))
    return results


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    results = _run_job(tmp_path_factory.mktemp("multihost"))
    not_started = [r["reason"] for r in results if not r["started"]]
    if not_started:
        pytest.skip(f"jax.distributed cannot start 2 processes on this platform: {not_started[0]}")
    errors = [f"process {i}:\n{r['error']}" for i, r in enumerate(results) if "error" in r]
    assert not errors, "\n".join(errors)
    return results


def test_every_process_sees_the_whole_job(job):
    assert sorted(r["process_index"] for r in job) == list(range(PROCESSES))
    for r in job:
        assert r["global_devices"] == PROCESSES * LOCAL_DEVICES, r
        assert r["local_devices"] == LOCAL_DEVICES, r


def test_each_slot_is_checked_once_against_the_reference(job):
    # The workers asserted their shards' bits; here: together they covered every slot once.
    pages = sorted(tuple(s["pages"]) for r in job for s in r["shards"])
    pages_per_slot = 2
    slots = PROCESSES * LOCAL_DEVICES
    assert pages == [(b * pages_per_slot, (b + 1) * pages_per_slot) for b in range(slots)]
    devices = [s["device"] for r in job for s in r["shards"]]
    assert len(set(devices)) == slots, devices


def test_the_output_keeps_the_pools_sharding(job):
    for r in job:
        assert r["same_sharding"], r["output_spec"]
        assert "dp" in r["output_spec"], r["output_spec"]


def test_no_collective_in_the_compiled_program(job):
    for r in job:
        assert "dflash_target_kv_cache_update" in r["custom_calls"], r["custom_calls"]
        assert r["collectives"] == [], f"process {r['process_index']}: {r['collectives']}"
