"""The benchmark's numeric flags are checked against their bounds before any work: a value out
of range exits 2 with argparse's message naming the flag, the range and the value, and no
traceback."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

import dflash_bench as benchmark
from dflash_bench.cli import MAX_ITERS, MAX_MIN_TIME_S, MAX_REPEATS, build_parser

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "bench" / "bench_kv_update.py"
SECONDS = f"a number of seconds > 0 and <= {MAX_MIN_TIME_S:g}"


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--min-time", "nan", f"{SECONDS}, got nan"),
        ("--min-time", "0", f"{SECONDS}, got 0"),
        ("--min-time", "-inf", f"{SECONDS}, got -inf"),
        ("--min-time", "inf", f"{SECONDS}, got inf"),
        ("--min-time", "1e308", f"{SECONDS}, got 1e308"),
        ("--min-time", "60.5", f"{SECONDS}, got 60.5"),
        ("--min-time", "soon", f"{SECONDS}, got 'soon'"),
        ("--iters", "0", f"an integer from 1 to {MAX_ITERS}, got 0"),
        ("--iters", "100000000", f"an integer from 1 to {MAX_ITERS}, got 100000000"),
        ("--iters", str(MAX_ITERS + 1), f"an integer from 1 to {MAX_ITERS}, got {MAX_ITERS + 1}"),
        ("--iters", "1e3", f"an integer from 1 to {MAX_ITERS}, got '1e3'"),
        ("--repeats", "-5", f"an integer from 1 to {MAX_REPEATS}, got -5"),
        ("--repeats", "two", f"an integer from 1 to {MAX_REPEATS}, got 'two'"),
        ("--repeats", "10000000", f"an integer from 1 to {MAX_REPEATS}, got 10000000"),
    ],
)
def test_numeric_flag_out_of_bounds_exits_2_with_the_range(flag, value, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        benchmark.main(["--backend", "cpu", f"{flag}={value}", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected {message}" in err, err
    assert not list(tmp_path.iterdir())  # nothing ran


@pytest.mark.parametrize(
    "flag, value, got",
    [
        ("--iters", MAX_ITERS, MAX_ITERS),
        ("--iters", 1, 1),
        ("--repeats", MAX_REPEATS, MAX_REPEATS),
        ("--min-time", MAX_MIN_TIME_S, MAX_MIN_TIME_S),
        ("--min-time", 1e-300, 1e-300),
    ],
)
def test_the_bounds_themselves_are_accepted(flag, value, got):
    args = build_parser().parse_args([flag, str(value)])
    assert getattr(args, flag.lstrip("-").replace("-", "_")) == got


@pytest.mark.parametrize(
    "flag, value", [("--iters", "100000000"), ("--min-time", "1e308"), ("--repeats", "1e9")]
)
def test_the_script_refuses_at_once_without_a_traceback(flag, value, tmp_path):
    """The values that hung (an unrolled chain of 1e8 updates) or ended in an OverflowError
    reported as a contender failure: refused by the script at once."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--backend", "cpu", flag, value, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert f"argument {flag}: expected" in done.stderr
    assert value in done.stderr.splitlines()[-1]
    assert "Traceback" not in done.stderr
    assert done.stdout == ""
    assert not list(tmp_path.iterdir())
