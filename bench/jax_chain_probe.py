"""The JAX path alone, outside the benchmark: a jitted chain of CHAIN updates (fp16, H=8, D=128,
P=128, L=16, slot capacity 2048, donated pool), timed per update from the host.

    python3 bench/jax_chain_probe.py B CHAIN        # e.g. 1 512
    SETS=32 XLA_PYTHON_CLIENT_PREALLOCATE=false WITH_TORCH=1 python3 bench/jax_chain_probe.py 8 256
    SHOW_HLO=1 ...                                  # print the compiled HLO first

SETS: rotated input sets (8); WITH_TORCH: import torch and hold 1 GiB of GPU memory first.
BENCHMARKS.md ("How the benchmark times") quotes its numbers. The chain and the rope table are
the benchmark's own (bench/dflash_bench/)."""

import os
import sys
import time

import jax.numpy as jnp
import numpy as np

import jax_dflash
from dflash_bench.jax_contenders import jitted_chain
from dflash_bench.problem import rope_table

B, L, H, D, P, PPS = int(sys.argv[1]), 16, 8, 128, 128, 16
CHAIN = int(sys.argv[2]) if len(sys.argv) > 2 else 8
cap = PPS * P
rng = np.random.default_rng(0)
sets = int(os.environ.get("SETS", 8))
if os.environ.get("WITH_TORCH"):
    import torch

    _t = torch.zeros(1 << 28, device="cuda")
ks = tuple(jnp.asarray(rng.standard_normal((B, L, H, D)), jnp.float16) for _ in range(sets))
vs = tuple(jnp.asarray(rng.standard_normal((B, L, H, D)), jnp.float16) for _ in range(sets))
starts = tuple(jnp.asarray(rng.integers(0, cap - L, B), jnp.int32) for _ in range(sets))
lengths = jnp.full((B,), L, jnp.int32)
rope = jnp.asarray(rope_table(cap, 128))


def update(pool, per_set, shared):
    (k, v, s), (r, n) = per_set, shared
    return jax_dflash.target_kv_cache_update(k, v, pool, r, s, n, pages_per_slot=PPS)


step = jitted_chain(update, CHAIN)
sets_ = tuple(zip(ks, vs, starts))
shared = (rope, lengths)
pool = jnp.zeros((2, B * PPS, P, H, D), jnp.float16)
if os.environ.get("SHOW_HLO"):
    print(step.lower(pool, sets_, shared).compile().as_text())
for _ in range(3):
    pool = step(pool, sets_, shared)
pool.block_until_ready()


def run(calls):
    global pool
    t0 = time.perf_counter()
    for _ in range(calls):
        pool = step(pool, sets_, shared)
    pool.block_until_ready()
    return (time.perf_counter() - t0) / (calls * CHAIN) * 1e6


calls = max(1, int(0.3e6 / (CHAIN * 3)))
print(
    f"B={B} chain={CHAIN}: jax us/update",
    sorted(run(calls) for _ in range(5))[2],
    "sets",
    sets,
    "prealloc",
    os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
    "torch",
    bool(os.environ.get("WITH_TORCH")),
)
