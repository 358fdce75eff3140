"""The ``jax-dflash`` command: help, a tiny checked run, --compare, check's parity self-test and
every bad-flag exit path. Runs in-process (``cli.main``) except for the ``python -m`` entry."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from jax_dflash import reference
from jax_dflash.cli import accept, memory, parity, plan, presets, readback, run_settings, workload
from jax_dflash.cli import main as cli
from jax_dflash.cli.presets import PRESETS
from jax_dflash.testing import compare_bits


def gpu_available() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def run_cli(capsys, *argv):
    """(exit status, stdout, stderr); argparse's SystemExit becomes the status."""
    try:
        status = cli.main(list(argv))
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


# ---- help ---------------------------------------------------------------------------------------


def test_top_level_help_lists_commands_and_presets(capsys):
    status, out, _ = run_cli(capsys, "--help")
    assert status == 0
    for command in ("run", "check"):
        assert command in out
    for preset in PRESETS.values():
        assert preset.name in out
        assert preset.describe() in out


def test_run_help_documents_every_flag_and_the_preset_shapes(capsys):
    status, out, _ = run_cli(capsys, "run", "--help")
    assert status == 0
    for flag in (
        "--preset",
        "--backend",
        "--steps",
        "--batch",
        "--seed",
        "--accept",
        "--dtype",
        "--compare",
        "--no-check",
        "--json",
        "--no-progress",
    ):
        assert flag in out
    assert "geometric:P" in out and "STOPS" in out  # the distribution and the capacity policy
    for preset in PRESETS.values():
        assert preset.describe() in out


def test_check_help(capsys):
    status, out, _ = run_cli(capsys, "check", "--help")
    assert status == 0
    assert "parity" in out and "--seed" in out


def test_bench_script_help():
    """The benchmark lives in bench/, apart from the package: its script answers --help."""
    script = pathlib.Path(__file__).resolve().parents[1] / "bench" / "bench_kv_update.py"
    done = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and "--backend" in done.stdout


