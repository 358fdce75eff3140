"""One process of tests/test_multihost.py: joins a jax.distributed job on localhost, runs the
slot-sharded update over the job's global CPU devices and writes what it saw as JSON.

Usage: python _multihost_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID OUT_JSON
(XLA_FLAGS=--xla_force_host_platform_device_count=N gives each process N CPU devices.)
"""

from __future__ import annotations

import functools
import json
import re
import sys
import traceback

import jax

COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
SEED = 20261201  # every process builds the same global problem


def run(coordinator: str, num_processes: int, process_id: int) -> dict:
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=60,
        )
    except Exception as e:  # any failure to start is reported, not raised
        return {"started": False, "reason": f"{type(e).__name__}: {e}"}

    import numpy as np
    from jax.sharding import NamedSharding

    import jax_dflash
    from jax_dflash import reference, testing
    from jax_dflash.sharding import partition_specs

    devices = jax.devices()
    batch, pages_per_slot = len(devices), 2  # one slot per device: B * pages_per_slot == numPages
    problem = testing.make_problem(
        np.random.default_rng(SEED),
        batch=batch,
        delta_len=5,
        heads=2,
        head_dim=16,
        page_size=4,
        pages_per_slot=pages_per_slot,
        dtype=np.float16,
    )
    expected = reference.target_kv_cache_update(*problem.args(), **problem.kwargs())

    mesh = jax.make_mesh((len(devices),), ("dp",), devices=devices)
    shardings = [NamedSharding(mesh, spec) for spec in partition_specs(batch_axis="dp")]
    args = [
        jax.make_array_from_callback(a.shape, s, functools.partial(lambda a, idx: a[idx], a))
        for a, s in zip(problem.args(), shardings)
    ]
    update = jax.jit(
        functools.partial(jax_dflash.target_kv_cache_update, pages_per_slot=pages_per_slot),
        donate_argnums=2,
    )
    hlo = update.lower(*args).compile().as_text()
    out = update(*args)

    shards = []
    for shard in out.addressable_shards:
        testing.assert_bits_equal(np.asarray(shard.data), expected[shard.index])
        # The page range of the slot this shard holds (its index on the pool's numPages dim).
        pages = shard.index[1]
        shards.append({"device": shard.device.id, "pages": [pages.start, pages.stop]})
    return {
        "started": True,
        "process_index": jax.process_index(),
        "global_devices": len(devices),
        "local_devices": jax.local_device_count(),
        "output_spec": str(out.sharding.spec),
        "same_sharding": out.sharding.is_equivalent_to(shardings[2], out.ndim),
        "collectives": sorted({c for c in COLLECTIVES if re.search(rf"\b{c}(-start)?\(", hlo)}),
        "custom_calls": sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo))),
        "shards": shards,
    }


def main(argv: list[str]) -> int:
    coordinator, num_processes, process_id, out_path = argv
    try:
        result = run(coordinator, int(num_processes), int(process_id))
    except Exception:  # the test prints the traceback
        result = {"started": True, "error": traceback.format_exc()}
    with open(out_path, "w") as f:
        json.dump(result, f)
    if result.get("started") and "error" not in result:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
