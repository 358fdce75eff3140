"""Running test cases in child processes, so that a crash fails its case instead of pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CHILD_TIMEOUT_S = 420


def run_in_children(platform: str, ids: list[str], script: Path, timeout=CHILD_TIMEOUT_S):
    """Runs ``ids`` in as few children as crashes allow: ``{id: result}``; a case during which
    the child died gets ``{"status": "crash", ...}``."""
    results, pending = {}, list(ids)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    while pending:
        try:
            done = subprocess.run(
                [sys.executable, str(script), platform, *pending],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
            )
            stdout, stderr, rc = done.stdout, done.stderr, done.returncode
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            rc = "timeout"
        started = None
        for line in stdout.splitlines():
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if "start" in record:
                started = record["start"]
            else:
                results[record["id"]] = record
                started = None
        finished = [i for i in pending if i in results]
        crashed = (
            started
            if started is not None
            else (pending[len(finished)] if len(finished) < len(pending) else None)
        )
        if crashed is not None and crashed not in results:
            results[crashed] = {
                "id": crashed,
                "status": "crash",
                "returncode": rc,
                "stderr": stderr[-3000:],
            }
        pending = [i for i in pending if i not in results]
    return results


def run_script(script: str, cwd: Path, env: dict | None = None, timeout=CHILD_TIMEOUT_S):
    """Runs the Python source ``script`` in a child process (JAX on the CPU, ``env`` added to the
    environment) from ``cwd``: the ``subprocess.CompletedProcess``."""
    return subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
    )