def test_python_dash_m_entry_point():
    done = subprocess.run(
        [sys.executable, "-m", "jax_dflash", "run", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "--preset" in done.stdout


# ---- run ----------------------------------------------------------------------------------------


def test_tiny_run_json_summary_and_check(capsys):
    status, out, err = run_cli(
        capsys,
        "run",
        "--preset",
        "tiny",
        "--steps",
        "3",
        "--seed",
        "7",
        "--json",
        "--no-progress",
        "--backend",
        "cpu",  # the wall-clock method below is the CPU's
    )
    assert status == 0, err
    summary = json.loads(out)  # stdout holds only the JSON; the table went to stderr
    tiny = PRESETS["tiny"]
    assert "dflash kernel" in err and "bit-exact vs reference" in err
    assert summary["preset"] == "tiny" and summary["steps"] == 3 and summary["seed"] == 7
    assert summary["batch"] == tiny.default_batch
    assert summary["shape"]["pool_shape"] == list(tiny.pool_shape())
    assert summary["shape"]["block_size"] == tiny.block_size
    assert summary["capacity_policy"] == "stop"
    # 1..block accepted per sequence and step.
    steps_times_batch = 3 * tiny.default_batch
    assert steps_times_batch <= summary["accepted_tokens"] <= steps_times_batch * tiny.block_size
    [kernel] = summary["results"]
    assert kernel["impl"] == "kernel" and kernel["steps"] == 3
    assert kernel["check"] == "bit-exact" and kernel["mismatched_elements"] == 0
    assert kernel["checked_elements"] == int(np.prod(tiny.pool_shape()))
    assert kernel["steps_per_s"] > 0 and kernel["accepted_tokens_per_s"] > 0
    assert kernel["update_method"] == "wall-clock" and kernel["update_resolution_ms"] > 0
    if not kernel["update_below_resolution"]:
        assert 0 < kernel["update_share"] <= 1 and kernel["update_gb_per_s"] > 0
    assert summary["check_passed"] is True


def test_run_compare_prints_both_and_writes_json_file(capsys, tmp_path):
    path = tmp_path / "summary.json"
    status, out, err = run_cli(
        capsys,
        "run",
        "--preset",
        "tiny",
        "--steps",
        "4",
        "--compare",
        "--dtype",
        "float16",
        "--json",
        str(path),
    )
    assert status == 0, err
    assert "dflash kernel" in out and "jnp baseline" in out  # the table is on stdout here
    assert "steps/s" in err  # the progress bar
    summary = json.loads(path.read_text())
    assert [r["impl"] for r in summary["results"]] == ["kernel", "baseline"]
    kernel, base = summary["results"]
    assert kernel["check"] == "bit-exact" and kernel["bit_exact_required"]
    # The baseline is checked too, but only reported (XLA may round its RoPE differently).
    assert base["check"] in ("bit-exact", "differs") and not base["bit_exact_required"]
    assert summary["shape"]["dtype"] == "float16"
    assert summary["check_passed"] is True


def test_run_until_every_slot_is_full_stops_and_still_checks(capsys):
    tiny = PRESETS["tiny"]
    # fixed:8 for 16 steps = 128 tokens > the 64-token slots: every sequence stops.
    status, out, err = run_cli(
        capsys,
        "run",
        "--preset",
        "tiny",
        "--steps",
        "16",
        "--accept",
        f"fixed:{tiny.block_size}",
        "--json",
        "--no-progress",
    )
    assert status == 0, err
    summary = json.loads(out)
    assert summary["sequences_stopped"] == tiny.default_batch
    starts_bound = tiny.slot_capacity // 4  # initial positions are drawn from [0, capacity / 4]
    assert (
        tiny.default_batch * (tiny.slot_capacity - starts_bound)
        <= summary["accepted_tokens"]
        <= tiny.default_batch * tiny.slot_capacity
    )
    assert summary["results"][0]["check"] == "bit-exact"


def test_run_no_check(capsys):
    status, out, err = run_cli(
        capsys, "run", "--preset", "tiny", "--steps", "2", "--no-check", "--json", "--no-progress"
    )
    assert status == 0, err
    summary = json.loads(out)
    assert summary["results"][0]["check"] == "skipped" and summary["check_passed"] is None


def test_run_fails_when_the_pools_differ_from_the_reference(capsys, monkeypatch):
    real = reference.target_kv_cache_update

    def off_by_one_bit(*args, **kwargs):
        expected = real(*args, **kwargs)
        bits = expected.view(np.uint16)
        bits.flat[0] ^= 1
        return expected

    monkeypatch.setattr(reference, "target_kv_cache_update", off_by_one_bit)
    status, out, err = run_cli(capsys, "run", "--preset", "tiny", "--steps", "2", "--no-progress")
    assert status == 1
    assert "FAILED" in out and "check FAILED" in err


@pytest.mark.skipif(not gpu_available(), reason="no GPU in this JAX: runs on the H200")
def test_run_on_gpu(capsys):
    status, out, err = run_cli(
        capsys,
        "run",
        "--backend",
        "gpu",
        "--preset",
        "tiny",
        "--steps",
        "5",
        "--compare",
        "--json",
        "--no-progress",
    )
    assert status == 0, err
    summary = json.loads(out)
    assert summary["backend"] in ("gpu", "cuda")
    assert summary["results"][0]["check"] == "bit-exact"


# ---- bad flags ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["run", "--batch", "99"], "--batch 99 is larger than the pool's 16 slots"),
        (
            ["run", "--preset", "tiny", "--batch", "5"],
            "--batch 5 is larger than the pool's 4 slots",
        ),
        (["run", "--accept", "fixed:17"], "--accept fixed:N expects 1 <= N <= block size 16"),
        (["run", "--accept", "fixed:x"], "--accept fixed:N expects 1 <= N <= block size 16"),
        (["run", "--accept", "geometric:1.5"], "--accept geometric:P expects 0 <= P <= 1"),
        (["run", "--accept", "poisson:3"], "--accept expects uniform | geometric:P"),
    ],
)
def test_impossible_runs_exit_2_with_one_line(capsys, argv, reason):
    status, out, err = run_cli(capsys, *argv)
    assert status == 2
    assert err.count("\n") == 1 and err.startswith("jax-dflash: error: ")
    assert reason in err
    assert out == ""


