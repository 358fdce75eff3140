"""``run``'s pool formats: ``--kv-dtype`` names (int8, the dynamic formats, int4, their aliases
and a "did you mean"), a dynamic format's run checked bit for bit with its scale pool, the pool
bytes with the scales (int4: half a byte per element), the refusal of a format the op's CUDA
handler does not write (read from the contract's row), ``--compare-formats`` (table, --json,
PNG) and its refusals. In-process, on the CPU, with the tiny presets."""

from __future__ import annotations

import argparse
import json
import sys
import types

import numpy as np
import pytest

from jax_dflash._shapes import POOL_FORMATS
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
        ("int4", "int4"),
        ("int4-dynamic", "int4"),
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
    with pytest.raises(argparse.ArgumentTypeError, match="did you mean 'int4-dynamic'"):
        _kv_dtype("int4-dynamc")


def test_bytes_per_element_counts_a_dynamic_scale_per_head():
    assert formats.bytes_per_element("int8", 32) == 1
    assert formats.bytes_per_element("int8-dynamic", 32) == 1 + 4 / 32
    assert formats.bytes_per_element("bfloat16", 128) == 2
    # int4: two elements per byte of a uint8 pool [..., D/2], and the same scales.
    assert formats.bytes_per_element("int4", 32) == 0.5 + 4 / 32
    assert formats.dtype_from_name("int4") == np.uint8
    assert formats.stored_shape("int4", (2, 2, 4, 8, 2, 32)) == (2, 2, 4, 8, 2, 16)
    assert formats.stored_shape("int8-dynamic", (2, 4, 32)) == (2, 4, 32)


def _pool_part(kv_dtype):
    """The estimate's "pools" part of a tiny run in ``kv_dtype``, and the pool's elements."""
    from jax_dflash.cli.presets import PRESETS

    preset = PRESETS["tiny"]
    args = argparse.Namespace(
        contract=None, window=None, batch=None, steps=None, accept="geometric:0.8",
        dtype=None, kv_dtype=kv_dtype,
    )  # fmt: skip
    settings = run_settings.validate(args, preset)
    parts = memory.estimate(
        preset, settings, check=True, compare=False, host_device=True, runtime=0
    )
    elements = memory.pool_elements(preset, settings)
    return next(p.bytes for p in parts if p.name == "pools"), elements, preset.head_dim


def test_the_memory_estimate_counts_the_scale_pool():
    (static, elements, head_dim), (dynamic, _, _) = _pool_part("int8"), _pool_part("int8-dynamic")
    scale_bytes = elements * 4 // head_dim
    # Every copy of the pool the run holds carries its scale pool.
    assert dynamic > static and (dynamic - static) % scale_bytes == 0


