"""The bracket proof of the CUDA kernel's divided stores, host-compiled from its own code.

The CUDA kernel stores int8 codes (static scales) and every scale-pool code from products with
the scale's approximate reciprocal where it can prove they round as the division ``y / s`` does
(csrc/dflash/numerics.h, "divided stores without their division"). With
``DFLASH_BRACKETED_CODES=1`` the proof is two products that bracket the quotient.
tools/bracket_check.cc compiles that code for the host and compares it with the division for
every reciprocal the hardware's bound admits, around every boundary of each grid, so the proof
is checked on any machine, with or without a GPU.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GRIDS = (
    "int8, static scale",
    "int8, scale pool",
    "int4, scale pool",
    "e4m3, scale pool",
    "e5m2, scale pool",
)


@pytest.fixture(scope="module")
def bracket_check(tmp_path_factory):
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH (c++, g++ or clang++) to build tools/bracket_check.cc")
    binary = tmp_path_factory.mktemp("bracket") / "bracket_check"
    subprocess.run(
        [
            compiler,
            "-std=c++17",
            "-O2",
            "-ffp-contract=off",
            "-DDFLASH_BRACKETED_CODES=1",
            f"-I{ROOT / 'csrc'}",
            str(ROOT / "tools" / "bracket_check.cc"),
            "-o",
            str(binary),
        ],
        check=True,
    )
    return binary


def test_bracketed_codes_are_the_division(bracket_check):
    result = subprocess.run(
        [str(bracket_check), "600"], capture_output=True, text=True, timeout=300
    )
    print(result.stdout)
    lines = {
        line.split(" ok")[0].split(" FAILED")[0].strip(): line
        for line in result.stdout.splitlines()
    }
    for grid in GRIDS:
        assert grid in lines, f"no line for {grid}: {result.stdout}"
        assert " ok:" in lines[grid] and ", 0 wrong codes" in lines[grid], lines[grid]
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_refuses_a_build_without_the_bracket(tmp_path):
    """The check is of the bracket's code: built with the bracket off, it must not compile (so
    that a build of the other proof cannot pass for one)."""
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH (c++, g++ or clang++) to build tools/bracket_check.cc")
    result = subprocess.run(
        [
            compiler,
            "-std=c++17",
            "-fsyntax-only",
            "-DDFLASH_BRACKETED_CODES=0",
            f"-I{ROOT / 'csrc'}",
            str(ROOT / "tools" / "bracket_check.cc"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "DFLASH_BRACKETED_CODES=1" in result.stderr
