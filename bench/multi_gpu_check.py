"""Checks the sharded DFlash update on real devices and prints one row per case.

Runs the multi-device cases of ``tests/test_sharding.py`` (KV heads split, whole slots split,
layer-batched, Rb = 1 and Rb = B rope, shard_map, the unsupported shardings) plus two
TensorRT-sized cases, on the first 2 (or 4) devices of a platform. Each sharded result must be
bit-exact against the unsharded op on one device, the compiled HLO must hold no all-gather,
all-to-all, collective-permute or all-reduce, the donated pool must stay aliased and the
output must keep the pool's sharding. Exit status 1 if any case fails.

    python3 bench/multi_gpu_check.py                  # 2 GPUs
    python3 bench/multi_gpu_check.py --platform cpu   # 4 forced host devices, no GPU needed
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platform", default="gpu", choices=("gpu", "cpu"))
    parser.add_argument("--devices", type=int, default=None,
                        help="mesh size: 2 or 4 (default: 2 on GPU, 4 on CPU)")
    args = parser.parse_args()
    num = args.devices or (2 if args.platform == "gpu" else 4)
    if args.platform == "cpu":  # before JAX starts its backends
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={num}")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

    import jax
    import test_sharding as t

    try:
        devices = jax.devices(args.platform)
    except RuntimeError as e:
        print(f"no {args.platform} backend: {e}")
        return 2
    if len(devices) < num:
        print(f"needs {num} {args.platform} devices, found {len(devices)}")
        return 2
    print(f"jax {jax.__version__}, {len(devices)} x {devices[0].device_kind}, mesh of {num}")

    x = (("x", num),)
    trt = dict(batch=2 * num, delta_len=16, heads=8, head_dim=128, page_size=128,
               pages_per_slot=2, rope_seq_len=200, dtype="float16")
    cases = t.cases(num) + [
        t.Case("trt_shape_heads", x, {**trt, "max_batch": 3 * num},
               t.partition_specs(head_axis="x")),
        t.Case("trt_shape_slots", x, {**trt, "rope_batch": 2 * num},
               t.partition_specs(batch_axis="x", rope_batched=True)),
    ]

    failed = 0
    header = (f"{'case':36} {'expect':6} {'result':6} {'bits≠':>6} {'collectives':24} "
              f"{'aliased':8} {'out=pool':8} {'s':>5}")
    print(header)
    print("-" * len(header))
    for case in cases:
        start = time.perf_counter()
        record = t.run_case(case, devices)
        seconds = time.perf_counter() - start
        try:
            t.check(case, record)
            result, why = "ok", ""
        except AssertionError as e:
            failed += 1
            result, why = "FAIL", str(e).splitlines()[0][:200]
        if "error" in record:
            lines = record["error"].strip().splitlines()
            line = next((x for x in lines if "Error:" in x and "Traceback" not in x), lines[0])
            line = line.strip()[:110]
            print(f"{case.name:36} {case.expect:6} {result:6} error: {line}")
        else:
            print(f"{case.name:36} {case.expect:6} {result:6} {record['mismatches']:>6} "
                  f"{','.join(record['collectives']) or '-':24} "
                  f"{record['program_aliases_pool']!s:8} "
                  f"{record['out_has_pool_sharding']!s:8} {seconds:5.1f}")
        if why:
            print(f"    {why}")
    print(f"{len(cases) - failed} of {len(cases)} cases as expected")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