@pytest.mark.skipif(gpu_available(), reason="this JAX has a GPU, so --backend gpu is valid")
def test_backend_gpu_without_a_gpu_exits_2(capsys):
    status, _, err = run_cli(capsys, "run", "--backend", "gpu", "--preset", "tiny")
    assert status == 2
    assert err.count("\n") == 1 and "--backend gpu: JAX has no gpu device here" in err


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["run", "--steps", "0"], "argument --steps: expected an integer >= 1, got '0'"),
        (["run", "--batch", "-3"], "argument --batch: expected an integer >= 1, got '-3'"),
        (["run", "--batch", "many"], "argument --batch: expected an integer >= 1, got 'many'"),
        (["run", "--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'"),
        (["run", "--preset", "gpt-5"], "argument --preset: invalid choice: 'gpt-5'"),
        (["run", "--backend", "tpu"], "argument --backend: invalid choice: 'tpu'"),
        (["run", "--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
        (["run", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["check", "--seed", "x"], "argument --seed: expected an integer >= 0, got 'x'"),
        (["frobnicate"], "argument {run,check}: invalid choice: 'frobnicate'"),
        ([], "the following arguments are required"),
    ],
)
def test_bad_flags_exit_2_with_a_reason(capsys, argv, reason):
    status, out, err = run_cli(capsys, *argv)
    assert status == 2
    last = err.strip().splitlines()[-1]  # argparse: the usage, then one line of reason
    assert "error:" in last and reason in last
    assert out == ""


# ---- check --------------------------------------------------------------------------------------


def test_check_reports_and_passes_parity_on_every_backend(capsys):
    status, out, err = run_cli(capsys, "check")
    assert status == 0, out + err
    for line in (
        "default backend:",
        "CUDA extension:",
        "CUDA launches, programmatic dependent launch:",
        "TensorRT plugin library:",
        "TensorRT runtime:",
        "parity: all cases bit-exact",
    ):
        assert line in out
    backends = ["cpu", "gpu"] if gpu_available() else ["cpu"]
    cases = len(parity.parity_cases(np.random.default_rng(0), np.dtype(np.float32)))
    for backend in backends:
        for dtype in presets.DTYPE_NAMES:
            assert f"  {backend:<4} {dtype:<9} {cases}/{cases} cases bit-exact" in out


def test_check_exits_1_when_parity_fails(capsys, monkeypatch):
    real = reference.target_kv_cache_update

    def wrong(*args, **kwargs):
        out = real(*args, **kwargs)
        if isinstance(out, tuple):  # (pool, scale_pool): the pool's bytes flipped
            return (out[0] ^ np.array(0xFF, np.uint8).view(out[0].dtype), out[1])
        return -out  # flips the sign of every element: never bit-equal

    monkeypatch.setattr(reference, "target_kv_cache_update", wrong)
    status, out, _ = run_cli(capsys, "check")
    assert status == 1
    assert "parity: FAILED" in out and "elements differ" in out


def test_check_covers_every_form_and_pool_format():
    cases = parity.parity_cases(np.random.default_rng(0), np.dtype(np.float16))
    forms = {form for _, form, _, _ in cases}
    assert forms == {"slot", "paged", "slot_mapping"}
    pools = {str(operands[2].dtype) for _, _, operands, _ in cases}
    assert {"float8_e4m3fn", "float8_e5m2", "int8", "uint8", "float16"} <= pools
    assert sum("scale_pool" in keywords for _, _, _, keywords in cases) >= 3


def test_check_fails_on_a_wrong_scale_pool(capsys, monkeypatch):
    real = reference.target_kv_cache_update_slots

    def wrong(*args, **kwargs):
        pool, scales = real(*args, **kwargs)
        return pool, (scales.view(np.uint32) ^ np.uint32(1)).view(np.float32)  # one bit of each

    monkeypatch.setattr(reference, "target_kv_cache_update_slots", wrong)
    status, out, _ = run_cli(capsys, "check")
    assert status == 1
    assert "scale_pool:" in out and "elements differ" in out


# ---- pieces -------------------------------------------------------------------------------------


def test_accept_distributions_stay_in_range():
    rng = np.random.default_rng(0)
    block = 16
    uniform = accept.parse_accept("uniform", block).sample(rng, (4000,), block)
    assert uniform.min() == 1 and uniform.max() == block
    never = accept.parse_accept("geometric:0", block).sample(rng, (100,), block)
    always = accept.parse_accept("geometric:1", block).sample(rng, (100,), block)
    assert (never == 1).all() and (always == block).all()
    g = accept.parse_accept("geometric:0.8", block).sample(rng, (20000,), block)
    assert 1 <= g.min() and g.max() <= block
    assert abs(g.mean() - (1 - 0.8**block) / (1 - 0.8)) < 0.1  # truncated geometric mean
    fixed = accept.parse_accept("fixed:3", block).sample(rng, (10,), block)
    assert (fixed == 3).all()


def test_schedule_stops_at_the_slot_capacity():
    rng = np.random.default_rng(1)
    uniform = accept.parse_accept("uniform", 8)
    s = plan.make_schedule(rng, uniform, steps=40, batch=5, block_size=8, capacity=64)
    ends = s.positions + s.lengths
    assert (ends <= 64).all() and (s.lengths >= 0).all()
    assert (s.starts + s.totals == 64).all() and s.stopped == 5
    # Each step starts where the previous one ended: no position is written twice.
    assert (s.positions[1:] == ends[:-1]).all()


def test_compare_bits_counts_ulps():
    one = np.float32(1.0)
    a = np.array([one, np.nextafter(one, np.float32(2)), -0.0], np.float32)
    e = np.array([one, one, 0.0], np.float32)
    assert compare_bits(a, e) == (2, 1)
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    assert compare_bits(np.array([-tiny]), np.array([tiny])) == (1, 2)


# ---- contracts, dtypes, windows -----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--contract", "paged", "--kv-dtype", "e4m3"],
        ["--contract", "paged", "--window", "16", "--kv-dtype", "bf16", "--steps", "12"],
        ["--contract", "slot", "--kv-dtype", "e5m2", "--no-fused-norm"],
    ],
)
def test_paged_fp8_and_window_runs_are_checked(capsys, argv):
    status, out, err = run_cli(
        capsys, "run", "--preset", "tiny", "--steps", "6", *argv, "--json", "--no-progress"
    )
    assert status == 0, err
    summary = json.loads(out)
    [kernel] = summary["results"]
    assert kernel["check"] == "bit-exact" and kernel["readback"]["passed"]
    assert summary["contract"] == argv[1]
    assert (
        summary["shape"]["pool_dtype"] == presets.DTYPE_ALIASES[argv[argv.index("--kv-dtype") + 1]]
    )
    assert summary["fused_norm"] is ("--no-fused-norm" not in argv)
    # The pool's memory in every pool dtype, the run's own first.
    sizes = summary["pool_bytes_by_dtype"]
    assert list(sizes)[0] == summary["shape"]["pool_dtype"]
    assert sizes["float32"] == 2 * sizes["bfloat16"] == 4 * sizes["float8_e4m3fn"]
    assert kernel["update_below_resolution"] or 0 < kernel["update_share"] <= 1
    if "--window" in argv:
        assert summary["window"] == 16 and summary["paged"]["ring"]
        assert summary["paged"]["table_pages"] == 16 // PRESETS["tiny"].page_size + 1
    if argv[1] == "paged":
        assert summary["paged"]["prompts"] >= 1 and summary["written_tokens"] > 0
    assert "read-back (dflash kernel)" in err and "passed" in err


