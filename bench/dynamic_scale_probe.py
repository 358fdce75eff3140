"""Per-token-head dynamic scales against static scales, on the GPU, through the JAX op (slot
form, jitted fori_loop of updates, state donated): microseconds per update and the bandwidth of
the bytes it must move (deltas read, pool elements and scales written), H=8 D=128 float16
deltas, for the fp16 pool, int8 and e4m3 with static per-head scales, int8, e4m3 and int4 with a
scale pool, each without and with the fused k-norm.

    python3 bench/dynamic_scale_probe.py

A quick look between whole benchmark runs (bench/bench_kv_update.py has the same formats as
rows, against the copy floor); the best of three timed calls, no L2 rotation.
"""

import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_dflash


def run(B, L, pool, dyn, k_norm, iters):
    H, D, P = 8, 128, 16
    pps = (L + 2 * P - 1) // P + 1
    rng = np.random.default_rng(0)
    N = B * pps
    k = jnp.asarray(rng.standard_normal((B, L, H, D), np.float32).astype(np.float16))
    v = jnp.asarray(rng.standard_normal((B, L, H, D), np.float32).astype(np.float16))
    dt = {"f16": np.float16, "i8": np.int8, "e4m3": ml_dtypes.float8_e4m3fn, "i4": np.uint8}[pool]
    last = D // 2 if pool == "i4" else D
    pool_a = jnp.zeros((2, N, P, H, last), dt)
    rope = jnp.asarray(rng.uniform(-1, 1, (1, pps * P, D)).astype(np.float32))
    starts = jnp.zeros((B,), jnp.int32)
    lengths = jnp.full((B,), L, jnp.int32)
    kw = dict(pages_per_slot=pps)
    if k_norm:
        kw["k_norm_weight"] = jnp.ones((D,), jnp.float16)
    sp = None
    if dyn:
        sp = jnp.zeros((2, N, P, H), jnp.float32)
    elif pool in ("i8", "e4m3"):
        kw["k_scale"] = jnp.full((H,), 0.05, jnp.float32)
        kw["v_scale"] = jnp.full((H,), 0.05, jnp.float32)
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
