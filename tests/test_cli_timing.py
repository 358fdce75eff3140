"""What ``run`` reports as its timing: the headline is the median of interleaved, repeated
replays of each implementation (nothing collected), printed with its spread and the same in
--json; the checked pass is reported apart, and its progress bar ends on its steps/s; the update's
time is device time where a profiler trace has it (faked here, as this machine has no GPU), else
a wall-clock difference with its resolution, below which the share prints as "< x%", never as
0.0%; the jnp pipeline's differences from the reference are explained in one line."""

from __future__ import annotations

import json
import re
import statistics
import types

import jax
import numpy as np
import pytest

from jax_dflash.cli import device_time, measure, replays, report, verify
from test_cli import run_cli
from test_workload import tiny_workload

TINY_COMPARE = ("run", "--preset", "tiny", "--steps", "4", "--compare", "--dtype", "float16")


def _tiny(contract="slot"):
    return tiny_workload(contract, steps=4, seed=3, dtype="float16")


def _checked(w):
    return [w.run(impl, progress=False) for impl in ("kernel", "baseline")]


# ---- the headline -------------------------------------------------------------------------------


def test_the_headline_is_the_median_of_interleaved_replays(monkeypatch):
    w = _tiny()
    results = _checked(w)
    calls = []
    real = replays.replay

    def spy(steps, compiled, pools, count=None):
        calls.append((compiled, count))
        return real(steps, compiled, pools, count)

    monkeypatch.setattr(replays, "replay", spy)
    w.measure(results, progress=False)
    names = {id(exe): key for key, (exe, _) in w.device_steps._compiled.items()}
    order = [names[id(c)] for c, _ in calls]
    assert all(count is None for _, count in calls)  # every replay runs all the decode steps
    # Each implementation's step, then (a CPU times the update by wall clock) the same without it.
    variants = [("kernel", True), ("baseline", True), ("kernel", False), ("baseline", False)]
    rounds = len(results[0].times.samples)
    assert rounds >= replays.ROUNDS[0] and len(results[1].times.samples) == rounds
    rotated = [variants[r % 4 :] + variants[: r % 4] for r in range(rounds)]
    assert order == variants + [v for round_ in rotated for v in round_]  # warm-up round first
    for r in results:
        samples = r.times.samples
        assert r.steps_per_s == pytest.approx(1 / statistics.median(samples))
        assert r.times.steps_per_s_range == (1 / max(samples), 1 / min(samples))
        assert r.accepted_tokens_per_s == pytest.approx(r.accepted_tokens * r.steps_per_s / 4)


def _row(out: str, label: str) -> list[str]:
    line = next(x for x in out.splitlines() if x.startswith(label + " "))
    return re.split(r"\s{2,}", line.strip())


def test_table_and_json_print_the_same_headline_and_the_checked_pass_apart(capsys, tmp_path):
    path = tmp_path / "summary.json"
    status, out, err = run_cli(capsys, *TINY_COMPARE, "--json", str(path))
    assert status == 0, err
    summary = json.loads(path.read_text())
    for r in summary["results"]:
        samples = r["step_ms_samples"]
        assert r["replays"] == len(samples) >= replays.ROUNDS[0]
        assert r["steps_per_s"] == pytest.approx(1e3 / statistics.median(samples), rel=1e-5)
        assert r["steps_per_s_slowest"] == pytest.approx(1e3 / max(samples), rel=1e-5)
        assert r["steps_per_s_fastest"] == pytest.approx(1e3 / min(samples), rel=1e-5)
        cells = _row(out, r["label"])
        assert cells[1] == f"{r['steps_per_s']:.1f}"
        assert cells[2] == f"{r['steps_per_s_slowest']:.1f}-{r['steps_per_s_fastest']:.1f}"
        checked = r["checked_pass"]["steps_per_s"]
        assert checked == pytest.approx(r["steps"] / r["checked_pass"]["seconds"])
        assert f"{r['label']} {checked:.1f} steps/s" in out  # the checked pass's own line
        # Its progress bar ends on the same steps/s: one definition.
        bar = [x for x in err.splitlines() if x.startswith(f"{r['label']}, checked pass")]
        assert bar[-1].endswith(f"{r['steps']}/{r['steps']} steps {checked:8.1f} steps/s")
    assert "median of" in out and "interleaved replays" in out


