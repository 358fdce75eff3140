"""``bench/sanitize_hostile.py`` (the hostile cases the H200 runs under compute-sanitizer) run
through XLA:CPU and the CPU entries: every addressing form's cases equal the reference bit for
bit. A subprocess, since the script sets JAX's allocator before JAX starts."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "bench" / "sanitize_hostile.py"


def test_every_forms_hostile_cases_match_the_reference_on_cpu():
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--platform", "cpu"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    for form in ("slot", "paged", "slot_mapping"):
        counts = re.search(rf"^{form}: (\d+) matched, 0 mismatched, 0 skipped$", run.stdout, re.M)
        assert counts and int(counts[1]) >= 15, f"{form}: {run.stdout[-2000:]}"
        scale_cases = re.findall(
            rf"^  ok       {form} .*scale pool.*: scale_pool$", run.stdout, re.M
        )
        assert len(scale_cases) == 9, f"{form}: the scale pools compared: {scale_cases}"
