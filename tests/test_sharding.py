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
import jax_dflash
from conftest import make_paged_problem, make_problem
from jax_dflash._shapes import check_update, check_update_paged
from jax_dflash.sharding import paged_partition_specs, partition_specs, plan_split

CPU_DEVICES = 4
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce")
_COLLECTIVE_RE = re.compile(r"\b(" + "|".join(COLLECTIVES) + r")(-start)?\(")
# Operand ranks of the unbatched forms (extras: scales [] / [1] / [H], weight [D]).
_BASE_RANKS = {"slot": (4, 4, 5, 3, 1, 1), "paged": (3, 3, 5, 2, 1, 1, 3)}
_EXTRA_RANKS = {"k_scale": 1, "v_scale": 1, "k_norm_weight": 1}
_EXTRA_ORDER = ("k_scale", "v_scale", "k_norm_weight")  # SPEC.md's operand order
_TARGET_RE = re.compile(r'custom_call_target="dflash_target_kv_cache_update(_paged)?"')
R = P()  # replicated


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    mesh: tuple[tuple[str, int], ...]  # (axis name, size), major to minor
    problem: dict
    specs: tuple  # every operand's PartitionSpec (the extras included, in SPEC.md's order)
    expect: str = "exact"  # "exact", "warn" (exact, plus warnings) or "error"
    match: tuple[str, ...] = ()  # substrings the warning / error text must hold
    # "jit", "nodonate", "eager", "shard_map", "partial_manual", "gspmd", "constraint" (the
    # pool's sharding set inside the program by with_sharding_constraint), "computed" (the pool
    # an intermediate value of the program)
    mode: str = "jit"
    contract: str = "slot"
    # Error cases: whether the ValueError reaches the caller as itself (raised while lowering,
    # where the pool's sharding is visible) rather than inside XLA's error text.
    plain_error: bool = True

    @property
    def num_devices(self) -> int:
        return math.prod(size for _, size in self.mesh)


