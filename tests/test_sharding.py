"""Multi-device partitioning (``jax_dflash.sharding``): per-shard updates under ``jax.jit``.

The sharded cases need several devices. On CPU that is
``XLA_FLAGS=--xla_force_host_platform_device_count=4``, which only takes effect before JAX
starts its backends, and another test file may have started them already; so the CPU cases run
in a child process (this file run as a script) that writes one JSON record per case, and the
tests here judge the records. With two or more GPUs the 2-device cases also run on them, in
this process. ``bench/multi_gpu_check.py`` runs the same cases and prints a table.

Each case compiles ``jax.jit(op, donate_argnums=2)`` on sharded operands and records: the
bitwise mismatches against the unsharded op on one device, the collectives in the compiled HLO,
whether the program and the per-shard custom call alias the pool, the output's sharding, the
warnings, or the compile error.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import make_problem

import jax_dflash
from jax_dflash._shapes import check_update
from jax_dflash.sharding import partition_specs, plan_split

CPU_DEVICES = 4
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce")
_COLLECTIVE_RE = re.compile(r"\b(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_BASE_RANKS = (4, 4, 5, 3, 1, 1)  # operand ranks of the unbatched form
R = P()  # replicated


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    mesh: tuple[tuple[str, int], ...]  # (axis name, size), major to minor
    problem: dict
    specs: tuple  # the six operands' PartitionSpecs
    expect: str = "exact"  # "exact", "warn" (exact, plus warnings) or "error"
    match: tuple[str, ...] = ()  # substrings the warning / error text must hold
    mode: str = "jit"  # "jit", "nodonate", "eager", "shard_map", "partial_manual", "gspmd"

    @property
    def num_devices(self) -> int:
        return math.prod(size for _, size in self.mesh)


def cases(num_devices: int) -> list[Case]:
    """The cases that fit on ``num_devices`` (2 or 4) devices."""
    n = num_devices
    x = (("x", n),)
    out = [
        # Tensor parallel: KV heads split, replicated rope (Rb = 1).
        Case("heads", x, dict(batch=3, heads=n, max_batch=5, pages_per_slot=3, dtype=np.float16),
             partition_specs(head_axis="x")),
        # Data parallel: whole slots split; every slot in use.
        Case("slots", x, dict(batch=n, heads=2, pages_per_slot=2, dtype="bfloat16"),
             partition_specs(batch_axis="x")),
        # Rb = B rope split with the batch.
        Case("slots_rope_batched", x,
             dict(batch=n, heads=2, pages_per_slot=3, rope_batch=n, dtype=np.float32),
             partition_specs(batch_axis="x", rope_batched=True)),
        # Rb = B rope, positions and lengths given replicated: sliced locally, no warning.
        Case("slots_small_operands_replicated", x,
             dict(batch=n, heads=2, pages_per_slot=2, rope_batch=n),
             (P("x"), P("x"), partition_specs(batch_axis="x")[2], R, R, R)),
        # Layer-batched form (vmap), shared rope/positions, heads split.
        Case("layered_heads", x, dict(layers=3, batch=2, heads=n, pages_per_slot=2),
             partition_specs(head_axis="x", layered=True)),
        # Layer-batched form split on layers, per-layer Rb = B rope and positions.
        Case("layered_layers", x,
             dict(layers=n, batch=2, heads=2, pages_per_slot=2, rope_batch=2,
                  rope_per_layer=True, positions_per_layer=True),
             partition_specs(layer_axis="x", layered=True, rope_batched=True,
                             rope_per_layer=True, positions_per_layer=True)),
        Case("layered_slots", x,
             dict(layers=2, batch=n, heads=2, pages_per_slot=2, positions_per_layer=True),
             partition_specs(batch_axis="x", layered=True, positions_per_layer=True)),
        # Hostile positions and lengths (padding, drops, negative starts) per shard.
        Case("slots_hostile", x, dict(batch=n, heads=2, pages_per_slot=2, hostile=True),
             partition_specs(batch_axis="x")),
        Case("not_donated", x, dict(batch=n, heads=n, pages_per_slot=2),
             partition_specs(batch_axis="x"), mode="nodonate"),
        Case("eager", x, dict(batch=2, heads=n, pages_per_slot=2),
             partition_specs(head_axis="x"), mode="eager"),
        Case("shard_map", x, dict(batch=n, heads=2, pages_per_slot=2),
             partition_specs(batch_axis="x"), mode="shard_map"),
        # What the op cannot follow: errors naming the pool and the dim.
        Case("error_pool_head_dim", x, dict(batch=2, heads=2, head_dim=8 * n),
             (R, R, P(None, None, None, None, "x"), R, R, R), expect="error",
             match=("past_key_value", "dim 4 (D)", "'x'")),
        Case("error_pool_page_rows", x, dict(batch=2, heads=2, page_size=2 * n),
             (R, R, P(None, None, "x"), R, R, R), expect="error",
             match=("past_key_value", "dim 2 (P)")),
        Case("error_pool_planes", (("x", 2),), dict(batch=2, heads=2),
             (R, R, P("x"), R, R, R), expect="error",
             match=("past_key_value", "dim 0 (K/V plane)")),
        Case("error_pages_not_whole_slots", x, dict(batch=1, heads=2, pages_per_slot=n),
             (R, R, P(None, "x"), R, R, R), expect="error",
             match=("past_key_value", "not a whole number of slots", f"pages_per_slot = {n}")),
        Case("error_slots_not_all_used", x,
             dict(batch=n // 2, max_batch=n, heads=2, pages_per_slot=1),
             (R, R, P(None, "x"), R, R, R), expect="error",
             match=("past_key_value", "B * pages_per_slot == numPages", f"B = {n // 2}")),
        Case("error_layered_page_rows", x, dict(layers=2, batch=2, heads=2, page_size=n),
             (R, R, P(None, None, None, "x"), R, R, R), expect="error",
             match=("past_key_value", "dim 3 (P)")),
        # A small operand against the pool: resharded with a warning, still exact.
        Case("warn_k_split_on_head_dim", x, dict(batch=2, heads=n, head_dim=4 * n),
             (P(None, None, None, "x"), R, partition_specs(head_axis="x")[2], R, R, R),
             expect="warn", match=("k_delta", "does not follow past_key_value")),
        Case("warn_batch_split_pool_replicated", x, dict(batch=n, heads=2),
             (P("x"), P("x"), R, R, P("x"), P("x")), expect="warn",
             match=("k_delta", "v_delta", "delta_start_positions", "delta_lengths")),
    ]
    if n >= 4:
        tp = (("dp", 2), ("tp", 2))
        out += [
            Case("slots_and_heads", tp, dict(batch=4, heads=4, pages_per_slot=2),
                 partition_specs(batch_axis="dp", head_axis="tp")),
            Case("slots_and_heads_rope_batched", tp,
                 dict(batch=4, heads=2, pages_per_slot=1, rope_batch=4, delta_len=6),
                 partition_specs(batch_axis="dp", head_axis="tp", rope_batched=True)),
            Case("layered_slots_and_heads", tp, dict(layers=3, batch=2, heads=4, pages_per_slot=2),
                 partition_specs(batch_axis="dp", head_axis="tp", layered=True)),
            Case("layered_layers_and_heads", tp,
                 dict(layers=2, batch=2, heads=2, pages_per_slot=2, rope_per_layer=True),
                 partition_specs(layer_axis="dp", head_axis="tp", layered=True,
                                 rope_per_layer=True)),
            Case("shard_map_slots_and_heads", tp, dict(batch=2, heads=4, pages_per_slot=2),
                 partition_specs(batch_axis="dp", head_axis="tp"), mode="shard_map"),
            Case("gspmd_slots_and_heads", tp, dict(batch=2, heads=4, pages_per_slot=2),
                 partition_specs(batch_axis="dp", head_axis="tp"), mode="gspmd"),
            Case("warn_partial_manual_shard_map", tp, dict(batch=2, heads=4, pages_per_slot=2),
                 partition_specs(batch_axis="dp"), expect="warn", mode="partial_manual",
                 match=("shard_map", "automatic", "'tp'")),
        ]
    return out


# ---- the worker: runs cases on real (or forced host) devices -------------------------------


def _in_axes(args):
    return tuple(0 if a.ndim > r else None for a, r in zip(args, _BASE_RANKS))


def _op(case: Case, args, pages_per_slot):
    fn = functools.partial(jax_dflash.target_kv_cache_update, pages_per_slot=pages_per_slot)
    if "layers" in case.problem:
        fn = jax.vmap(fn, in_axes=_in_axes(args))
    return fn


_HLO_DTYPES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


def _buffers(array) -> dict:
    return {str(shard.device): shard.data.unsafe_buffer_pointer()
            for shard in array.addressable_shards}


def _bit_mismatches(actual, expected) -> int:
    a = np.asarray(actual)
    e = np.asarray(expected)
    assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
    a = a.view(np.uint8).reshape(*a.shape, -1)
    e = e.view(np.uint8).reshape(*e.shape, -1)
    return int(np.any(a != e, axis=-1).sum())


def _slots_written(pool: np.ndarray, updated: np.ndarray, pages_per_slot: int) -> int:
    """How many (layer, slot) pairs the update changed."""
    lead = pool.shape[:-5]
    num_pages = pool.shape[-4]
    per_slot = (*lead, 2, num_pages // pages_per_slot, -1)
    changed = (pool.view(np.uint8) != updated.view(np.uint8)).reshape(per_slot)
    return int(changed.any(axis=-1).any(axis=-2).sum())


def run_case(case: Case, devices) -> dict:
    # Not hostile unless asked: every sequence then writes, so a wrong slot cannot hide.
    problem = make_problem(np.random.default_rng(zlib.crc32(case.name.encode())),
                           **{"hostile": False, **case.problem})
    args = problem.args()
    pps = problem.pages_per_slot
    fn = _op(case, args, pps)
    expected = np.asarray(jax.jit(fn)(*[jax.device_put(a, devices[0]) for a in args]))

    names = tuple(name for name, _ in case.mesh)
    sizes = tuple(size for _, size in case.mesh)
    mesh = Mesh(np.asarray(devices[: case.num_devices]).reshape(sizes), names)
    shardings = [NamedSharding(mesh, s) for s in case.specs]
    sharded = [jax.device_put(a, s) for a, s in zip(args, shardings)]
    # A pool in buffers of XLA's own (device_put of a NumPy array may borrow the host memory,
    # which donation then cannot reuse).
    sharded[2] = jax.jit(jnp.copy, out_shardings=shardings[2])(sharded[2])
    record: dict = {
        "local_pool_shape": list(sharded[2].addressable_shards[0].data.shape),
        "slots_written": _slots_written(problem.past_key_value, expected, pps),
        "slots_in_use": int(np.prod(problem.k_delta.shape[:-3])),  # B, or layers * B
    }

    if case.mode in ("shard_map", "partial_manual"):
        axis_names = {"dp"} if case.mode == "partial_manual" else set(names)
        fn = jax.shard_map(fn, mesh=mesh, in_specs=tuple(case.specs), out_specs=case.specs[2],
                           axis_names=axis_names)
    donate = () if case.mode in ("nodonate", "eager") else (2,)
    jitted = jax.jit(fn, donate_argnums=donate)
    previous_partitioner = jax.config.jax_use_shardy_partitioner
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if case.mode == "gspmd":
                jax.config.update("jax_use_shardy_partitioner", False)
            compiled = jitted.lower(*sharded).compile()
            pool_buffers = _buffers(sharded[2])
            if case.mode == "eager":
                out = jax_dflash.target_kv_cache_update(*sharded, pages_per_slot=pps)
            else:
                out = compiled(*sharded)
            out.block_until_ready()
        except Exception as e:  # noqa: BLE001 - the record carries it to the judge
            record["error"] = f"{type(e).__name__}: {e}"
            return record
        finally:
            jax.config.update("jax_use_shardy_partitioner", previous_partitioner)
    record["warnings"] = [str(w.message) for w in caught]
    hlo = compiled.as_text()
    record["collectives"] = sorted({m.group(1) for m in _COLLECTIVE_RE.finditer(hlo)})
    record["program_aliases_pool"] = "input_output_alias={ {}: (2, {}" in hlo
    calls = [line for line in hlo.splitlines()
             if 'custom_call_target="dflash_target_kv_cache_update"' in line]
    record["shard_calls"] = len(calls)
    record["shard_calls_alias_pool"] = bool(calls) and all(
        "output_to_operand_aliasing={{}: (2, {})}" in line for line in calls)
    dims = ",".join(map(str, record["local_pool_shape"]))
    local_pool = f"{_HLO_DTYPES[str(expected.dtype)]}[{dims}]"
    record["pool_copies"] = sum(1 for line in hlo.splitlines()
                                if re.search(r"\bcopy(-start)?\(", line) and local_pool in line)
    # Donated: every shard's output is the shard's own pool buffer, updated in place.
    record["in_place"] = _buffers(out) == pool_buffers
    record["out_has_pool_sharding"] = out.sharding.is_equivalent_to(shardings[2], expected.ndim)
    record["out_sharding"] = str(out.sharding)
    record["mismatches"] = _bit_mismatches(out, expected)
    return record


def run_cases(platform: str, num_devices: int) -> dict[str, dict]:
    """Runs ``cases(num_devices)`` on the first devices of ``platform``."""
    devices = jax.devices(platform)
    return {case.name: run_case(case, devices) for case in cases(num_devices)
            if case.num_devices <= len(devices)}


# ---- the judge -------------------------------------------------------------------------------


def check(case: Case, record: dict) -> None:
    """Asserts that ``record`` is what ``case`` expects."""
    if case.expect == "error":
        assert "error" in record, f"expected a compile error, got {record}"
        for text in case.match:
            assert text in record["error"], f"{text!r} not in the error: {record['error']}"
        return
    assert "error" not in record, record.get("error")
    if not case.problem.get("hostile"):
        assert record["slots_written"] == record["slots_in_use"], "the case writes too little"
    assert record["mismatches"] == 0, f"{record['mismatches']} elements differ from unsharded"
    assert record["out_has_pool_sharding"], f"output sharding {record['out_sharding']}"
    if case.expect == "warn":
        text = "\n".join(record["warnings"])
        for needle in case.match:
            assert needle in text, f"{needle!r} not in the warnings: {record['warnings']}"
    else:
        assert record["warnings"] == [], record["warnings"]
        assert record["collectives"] == [], f"collectives in the HLO: {record['collectives']}"
        split = [a // b for a, b in zip(_pool_shape(case), record["local_pool_shape"])]
        assert math.prod(split) == case.num_devices, f"pool blocks {record['local_pool_shape']}"
    assert record["shard_calls"] >= 1, "no per-shard dflash custom call in the HLO"
    assert record["shard_calls_alias_pool"], "the per-shard custom call does not alias the pool"
    if case.mode not in ("nodonate", "eager"):
        assert record["program_aliases_pool"], "the donated pool is not aliased to the output"
        assert record["pool_copies"] == 0, f"{record['pool_copies']} pool copies when donated"
        assert record["in_place"], "the donated pool shards were not updated in place"


def _pool_shape(case: Case) -> tuple[int, ...]:
    return make_problem(np.random.default_rng(0), **case.problem).past_key_value.shape


# ---- the tests -------------------------------------------------------------------------------

MESH_SIZES = (2, CPU_DEVICES)


@pytest.fixture(scope="module")
def cpu_records(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharding") / "records.json"
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={CPU_DEVICES}"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, __file__, "--platform", "cpu", "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "num_devices, case",
    [(n, case) for n in MESH_SIZES for case in cases(n)],
    ids=lambda v: v.name if isinstance(v, Case) else f"mesh{v}",
)
def test_cpu_mesh(num_devices, case, cpu_records):
    records = cpu_records[str(num_devices)]
    assert case.name in records, f"the worker did not run {case.name}: {sorted(records)}"
    check(case, records[case.name])


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@pytest.fixture(scope="module")
def gpu_records():
    if len(_gpus()) < 2:
        pytest.skip(f"needs 2 GPUs, this JAX sees {len(_gpus())} (the 2-GPU check runs on H200s)")
    return run_cases("gpu", 2)


@pytest.mark.parametrize("case", cases(2), ids=lambda case: case.name)
def test_two_gpus(case, gpu_records):
    check(case, gpu_records[case.name])


# Unit checks of the plan, on an abstract mesh: no devices needed.


def _shape(**kwargs):
    problem = make_problem(np.random.default_rng(0), **kwargs)
    return check_update(*problem.args(), problem.pages_per_slot)


def _abstract(**axes):
    return jax.sharding.AbstractMesh(tuple(axes.values()), tuple(axes))


def test_plan_split_follows_the_pool():
    mesh = _abstract(dp=2, tp=2)
    shape = _shape(batch=4, heads=4, pages_per_slot=2)
    split = plan_split(shape, mesh, NamedSharding(mesh, P(None, "dp", None, "tp")))
    assert (split.slots, split.heads, split.layers) == (("dp",), ("tp",), ())
    layered = _shape(layers=4, batch=4, heads=4)
    split = plan_split(layered, mesh, NamedSharding(mesh, P(("dp", "tp"))))
    assert split.layers == ("dp", "tp")


def test_plan_split_rejects_uneven_splits():
    mesh = _abstract(x=2)
    with pytest.raises(ValueError, match=r"past_key_value: .*H = 3 .* does not divide"):
        plan_split(_shape(heads=3), mesh, NamedSharding(mesh, P(None, None, None, "x")))
    with pytest.raises(ValueError, match=r"past_key_value: .*3 layers .* does not divide"):
        plan_split(_shape(layers=3), mesh, NamedSharding(mesh, P("x")))


def test_partition_specs():
    k, v, pool, rope, starts, lengths = partition_specs(
        batch_axis="dp", head_axis=("tp", "sp"), rope_batched=True)
    assert k == v == P("dp", None, ("tp", "sp"), None)
    assert pool == P(None, "dp", None, ("tp", "sp"), None)
    assert rope == P("dp", None, None) and starts == lengths == P("dp")
    k, _, pool, rope, starts, _ = partition_specs(layer_axis="pp", layered=True,
                                                  positions_per_layer=True)
    assert k == P("pp", None, None, None, None) and pool == P("pp", None, None, None, None, None)
    assert rope == P(None, None, None) and starts == P("pp", None)
    with pytest.raises(ValueError, match="layer_axis"):
        partition_specs(layer_axis="pp")


def _main(argv):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platform", default="cpu")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    results = {str(n): run_cases(args.platform, n) for n in MESH_SIZES}
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    _main(sys.argv[1:])
