"""Per-token-head dynamic scales against static scales, on the GPU, through the JAX op (slot
form, jitted fori_loop of updates, state donated): microseconds per update and the bandwidth of
the bytes it must move (deltas read, pool elements and scales written), H=8 D=128 float16
deltas, for the fp16 pool, int8 and e4m3 with static per-head scales, int8, e4m3 and int4 with a
scale pool, each without and with the fused k-norm.

    python3 bench/dynamic_scale_probe.py

The problem is bench/profile_one_update.py's (slot_update_inputs). A quick look between whole
benchmark runs (bench/bench_kv_update.py has the same formats as rows, against the copy floor);
the best of three timed calls, no L2 rotation.
"""

import sys
import time

import jax

import jax_dflash
from profile_one_update import slot_update_inputs

# The probe's names of the pool formats, as profile_one_update's problem builder names them.
_POOLS = {"f16": "fp16", "i8": "int8", "e4m3": "e4m3", "i4": "int4"}


def run(B, L, pool, dyn, k_norm, iters):
    (k, v, pool_a, rope, starts, lengths), kw = slot_update_inputs(B, L, _POOLS[pool], dyn, k_norm)
    sp = kw.pop("scale_pool", None)
    if sp is None:

        def body(i, pl):
            return jax_dflash.target_kv_cache_update(
                k, v, pl, rope, starts + (i % 2), lengths, **kw
            )

        f = jax.jit(lambda pl: jax.lax.fori_loop(0, iters, body, pl), donate_argnums=0)
        st = pool_a
    else:

        def body(i, c):
            pl, s = c
            return jax_dflash.target_kv_cache_update(
                k, v, pl, rope, starts + (i % 2), lengths, scale_pool=s, **kw
            )

        f = jax.jit(lambda c: jax.lax.fori_loop(0, iters, body, c), donate_argnums=0)
        st = (pool_a, sp)
    st = f(st)
    jax.block_until_ready(st)
    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        st = f(st)
        jax.block_until_ready(st)
        best = min(best, time.perf_counter() - t)
    us = best / iters * 1e6
    elem = {"f16": 2, "i8": 1, "e4m3": 1, "i4": 0.5}[pool]
    H, D = k.shape[-2:]
    byts = B * L * H * D * 2 * 2 + B * L * H * D * 2 * elem + (B * L * H * 2 * 4 if dyn else 0)
    return us, byts / us / 1e6


def main() -> int:
    try:
        jax.devices("gpu")
    except RuntimeError:
        print("SKIPPED: JAX sees no GPU here; this probe times the CUDA kernel")
        return 77
    for B, L, iters in ((64, 16, 2000), (8, 2048, 200)):
        for k_norm in (False, True):
            for pool, dyn in (
                ("f16", False),
                ("i8", False),
                ("i8", True),
                ("e4m3", False),
                ("e4m3", True),
                ("i4", True),
            ):
                us, tbs = run(B, L, pool, dyn, k_norm, iters)
                print(
                    f"B={B} L={L} knorm={int(k_norm)} {pool}{'-dyn' if dyn else ''}: {us:.2f} us  {tbs:.2f} TB/s",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
