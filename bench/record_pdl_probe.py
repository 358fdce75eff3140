"""The FFI record stage on a GPU: does XLA's command buffer run our launches (and with what bits),
and what programmatic dependent launch (PDL) does to a chain of updates there.

    python3 bench/record_pdl_probe.py             # all of it, about 100 s on the H200
    python3 bench/record_pdl_probe.py --bits      # (a) alone, in this process (prints JSON)
    python3 bench/record_pdl_probe.py --time      # (b) alone, in this process (prints JSON)
    python3 bench/record_pdl_probe.py --dump DIR  # (c) alone: XLA's dump of one chain into DIR

(a) Bits: jitted functions of two updates each (and a scanned loop of six), pool donated, on the
    GPU against the same functions on the CPU, bit for bit: slot bf16, slot fp16 -> FP8 with
    scales and the k-norm weight, paged FP8 with both norms over three layers; and one without
    donation, which the record stage hands back to XLA to capture (the pool needs a copy first).
(b) Time: a jitted chain of CHAIN back-to-back updates, and a chain of GEMM -> update (two small
    jnp.dot making each update's deltas), slot contract, bf16, B=1 and B=64, L=16, H=8, D=128, in
    a child process each for the record stage with PDL (DFLASH_PDL unset), without it
    (DFLASH_PDL=0), both registered with DFLASH_RECORD_STAGE=1, and the execute stage
    (DFLASH_RECORD_STAGE=0: XLA captures it on a stream);
    microseconds per step from the host over REPEATS calls.
(c) XLA's dump of one chain (--xla_dump_to): the lines that name the custom call in its
    command-buffer thunks, where this XLA writes them.

XLA_FLAGS for every child: PROBE_XLA_FLAGS if set, else the command-buffer flags below (XLA puts
custom calls into command buffers only when CUSTOM_CALL is among the enabled command types, and
only sequences of at least --xla_gpu_graph_min_graph_size commands); printed first. The record
stage counts (record_stage_counts(): launches created, updated, calls captured) say which path
each child took.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMAND_BUFFER_FLAGS = (
    "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL "
    "--xla_gpu_graph_min_graph_size=1"
)
CHAIN = int(os.environ.get("CHAIN", 32))
REPEATS = int(os.environ.get("REPEATS", 200))
CHILD_TIMEOUT_S = 150
B_VALUES, L, H, D, PAGE, PPS = (1, 64), 16, 8, 128, 128, 16


def _counts():
    from jax_dflash import _ext

    return dict(_ext.extension("cuda").record_stage_counts())


def _last_capture() -> str:
    from jax_dflash import _ext

    return _ext.extension("cuda").record_stage_last_capture()


def _path():
    from jax_dflash import _ext

    cuda = _ext.extension("cuda")
    return {
        "ffi_record_stage": bool(cuda.ffi_record_stage()),
        "record_stage_registered": _ext.record_stage_registered(),
        "record_pdl": bool(cuda.record_pdl_enabled()),
        "stream_pdl": bool(cuda.pdl_enabled()),
    }


# ---- (a) bits ------------------------------------------------------------------------------------


def bits() -> dict:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_dflash
    from jax_dflash.testing import compare_bits, make_paged_problem, make_problem

    cpu, gpu = jax.devices("cpu")[0], jax.devices("gpu")[0]
    results = {}

    def check(name, fn, operands, pool_index, donate=True):
        before = _counts()
        on_gpu = jax.jit(fn, donate_argnums=(pool_index,) if donate else ())(
            *(jax.device_put(a, gpu) for a in operands)
        )
        on_cpu = jax.jit(fn)(*(jax.device_put(a, cpu) for a in operands))
        mismatched = total = 0
        for got, want in zip(jax.tree.leaves(on_gpu), jax.tree.leaves(on_cpu)):
            m, t = compare_bits(np.asarray(got), np.asarray(want))
            mismatched, total = mismatched + m, total + t
        after = _counts()
        results[name] = {
            "bit_exact": mismatched == 0,
            "mismatched": int(mismatched),
            "elements": int(total),
            "counts": {k: after[k] - before[k] for k in after},
            "last_capture": _last_capture(),
        }

    # Slot, bf16: two updates (the second at later positions), >= 5 ops with the delta math.
    rng = np.random.default_rng(1)
    p = make_problem(
        rng,
        batch=3,
        delta_len=4,
        heads=4,
        head_dim=128,
        page_size=16,
        pages_per_slot=4,
        dtype=jnp.bfloat16,
    )
    op = functools.partial(jax_dflash.target_kv_cache_update, **p.kwargs())

    def two_slot(k, v, pool, rope, starts, lengths):
        pool = op(k * 2, v * 2, pool, rope, starts, lengths)
        return op(k - 1, v + 1, pool, rope, starts + 4, lengths)

    check("slot bf16, two updates", two_slot, p.args(), 2)
    # Not donated: XLA copies the parameter into the buffer the call updates in place.
    check("slot bf16, two updates, pool not donated", two_slot, p.args(), 2, donate=False)

    # Slot, fp16 deltas into an FP8 pool with scales and the k-norm weight.
    rng = np.random.default_rng(2)
    q = make_problem(
        rng,
        batch=2,
        delta_len=5,
        heads=8,
        head_dim=128,
        page_size=16,
        pages_per_slot=4,
        dtype=np.float16,
        pool_dtype=jnp.float8_e4m3fn,
        k_norm=True,
        v_norm=True,
    )
    op_q = functools.partial(jax_dflash.target_kv_cache_update, **q.kwargs())

    def two_fp8(k, v, pool, rope, starts, lengths):
        pool = op_q(k * 2, v * 2, pool, rope, starts, lengths)
        return op_q(k + 1, v - 1, pool, rope, starts + 5, lengths)

    check("slot fp16 -> e4m3, scales, both norms", two_fp8, q.args(), 2)

    # Paged, three layers in one launch, FP8 pool, both norms (the butterfly kernel).
    rng = np.random.default_rng(3)
    r = make_paged_problem(
        rng,
        tokens=24,
        batch=3,
        heads=4,
        head_dim=128,
        num_pages=16,
        page_size=8,
        table_pages=4,
        dtype=np.float16,
        pool_dtype=jnp.float8_e4m3fn,
        layers=3,
        k_norm=True,
        v_norm=True,
    )
    op_r = functools.partial(jax_dflash.target_kv_cache_update_paged, **r.kwargs())

    def two_paged(k, v, pool, *rest):
        pool = op_r(k * 2, v * 2, pool, *rest)
        return op_r(k - 3, v + 3, pool, *rest)

    check("paged e4m3, 3 layers, both norms", two_paged, r.args(), 2)

    # Per-token-head dynamic scales (their own kernel): handed back to XLA to capture.
    rng = np.random.default_rng(4)
    d = make_problem(
        rng,
        batch=2,
        delta_len=4,
        heads=4,
        head_dim=128,
        page_size=16,
        pages_per_slot=4,
        dtype=np.float16,
        pool_dtype=jnp.float8_e4m3fn,
    )
    scale_bits = rng.integers(0, 2**32, d.past_key_value.shape[:-1], dtype=np.uint64)
    scale_pool = scale_bits.astype(np.uint32).view(np.float32)
    plain = {k: v for k, v in d.kwargs().items() if k not in ("k_scale", "v_scale")}

    def dynamic(k, v, pool, rope, starts, lengths, scales):
        return jax_dflash.target_kv_cache_update(
            k * 2, v * 2, pool, rope, starts, lengths, scale_pool=scales, **plain
        )

    check("slot fp16 -> e4m3, dynamic scales (captured)", dynamic, (*d.args(), scale_pool), 2)

    # A scanned decode loop of six steps over the bf16 slot problem.
    steps = 6

    def loop(k, v, pool, rope, starts, lengths):
        def body(pool, i):
            ki = (k + i.astype(k.dtype)).astype(k.dtype)
            return op(ki, ki - 1, pool, rope, starts + 4 * i, lengths), None

        return jax.lax.scan(body, pool, jnp.arange(steps, dtype=jnp.int32))[0]

    check("slot bf16, scan of 6", loop, p.args(), 2)
    return {"path": _path(), "cases": results, "counts": _counts()}


# ---- (b) time ------------------------------------------------------------------------------------


def _chains(batch: int):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_dflash

    rng = np.random.default_rng(batch)
    cap = PPS * PAGE
    k = jnp.asarray(rng.standard_normal((batch, L, H, D)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((batch, L, H, D)), jnp.bfloat16)
    starts = jnp.asarray(rng.integers(0, cap - L, batch), jnp.int32)
    lengths = jnp.full((batch,), L, jnp.int32)
    angles = np.arange(cap)[:, None] / 10000.0 ** (np.arange(D // 2) / (D // 2))
    rope = jnp.asarray(np.concatenate([np.cos(angles), np.sin(angles)], -1)[None], jnp.float32)
    pool = jnp.zeros((2, batch * PPS, PAGE, H, D), jnp.bfloat16)
    xs = tuple(
        jnp.asarray(rng.standard_normal((batch * L, H * D)) * 0.05, jnp.bfloat16)
        for _ in range(CHAIN)
    )
    wk = jnp.asarray(rng.standard_normal((H * D, H * D)) * 0.03, jnp.bfloat16)
    wv = jnp.asarray(rng.standard_normal((H * D, H * D)) * 0.03, jnp.bfloat16)

    def update(pool, kk, vv):
        return jax_dflash.target_kv_cache_update(
            kk, vv, pool, rope, starts, lengths, pages_per_slot=PPS
        )

    def update_chain(pool, k, v):
        return jax.lax.fori_loop(0, CHAIN, lambda i, pool: update(pool, k, v), pool, unroll=True)

    def gemm_chain(pool, xs, wk, wv):
        for x in xs:
            kk = jnp.dot(x, wk).reshape(batch, L, H, D)
            vv = jnp.dot(x, wv).reshape(batch, L, H, D)
            pool = update(pool, kk, vv)
        return pool

    return pool, {
        "update": (jax.jit(update_chain, donate_argnums=0), (k, v)),
        "gemm->update": (jax.jit(gemm_chain, donate_argnums=0), (xs, wk, wv)),
    }


def timing() -> dict:
    out = {}
    for batch in B_VALUES:
        pool, chains = _chains(batch)
        for name, (fn, operands) in chains.items():
            before = _counts()
            for _ in range(3):
                pool = fn(pool, *operands)
            pool.block_until_ready()
            t0 = time.perf_counter()
            for _ in range(REPEATS):
                pool = fn(pool, *operands)
            pool.block_until_ready()
            us = (time.perf_counter() - t0) / (REPEATS * CHAIN) * 1e6
            after = _counts()
            out[f"B={batch} {name}"] = {
                "us_per_step": round(us, 3),
                "counts": {k: after[k] - before[k] for k in after},
            }
    return {"path": _path(), "chain": CHAIN, "repeats": REPEATS, "results": out}


# ---- (c) dump ------------------------------------------------------------------------------------


def dump(directory: str) -> dict:
    pool, chains = _chains(1)
    fn, operands = chains["gemm->update"]
    fn(pool, *operands).block_until_ready()
    lines = []
    for path in sorted(Path(directory).rglob("*")):
        if not path.is_file() or path.stat().st_size > 50 << 20:
            continue
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            low = line.lower()
            if "dflash" in low and ("command" in low or "thunk" in low or "graph" in low):
                lines.append(f"{path.name}: {line.strip()[:200]}")
    return {"path": _path(), "files": len(list(Path(directory).rglob("*"))), "lines": lines[:40]}


# ---- the parent ----------------------------------------------------------------------------------


def _child(mode: list[str], env_extra: dict[str, str | None], flags: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": flags, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    env.pop("JAX_PLATFORMS", None)
    for key, value in env_extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    done = subprocess.run(
        [sys.executable, __file__, *mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr[-2500:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    flags = os.environ.get("PROBE_XLA_FLAGS", COMMAND_BUFFER_FLAGS)
    print(f"XLA_FLAGS for the children: {flags}")
    print(f"chain of {CHAIN} updates per jitted call, {REPEATS} calls timed")
    started = time.perf_counter()
    ok = True

    print("\n(a) bits, GPU (record stage, DFLASH_PDL unset) vs CPU:")
    a = _child(["--bits"], {"DFLASH_PDL": None, "DFLASH_RECORD_STAGE": "1"}, flags)
    if "error" in a:
        print(f"  FAILED: {a['error']}")
        ok = False
    else:
        print(f"  path: {a['path']}")
        for name, case in a["cases"].items():
            verdict = (
                "bit-exact"
                if case["bit_exact"]
                else f"MISMATCH {case['mismatched']}/{case['elements']}"
            )
            why = f" (last capture: {case['last_capture']})" if case["counts"]["captured"] else ""
            print(f"  {name:<52} {verdict:<12} record stage: {case['counts']}{why}")
            ok &= case["bit_exact"]

    print("\n(b) microseconds per step (host timing):")
    runs = {
        "record stage, PDL": {"DFLASH_PDL": None, "DFLASH_RECORD_STAGE": "1"},
        "record stage, DFLASH_PDL=0": {"DFLASH_PDL": "0", "DFLASH_RECORD_STAGE": "1"},
        "execute stage (captured), DFLASH_PDL=1": {"DFLASH_PDL": "1", "DFLASH_RECORD_STAGE": "0"},
        "execute stage (captured), DFLASH_PDL=0": {"DFLASH_PDL": "0", "DFLASH_RECORD_STAGE": "0"},
    }
    table = {}
    for label, env in runs.items():
        b = _child(["--time"], env, flags)
        if "error" in b:
            print(f"  {label}: FAILED: {b['error']}")
            ok = False
            continue
        table[label] = b
        print(f"  {label}: path {b['path']}")
        for shape, r in b["results"].items():
            print(f"    {shape:<20} {r['us_per_step']:8.3f} us/step   record stage: {r['counts']}")

    print("\n(c) XLA's dump of one GEMM -> update chain (B=1):")
    with tempfile.TemporaryDirectory() as tmp:
        c = _child(
            ["--dump", tmp],
            {"DFLASH_PDL": None, "DFLASH_RECORD_STAGE": "1"},
            f"{flags} --xla_dump_to={tmp} --xla_dump_hlo_as_text",
        )
    if "error" in c:
        print(f"  FAILED: {c['error']}")
    else:
        print(f"  {c['files']} files; lines naming dflash with command/thunk/graph:")
        for line in c["lines"] or [
            "  (none: this XLA's dump does not show the command buffer's commands)"
        ]:
            print(f"    {line}")
    print(f"\nprobe: {'OK' if ok else 'FAILED'} in {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--bits":
        print(json.dumps(bits()))
    elif len(sys.argv) > 1 and sys.argv[1] == "--time":
        print(json.dumps(timing()))
    elif len(sys.argv) > 2 and sys.argv[1] == "--dump":
        print(json.dumps(dump(sys.argv[2])))
    else:
        sys.exit(main())