def test_a_cpu_times_the_update_by_wall_clock_and_states_its_resolution(capsys):
    status, out, err = run_cli(capsys, *TINY_COMPARE, "--json", "--no-progress", "--backend", "cpu")
    assert status == 0, err
    for r in json.loads(out)["results"]:
        assert r["update_method"] == "wall-clock" and r["update_resolution_ms"] > 0
        assert r["update_note"] == "a CPU has no device trace"
        cells = _row(err, r["label"])  # the table is on stderr with --json on stdout
        ms, share = cells[5], cells[6]
        if r["update_below_resolution"]:
            assert r["update_share"] is None
            assert share == f"< {r['update_share_resolution'] * 100:.3g}%" and ms.startswith("<")
        else:
            assert r["update_ms_per_step"] > r["update_resolution_ms"]
            assert share == (
                f"{r['update_share'] * 100:.3g}% ± {r['update_share_resolution'] * 100:.3g}%"
            )
    assert "0.0%" not in err and "a share below it prints as < resolution" in err


def _result(update, step_seconds=1e-3):
    r = measure.ImplResult(
        "kernel", "dflash kernel", measure.CheckedPass(10, 0.02, 0.1), 40, 10**6, "skipped",
        None, None, None,
    )  # fmt: skip
    r.times = replays.StepTimes(10, (step_seconds,) * 3)
    r.update = update
    return r


def test_a_share_below_the_resolution_prints_as_less_than_never_as_zero():
    below = _result(replays.UpdateTime("wall-clock", "difference", None, 2.5e-6))
    assert report._update_cells(below) == ("< 0.0025", "< 0.25%", "n/a")
    tiny_device = _result(replays.UpdateTime("device", "the op's kernels", 3.1e-7))
    assert report._update_cells(tiny_device) == ("0.00031", "0.031%", "322.6")
    resolved = _result(replays.UpdateTime("wall-clock", "difference", 1.5e-4, 2e-5))
    assert report._update_cells(resolved) == ("0.15 ± 0.02", "15% ± 2%", "0.7")


def test_wall_clock_update_resolves_an_offset_but_not_noise():
    with_update = [1.0e-3, 1.1e-3, 0.9e-3, 1.05e-3, 0.95e-3]
    same = replays.wall_clock_update(with_update, with_update, 100, "")
    assert same.below_resolution and same.resolution == replays.TIMER_SECONDS / 100
    offset = replays.wall_clock_update(with_update, [t - 2e-4 for t in with_update], 100, "")
    assert offset.seconds == pytest.approx(2e-4)
    noise = [1e-4, -1e-4, 5e-5, -5e-5, 0.0]  # median 0, 5e-5 from it at the median
    noisy = replays.wall_clock_update(np.add(with_update, noise), with_update, 100, "")
    assert noisy.below_resolution
    assert noisy.resolution == pytest.approx(2 * 1.4826 * np.sqrt(np.pi / 2) * 5e-5 / np.sqrt(5))


# ---- device time --------------------------------------------------------------------------------

OP_KERNEL = "void dflash::kernel::update_kernel<(dflash::Contract)0, F16, F16, 8, 1, false>(...)"


def test_device_time_is_the_op_kernels_and_what_the_jnp_update_adds(monkeypatch, capsys):
    """A device whose profiler trace has the kernels: the kernel's update is its op's kernels,
    the jnp pipeline's the kernel time its update adds to the step; no wall-clock replays of
    the step without the update."""
    traces = iter(
        [
            {OP_KERNEL: 8e-6, "loop_fusion": 4e-5},  # the kernel's step
            {"loop_fusion": 4e-5, "scatter": 2e-5, "rope_fusion": 1.2e-5},  # the jnp step
            {"loop_fusion": 4e-5},  # the jnp step without the update
        ]
    )

    def fake_trace(run, device):
        run()
        return next(traces), ""

    monkeypatch.setattr(device_time, "has_trace", lambda device: True)
    monkeypatch.setattr(device_time, "kernel_seconds", fake_trace)
    w = _tiny("paged")
    results = _checked(w)
    w.measure(results, progress=False)
    kernel, baseline = results
    profiled = min(w.steps, replays.PROFILED_STEPS)
    assert (kernel.update.method, kernel.update.basis) == ("device", "the op's kernels")
    assert kernel.update.seconds == pytest.approx(8e-6 / profiled)
    assert baseline.update.method == "device"
    assert baseline.update.seconds == pytest.approx(3.2e-5 / profiled)
    assert kernel.update_share == pytest.approx(kernel.update.seconds / kernel.times.median)
    assert ("kernel", False) not in w.device_steps._compiled  # never replayed without
    text = report.results_table(results, w)
    assert "±" not in text and "from a profiler trace of the jitted step" in text


