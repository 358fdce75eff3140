"""Builds the kernel-variant timing binaries of the kernel notes (bench/results/HISTORY.md).

Each variant is the shipped kernel (csrc/dflash) compiled with its tuning macros set by -D
(build.py), linked with kbench.cu (a CUDA-graph timing harness, both contracts, fp16 H=8 D=128
R=128 P=128, plain, with the k-norm, bf16, into an e4m3 pool and into an int8 pool):
kb_cs{1,0}_b{128,256,512}_v{16,8} for DFLASH_STREAMING_STORES, DFLASH_BLOCK_THREADS and
DFLASH_MAX_VEC_BYTES, and the named variants of NAMED (kb_shipped: no -D at all). Run each binary
on the GPU machine; it prints one line per contract and shape. Needs nvcc (sm_90).

    python bench/kernel_variants/make_variants.py OUTDIR [--only cs1_b128_v16,...] [--jobs N]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from build import HERE, build

GRID = {
    "DFLASH_STREAMING_STORES": (1, 0),
    "DFLASH_BLOCK_THREADS": (128, 256, 512),
    "DFLASH_MAX_VEC_BYTES": (16, 8),
}


# Variants outside the grid, each the shipped defaults but for its own knobs.
NAMED = {
    "shipped": {},
    # The scale-pool group kernel's two scheduling defaults, each alone off, and both (the kernel
    # as it was before them): each row group's address words loaded when it starts, not a group
    # ahead in the four-chunk kernel; K stored before V. And the words a group ahead in every
    # group kernel (two-chunk at decode sizes: measured slower).
    "own_words": {"DFLASH_ADDRESS_AHEAD": 0},
    "keys_first": {"DFLASH_VALUES_FIRST": 0},
    "group_before": {"DFLASH_ADDRESS_AHEAD": 0, "DFLASH_VALUES_FIRST": 0},
    "words_ahead_all": {"DFLASH_ADDRESS_AHEAD": 7},
    # The scale-pool stores' instruction counts: the FP8 bracket ends compared as words and the
    # int4 codes stored as words (defaults), each alone off, and both off (the stores before
    # them); each row's two address words loaded together and the group kernel's copies at
    # constant offsets (measured slower at B=8 L=2048, off), and both of them on.
    "fp8_end_pairs": {"DFLASH_FP8_END_WORDS": 0},
    "int4_bytes": {"DFLASH_INT4_WORDS": 0},
    "stores_before": {"DFLASH_FP8_END_WORDS": 0, "DFLASH_INT4_WORDS": 0},
    "words_at_once": {"DFLASH_WORDS_AT_ONCE": 1},
    "copy_immediates": {"DFLASH_COPY_IMMEDIATES": 1},
    "loads_and_copies": {"DFLASH_WORDS_AT_ONCE": 1, "DFLASH_COPY_IMMEDIATES": 1},
    # Static-scale int8 codes clamped one by one, as before the chunk's largest magnitude proved
    # that none saturates (default).
    "static_clamps": {"DFLASH_STATIC_RANGE_BY_MAXIMUM": 0},
    # The scale-pool kernels as they were before the bracket, the lean offsets and the rows-based
    # choice of the wide kernel were measured and made the defaults; and each of them alone off.
    "previous": {"DFLASH_BRACKETED_CODES": 0, "DFLASH_LEAN_OFFSETS": 0, "DFLASH_WIDE_BY_ROWS": 0},
    "unbracketed": {"DFLASH_BRACKETED_CODES": 0},
    "coordinate_offsets": {"DFLASH_LEAN_OFFSETS": 0},
    "four_chunks": {"DFLASH_WIDE_BY_ROWS": 0},
    # Measured slower (BENCHMARKS.md), kept as knobs: 16-channel items from 16-bit deltas into
    # 1-byte pools; the scale-pool group kernel held to 5 blocks per SM (96 registers, spills), and
    # that with each rotary chunk's cos/sin loaded at its use.
    "bytevec16": {"DFLASH_BYTE_POOL_VEC": 16},
    "group_min5": {"DFLASH_GROUP_MIN_BLOCKS": 5},
    "rope5": {"DFLASH_GROUP_MIN_BLOCKS": 5, "DFLASH_ROPE_AT_USE": 1},
    # The scale-pool stores by the bracket and its fallback for every row, as before the exact
    # quotients.
    "bracketed_quotients": {"DFLASH_EXACT_QUOTIENTS": 0},
    # The update kernels held to 7 blocks per SM (72 registers).
    "update_min7": {"DFLASH_UPDATE_MIN_BLOCKS": 7},
    # The scale-pool group kernel's rope rows loaded after the wait for the group's copies, its
    # address words one group ahead, as before DFLASH_ROPE_AHEAD.
    "rope_after_wait": {"DFLASH_ROPE_AHEAD": 0},
    # The scale-pool four-chunk kernel storing K before V, the next group's row and rope row taken
    # right after K's rotation.
    "rope_after_keys": {"DFLASH_ROPE_AFTER_KEYS": 1},
    # The scale-pool group kernel's row store address formed once (off until timed on an H200).
    "store_base": {"DFLASH_STORE_BASE": 1},
    # The scale-pool four-chunk kernel's rows worked out once a warp and shuffled to their groups'
    # lanes, alone and with the store base.
    "shared_rows": {"DFLASH_SHARED_ROWS": 1},
    "shared_store": {"DFLASH_SHARED_ROWS": 1, "DFLASH_STORE_BASE": 1},
    # The same with the bfloat16 fused-norm kernels' rows shared too (2 resident blocks, not 3).
    "shared_store_all": {"DFLASH_SHARED_ROWS": 2, "DFLASH_STORE_BASE": 1},
    # A static-scale int8 item's two packs quantized as one chunk (off until timed).
    "pair_quotients": {"DFLASH_PAIR_QUOTIENTS": 1},
    # The int8 and int4 scale-pool rows' codes by the bracket first, the exact quotients only for
    # a plane where it fails: in the computed planes (rotated or normed), in every plane, and in
    # the computed planes with the shared rows and the store base.
    "plane_bracket": {"DFLASH_PLANE_BRACKET": 1},
    "plane_bracket_all": {"DFLASH_PLANE_BRACKET": 2},
    "plane_bracket_shared": {
        "DFLASH_PLANE_BRACKET": 1,
        "DFLASH_SHARED_ROWS": 1,
        "DFLASH_STORE_BASE": 1,
    },
}


def variants() -> dict[str, dict[str, int]]:
    out = {}
    for cs, block, vec in itertools.product(*GRID.values()):
        out[f"cs{cs}_b{block}_v{vec}"] = dict(zip(GRID, (cs, block, vec)))
    out.update(NAMED)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for the binaries kb_<variant>")
    parser.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    parser.add_argument("--jobs", type=int, default=None, help="parallel nvcc jobs (default: CPUs)")
    args = parser.parse_args(argv)
    grid = variants()
    wanted = [n for n in args.only.split(",") if n] or list(grid)
    if unknown := [n for n in wanted if n not in grid]:
        print(f"--only: unknown {unknown}; expected names from {list(grid)}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for name in wanted:
        print(f"building kb_{name}: {grid[name]}", flush=True)
        build(args.out.resolve(), HERE / "kbench.cu", f"kb_{name}", grid[name], args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
