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
    skipped = [line for line in run.stdout.splitlines() if line.lstrip().startswith("skipped")]
    # The one skip: the raw entries of the scale-pool cases (their JAX runs are counted).
    assert all("take no scale pool" in line for line in skipped), "\n".join(skipped)
    for form in ("slot", "paged", "slot_mapping"):
        with_scales = [line for line in skipped if line.split()[1] == form]
        counts = re.search(
            rf"^{form}: (\d+) matched, 0 mismatched, {len(with_scales)} skipped$", run.stdout, re.M
        )
        assert counts and int(counts[1]) >= 15, f"{form}: {run.stdout[-2000:]}"
        assert len(with_scales) == 3, f"{form}: the scale-pool cases: {with_scales}"