class _Plane(types.SimpleNamespace):
    pass


def _event(name, ns):
    return types.SimpleNamespace(name=name, duration_ns=ns)


def _line(name, *events):
    return types.SimpleNamespace(name=name, events=list(events))


def test_a_trace_counts_the_kernels_on_the_device_streams_once():
    gpu0 = _Plane(
        name="/device:GPU:0",
        lines=[
            _line("XLA Ops", _event("custom-call.1", 2000.0)),  # derived: repeats the kernels
            _line("Stream #7(Compute)", _event(OP_KERNEL, 2000.0), _event("fusion", 500.0)),
            _line("Stream #8(MemcpyH2D)", _event("MemcpyH2D", 900.0)),
            _line("Stream #7(Compute)", _event(OP_KERNEL, 2000.0)),
        ],
    )
    gpu1 = _Plane(name="/device:GPU:1", lines=[_line("Stream #3", _event("other", 1.0))])
    host = _Plane(name="/host:CPU", lines=[_line("python", _event(OP_KERNEL, 1e9))])
    profile = types.SimpleNamespace(planes=[host, gpu0, gpu1])
    times = device_time.trace_kernel_seconds(profile, ("/device:GPU:0",))
    assert times == {OP_KERNEL: pytest.approx(4e-6), "fusion": pytest.approx(5e-7)}
    assert device_time.op_kernel(OP_KERNEL) and not device_time.op_kernel("fusion")
    only_gpu = types.SimpleNamespace(planes=[host, gpu1])  # another numbering: the one GPU
    assert device_time.trace_kernel_seconds(only_gpu, ("/device:GPU:0",)) == {"other": 1e-9}


def test_a_cpu_has_no_device_trace():
    assert not device_time.has_trace(jax.devices("cpu")[0])


# ---- the jnp pipeline's ulps --------------------------------------------------------------------


def test_differences_name_keys_and_values_and_the_worst_ulp():
    expected = np.linspace(-1, 1, 2 * 2 * 3 * 4, dtype=np.float16).reshape(2, 2, 3, 4)
    actual = expected.copy()
    bits = actual.view(np.int16)
    bits[1, 0, 2, 1] += 5  # a key of layer 1, 5 ulp off
    bits[0, 1, 0, 3] += 1  # a value of layer 0
    d = verify.differences(actual, expected)
    assert (d.keys, d.values, d.max_ulp) == (1, 1, 5)
    assert d.magnitude_at_max_ulp == pytest.approx(abs(float(expected[1, 0, 2, 1])))
    worst = np.abs(actual.astype(np.float32) - expected.astype(np.float32)).max()
    assert d.max_abs == pytest.approx(float(worst))


def test_compare_explains_the_jnp_pipeline_ulps_in_one_line(capsys, monkeypatch):
    real = verify.Checks.reference_pools

    def one_value_off(self, deltas, impl="kernel"):
        pools = real(self, deltas, impl)
        if impl == "baseline":
            pools[0, 1].view(np.uint16).flat[0] ^= 1  # a value the jnp pipeline did not write
        return pools

    monkeypatch.setattr(verify.Checks, "reference_pools", one_value_off)
    status, out, err = run_cli(capsys, *TINY_COMPARE, "--no-progress")
    assert status == 0, err  # the jnp pipeline need not be bit-exact
    [line] = [x for x in out.splitlines() if x.startswith('jnp baseline, "max ')]
    max_ulp = re.search(r'"max (\d+) ulp"', line)[1]
    assert f"max {max_ulp} ulp)" in _row(out, "jnp baseline")[-1]  # the table's cell it explains
    assert re.search(r"\d+ keys and [1-9]\d* values differ from the reference", line)
    assert "only the kernel must be bit-exact" in line
    assert not any(x.startswith('dflash kernel, "max') for x in out.splitlines())