def test_compare_says_how_long_the_baseline_takes_before_it_starts(capsys):
    status, out, err = run_cli(
        capsys,
        "run",
        "--preset",
        "tiny",
        "--steps",
        "3",
        "--contract",
        "paged",
        "--kv-dtype",
        "e4m3",
        "--compare",
        "--no-progress",
    )
    assert status == 0, err
    estimate = out.index("jnp baseline: about")
    assert estimate < out.index("jnp baseline  ")  # the estimate precedes the baseline's row
    assert "ms per step" in out[estimate:].splitlines()[0]


def test_a_failed_read_back_exits_1(capsys, monkeypatch):
    real = readback.check_sequences

    def corrupted(pools, *args, **kwargs):
        return real(-pools, *args, **kwargs)  # every stored key and value negated

    monkeypatch.setattr(readback, "check_sequences", corrupted)
    status, out, err = run_cli(capsys, "run", "--preset", "tiny", "--steps", "2", "--no-progress")
    assert status == 1
    assert "check FAILED: read-back" in err and "beyond the rounding bound" in err


# ---- validation: every bad flag exits 2 with its reason, before the run --------------------------


@pytest.mark.parametrize(
    "argv, reason",
    [
        (
            ["run", "--seed", str(2**63)],
            "argument --seed: expected an integer < 9223372036854775808",
        ),
        (["run", "--window", "0"], "argument --window: expected an integer >= 1, got '0'"),
        (["run", "--kv-dtype", "e6m1"], "argument --kv-dtype: invalid choice: 'e6m1'"),
        (["run", "--contract", "ring"], "argument --contract: invalid choice: 'ring'"),
    ],
)
def test_bad_new_flags_exit_2_with_a_reason(capsys, argv, reason):
    status, out, err = run_cli(capsys, *argv)
    assert status == 2
    last = err.strip().splitlines()[-1]
    assert "error:" in last and reason in last
    assert out == ""


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["--steps", str(10**12)], "--steps 1000000000000: expected at most 1000000 steps"),
        (
            ["--steps", str(10**8), "--no-check"],
            "--steps 100000000: expected at most 1000000 steps",
        ),
        (
            ["--contract", "paged", "--steps", "400000", "--no-check"],
            "--steps 400000 --batch 8: the paged plan simulates every sequence's every step",
        ),
        (
            ["--preset", "tiny", "--contract", "paged", "--window", "12"],
            "--window 12: expected a positive multiple of the page size 8",
        ),
        (["--preset", "tiny", "--window", "16"], "--window 16 needs --contract paged"),
        (
            ["--preset", "dflash2-b8-w2048", "--contract", "slot"],
            "preset dflash2-b8-w2048's window 2048 needs --contract paged",
        ),
        (
            ["--contract", "paged", "--window", str(2**62)],
            f"--window {2**62}: expected at most 1024 tokens, the longest sequence of preset small",
        ),
        (
            ["--json", "/nonexistent-folder/summary.json"],
            "--json /nonexistent-folder/summary.json: folder /nonexistent-folder does not exist",
        ),
    ],
)
def test_impossible_settings_exit_2_before_the_run(capsys, monkeypatch, argv, reason):
    def no_run(*args, **kwargs):
        raise AssertionError("the workload was built before the flags were checked")

    monkeypatch.setattr(workload, "Workload", no_run)
    status, out, err = run_cli(capsys, "run", *argv, "--backend", "cpu")
    assert status == 2, err
    assert err.count("\n") == 1 and err.startswith("jax-dflash: error: ")
    assert reason in err
    assert out == ""


