"""bench/profile_one_update.py, the profiler's driver: on the CPU backend each pool format and
scale kind runs and writes what it addresses (every token of every sequence, both planes), and
bad flags exit 2 naming the flag, what was expected and what was given."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "bench" / "profile_one_update.py"
sys.path.insert(0, str(SCRIPT.parent))
import profile_one_update as driver  # noqa: E402


@pytest.mark.parametrize(
    "pool, scales",
    [
        ("fp16", "static"),
        ("int8", "static"),
        ("int8", "dynamic"),
        ("e4m3", "dynamic"),
        ("int4", "dynamic"),
    ],
)
@pytest.mark.parametrize("k_norm", [False, True], ids=["plain", "k-norm"])
def test_every_format_writes_every_token(pool, scales, k_norm):
    import jax

    argv = [
        "--backend",
        "cpu",
        "--batch",
        "2",
        "--length",
        "20",
        "--pool",
        pool,
        "--scales",
        scales,
    ]
    args = driver.parse([*argv, *(["--k-norm"] if k_norm else []), "--calls", "2"])
    state = driver.run(args, jax.devices("cpu")[0])
    values = np.asarray(state[0])
    assert (
        values.dtype
        == {"fp16": np.float16, "int8": np.int8, "e4m3": ml_dtypes.float8_e4m3fn, "int4": np.uint8}[
            pool
        ]
    )
    assert values.shape[-1] == (64 if pool == "int4" else 128)
    # Slot b's pages are [b * pages_per_slot, ...): its first 20 rows hold tokens 0..19.
    pages_per_slot = values.shape[1] // 2
    for b in range(2):
        rows = values[:, b * pages_per_slot : (b + 1) * pages_per_slot].reshape(
            2, -1, 8, values.shape[-1]
        )
        written = np.any(rows.view(np.uint8) != 0, axis=-1)
        assert written[:, :20].all() and not written[:, 20:].any()
    if scales == "dynamic":
        scale_pool = np.asarray(state[1]).reshape(2, 2, -1, 8)
        assert (scale_pool[:, :, :20] > 0).all() and (scale_pool[:, :, 20:] == 0).all()
    else:
        assert len(state) == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch", "0"], "argument --batch: expected an integer >= 1, got '0'"),
        (["--length", "many"], "argument --length: expected an integer >= 1, got 'many'"),
        (["--calls", "-1"], "argument --calls: expected an integer >= 1, got '-1'"),
        (["--pool", "int2"], "argument --pool: invalid choice: 'int2'"),
        (
            ["--pool", "int4", "--scales", "static"],
            "--scales: an int4 pool takes a scale pool only (dynamic), got static",
        ),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(argv, message):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--backend", "cpu", *argv], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