# Long: a table of cases, one entry each.
def cases(num_devices: int) -> list[Case]:
    """The cases that fit on ``num_devices`` (2 or 4) devices."""
    n = num_devices
    x = (("x", n),)
    out = [
        # Tensor parallel: KV heads split, replicated rope (Rb = 1).
        Case(
            "heads",
            x,
            dict(batch=3, heads=n, max_batch=5, pages_per_slot=3, dtype=np.float16),
            partition_specs(head_axis="x"),
        ),
        # Data parallel: whole slots split; every slot in use.
        Case(
            "slots",
            x,
            dict(batch=n, heads=2, pages_per_slot=2, dtype="bfloat16"),
            partition_specs(batch_axis="x"),
        ),
        # Rb = B rope split with the batch.
        Case(
            "slots_rope_batched",
            x,
            dict(batch=n, heads=2, pages_per_slot=3, rope_batch=n, dtype=np.float32),
            partition_specs(batch_axis="x", rope_batched=True),
        ),
        # Rb = B rope, positions and lengths given replicated: sliced locally, no warning.
        Case(
            "slots_small_operands_replicated",
            x,
            dict(batch=n, heads=2, pages_per_slot=2, rope_batch=n),
            (P("x"), P("x"), partition_specs(batch_axis="x")[2], R, R, R),
        ),
        # Layer-batched form (vmap), shared rope/positions, heads split.
        Case(
            "layered_heads",
            x,
            dict(layers=3, batch=2, heads=n, pages_per_slot=2),
            partition_specs(head_axis="x", layered=True),
        ),
        # Layer-batched form split on layers, per-layer Rb = B rope and positions.
        Case(
            "layered_layers",
            x,
            dict(
                layers=n,
                batch=2,
                heads=2,
                pages_per_slot=2,
                rope_batch=2,
                rope_per_layer=True,
                positions_per_layer=True,
            ),
            partition_specs(
                layer_axis="x",
                layered=True,
                rope_batched=True,
                rope_per_layer=True,
                positions_per_layer=True,
            ),
        ),
        Case(
            "layered_slots",
            x,
            dict(layers=2, batch=n, heads=2, pages_per_slot=2, positions_per_layer=True),
            partition_specs(batch_axis="x", layered=True, positions_per_layer=True),
        ),
        # Hostile positions and lengths (padding, drops, negative starts) per shard.
        Case(
            "slots_hostile",
            x,
            dict(batch=n, heads=2, pages_per_slot=2, hostile=True),
            partition_specs(batch_axis="x"),
        ),
        Case(
            "not_donated",
            x,
            dict(batch=n, heads=n, pages_per_slot=2),
            partition_specs(batch_axis="x"),
            mode="nodonate",
        ),
        Case(
            "eager",
            x,
            dict(batch=2, heads=n, pages_per_slot=2),
            partition_specs(head_axis="x"),
            mode="eager",
        ),
        Case(
            "shard_map",
            x,
            dict(batch=n, heads=2, pages_per_slot=2),
            partition_specs(batch_axis="x"),
            mode="shard_map",
        ),
        # What the op cannot follow: errors naming the pool and the dim.
        Case(
            "error_pool_head_dim",
            x,
            dict(batch=2, heads=2, head_dim=8 * n),
            (R, R, P(None, None, None, None, "x"), R, R, R),
            expect="error",
            match=("past_key_value", "dim 4 (D)", "'x'"),
        ),
        Case(
            "error_pool_page_rows",
            x,
            dict(batch=2, heads=2, page_size=2 * n),
            (R, R, P(None, None, "x"), R, R, R),
            expect="error",
            match=("past_key_value", "dim 2 (P)"),
        ),
        Case(
            "error_pool_planes",
            (("x", 2),),
            dict(batch=2, heads=2),
            (R, R, P("x"), R, R, R),
            expect="error",
            match=("past_key_value", "dim 0 (K/V plane)"),
        ),
        Case(
            "error_pages_not_whole_slots",
            x,
            dict(batch=1, heads=2, pages_per_slot=n),
            (R, R, P(None, "x"), R, R, R),
            expect="error",
            match=("past_key_value", "not a whole number of slots", f"pages_per_slot = {n}"),
        ),
        Case(
            "error_slots_not_all_used",
            x,
            dict(batch=n // 2, max_batch=n, heads=2, pages_per_slot=1),
            (R, R, P(None, "x"), R, R, R),
            expect="error",
            match=("past_key_value", "B * pages_per_slot == numPages", f"B = {n // 2}"),
        ),
        Case(
            "error_layered_page_rows",
            x,
            dict(layers=2, batch=2, heads=2, page_size=n),
            (R, R, P(None, None, None, "x"), R, R, R),
            expect="error",
            match=("past_key_value", "dim 3 (P)"),
        ),
        # A small operand against the pool: resharded with a warning, still exact.
        Case(
            "warn_k_split_on_head_dim",
            x,
            dict(batch=2, heads=n, head_dim=4 * n),
            (P(None, None, None, "x"), R, partition_specs(head_axis="x")[2], R, R, R),
            expect="warn",
            match=("k_delta", "does not follow past_key_value"),
        ),
        Case(
            "warn_batch_split_pool_replicated",
            x,
            dict(batch=n, heads=2),
            (P("x"), P("x"), R, R, P("x"), P("x")),
            expect="warn",
            match=("k_delta", "v_delta", "delta_start_positions", "delta_lengths"),
        ),
        # The pool's sharding set inside the program: still reported while lowering.
        Case(
            "error_constraint_page_rows",
            x,
            dict(batch=2, heads=2, page_size=2 * n),
            (R, R, P(None, None, "x"), R, R, R),
            expect="error",
            mode="constraint",
            match=("past_key_value", "dim 2 (P)"),
        ),
        # A pool computed inside the program: its sharding is known only to the partitioner,
        # whose error XLA wraps; the message is still there.
        Case(
            "error_computed_pool_page_rows",
            x,
            dict(batch=2, heads=2, page_size=2 * n),
            (R, R, P(None, None, "x"), R, R, R),
            expect="error",
            mode="computed",
            match=("past_key_value", "dim 2 (P)"),
            plain_error=False,
        ),
        # FP8 pools: per-head scales follow the heads, per-tensor ones are replicated.
        Case(
            "fp8_per_head_scales_heads",
            x,
            dict(batch=2, heads=n, pool_dtype="float8_e4m3fn", scale_shape=(n,), k_norm=True),
            partition_specs(head_axis="x", scales="head", k_norm=True),
        ),
        Case(
            "fp8_per_tensor_scales_slots",
            x,
            dict(batch=n, heads=2, pool_dtype="float8_e5m2", scale_shape=(), v_norm=True),
            partition_specs(batch_axis="x", scales="tensor"),
        ),
        Case(
            "warn_scale_split_pool_replicated",
            x,
            dict(batch=2, heads=n, pool_dtype="float8_e4m3fn", scale_shape=(n,)),
            (R, R, R, R, R, R, P("x"), P("x")),
            expect="warn",
            match=("k_scale", "v_scale", "does not follow past_key_value"),
        ),
        # The paged contract: KV heads and layers only.
        Case(
            "paged_heads",
            x,
            dict(tokens=9, batch=2, heads=n, num_pages=6, table_pages=3),
            paged_partition_specs(head_axis="x"),
            contract="paged",
        ),
        Case(
            "paged_hostile_ring_heads",
            x,
            dict(
                tokens=9,
                batch=2,
                heads=n,
                num_pages=6,
                table_pages=3,
                hostile=True,
                ring=True,
                dtype=np.float32,
                pool_dtype="bfloat16",
            ),
            paged_partition_specs(head_axis="x"),
            contract="paged",
        ),
        Case(
            "paged_fp8_per_head_scales_heads",
            x,
            dict(
                tokens=7,
                batch=2,
                heads=n,
                pool_dtype="float8_e4m3fn",
                scale_shape=(n,),
                k_norm=True,
                v_norm=True,
            ),
            paged_partition_specs(head_axis="x", scales="head", k_norm=True),
            contract="paged",
        ),
        Case(
            "paged_layered_heads",
            x,
            dict(layers=3, tokens=6, batch=2, heads=n),
            paged_partition_specs(head_axis="x", layered=True),
            contract="paged",
        ),
        Case(
            "paged_layered_layers",
            x,
            dict(
                layers=n,
                tokens=6,
                batch=2,
                heads=2,
                rope_per_layer=True,
                positions_per_layer=True,
                table_per_layer=True,
                pool_dtype="float8_e5m2",
                scale_shape=(n, 2),
                k_norm=True,
                norm_weight_per_layer=True,
            ),
            paged_partition_specs(
                layer_axis="x",
                layered=True,
                rope_per_layer=True,
                positions_per_layer=True,
                table_per_layer=True,
                scales="head",
                scales_per_layer=True,
                k_norm=True,
                norm_weight_per_layer=True,
            ),
            contract="paged",
        ),
        # Per-layer rings split with the layers: every shard's layers take (ring, no ring).
        Case(
            "paged_layered_layers_per_layer_ring",
            x,
            dict(layers=2 * n, tokens=9, batch=2, heads=2, hostile=True, ring=(True, False) * n),
            paged_partition_specs(layer_axis="x", layered=True),
            contract="paged",
        ),
        Case(
            "paged_eager",
            x,
            dict(tokens=5, batch=2, heads=n),
            paged_partition_specs(head_axis="x"),
            mode="eager",
            contract="paged",
        ),
        Case(
            "paged_shard_map",
            x,
            dict(tokens=5, batch=2, heads=n),
            paged_partition_specs(head_axis="x"),
            mode="shard_map",
            contract="paged",
        ),
        Case(
            "error_paged_pages",
            x,
            dict(tokens=6, batch=2, heads=2, num_pages=2 * n),
            (R, R, P(None, "x"), R, R, R, R),
            expect="error",
            contract="paged",
            match=("past_key_value", "dim 1 (numPages)", "page table", "only the KV heads (dim 3)"),
        ),
        Case(
            "error_paged_layered_page_rows",
            x,
            dict(layers=2, tokens=6, batch=2, heads=2, page_size=n),
            (R, R, P(None, None, None, "x"), R, R, R, R),
            expect="error",
            contract="paged",
            match=("past_key_value", "dim 3 (P)", "the layers (dim 0)"),
        ),
        Case(
            "error_paged_per_layer_rings_differ_between_shards",
            x,
            dict(layers=2 * n, tokens=6, batch=2, heads=2, ring=(True,) * n + (False,) * n),
            paged_partition_specs(layer_axis="x", layered=True),
            expect="error",
            contract="paged",
            match=("past_key_value", "per-layer rings differ", "(True, True) on shard 0", "ring"),
        ),
        Case(
            "warn_paged_table_split",
            x,
            dict(tokens=6, batch=n, heads=2, num_pages=2 * n, table_pages=2),
            (*paged_partition_specs()[:6], P("x")),
            expect="warn",
            contract="paged",
            match=("kv_page_table", "does not follow past_key_value"),
        ),
    ]
    if n >= 4:
        tp = (("dp", 2), ("tp", 2))
        out += [
            Case(
                "slots_and_heads",
                tp,
                dict(batch=4, heads=4, pages_per_slot=2),
                partition_specs(batch_axis="dp", head_axis="tp"),
            ),
            Case(
                "slots_and_heads_rope_batched",
                tp,
                dict(batch=4, heads=2, pages_per_slot=1, rope_batch=4, delta_len=6),
                partition_specs(batch_axis="dp", head_axis="tp", rope_batched=True),
            ),
            Case(
                "layered_slots_and_heads",
                tp,
                dict(layers=3, batch=2, heads=4, pages_per_slot=2),
                partition_specs(batch_axis="dp", head_axis="tp", layered=True),
            ),
            Case(
                "layered_layers_and_heads",
                tp,
                dict(layers=2, batch=2, heads=2, pages_per_slot=2, rope_per_layer=True),
                partition_specs(layer_axis="dp", head_axis="tp", layered=True, rope_per_layer=True),
            ),
            Case(
                "shard_map_slots_and_heads",
                tp,
                dict(batch=2, heads=4, pages_per_slot=2),
                partition_specs(batch_axis="dp", head_axis="tp"),
                mode="shard_map",
            ),
            Case(
                "gspmd_slots_and_heads",
                tp,
                dict(batch=2, heads=4, pages_per_slot=2),
                partition_specs(batch_axis="dp", head_axis="tp"),
                mode="gspmd",
            ),
            Case(
                "warn_partial_manual_shard_map",
                tp,
                dict(batch=2, heads=4, pages_per_slot=2),
                partition_specs(batch_axis="dp"),
                expect="warn",
                mode="partial_manual",
                match=("shard_map", "automatic", "'tp'"),
            ),
        ]
    return out


# ---- the worker: runs cases on real (or forced host) devices -------------------------------


def _problem(case: Case, seed: int = 0):
    build = make_paged_problem if case.contract == "paged" else make_problem
    return build(np.random.default_rng(seed), **{"hostile": False, **case.problem})


def _operands(problem):
    """(operands with the array extras in SPEC.md's order, their names, the static keywords)."""
    kwargs = problem.kwargs()
    extras = [n for n in _EXTRA_ORDER if n in kwargs]
    static = {k: v for k, v in kwargs.items() if k not in extras}
    return [*problem.args(), *(kwargs[n] for n in extras)], extras, static


def _op(case: Case, operands, extras, static):
    base = len(_BASE_RANKS[case.contract])
    op = (
        jax_dflash.target_kv_cache_update_paged
        if case.contract == "paged"
        else jax_dflash.target_kv_cache_update
    )

    def fn(*ops):
        return op(*ops[:base], **static, **dict(zip(extras, ops[base:])))

    # vmap's calls take one bool ring: a per-layer ring is the layer-batched call itself.
    if "layers" in case.problem and not isinstance(static.get("ring"), tuple):
        ranks = _BASE_RANKS[case.contract] + tuple(_EXTRA_RANKS[n] for n in extras)
        fn = jax.vmap(fn, in_axes=tuple(0 if a.ndim > r else None for a, r in zip(operands, ranks)))
    return fn, op, base


_HLO_DTYPES = {
    "float16": "f16",
    "bfloat16": "bf16",
    "float32": "f32",
    "float8_e4m3fn": "f8e4m3fn",
    "float8_e5m2": "f8e5m2",
}


def _buffers(array) -> dict:
    return {
        str(shard.device): shard.data.unsafe_buffer_pointer() for shard in array.addressable_shards
    }


def _bit_mismatches(actual, expected) -> int:
    a = np.asarray(actual)
    e = np.asarray(expected)
    assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
    a = a.view(np.uint8).reshape(*a.shape, -1)
    e = e.view(np.uint8).reshape(*e.shape, -1)
    return int(np.any(a != e, axis=-1).sum())


def _written(case: Case, problem, updated: np.ndarray) -> tuple[int, int]:
    """(what the update changed, what it must change when every token is valid): (layer, slot)
    pairs in the slot contract, K rows in the paged one."""
    pool = problem.past_key_value
    lead = pool.shape[:-5]
    changed = pool.view(np.uint8) != updated.view(np.uint8)
    if case.contract == "paged":
        rows = changed.reshape(*lead, 2, pool.shape[-4] * pool.shape[-3], -1).any(-1)
        return int(rows[..., 0, :].sum()), int(np.prod(problem.k_delta.shape[:-2]))
    per_slot = (*lead, 2, pool.shape[-4] // problem.pages_per_slot, -1)
    slots = int(changed.reshape(per_slot).any(axis=-1).any(axis=-2).sum())
    return slots, int(np.prod(problem.k_delta.shape[:-3]))  # B, or layers * B


# Long: one case's steps (build, compile, run, compare, inspect the HLO), in order.
def run_case(case: Case, devices) -> dict:
    # Not hostile unless asked: every sequence then writes, so a wrong slot cannot hide.
    problem = _problem(case, zlib.crc32(case.name.encode()))
    args, extras, static = _operands(problem)
    fn, op, base = _op(case, args, extras, static)
    if case.expect == "error":
        expected = None  # nothing to compare with
    else:
        try:
            expected = np.asarray(jax.jit(fn)(*[jax.device_put(a, devices[0]) for a in args]))
        except Exception as e:  # noqa: BLE001 - the record carries it to the judge
            return {"error": f"unsharded run: {type(e).__name__}: {e}"}

    names = tuple(name for name, _ in case.mesh)
    sizes = tuple(size for _, size in case.mesh)
    mesh = Mesh(np.asarray(devices[: case.num_devices]).reshape(sizes), names)
    assert len(case.specs) == len(args), (case.name, len(case.specs), len(args))
    shardings = [NamedSharding(mesh, s) for s in case.specs]
    if case.mode == "constraint":
        pool_sharding = shardings[2]
        shardings = [NamedSharding(mesh, R)] * len(args)
        inner = fn

        def fn(*ops):
            pool = jax.lax.with_sharding_constraint(ops[2], pool_sharding)
            return inner(*ops[:2], pool, *ops[3:])

    if case.mode == "computed":
        inner_op = fn

        def fn(*ops):
            return inner_op(*ops[:2], ops[2] * jnp.ones((), ops[2].dtype), *ops[3:])

    sharded = [jax.device_put(a, s) for a, s in zip(args, shardings)]
    # A pool in buffers of XLA's own (device_put of a NumPy array may borrow the host memory,
    # which donation then cannot reuse).
    sharded[2] = jax.jit(jnp.copy, out_shardings=shardings[2])(sharded[2])
    record: dict = {"local_pool_shape": list(sharded[2].addressable_shards[0].data.shape)}
    if expected is not None:
        record["written"], record["must_write"] = _written(case, problem, expected)

    if case.mode in ("shard_map", "partial_manual"):
        axis_names = {"dp"} if case.mode == "partial_manual" else set(names)
        fn = jax.shard_map(
            fn,
            mesh=mesh,
            in_specs=tuple(case.specs),
            out_specs=case.specs[2],
            axis_names=axis_names,
        )
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
                out = op(*sharded[:base], **static, **dict(zip(extras, sharded[base:])))
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
    calls = [line for line in hlo.splitlines() if _TARGET_RE.search(line)]
    record["shard_calls"] = len(calls)
    record["shard_calls_alias_pool"] = bool(calls) and all(
        "output_to_operand_aliasing={{}: (2, {})}" in line for line in calls
    )
    dims = ",".join(map(str, record["local_pool_shape"]))
    local_pool = f"{_HLO_DTYPES[str(expected.dtype)]}[{dims}]"
    record["pool_copies"] = sum(
        1
        for line in hlo.splitlines()
        if re.search(r"\bcopy(-start)?\(", line) and local_pool in line
    )
    # Donated: every shard's output is the shard's own pool buffer, updated in place.
    record["in_place"] = _buffers(out) == pool_buffers
    record["out_has_pool_sharding"] = out.sharding.is_equivalent_to(
        NamedSharding(mesh, case.specs[2]), expected.ndim
    )
    record["out_sharding"] = str(out.sharding)
    record["mismatches"] = _bit_mismatches(out, expected)
    return record


def run_cases(platform: str, num_devices: int) -> dict[str, dict]:
    """Runs ``cases(num_devices)`` on the first devices of ``platform``."""
    devices = jax.devices(platform)
    return {
        case.name: run_case(case, devices)
        for case in cases(num_devices)
        if case.num_devices <= len(devices)
    }


# ---- the judge -------------------------------------------------------------------------------


def check(case: Case, record: dict) -> None:
    """Asserts that ``record`` is what ``case`` expects."""
    if case.expect == "error":
        assert "error" in record, f"expected a compile error, got {record}"
        for text in case.match:
            assert text in record["error"], f"{text!r} not in the error: {record['error']}"
        if case.plain_error:
            # The ValueError itself, first: not buried in an XLA error's Python traceback.
            assert record["error"].startswith("ValueError: past_key_value: "), record["error"]
        return
    assert "error" not in record, record.get("error")
    if not case.problem.get("hostile"):
        assert record["written"] == record["must_write"], "the case writes too little"
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
    return _problem(case).past_key_value.shape


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
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
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
        batch_axis="dp", head_axis=("tp", "sp"), rope_batched=True
    )
    assert k == v == P("dp", None, ("tp", "sp"), None)
    assert pool == P(None, "dp", None, ("tp", "sp"), None)
    assert rope == P("dp", None, None) and starts == lengths == P("dp")
    k, _, pool, rope, starts, _ = partition_specs(
        layer_axis="pp", layered=True, positions_per_layer=True
    )
    assert k == P("pp", None, None, None, None) and pool == P("pp", None, None, None, None, None)
    assert rope == P(None, None, None) and starts == P("pp", None)
    with pytest.raises(ValueError, match="layer_axis"):
        partition_specs(layer_axis="pp")


def _paged_shape(**kwargs):
    problem = make_paged_problem(np.random.default_rng(0), **kwargs)
    extras = {
        k: v for k, v in problem.kwargs().items() if k in ("k_scale", "v_scale", "k_norm_weight")
    }
    return check_update_paged(*problem.args(), **extras)


def test_paged_plan_allows_heads_and_layers_only():
    mesh = _abstract(dp=2, tp=2)
    shape = _paged_shape(layers=2, heads=4)
    split = plan_split(shape, mesh, NamedSharding(mesh, P("dp", None, None, None, "tp")))
    assert (split.layers, split.heads, split.slots) == (("dp",), ("tp",), ())
    with pytest.raises(ValueError) as info:
        plan_split(_paged_shape(heads=2), mesh, NamedSharding(mesh, P(None, "dp")))
    message = str(info.value)
    for text in (
        "past_key_value: sharding P(None, 'dp', None, None, None)",
        "dim 1 (numPages)",
        "page table",
        "only the KV heads (dim 3)",
        "replicate dim 1",
    ):
        assert text in message, (text, message)


def test_a_split_over_a_size_1_axis_is_replication():
    """A mesh axis of size 1 splits nothing: naming it on a dim the update cannot split (the
    paged pool's pages, P, D) is accepted as the replication it is, and plans no split."""
    mesh = _abstract(one=1, also_one=1, tp=2)
    shape = _paged_shape(heads=2)
    spec = P(None, "one", "also_one", "tp")
    split = plan_split(shape, mesh, NamedSharding(mesh, spec))
    assert (split.layers, split.heads, split.slots) == ((), ("tp",), ())
    with pytest.raises(ValueError, match=r"dim 1 \(numPages\)"):
        plan_split(shape, mesh, NamedSharding(mesh, P(None, ("one", "tp"))))


def test_operand_specs_follow_heads_and_layers():
    from jax_dflash.sharding import Split, operand_specs

    split = Split(layers=("pp",), heads=("tp",))
    shape = _paged_shape(
        layers=2,
        heads=2,
        pool_dtype="float8_e4m3fn",
        scale_shape=(2, 2),
        k_norm=True,
        norm_weight_per_layer=True,
        table_per_layer=True,
    )
    specs = operand_specs(shape, split)
    assert len(specs) == 10  # 7 base operands, k_scale, v_scale, k_norm_weight
    assert specs[2] == P("pp", None, None, None, "tp", None)
    assert specs[6] == P("pp", None, None, None)  # the table: per layer, never split on pages
    assert specs[7] == specs[8] == P("pp", "tp")  # per-layer, per-head scales
    assert specs[9] == P("pp")  # the per-layer weight
    shared = _paged_shape(heads=2, pool_dtype="float8_e5m2", scale_shape=(), k_norm=True)
    specs = operand_specs(shared, Split(heads=("tp",)))
    assert specs[7] == specs[8] == P() and specs[9] == P()
    assert specs == paged_partition_specs(head_axis="tp", scales="tensor", k_norm=True)
    fp8 = make_problem(
        np.random.default_rng(0), heads=2, batch=2, pool_dtype="float8_e4m3fn", scale_shape=(2,)
    )
    slot_shape = check_update(*fp8.args(), 2, k_scale=fp8.k_scale, v_scale=fp8.v_scale)
    assert operand_specs(slot_shape, Split(slots=("dp",), heads=("tp",))) == partition_specs(
        batch_axis="dp", head_axis="tp", scales="head"
    )


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