def test_the_memory_estimate_counts_int4_at_half_a_byte_per_element_and_its_scales():
    int8, elements, head_dim = _pool_part("int8")
    dynamic, int4 = _pool_part("int8-dynamic")[0], _pool_part("int4")[0]
    scale_bytes = elements * 4 // head_dim
    # Per copy of the pool: int8-dynamic holds E + scales, int4 E / 2 + the same scales.
    copies = (dynamic - int4) // (elements // 2)
    assert copies >= 1 and dynamic - int4 == copies * (elements // 2)
    assert int8 - int4 == copies * (elements // 2 - scale_bytes)


# One full run (its timing replays included); --compare-formats checks every other format.
@pytest.mark.parametrize("kv_dtype", ["int8-dynamic", "int4-dynamic"])
def test_a_scaled_format_runs_bit_exact_and_reads_back(capsys, kv_dtype):
    status, out, err = run_cli(capsys, *TINY, "--kv-dtype", kv_dtype, "--json", "-")
    assert status == 0, err
    summary = json.loads(out)
    (result,) = summary["results"]
    assert result["check"] == "bit-exact"
    assert result["mismatched_scales"] == 0 and result["checked_scales"] == 2 * 2 * 32 * 8 * 2
    assert result["readback"]["passed"] and 0 < result["readback"]["output_error"] < 0.1
    name = _kv_dtype(kv_dtype)
    per_token = 2 * 2 * 2 * 32 * formats.bytes_per_element(name, 32)  # layers, K/V, H, D
    assert f"{name} {per_token:g}" in err  # the header's bytes per token, scales included
    assert summary["pool_bytes_by_dtype"][name] == summary["shape"]["pool_bytes"]
    # The pool array: int4's last dim is D/2 bytes, and every byte of it is checked.
    width = 32 // formats.elements_per_byte(name)
    assert summary["shape"]["pool_shape"] == [2, 2, 32, 8, 2, width]
    assert result["checked_elements"] == 2 * 2 * 32 * 8 * 2 * width


def test_formats_on_a_gpu_follow_the_contract_rows_cuda_field():
    """Every format runs on the CPU; on a GPU, those whose contract row says the CUDA handler
    writes them (the scale-pool formats among them), and the others are refused naming the
    format and the backend that writes it."""
    gpu, cpu = types.SimpleNamespace(platform="gpu"), types.SimpleNamespace(platform="cpu")
    for name in formats.POOL_DTYPE_NAMES:
        run_settings.check_format_runs(f"--kv-dtype {name}", name, cpu)
        cuda = POOL_FORMATS[formats.storage_name(name)]["cuda"]
        assert run_settings.format_runs_on(name, gpu) == cuda
        if cuda:
            run_settings.check_format_runs(f"--kv-dtype {name}", name, gpu)
        else:
            with pytest.raises(UsageError, match=f"--kv-dtype {name}: .* {name} pools .* "
                               "expected --backend cpu, got a gpu device"):  # fmt: skip
                run_settings.check_format_runs(f"--kv-dtype {name}", name, gpu)
    for name in ("int8-dynamic", "float8_e4m3fn-dynamic", "float8_e5m2-dynamic"):
        assert run_settings.format_runs_on(name, gpu)


def test_a_format_cuda_does_not_write_is_refused_on_a_gpu(monkeypatch):
    """Whatever the rows say today: a format whose row has ``cuda`` false is refused by name."""
    monkeypatch.setattr(formats, "runs_on_cuda", lambda name: name != "int4")
    gpu = types.SimpleNamespace(platform="gpu")
    with pytest.raises(UsageError) as refused:
        run_settings.check_format_runs("--kv-dtype int4", "int4", gpu)
    message = str(refused.value)
    assert message.startswith("--kv-dtype int4: the op's CUDA handler does not write int4 pools")
    assert "expected --backend cpu, got a gpu device" in message
    run_settings.check_format_runs("--kv-dtype int8-dynamic", "int8-dynamic", gpu)


def test_compare_formats_skips_what_cuda_does_not_write_with_the_reason(monkeypatch):
    monkeypatch.setattr(formats, "runs_on_cuda", lambda name: name != "int4")
    ran = []

    class Ran(Exception):
        pass

    def record(name):
        ran.append(name)
        raise Ran  # the workload itself is not what is tested

    gpu = types.SimpleNamespace(platform="gpu")
    with pytest.raises(Ran):
        compare_formats.run_formats(record, ("int4", "int8-dynamic"), gpu, out=sys.stdout)
    assert ran == ["int8-dynamic"]  # int4 skipped, the dynamic int8 pool run
    (row,) = compare_formats.run_formats(record, ("int4",), gpu, out=sys.stdout)
    assert "int4 pools" in row.skipped and "--backend cpu" in row.skipped
    assert "int4: skipped: the op's CUDA handler does not write int4" in compare_formats.table(
        [row]
    )


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
        "int4",
    ]
    assert all(r["check"] == "bit-exact" and r["readback_passed"] for r in rows.values())
    # Memory: 8-bit is half of 16-bit; a dynamic format adds 4 bytes per head, plane and layer.
    assert rows["int8"]["bytes_per_token"] * 2 == rows["bfloat16"]["bytes_per_token"]
    assert (
        rows["int8-dynamic"]["bytes_per_token"] == rows["int8"]["bytes_per_token"] + 4 * 2 * 2 * 2
    )
    assert rows["int8-dynamic"]["pool_bytes"] > rows["int8"]["pool_bytes"]
    # int4: a quarter of 16-bit plus the same scales as the other dynamic formats.
    assert (
        rows["int4"]["bytes_per_token"] == rows["bfloat16"]["bytes_per_token"] / 4 + 4 * 2 * 2 * 2
    )
    scale_pool_bytes = 2 * 2 * 32 * 8 * 2 * 4  # layers, K/V, pages, P, H, float32
    assert rows["int4"]["pool_bytes"] * 2 == rows["int8-dynamic"]["pool_bytes"] + scale_pool_bytes
    # Error: every 8-bit format loses more than the 16-bit pool; a row's own scale beats a
    # calibrated one of the same format.
    errors = {n: r["output_error"] for n, r in rows.items()}
    assert all(errors["bfloat16"] < e for n, e in errors.items() if n != "bfloat16")
    assert errors["int8-dynamic"] < errors["int8"]
    assert errors["int8-dynamic"] < errors["int4"]  # 7 levels a side against 127
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


@pytest.mark.parametrize(
    "kv_dtype, counted",
    [
        ("int8-dynamic", "0 of 65536 elements"),
        ("int4", "0 of 32768 bytes (two int4 elements each)"),
    ],
)
def test_a_wrong_dynamic_scale_fails_the_reference_check(capsys, monkeypatch, kv_dtype, counted):
    """The scale pool is checked bit for bit beside the pool: one changed scale fails the run."""
    from jax_dflash.cli import verify

    real = verify.Checks.reference_pools

    def one_scale_off(self, deltas, impl="kernel"):
        pool, scales = real(self, deltas, impl)
        scales = scales.copy()
        scales.reshape(-1)[0] *= 2  # an unwritten row's scale: only the bits check sees it
        return pool, scales

    monkeypatch.setattr(verify.Checks, "reference_pools", one_scale_off)
    status, _, err = run_cli(capsys, *TINY, "--kv-dtype", kv_dtype, "--json", "-")
    assert status == 1
    assert f"{counted} and 1 of 2048 dynamic scales" in err


def test_the_read_back_unpacks_int4_low_nibble_first(capsys, monkeypatch):
    """A reader that takes each byte's high nibble first reads other keys and values than the
    ones written: the read-back must fail (the reference check, on the bytes, still passes)."""
    from jax_dflash import read
    from jax_dflash.cli import readback

    real = read._unpacked

    def high_first(stored, per_byte):
        return real((stored >> 4) | (stored << 4), per_byte)  # the nibbles swapped

    monkeypatch.setattr(read, "_unpacked", high_first)
    readback._check_view.clear_cache()  # traced by an earlier run with the real reader
    try:
        status, out, err = run_cli(capsys, *TINY, "--kv-dtype", "int4")
    finally:
        readback._check_view.clear_cache()  # later runs trace the real reader again
    assert status == 1
    assert "check FAILED: read-back" in err and "beyond the rounding bound" in err
    assert "bit-exact vs reference" in out
