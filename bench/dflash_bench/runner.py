"""One shape end to end: its problem, every contender set up and checked, then all timed
together; the shape's entry of the results (what the JSON holds per shape)."""

from __future__ import annotations

import time

import numpy as np

from dflash_bench.clocks import GpuClocks
from dflash_bench.contenders import GEMM_CHAINS, OURS, prepare_contender
from dflash_bench.dtypes import bits
from dflash_bench.problem import Problem, make_problem
from dflash_bench.shapes import BenchShape
from dflash_bench.timing import Prepared, Settings, time_interleaved


def measured_us(entry: dict, name: str) -> float | None:
    """A contender's time per update at a shape, when it ran (right or wrong)."""
    c = entry["contenders"].get(name, {})
    return c.get("us") if c.get("status") in ("ok", "wrong") else None


def _shape_entry(shape: BenchShape, problem: Problem) -> dict:
    return {
        "name": shape.name,
        "description": shape.describe(),
        "dtype": shape.dtype,
        "pool_dtype": shape.pool_dtype_name,
        "pool_format": shape.pool_format,
        "pool_scales": shape.pool_spec.scales,
        "num_layers": shape.num_layers,
        "batch": shape.batch,
        "delta_len": shape.delta_len,
        "tokens": shape.tokens,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "rotary_dim": shape.rotary_dim,
        "page_size": shape.page_size,
        "pages_per_slot": shape.pages_per_slot,
        "slot_capacity": shape.slot_capacity,
        "num_pages": shape.num_pages,
        "num_input_sets": problem.num_sets,
        "bytes": problem.bytes,
        "contenders": {},
    }


def _prepare_all(problem: Problem, settings: Settings, contenders) -> tuple[dict, dict]:
    """(prepared contenders, results of those that do not run), each with its setup time."""
    prepared, results, ctx = {}, {}, {}
    for name in contenders:
        t0 = time.perf_counter()
        ready = prepare_contender(name, problem, settings, ctx)
        setup_s = round(time.perf_counter() - t0, 2)
        if isinstance(ready, Prepared):
            ready.info["setup_s"] = setup_s
            prepared[name] = ready
        else:
            results[name] = {**ready, "setup_s": setup_s}
    # ctx ends here: the shared uploads stay alive as long as a prepared contender holds them.
    return prepared, results


def _references_agree(problem: Problem) -> bool | None:
    """Whether the references of the contracts computed (two at least) agree bit for bit, their
    scale pool entries too; None when fewer were computed."""
    agree = None
    for references in (problem.references, problem.scale_references):
        plain = [r for (_, fused_norm), r in references.items() if not fused_norm]
        if len(plain) >= 2:
            same = all(np.array_equal(bits(plain[0]), bits(r)) for r in plain[1:])
            agree = same if agree is None else agree and same
    return agree


def run_shape(
    shape: BenchShape,
    settings: Settings,
    contenders,
    peak_bw: float,
    clocks: GpuClocks | None = None,
) -> dict:
    problem = make_problem(shape, settings.backend)
    entry = _shape_entry(shape, problem)
    # Every contender is set up first and they are timed together, interleaved (time_interleaved).
    prepared, results = _prepare_all(problem, settings, contenders)
    results.update(time_interleaved(prepared, settings, clocks))
    del prepared  # frees this shape's buffers before the next shape's
    agree = _references_agree(problem)
    if agree is not None:
        entry["references_agree"] = agree
    for name in contenders:
        result = results[name]
        if "check" in result and "us" in result:
            result["status"] = "ok" if result["check"]["ok"] else "wrong"
        entry["contenders"][name] = result
        if result["status"] == "n/a":
            continue
        shown = (
            f"{result['us']:.2f} us (min {result['us_min']:.2f}, max {result['us_max']:.2f})"
            if "us" in result
            else result.get("reason", "")
        )
        print(f"  {shape.name:<24} {name:<13} {result['status']:<8} {shown}", flush=True)
    entry["derived"] = derived(entry, peak_bw)
    return entry


def gemm_added_us(entry: dict, name: str) -> float | None:
    """What the update adds to the GEMM chain ``name`` (contenders.GEMM_CHAINS): its time per
    step minus that of its path's GEMM chain alone, when both ran."""
    alone = GEMM_CHAINS[name][0]
    with_update, without = measured_us(entry, name), measured_us(entry, alone)
    return None if with_update is None or without is None else with_update - without


def derived(entry: dict, peak_bw: float) -> dict:
    """This project's contenders' fractions of the copy floor and of peak copy bandwidth, and
    what the update adds to each GEMM chain (µs, and over the copy floor)."""
    total = entry["bytes"]["total"]
    floor = measured_us(entry, "copy")
    out = {}
    for name in OURS:
        t = measured_us(entry, name)
        if t is None:
            continue
        if floor is not None:
            out[f"floor_over_{name}"] = floor / t
        if peak_bw:
            out[f"{name}_bytes_per_s"] = total / (t * 1e-6)
            out[f"{name}_fraction_of_peak_copy_bw"] = total / (t * 1e-6) / peak_bw
    for name in GEMM_CHAINS:
        added = gemm_added_us(entry, name)
        if added is None:
            continue
        out[f"{name}_added_us"] = added
        if floor is not None:
            out[f"{name}_added_over_floor"] = added / floor
    return out