@pytest.mark.parametrize(
    "argv, reason",
    [
        (
            ["--steps", "20000"],
            "--steps 20000 --batch 8: the run would need about",
        ),
        (
            ["--preset", "qwen3-8b-b16", "--force", "--no-check"],
            "--preset qwen3-8b-b16: the run would need about",
        ),
        (
            ["--preset", "dflash2-b8-w2048", "--force", "--no-check", "--window", "8192"],
            "--window 8192: the run would need about",
        ),
    ],
)
def test_memory_estimate_names_the_flags_that_size_it(capsys, monkeypatch, argv, reason):
    monkeypatch.setattr(memory, "physical_memory", lambda: 2 << 20)  # a 2 MiB machine
    monkeypatch.setattr(workload, "Workload", None)  # building it would raise TypeError
    status, out, err = run_cli(capsys, "run", *argv, "--backend", "cpu")
    assert status == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"jax-dflash: error: {reason}")
    assert "GiB of host memory (mostly " in err
    assert "expected at most 1.0 MiB, half of this machine's" in err
    assert "steps" not in err.split("expected at most")[1]
    if "--no-check" not in argv:
        assert "(mostly checked deltas" in err and "--no-check drops the deltas" in err


def test_json_path_that_is_a_folder_or_unwritable_exits_2_before_the_run(
    capsys, monkeypatch, tmp_path
):
    monkeypatch.setattr(workload, "Workload", None)  # building it would raise TypeError
    status, _, err = run_cli(capsys, "run", "--json", str(tmp_path))
    assert status == 2 and "is a folder (expected a file path)" in err
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root): no unwritable folder")
        status, _, err = run_cli(capsys, "run", "--json", str(locked / "s.json"))
        assert status == 2 and "is not writable" in err
    finally:
        locked.chmod(0o700)


