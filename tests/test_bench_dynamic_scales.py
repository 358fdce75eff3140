"""The benchmark's pools with per-token-head dynamic scales (int8, FP8) and int4 pools: the CPU
run times and checks them (the scale pool against the reference too), through the JAX op and
the raw entries, the bytes count the scales, and the targets follow the numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dflash_bench as benchmark
from dflash_bench.check import check_scales, compare_sample
from dflash_bench.contracts import CONTRACTS
from dflash_bench.dtypes import DTYPES, bits
from dflash_bench.problem import host_scale_pool, make_problem
from dflash_bench.shapes import CPU_SHAPES, GPU_SHAPES, BenchShape
from dflash_bench.targets import evaluate_targets

TINY = {"num_kv_heads": 2, "head_dim": 16, "rotary_dim": 8, "page_size": 4, "min_capacity": 8}
DYNAMIC_FORMATS = ("int8-dynamic", "float8_e4m3fn-dynamic", "float8_e5m2-dynamic", "int4")
NEW_CPU_SHAPES = ("decode_b8_int8_dynamic", "decode_b8_fp8_dynamic", "decode_b8_int4")
CHECKED = ("ours_jax", "paged_jax", "slots_jax", "knorm_jax")
RAW = ("ours_raw", "paged_raw", "slots_raw")


def test_quick_cpu_run_checks_and_times_the_dynamic_and_int4_pools(tmp_path, capsys):
    """Each JAX contender's sample and its scale pool entries are the reference's, bit for bit;
    a paged or slot-mapping pool and scale pool, gathered in slot order, are the slot op's; the
    raw entries (by name, with the scale pool) pass the same checks; the table and the JSON have
    the rows."""
    names = [*CHECKED, *RAW, "jax_baseline", "copy"]
    argv = ["--backend", "cpu", "--quick", "--repeats", "1", "--min-time", "0.002"]
    argv += ["--shapes", ",".join(NEW_CPU_SHAPES), "--contenders", ",".join(names)]
    assert benchmark.main([*argv, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "kv_update_cpu.json").read_text())
    by_name = {e["name"]: e for e in results["shapes"]}
    assert list(by_name) == list(NEW_CPU_SHAPES)
    formats = {name: by_name[name]["pool_format"] for name in NEW_CPU_SHAPES}
    assert formats == dict(zip(NEW_CPU_SHAPES, ("int8-dynamic", "float8_e4m3fn-dynamic", "int4")))
    assert [by_name[n]["pool_dtype"] for n in NEW_CPU_SHAPES] == ["int8", "float8_e4m3fn", "uint8"]
    for entry in results["shapes"]:
        contenders = entry["contenders"]
        assert entry["pool_scales"] == "dynamic"
        assert entry["references_agree"]
        for name in (*CHECKED, "copy"):
            c = contenders[name]
            assert c["status"] == "ok" and c["us"] > 0, (entry["name"], name, c)
        for name in CHECKED:
            check = contenders[name]["check"]
            assert check["bit_exact"] and check["scale_pool"]["bit_exact"], (entry["name"], name)
            if name != "ours_jax":
                assert check["full_pool_bits_differing_vs_slot_op"] == 0, (entry["name"], name)
        for name in RAW:
            c = contenders[name]
            assert c["status"] == "ok" and c["us"] > 0, (entry["name"], name, c)
            assert c["check"]["bit_exact"] and c["check"]["scale_pool"]["bit_exact"], (
                entry["name"],
                name,
            )
        assert contenders["jax_baseline"]["status"] == "skipped"
        # 8 sequences x 16 tokens, 8 heads of 128: fp16 deltas read, one byte (int4: half) per
        # pool element and 4 bytes per head of each row for its scale written, in K and V.
        per_byte = 2 if entry["pool_format"] == "int4" else 1
        assert entry["bytes"] == {
            "kv_read": 2 * 128 * 1024 * 2,
            "pool_write": 2 * 128 * 1024 // per_byte,
            "scale_write": 2 * 128 * 8 * 4,
            "rope_read": 128 * 128 * 4,
            "total": 2 * 128 * 1024 * 2 + 2 * 128 * 1024 // per_byte + 2 * 128 * 8 * 4 + 65536,
            "written_tokens": 128,
        }
        # The floor copies the same bytes, scales included.
        assert contenders["copy"]["bytes_copied"] == entry["bytes"]["total"] // 2
    printed = capsys.readouterr().out
    assert "| B=8 L=16 float16, int8-dynamic pool |" in printed
    assert "| B=8 L=16 float16, int4 pool |" in printed
    assert "take no scale pool" not in printed


@pytest.mark.parametrize("pool_format", DYNAMIC_FORMATS)
@pytest.mark.parametrize("layers", [None, 2])
def test_every_contract_reference_writes_the_same_rows_and_scales(pool_format, layers):
    shape = BenchShape("tiny", 3, 4, pool_dtype=pool_format, num_layers=layers, **TINY)
    problem = make_problem(shape, "cpu")
    d = TINY["head_dim"] // DTYPES[pool_format].per_byte
    assert problem.sample_init.shape[-1] == d and shape.pool_shape[-1] == d
    assert problem.sample_scale_init.shape == problem.sample_init.shape[:-1]
    for fused_norm in (False, True):
        pools = [problem.expected(c, fused_norm) for c in CONTRACTS]
        scales = [problem.expected_scales(c, fused_norm) for c in CONTRACTS]
        for pool, scale in zip(pools[1:], scales[1:]):
            np.testing.assert_array_equal(bits(pool), bits(pools[0]))
            np.testing.assert_array_equal(bits(scale), bits(scales[0]))
    # The update writes rows and their scales (what the check compares is not the initial one).
    assert not np.array_equal(bits(problem.expected("slot")), bits(problem.sample_init))
    assert not np.array_equal(
        bits(problem.expected_scales("slot")), bits(problem.sample_scale_init)
    )


@pytest.mark.parametrize("pool_format", ["int8-dynamic", "int4"])
def test_correctness_gate_rejects_one_wrong_scale(pool_format):
    shape = BenchShape("tiny", 2, 4, pool_dtype=pool_format, **TINY)
    problem = make_problem(shape, "cpu")
    want = problem.expected_scales("paged")
    scale_pool = host_scale_pool(problem, "paged")
    k_pages, v_pages = problem.sample_pages("paged")
    scale_pool[0, k_pages], scale_pool[1, v_pages] = want[0], want[1]
    pool_ok = compare_sample(problem.expected("paged"), problem.expected("paged"), True)
    assert check_scales(dict(pool_ok), scale_pool, problem, "paged")["ok"]
    written = np.argwhere(want != problem.sample_scale_init)[0]
    plane, page, row, head = written
    pages = k_pages if plane == 0 else v_pages
    scale_pool[plane, pages[page], row, head] = np.nextafter(want[tuple(written)], np.float32(1))
    check = check_scales(dict(pool_ok), scale_pool, problem, "paged")
    assert not check["ok"] and not check["scale_pool"]["bit_exact"]
    # Without dynamic scales there is nothing to compare.
    static = make_problem(BenchShape("tiny", 2, 4, pool_dtype="int8", **TINY), "cpu")
    assert static.expected_scales("slot") is None
    assert check_scales(dict(pool_ok), None, static, "slot") == pool_ok


def test_the_chain_donates_the_pool_and_the_scale_pool_together():
    """The jitted chain of a dynamic-scale shape carries (pool, scale_pool) and donates both."""
    import jax

    from dflash_bench.jax_contenders import JaxInputs, dflash_update, jax_pool, jitted_chain

    problem = make_problem(BenchShape("tiny", 2, 4, pool_dtype="int4", **TINY), "cpu")
    device = jax.devices("cpu")[0]
    inputs = JaxInputs(problem, device)
    pools = jax_pool(problem, device, "paged")
    assert isinstance(pools, tuple) and len(pools) == 2
    step = jitted_chain(dflash_update("paged", problem.shape), 3)
    out = step(pools, *inputs.operands("paged"))
    assert all(x.is_deleted() for x in pools)
    assert out[0].shape == problem.shape.pool_shape
    assert out[1].shape == problem.shape.scale_pool_shape


def _entry(shape: BenchShape, total: float = 1e6, **us) -> dict:
    keys = ("batch", "delta_len", "dtype", "num_layers", "num_kv_heads", "head_dim")
    keys += ("rotary_dim", "page_size", "pages_per_slot")
    return {
        "name": shape.name,
        "pool_format": shape.pool_format,
        **{k: getattr(shape, k) for k in keys},
        "bytes": {"total": total},
        "contenders": {n: {"status": "ok", "us": t} for n, t in us.items()},
    }


def test_dynamic_scale_and_int4_targets_follow_the_numbers():
    gpu = {s.name: s for s in GPU_SHAPES}

    def times(t, **more):
        return dict(ours_jax=t, paged_jax=t, slots_jax=t, knorm_jax=t, **more)

    shapes = [
        # 1e6 bytes at 1e11 bytes/s take 10 us: 10.5 us is 95% of copy bandwidth.
        _entry(gpu["prefill_b8_l2048_int8"], **times(10.5, ours_raw=10.5, paged_raw=11.5)),
        # +9.5%: within 10% of static and 87% of copy bandwidth; slots_jax +14%: missed.
        _entry(gpu["prefill_b8_l2048_int8_dynamic"], **{**times(11.5), "slots_jax": 12.0}),
        _entry(gpu["prefill_b8_l2048_fp8"], **times(10.5)),
        # +19%, and 80% of copy bandwidth: both missed.
        _entry(gpu["prefill_b8_l2048_fp8_dynamic"], **times(12.5)),
        _entry(gpu["decode_b64_fp8"], total=1e5, **times(3.0)),
        _entry(gpu["decode_b64_fp8_dynamic"], total=1e5, **times(3.2)),
        # int4: 8e5 bytes in 9.0 us = 88.9%, in 9.5 us = 84.2%.
        _entry(gpu["prefill_b8_l2048_int4"], total=8e5, ours_jax=9.0, paged_jax=9.5),
        _entry(gpu["decode_b64_int4"], total=1e5, ours_jax=3.0),
    ]
    results = {"backend": "gpu", "peak_copy_bandwidth": {"bytes_per_s": 1e11}, "shapes": shapes}
    rows = {t["target"]: t for t in evaluate_targets(results)}
    met = {k: t["met"] for k, t in rows.items()}

    static_bw = "prefill_b8_l2048_int8: {} >= 90% of measured copy bandwidth (its bytes)"
    assert met[static_bw.format("ours_raw")] and not met[static_bw.format("paged_raw")]
    dyn_bw = "prefill_b8_l2048_int8_dynamic: {} >= 85% of measured copy bandwidth (its bytes)"
    assert met[dyn_bw.format("ours_jax")] and met[dyn_bw.format("paged_jax")]
    assert rows[dyn_bw.format("ours_jax")]["measured"] == "87.0%"
    assert dyn_bw.format("ours_raw") not in met  # skipped: no number, no row
    fp8_bw = "prefill_b8_l2048_fp8_dynamic: {} >= 85% of measured copy bandwidth (its bytes)"
    assert not met[fp8_bw.format("paged_jax")]
    int4_bw = "prefill_b8_l2048_int4: {} >= 85% of measured copy bandwidth (its bytes)"
    assert met[int4_bw.format("ours_jax")] and not met[int4_bw.format("paged_jax")]

    over = "{}: {} dynamic scales at most +10% over static ({})"
    key = over.format("prefill_b8_l2048_int8_dynamic", "ours_jax", "prefill_b8_l2048_int8")
    assert met[key] and rows[key]["measured"] == "11.50 vs 10.50 us (+9.5%)"
    key = over.format("prefill_b8_l2048_int8_dynamic", "slots_jax", "prefill_b8_l2048_int8")
    assert not met[key]
    key = over.format("prefill_b8_l2048_fp8_dynamic", "knorm_jax", "prefill_b8_l2048_fp8")
    assert not met[key] and rows[key]["measured"] == "12.50 vs 10.50 us (+19.0%)"
    key = over.format("decode_b64_fp8_dynamic", "paged_jax", "decode_b64_fp8")
    assert met[key]  # 3.2 vs 3.0: +6.7%
    # int4 has no static format; the dynamic int8 decode shape's static twin did not run.
    assert not [k for k in met if k.startswith(("decode_b64_int4", "decode_b64_int8_dynamic"))]
    assert not [k for k in met if "int4" in k and "over static" in k]


def test_every_dynamic_shape_has_its_static_neighbour():
    """The dynamic int8 and FP8 shapes are compared with the same update's static-scale shape,
    on the GPU and the CPU; the GPU has both formats at B=64 L=16 and at B=8 L=2048, with int4."""
    gpu = {s.name: s for s in GPU_SHAPES}
    for name in ("decode_b64", "prefill_b8_l2048"):
        for suffix, fmt in (
            ("_int8", "int8"),
            ("_int8_dynamic", "int8-dynamic"),
            ("_fp8", "float8_e4m3fn"),
            ("_fp8_dynamic", "float8_e4m3fn-dynamic"),
            ("_int4", "int4"),
        ):
            assert gpu[name + suffix].pool_format == fmt
            assert gpu[name + suffix].batch == gpu[name].batch
            assert gpu[name + suffix].delta_len == gpu[name].delta_len
    for shapes in (GPU_SHAPES, CPU_SHAPES):
        for s in shapes:
            if s.dynamic_scales and s.pool_format != "int4":
                static = DTYPES[s.pool_format].storage_name
                assert any(
                    o.pool_format == static and (o.batch, o.delta_len) == (s.batch, s.delta_len)
                    for o in shapes
                ), s.name
    assert {s.name for s in CPU_SHAPES} >= set(NEW_CPU_SHAPES)
