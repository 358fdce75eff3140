"""Compiles the shipped CUDA sources (csrc/dflash) with tuning macros set by -D, plus a harness.

The kernel's knobs (KNOBS below, the one list of them) are ``#ifndef`` macros in
csrc/dflash/kv_update_kernel.cuh and csrc/dflash/numerics.h: a variant is the shipped code
compiled with other values, never an edited copy of it. Used by make_variants.py and make_probe.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CSRC = ROOT / "csrc"
# What the CUDA kernel library of CMakeLists.txt compiles: the dispatcher, one unit per pool
# format (the same glob), and the operand checks it links against.
KERNEL_SOURCES = ("dflash/kv_update_cuda.cu",) + tuple(
    sorted(str(p.relative_to(CSRC)) for p in (CSRC / "dflash").glob("kv_update_cuda_*.cu"))
)
HOST_SOURCES = ("dflash/operands.cc",)
KNOBS = (
    "DFLASH_BLOCK_THREADS",
    "DFLASH_STREAMING_STORES",
    "DFLASH_MAX_VEC_BYTES",
    "DFLASH_PAGED_STREAMING_LOADS",
    "DFLASH_STREAMING_LOADS_BYTES",
    "DFLASH_PAGED_VALUES_EARLY",
    "DFLASH_PAGED_INDEX_BRANCH",
    "DFLASH_BYTE_POOL_VEC",
    "DFLASH_WIDE_BY_ROWS",
    "DFLASH_GROUP_MIN_BLOCKS",
    "DFLASH_UPDATE_MIN_BLOCKS",
    "DFLASH_LEAN_OFFSETS",
    "DFLASH_ROPE_AT_USE",
    "DFLASH_ADDRESS_AHEAD",
    "DFLASH_VALUES_FIRST",
    "DFLASH_WORDS_AT_ONCE",
    "DFLASH_FP8_END_WORDS",
    "DFLASH_INT4_WORDS",
    "DFLASH_COPY_IMMEDIATES",
    "DFLASH_STATIC_RANGE_BY_MAXIMUM",
    "DFLASH_PAIR_QUOTIENTS",
    "DFLASH_EXACT_QUOTIENTS",
    "DFLASH_PLANE_BRACKET",
    "DFLASH_ROPE_AHEAD",
    "DFLASH_ROPE_AFTER_KEYS",
    "DFLASH_BRACKETED_CODES",
    "DFLASH_STORE_BASE",
    "DFLASH_SHARED_ROWS",
)


def nvcc() -> str:
    found = os.environ.get("NVCC") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(found).exists() and not shutil.which(found):
        raise SystemExit("nvcc not found: set NVCC or put the CUDA toolkit's bin on PATH")
    return found


def flags(arch: str = "sm_90") -> list[str]:
    # The kernel library's own options (CMakeLists.txt): products and sums never fused.
    return ["-std=c++17", "-O3", "--fmad=false", f"-arch={arch}", f"-I{CSRC}"]


def defines(knobs: dict[str, int]) -> list[str]:
    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise SystemExit(f"knobs: expected names from {KNOBS}, got {unknown}")
    return [f"-D{name}={value}" for name, value in knobs.items()]


def build(
    out: Path,
    harness: Path,
    binary: str,
    knobs: dict[str, int],
    jobs: int | None = None,
    arch: str = "sm_90",
) -> Path:
    """Objects of the shipped sources under ``out/binary.objs`` (compiled with ``knobs``),
    linked with ``harness`` into ``out/binary``. Raises SystemExit naming a failed compile."""
    objs = out / f"{binary}.objs"
    objs.mkdir(parents=True, exist_ok=True)
    base = [nvcc(), *flags(arch), *defines(knobs)]
    units = [CSRC / s for s in KERNEL_SOURCES + HOST_SOURCES] + [harness]
    commands = [base + ["-c", str(src), "-o", str(objs / (src.name + ".o"))] for src in units]

    def run(cmd: list[str]) -> tuple[list[str], int]:
        return cmd, subprocess.call(cmd)

    with ThreadPoolExecutor(jobs or max(1, os.cpu_count() or 1)) as pool:
        for cmd, status in pool.map(run, commands):
            if status:
                raise SystemExit(f"nvcc failed ({status}): {' '.join(cmd)}")
    target = out / binary
    link = [nvcc(), f"-arch={arch}", *[c[-1] for c in commands], "-o", str(target)]
    if subprocess.call(link):
        raise SystemExit(f"link failed: {' '.join(link)}")
    return target