@pytest.mark.skipif(gpu_available(), reason="this JAX has a GPU: GPU-sized presets are allowed")
def test_gpu_sized_presets_refuse_the_cpu_without_force(capsys, monkeypatch):
    monkeypatch.setattr(workload, "Workload", None)
    status, out, err = run_cli(capsys, "run", "--preset", "qwen3-8b-b16")
    assert status == 2 and err.count("\n") == 1
    assert "preset qwen3-8b-b16 is GPU-sized (pool 2.5 GiB" in err and "--force" in err


def test_fused_norm_and_fp8_need_an_op_and_a_jax_that_have_them(capsys, monkeypatch):
    monkeypatch.setattr(run_settings, "op_supports", lambda name: False)
    status, _, err = run_cli(capsys, "run", "--preset", "tiny", "--fused-norm")
    assert status == 2 and "--fused-norm: the installed jax_dflash op takes no k_norm_weight" in err
    status, _, err = run_cli(capsys, "run", "--preset", "tiny", "--kv-dtype", "e4m3")
    assert status == 2 and "takes no k_scale/v_scale" in err
    monkeypatch.delattr(jax.numpy, "float8_e5m2")
    status, _, err = run_cli(capsys, "run", "--preset", "tiny", "--kv-dtype", "e5m2")
    assert status == 2 and f"this JAX ({jax.__version__}) has no jnp.float8_e5m2" in err


def test_presets_mark_their_assumptions():
    assumed = ("kimi-k2.5-b8", "qwen3.5-27b-b16", "dflash2-b8-w2048", "llama3.1-8b-b10")
    for name in (*assumed, "qwen3-8b-b16-w2048"):
        assert "ASSUMED" in PRESETS[name].source
    q = PRESETS["qwen3.5-27b-b16"]
    assert (q.num_kv_heads, q.head_dim, q.rope_dim) == (4, 256, 64)
    k = PRESETS["kimi-k2.5-b8"]
    assert k.num_layers == 6 and k.hidden_size == 7168
    d = PRESETS["dflash2-b8-w2048"]
    assert d.block_size == 8 and d.window == 2048 and d.default_contract == "paged"
    assert d.window % d.page_size == 0 and d.window < d.slot_capacity
    z = PRESETS["qwen3-8b-b16"]
    assert (z.num_layers, z.num_kv_heads, z.head_dim, z.block_size) == (5, 8, 128, 16)
    m = PRESETS["qwen3-8b-b16-w2048"]  # the same geometry, four sliding layers and a full one
    shape = (m.num_layers, m.num_kv_heads, m.head_dim, m.block_size, m.hidden_size)
    assert shape == (5, 8, 128, 16, z.hidden_size)
    assert m.window == 2048 and m.window_layers == (True, True, True, True, False)
    assert m.default_contract == "paged" and m.slot_capacity >= 4 * m.window
    assert not PRESETS["tiny"].gpu_sized and not PRESETS["small"].gpu_sized
    assert all(p.gpu_sized for p in PRESETS.values() if p.page_size == 128)
