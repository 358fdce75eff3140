"""Checks the sharded DFlash update on real devices and prints one row per case.

Both contracts, on the first 2 (or 4) devices of a platform: KV heads split, whole slots split,
layer-batched (split on heads or layers), Rb = B rope, hostile positions, FP8 pools with per-head
scales, the fused k-norm, a donated and a not-donated pool, ``shard_map``, TensorRT-sized
problems, and shardings the op cannot follow (an error naming the operand and dim). Each
sharded result must equal the unsharded op on one device bit for bit, the compiled HLO must
hold no all-gather, all-to-all, collective-permute or all-reduce, the donated pool must stay
aliased to the output and the output must keep the pool's sharding. Exit status 1 if any case
fails, 2 if the devices are missing.

    python3 bench/multi_gpu_check.py                  # 2 GPUs
    python3 bench/multi_gpu_check.py --platform cpu   # 4 forced host devices, no GPU needed
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
import zlib

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce")
_COLLECTIVE_RE = re.compile(r"\b(" + "|".join(COLLECTIVES) + r")(-start)?\(")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    contract: str  # "slot" or "paged"
    problem: dict  # keywords of jax_dflash.testing.make_problem / make_paged_problem
    specs: dict  # keywords of jax_dflash.sharding.partition_specs / paged_partition_specs
    expect: str = "exact"  # "exact" or "error"
    match: tuple[str, ...] = ()  # substrings the error must hold
    mode: str = "jit"  # "jit", "nodonate" or "shard_map"
    pool_spec: tuple | None = None  # overrides the pool's PartitionSpec (error cases)


# Long: a table of cases, one entry each.
def cases(n: int) -> list[Case]:
    """The cases of an ``n``-device mesh along one axis ``x``."""
    import ml_dtypes
    import numpy as np

    e4m3 = ml_dtypes.float8_e4m3fn
    trt = dict(heads=8, head_dim=128, page_size=128, dtype=np.float16)
    return [
        Case(
            "slot_heads",
            "slot",
            dict(batch=3, heads=n, max_batch=5, pages_per_slot=3),
            dict(head_axis="x"),
        ),
        Case(
            "slot_slots_bf16",
            "slot",
            dict(batch=n, heads=2, dtype=ml_dtypes.bfloat16),
            dict(batch_axis="x"),
        ),
        Case(
            "slot_slots_rope_batched",
            "slot",
            dict(batch=n, heads=2, rope_batch=n, dtype=np.float32),
            dict(batch_axis="x", rope_batched=True),
        ),
        Case(
            "slot_layered_heads",
            "slot",
            dict(layers=3, batch=2, heads=n),
            dict(head_axis="x", layered=True),
        ),
        Case(
            "slot_layered_layers",
            "slot",
            dict(
                layers=n,
                batch=2,
                heads=2,
                rope_batch=2,
                rope_per_layer=True,
                positions_per_layer=True,
            ),
            dict(
                layer_axis="x",
                layered=True,
                rope_batched=True,
                rope_per_layer=True,
                positions_per_layer=True,
            ),
        ),
        Case(
            "slot_slots_hostile", "slot", dict(batch=n, heads=2, hostile=True), dict(batch_axis="x")
        ),
        Case(
            "slot_fp8_heads",
            "slot",
            dict(batch=2, heads=n, pool_dtype=e4m3),
            dict(head_axis="x", scales="head"),
        ),
        Case(
            "slot_knorm_slots",
            "slot",
            dict(batch=n, heads=2, k_norm=True, v_norm=True),
            dict(batch_axis="x", k_norm=True),
        ),
        Case(
            "slot_not_donated",
            "slot",
            dict(batch=n, heads=n),
            dict(batch_axis="x"),
            mode="nodonate",
        ),
        Case(
            "slot_shard_map", "slot", dict(batch=n, heads=2), dict(batch_axis="x"), mode="shard_map"
        ),
        Case(
            "slot_trt_heads",
            "slot",
            dict(
                batch=2 * n,
                delta_len=16,
                pages_per_slot=2,
                max_batch=3 * n,
                rope_seq_len=200,
                **trt,
            ),
            dict(head_axis="x"),
        ),
        Case(
            "paged_heads",
            "paged",
            dict(tokens=12, batch=3, heads=n, num_pages=12, table_pages=3),
            dict(head_axis="x"),
        ),
        Case(
            "paged_hostile_ring",
            "paged",
            dict(tokens=12, batch=3, heads=n, num_pages=12, table_pages=3, hostile=True, ring=True),
            dict(head_axis="x"),
        ),
        Case(
            "paged_layered_layers",
            "paged",
            dict(
                tokens=10,
                batch=2,
                heads=2,
                num_pages=8,
                table_pages=3,
                layers=n,
                rope_per_layer=True,
                positions_per_layer=True,
                table_per_layer=True,
            ),
            dict(
                layer_axis="x",
                layered=True,
                rope_per_layer=True,
                positions_per_layer=True,
                table_per_layer=True,
            ),
        ),
        Case(
            "paged_fp8_knorm_heads",
            "paged",
            dict(
                tokens=12,
                batch=3,
                heads=n,
                num_pages=12,
                table_pages=3,
                pool_dtype=e4m3,
                k_norm=True,
            ),
            dict(head_axis="x", scales="head", k_norm=True),
        ),
        Case(
            "paged_trt_heads",
            "paged",
            dict(tokens=64, batch=4, num_pages=8, table_pages=2, **trt),
            dict(head_axis="x"),
        ),
        Case(
            "error_slot_pool_head_dim",
            "slot",
            dict(batch=2, heads=2, head_dim=8 * n),
            {},
            expect="error",
            match=("past_key_value", "dim 4 (D)"),
            pool_spec=(None, None, None, None, "x"),
        ),
        Case(
            "error_paged_pool_pages",
            "paged",
            dict(tokens=8, batch=2, heads=2, num_pages=4 * n, table_pages=2),
            {},
            expect="error",
            match=("past_key_value",),
            pool_spec=(None, "x"),
        ),
    ]


def _problem(case: Case):
    import numpy as np

    from jax_dflash import testing

    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    build = testing.make_problem if case.contract == "slot" else testing.make_paged_problem
    # Not hostile unless asked: every sequence then writes, so a wrong shard cannot hide.
    return build(rng, **{"hostile": False, **case.problem})


def run_case(case: Case, devices) -> dict:
    """Runs one case; the record holds what ``check`` judges (or the error)."""
    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_dflash
    from jax_dflash import sharding

    problem = _problem(case)
    args = list(problem.args())
    kwargs = problem.kwargs()
    static = {k: v for k, v in kwargs.items() if not isinstance(v, np.ndarray)}
    extra_names = [k for k in ("k_scale", "v_scale", "k_norm_weight") if k in kwargs]
    extras = [kwargs[k] for k in extra_names]
    base = (
        jax_dflash.target_kv_cache_update
        if case.contract == "slot"
        else jax_dflash.target_kv_cache_update_paged
    )

    def op(*operands):
        n = len(args)
        return base(*operands[:n], **dict(zip(extra_names, operands[n:])), **static)

    operands = args + extras
    expected = np.asarray(jax.jit(op)(*[jax.device_put(a, devices[0]) for a in operands]))

    num = len(devices)
    mesh = Mesh(np.asarray(devices[:num]), ("x",))
    if case.pool_spec is not None:
        specs = [P()] * len(operands)
        specs[2] = P(*case.pool_spec)
    else:
        make_specs = (
            sharding.partition_specs if case.contract == "slot" else sharding.paged_partition_specs
        )
        specs = list(make_specs(**case.specs))
    shardings = [NamedSharding(mesh, s) for s in specs]
    sharded = [jax.device_put(a, s) for a, s in zip(operands, shardings)]
    # A pool in buffers of XLA's own (a device_put NumPy array may borrow host memory, which
    # donation then cannot reuse).
    sharded[2] = jax.jit(jnp.copy, out_shardings=shardings[2])(sharded[2])
    fn = op
    if case.mode == "shard_map":
        fn = jax.shard_map(op, mesh=mesh, in_specs=tuple(specs), out_specs=specs[2])
    donate = () if case.mode == "nodonate" else (2,)
    record: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            compiled = jax.jit(fn, donate_argnums=donate).lower(*sharded).compile()
            out = compiled(*sharded)
            out.block_until_ready()
        except Exception as e:  # noqa: BLE001 - the record carries it to the judge
            record["error"] = f"{type(e).__name__}: {e}"
            return record
    record["warnings"] = [str(w.message) for w in caught]
    hlo = compiled.as_text()
    record["collectives"] = sorted({m.group(1) for m in _COLLECTIVE_RE.finditer(hlo)})
    record["program_aliases_pool"] = "input_output_alias={ {}: (2, {}" in hlo
    record["out_has_pool_sharding"] = out.sharding.is_equivalent_to(shardings[2], expected.ndim)
    record["out_sharding"] = str(out.sharding)
    got = np.asarray(out)
    record["mismatches"] = int(
        np.any(
            got.view(np.uint8).reshape(*got.shape, -1)
            != expected.view(np.uint8).reshape(*expected.shape, -1),
            axis=-1,
        ).sum()
    )
    record["written"] = int(
        np.any(expected.view(np.uint8) != np.asarray(problem.past_key_value).view(np.uint8))
    )
    return record


def check(case: Case, record: dict) -> str | None:
    """None when ``record`` is what ``case`` expects, else why not."""
    if record.get("before_sharded_run"):  # an expected error must come from the sharded run
        return "failed before the sharded run: " + record["error"].splitlines()[0][:200]
    if case.expect == "error":
        if "error" not in record:
            return "expected an error, the case ran"
        missing = [t for t in case.match if t not in record["error"]]
        return f"{missing} not in the error: {record['error'][:200]}" if missing else None
    if "error" in record:
        return record["error"].splitlines()[0][:200]
    if not record["written"]:
        return "the case writes nothing"
    if record["mismatches"]:
        return f"{record['mismatches']} elements differ from the unsharded op"
    if record["collectives"]:
        return f"collectives in the HLO: {record['collectives']}"
    if record["warnings"]:
        return f"warnings: {record['warnings']}"
    if not record["out_has_pool_sharding"]:
        return f"output sharding {record['out_sharding']} is not the pool's"
    if case.mode != "nodonate" and not record["program_aliases_pool"]:
        return "the donated pool is not aliased to the output"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platform", default="gpu", choices=("gpu", "cpu"))
    parser.add_argument(
        "--devices",
        type=int,
        default=None,
        choices=(2, 4),
        help="mesh size (default: 2 on GPU, 4 on CPU)",
    )
    args = parser.parse_args()
    num = args.devices or (2 if args.platform == "gpu" else 4)
    if args.platform == "cpu":  # before JAX starts its backends
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={num}"
        )
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax

    from jax_dflash import testing

    devices = testing.gpu_devices() if args.platform == "gpu" else jax.devices("cpu")
    if len(devices) < num:
        print(f"needs {num} {args.platform} devices, found {len(devices)}")
        return 2
    devices = devices[:num]
    print(f"jax {jax.__version__}, {len(devices)} x {devices[0].device_kind}, mesh of {num}")
    header = (
        f"{'case':28} {'expect':6} {'result':6} {'bits≠':>6} {'collectives':20} "
        f"{'aliased':8} {'out=pool':8} {'s':>5}"
    )
    print(header)
    print("-" * len(header))
    all_cases = cases(num)
    failed = 0
    for case in all_cases:
        start = time.perf_counter()
        try:
            record = run_case(case, devices)
        except Exception as e:  # noqa: BLE001 - e.g. the unsharded run itself: report, go on
            record = {"error": f"{type(e).__name__}: {e}", "before_sharded_run": True}
        seconds = time.perf_counter() - start
        why = check(case, record)
        failed += why is not None
        result = "ok" if why is None else "FAIL"
        if "error" in record:
            print(
                f"{case.name:28} {case.expect:6} {result:6} error: "
                f"{record['error'].splitlines()[0][:100]}"
            )
        else:
            print(
                f"{case.name:28} {case.expect:6} {result:6} {record['mismatches']:>6} "
                f"{','.join(record['collectives']) or '-':20} "
                f"{record['program_aliases_pool']!s:8} {record['out_has_pool_sharding']!s:8} "
                f"{seconds:5.1f}"
            )
        if why:
            print(f"    {why}")
    print(f"{len(all_cases) - failed} of {len(all_cases)} cases as expected")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
