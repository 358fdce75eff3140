"""The benchmark's CPU mode runs end to end, and its correctness gate catches a wrong kernel."""

from __future__ import annotations

import json

import numpy as np

import dflash_bench as benchmark


def test_quick_cpu_run_writes_json_with_every_contender(tmp_path, capsys):
    shapes = "decode_b1,decode_b8_5layers"
    rc = benchmark.main(["--backend", "cpu", "--quick", "--shapes", shapes, "--repeats", "1",
                         "--min-time", "0.002", "--out", str(tmp_path)])
    assert rc == 0
    results = json.loads((tmp_path / "kv_update_cpu.json").read_text())
    assert results["backend"] == "cpu"
    assert [e["name"] for e in results["shapes"]] == shapes.split(",")
    for entry in results["shapes"]:
        contenders = entry["contenders"]
        assert set(contenders) == set(benchmark.CONTENDERS)
        for name in ("ours_jax", "ours_raw", "jax_baseline", "copy"):
            assert contenders[name]["status"] == "ok", (name, contenders[name])
            assert contenders[name]["us"] > 0
            assert len(contenders[name]["samples_us"]) == 1  # --repeats 1
        for name in ("ours_jax", "ours_raw"):  # this project's kernel: same bits as the reference
            assert contenders[name]["check"]["bit_exact"]
        assert contenders["ours_jax"]["check"]["full_pool_max_abs_diff_vs_baseline"] < 0.02
        assert contenders["flashinfer"] == {"status": "skipped", "reason": "GPU only",
                                            "setup_s": contenders["flashinfer"]["setup_s"]}
    # Bytes = K/V read + pool rows written + cos/sin read: 1 x 16 tokens x 8 heads x 128 fp16.
    b1 = results["shapes"][0]["bytes"]
    assert b1 == {"kv_read": 65536, "pool_write": 65536, "rope_read": 16 * 128 * 4,
                  "total": 139264, "written_tokens": 16}
    assert results["shapes"][1]["bytes"]["total"] == 5 * 8 * 139264  # 5 layers, B=8
    assert {t["target"].split(":")[0] for t in results["targets"]} == set(shapes.split(","))
    printed = capsys.readouterr().out
    assert "| shape | bytes | ours_jax (us) | ours_raw (us) | jax_baseline (us)" in printed


def test_correctness_gate_rejects_one_wrong_element():
    shape = benchmark.BenchShape("tiny", 2, 4, num_kv_heads=2, head_dim=16, rotary_dim=8,
                                 page_size=4, min_capacity=8)
    problem = benchmark.make_problem(shape, "cpu")
    good = problem.sample_expected.copy()
    assert benchmark.compare_sample(good, problem, exact_required=True)["ok"]
    wrong = good.copy()
    written = np.argwhere(good.astype(np.float32) != problem.sample_init.astype(np.float32))
    wrong[tuple(written[0])] += np.float16(0.5)
    assert not benchmark.compare_sample(wrong, problem, exact_required=True)["ok"]
    assert not benchmark.compare_sample(wrong, problem, exact_required=False)["ok"]
    # One ulp off is not bit-exact but within the peers' tolerance.
    ulp = good.copy()
    ulp.view(np.uint16)[tuple(written[0])] += 1
    assert not benchmark.compare_sample(ulp, problem, exact_required=True)["ok"]
    assert benchmark.compare_sample(ulp, problem, exact_required=False)["ok"]


def test_interleaved_timing_rotates_the_order_and_calibrates_in_the_steady_state():
    order = []

    def contender(name, seconds_per_call, first_calls_slow=0):
        state = {"calls": 0}

        def run(calls):
            order.append((name, calls))
            slow = min(calls, max(0, first_calls_slow - state["calls"]))
            state["calls"] += calls
            return calls * seconds_per_call + slow * 0.01  # a slow call costs 10 ms more

        return benchmark.Prepared(run, updates_per_call=10, info={"check": {"ok": True}})

    prepared = {"a": contender("a", 1e-3, first_calls_slow=3), "b": contender("b", 2e-3),
                "c": contender("c", 4e-3)}
    settings = benchmark.Settings("cpu", chain=10, baseline_chain=10, repeats=6, min_time=0.05)
    results = benchmark.time_interleaved(prepared, settings)
    # Calibrated past the slow first calls: 1 ms per call -> 50 calls for 50 ms, not 5.
    assert results["a"]["updates_per_measurement"] == 10 * 50
    assert results["b"]["updates_per_measurement"] == 10 * 25
    assert results["c"]["updates_per_measurement"] == 10 * 13  # ceil(4 * 0.05 / 0.016)
    for name, per_call in (("a", 1e-3), ("b", 2e-3), ("c", 4e-3)):
        assert len(results[name]["samples_us"]) == 6
        assert abs(results[name]["us"] - per_call / 10 * 1e6) < 1e-6
    timed = [name for name, calls in order[-18:]]  # the 6 rounds of 3 measurements
    rounds = [timed[i:i + 3] for i in range(0, 18, 3)]
    assert rounds[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)


def test_interleaved_timing_reports_a_contender_that_fails_and_times_the_others():
    def failing(calls):
        raise RuntimeError("device lost")

    prepared = {"bad": benchmark.Prepared(failing, 1, {}),
                "good": benchmark.Prepared(lambda calls: calls * 1e-3, 1, {"check": {"ok": True}})}
    settings = benchmark.Settings("cpu", chain=1, baseline_chain=1, repeats=2, min_time=0.01)
    results = benchmark.time_interleaved(prepared, settings)
    assert results["bad"] == {"status": "error", "reason": "RuntimeError: device lost"}
    assert results["good"]["samples_us"] == [1000.0, 1000.0]
