"""A few jitted updates of the slot op, for a profiler to capture one of them: H=8 D=128 R=128
fp16 deltas, the pool donated, the benchmark's page size (16) and a slot capacity of the delta
length plus two pages.

    python3 bench/profile_one_update.py --batch 8 --length 2048 --pool int8 --scales dynamic
    ncu --clock-control none --kernel-name regex:"dynamic_group_kernel|update_kernel" \\
        --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section SchedulerStats --section LaunchStats \\
        python3 bench/profile_one_update.py --batch 8 --length 2048 --pool int8 --scales dynamic

The first calls compile and warm up; --calls of them run in all (the profiler skips the first
--launch-skip). BENCHMARKS.md quotes what Nsight Compute read from it on the H200."""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_dflash

HEADS, HEAD_DIM, PAGE = 8, 128, 16
POOLS = {"fp16": np.float16, "int8": np.int8, "e4m3": ml_dtypes.float8_e4m3fn, "int4": np.uint8}


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=positive, default=8, help="sequences (default 8)")
    parser.add_argument(
        "--length", type=positive, default=2048, help="tokens a sequence (default 2048)"
    )
    parser.add_argument(
        "--pool", choices=tuple(POOLS), default="int8", help="pool format (default int8)"
    )
    parser.add_argument(
        "--scales",
        choices=("static", "dynamic"),
        default="dynamic",
        help="per-head static scales or a scale pool (default dynamic; fp16 takes neither, int4 "
        "only dynamic)",
    )
    parser.add_argument("--k-norm", action="store_true", help="fuse the k-norm (weights of ones)")
    parser.add_argument("--calls", type=positive, default=3, help="updates in all (default 3)")
    parser.add_argument(
        "--backend", choices=("gpu", "cpu"), default="gpu", help="JAX backend (default gpu)"
    )
    args = parser.parse_args(argv)
    if args.pool == "int4" and args.scales != "dynamic":
        parser.error("--scales: an int4 pool takes a scale pool only (dynamic), got static")
    return args


def slot_update_inputs(batch, length, pool, dynamic, k_norm, device=None):
    """The slot op's inputs for this module's problem (also bench/dynamic_scale_probe.py's):
    ``(args, kwargs)``, ``kwargs`` with ``scale_pool`` where ``dynamic``, else with static
    per-head scales for an int8 or FP8 pool. ``pool`` is a key of POOLS."""
    B, L, H, D = batch, length, HEADS, HEAD_DIM
    pages_per_slot = (L + 2 * PAGE - 1) // PAGE + 1
    N = B * pages_per_slot
    rng = np.random.default_rng(0)
    put = lambda a: jax.device_put(a, device)  # noqa: E731
    k = put(rng.standard_normal((B, L, H, D), np.float32).astype(np.float16))
    v = put(rng.standard_normal((B, L, H, D), np.float32).astype(np.float16))
    last = D // 2 if pool == "int4" else D
    pool_array = put(np.zeros((2, N, PAGE, H, last), POOLS[pool]))
    rope = put(rng.uniform(-1, 1, (1, pages_per_slot * PAGE, D)).astype(np.float32))
    starts = put(np.zeros((B,), np.int32))
    lengths = put(np.full((B,), L, np.int32))
    kw = dict(pages_per_slot=pages_per_slot)
    if k_norm:
        kw["k_norm_weight"] = put(np.ones((D,), np.float16))
    if dynamic:
        kw["scale_pool"] = put(np.zeros((2, N, PAGE, H), np.float32))
    elif pool != "fp16":
        kw["k_scale"] = put(np.full((H,), 0.05, np.float32))
        kw["v_scale"] = put(np.full((H,), 0.05, np.float32))
    return (k, v, pool_array, rope, starts, lengths), kw


def run(args, device):
    """The state after args.calls updates on `device`: (pool,) or (pool, scale_pool)."""
    dynamic = args.pool != "fp16" and args.scales == "dynamic"
    (k, v, pool, rope, starts, lengths), kw = slot_update_inputs(
        args.batch, args.length, args.pool, dynamic, args.k_norm, device
    )
    scale_pool = kw.pop("scale_pool", None)

    def update(state):
        extra = {"scale_pool": state[1]} if dynamic else {}
        out = jax_dflash.target_kv_cache_update(
            k, v, state[0], rope, starts, lengths, **kw, **extra
        )
        return tuple(out) if dynamic else (out,)

    state = (pool, scale_pool) if dynamic else (pool,)
    step = jax.jit(update, donate_argnums=0)
    for _ in range(args.calls):
        state = step(state)
    return jax.block_until_ready(state)


def main(argv=None) -> int:
    args = parse(argv)
    try:
        device = jax.devices(args.backend)[0]
    except RuntimeError:
        print(f"SKIPPED: JAX sees no {args.backend} device here")
        return 77
    state = run(args, device)
    kind = (
        "a scale pool"
        if len(state) == 2
        else f"{args.scales} scales"
        if args.pool != "fp16"
        else "no scales"
    )
    print(
        f"{args.calls} updates, B={args.batch} L={args.length}, {args.pool} pool {jnp.shape(state[0])}, {kind}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
