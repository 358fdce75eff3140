"""``run``'s pool formats: ``--kv-dtype`` names (int8, the dynamic formats, their aliases and a
"did you mean"), a dynamic format's run checked bit for bit with its scale pool, the pool bytes
with the scales, ``--compare-formats`` (table, --json, PNG) and its refusals. In-process, on the
CPU, with the tiny presets."""

from __future__ import annotations

import argparse
import json
import sys
import types

import pytest

from jax_dflash.cli import compare_formats, formats, memory, run_settings, workload
from jax_dflash.cli.common import UsageError, named
from test_cli import run_cli

TINY = ("run", "--preset", "tiny", "--steps", "3", "--no-progress", "--backend", "cpu")


def _kv_dtype(text):
    return named("kv-dtype", formats.POOL_DTYPE_NAMES, formats.DTYPE_ALIASES)(text)


@pytest.mark.parametrize(
    "given, name",
    [
        ("int8", "int8"),
        ("int8-dynamic", "int8-dynamic"),
        ("e4m3-dynamic", "float8_e4m3fn-dynamic"),
        ("e5m2-dynamic", "float8_e5m2-dynamic"),
        ("float8_e4m3fn-dynamic", "float8_e4m3fn-dynamic"),
        ("e4m3", "float8_e4m3fn"),
    ],
)
def test_kv_dtype_names_and_aliases(given, name):
    assert _kv_dtype(given) == name
    assert formats.dtype_from_name(name).itemsize == (2 if name == "float16" else 1)


def test_a_wrong_format_name_says_the_closest_one():
    with pytest.raises(argparse.ArgumentTypeError, match="did you mean 'int8-dynamic'"):
        _kv_dtype("int8-dynamc")
    with pytest.raises(argparse.ArgumentTypeError, match="did you mean 'e4m3-dynamic'"):
        _kv_dtype("e4m3-dynamik")


def test_bytes_per_element_counts_a_dynamic_scale_per_head():
    assert formats.bytes_per_element("int8", 32) == 1
    assert formats.bytes_per_element("int8-dynamic", 32) == 1 + 4 / 32
    assert formats.bytes_per_element("bfloat16", 128) == 2


def test_the_memory_estimate_counts_the_scale_pool():
    from jax_dflash.cli.presets import PRESETS

    preset = PRESETS["tiny"]

    def pools(kv_dtype):
        args = argparse.Namespace(
            contract=None, window=None, batch=None, steps=None, accept="geometric:0.8",
            dtype=None, kv_dtype=kv_dtype,
        )  # fmt: skip
        settings = run_settings.validate(args, preset)
        parts = memory.estimate(
            preset, settings, check=True, compare=False, host_device=True, runtime=0
        )
        scale_bytes = memory.pool_elements(preset, settings) * 4 // preset.head_dim
        return next(p.bytes for p in parts if p.name == "pools"), scale_bytes

    (static, _), (dynamic, scale_bytes) = pools("int8"), pools("int8-dynamic")
    # Every copy of the pool the run holds carries its scale pool.
    assert dynamic > static and (dynamic - static) % scale_bytes == 0


# One full run (its timing replays included); --compare-formats checks every other format.
@pytest.mark.parametrize("kv_dtype", ["int8-dynamic"])
def test_a_scaled_format_runs_bit_exact_and_reads_back(capsys, kv_dtype):
    status, out, err = run_cli(capsys, *TINY, "--kv-dtype", kv_dtype, "--json", "-")
    assert status == 0, err
    summary = json.loads(out)
    (result,) = summary["results"]
    assert result["check"] == "bit-exact"
    assert result["readback"]["passed"] and 0 < result["readback"]["output_error"] < 0.1
    name = _kv_dtype(kv_dtype)
    per_token = 2 * 2 * 2 * 32 * formats.bytes_per_element(name, 32)  # layers, K/V, H, D
    assert f"{name} {per_token:g}" in err  # the header's bytes per token, scales included
    assert summary["pool_bytes_by_dtype"][name] == summary["shape"]["pool_bytes"]


def test_a_dynamic_format_on_a_gpu_says_it_needs_the_cpu_backend():
    gpu = types.SimpleNamespace(platform="gpu")
    with pytest.raises(UsageError, match="--kv-dtype int8-dynamic: .* expected --backend cpu"):
        run_settings.dynamic_format_runs("--kv-dtype int8-dynamic", gpu)
    run_settings.dynamic_format_runs(
        "--kv-dtype int8-dynamic", types.SimpleNamespace(platform="cpu")
    )


