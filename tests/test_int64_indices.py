"""int64 positions, lengths, owners and page ids are never narrowed, whatever route they take.

With ``jax_enable_x64`` on, a position of 2**32 + 1 must not reach a kernel as 1. Every route
into the op (eager, the caller's ``jax.jit``, ``vmap``, a hand-bound primitive, the NumPy
reference) refuses them at trace time, naming the operand. x64 is process-wide, so the routes
run in a child process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_enable_x64", True)
    import jax_dflash
    from jax_dflash import reference

    H, D, N, P = 1, 8, 4, 4
    pool = jnp.zeros((2, N, P, H, D), jnp.float32)
    big = 2**32 + 1  # 1 once narrowed to int32: a row that must not be written

    def paged(pos, own, table):
        k = jnp.ones((2, H, D), jnp.float32)
        return (k, k, pool, jnp.ones((2, D), jnp.float32), pos, own, table)

    def slot(starts, lengths):
        k = jnp.ones((1, 2, H, D), jnp.float32)
        return (k, k, pool, jnp.ones((1, 8, D), jnp.float32), starts, lengths)

    i64 = lambda *v: jnp.array(v, jnp.int64)
    i32 = lambda *v: jnp.array(v, jnp.int32)
    table32 = i32([[0, 1, 2, 3], [4, 5, 6, 7]]).reshape(1, 2, 4)
    cases = {
        "paged positions": (jax_dflash.target_kv_cache_update_paged, paged(i64(big, 0), i32(0, 0), table32), {}),
        "paged owners": (jax_dflash.target_kv_cache_update_paged, paged(i32(0, 1), i64(2**32, 0), table32), {}),
        "paged table": (jax_dflash.target_kv_cache_update_paged,
                        paged(i32(0, 1), i32(0, 0), table32.astype(jnp.int64) + 2**32), {}),
        "slot starts": (jax_dflash.target_kv_cache_update, slot(i64(big), i32(2)), {"pages_per_slot": 2}),
        "slot lengths": (jax_dflash.target_kv_cache_update, slot(i32(0), i64(2**32 + 2)), {"pages_per_slot": 2}),
    }
    results = {}
    for name, (op, args, kw) in cases.items():
        routes = {
            "eager": lambda: op(*args, **kw),
            "jit": lambda: jax.jit(lambda *a: op(*a, **kw))(*args),
            "vmap": lambda: jax.jit(jax.vmap(lambda *a: op(*a, **kw), in_axes=None, axis_size=2))(*args),
            "reference": lambda: getattr(reference, op.__name__)(*map(np.asarray, args), **kw),
        }
        for route, fn in routes.items():
            try:
                out = np.asarray(fn())
                results[f"{name} / {route}"] = ["written", float(np.abs(out).sum())]
            except (TypeError, ValueError) as e:
                results[f"{name} / {route}"] = ["refused", str(e).splitlines()[0]]
    print(json.dumps(results))
    """
)

EXPECTED_OPERAND = {
    "paged positions": "delta_positions",
    "paged owners": "delta_token_to_sequence",
    "paged table": "kv_page_table",
    "slot starts": "delta_start_positions",
    "slot lengths": "delta_lengths",
}


def test_int64_indices_are_refused_on_every_route_with_x64_on():
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == 5 * 4
    for key, (verdict, detail) in results.items():
        case = key.split(" / ")[0]
        assert verdict == "refused", f"{key}: an int64 index was accepted ({detail})"
        assert EXPECTED_OPERAND[case] in detail and "int32" in detail and "int64" in detail, (
            key,
            detail,
        )