def test_compare_formats_skips_dynamic_formats_off_the_cpu_with_the_reason(capsys):
    def never(name):
        raise AssertionError(f"{name} was run on a GPU")

    gpu = types.SimpleNamespace(platform="gpu")
    rows = compare_formats.run_formats(
        never, ("int8-dynamic", "float8_e4m3fn-dynamic"), gpu, out=sys.stdout
    )
    assert all("--backend cpu" in r.skipped for r in rows)
    table = compare_formats.table(rows)
    assert "int8-dynamic: skipped: dynamic scales (scale_pool) run on the CPU backend" in table


def test_compare_formats_table_json_and_png(capsys, tmp_path):
    try:
        import matplotlib  # noqa: F401

        png = tmp_path / "formats.png"
    except ImportError:  # the table and the summary still run
        png = None
    flag = ("--compare-formats",) + (() if png is None else (str(png),))
    status, out, err = run_cli(capsys, *TINY, *flag, "--json", "-")
    assert status == 0, err
    summary = json.loads(out)
    rows = {r["name"]: r for r in summary["formats"]}
    assert list(rows) == [
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "int8",
        "int8-dynamic",
        "float8_e4m3fn-dynamic",
        "float8_e5m2-dynamic",
    ]
    assert all(r["check"] == "bit-exact" and r["readback_passed"] for r in rows.values())
    # Memory: 8-bit is half of 16-bit; a dynamic format adds 4 bytes per head, plane and layer.
    assert rows["int8"]["bytes_per_token"] * 2 == rows["bfloat16"]["bytes_per_token"]
    assert (
        rows["int8-dynamic"]["bytes_per_token"] == rows["int8"]["bytes_per_token"] + 4 * 2 * 2 * 2
    )
    assert rows["int8-dynamic"]["pool_bytes"] > rows["int8"]["pool_bytes"]
    # Error: every 8-bit format loses more than the 16-bit pool; a row's own scale beats a
    # calibrated one of the same format.
    errors = {n: r["output_error"] for n, r in rows.items()}
    assert all(errors["bfloat16"] < e for n, e in errors.items() if n != "bfloat16")
    assert errors["int8-dynamic"] < errors["int8"]
    assert errors["float8_e4m3fn"] < errors["float8_e5m2"]
    assert summary["check_passed"] is True
    assert "pool format" in err and "read-back error" in err
    if png is not None:
        assert summary["formats_plot"] == str(png) and f"plot: {png}" in err
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_formats_without_matplotlib_names_the_extra(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails

    def refuse(*args, **kwargs):
        raise AssertionError("the workload was built before the plot was checked")

    monkeypatch.setattr(workload, "Workload", refuse)
    status, out, err = run_cli(capsys, *TINY, "--compare-formats", str(tmp_path / "f.png"))
    assert status == 2 and out == ""
    assert 'pip install -e ".[plot]"' in err and "--compare-formats" in err


@pytest.mark.parametrize(
    "extra, reason",
    [
        (("--kv-dtype", "int8"), "expected no --kv-dtype, got --kv-dtype int8"),
        (("--compare",), "expected no --compare"),
        (("--no-check",), "expected no --no-check"),
    ],
)
def test_compare_formats_refuses_conflicting_flags(capsys, extra, reason):
    status, out, err = run_cli(capsys, *TINY, "--compare-formats", *extra)
    assert status == 2 and reason in err, err


def test_compare_formats_refuses_a_missing_folder(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "gone" / "f.png"
    status, _, err = run_cli(capsys, *TINY, "--compare-formats", str(path))
    assert status == 2 and "does not exist" in err


def test_the_read_back_applies_the_dynamic_scales(capsys, monkeypatch):
    """Doubled scales double every key and value read: the read-back must fail."""
    from jax_dflash.cli import readback

    real = readback.check_sequences

    def doubled(pools, *args, scale_pool=None, **kwargs):
        return real(pools, *args, scale_pool=2 * scale_pool, **kwargs)

    monkeypatch.setattr(readback, "check_sequences", doubled)
    status, _, err = run_cli(capsys, *TINY, "--kv-dtype", "int8-dynamic")
    assert status == 1
    assert "check FAILED: read-back" in err and "beyond the rounding bound" in err


def test_a_wrong_dynamic_scale_fails_the_reference_check(capsys, monkeypatch):
    """The scale pool is checked bit for bit beside the pool: one changed scale fails the run."""
    from jax_dflash.cli import verify

    real = verify.Checks.reference_pools

    def one_scale_off(self, deltas, impl="kernel"):
        pool, scales = real(self, deltas, impl)
        scales = scales.copy()
        scales.reshape(-1)[0] *= 2  # an unwritten row's scale: only the bits check sees it
        return pool, scales

    monkeypatch.setattr(verify.Checks, "reference_pools", one_scale_off)
    status, _, err = run_cli(capsys, *TINY, "--kv-dtype", "int8-dynamic", "--json", "-")
    assert status == 1
    assert "0 of 65536 elements and 1 of 2048 dynamic scales" in err
