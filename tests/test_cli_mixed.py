"""``run`` with a draft whose layers mix sliding-window and full attention (``tiny-w16``: windowed,
full, windowed): a page table per layer, one launch with a ring per layer, bit-exact with the
reference layer by layer, read back with each layer's mask; the header and --json give the pool
by layer kind against every layer full; the slot contract is refused."""

from __future__ import annotations

import json
import re
import types

import jax
import numpy as np
import pytest

from jax_dflash import reference
from jax_dflash.cli import memory, workload
from jax_dflash.cli.accept import parse_accept
from jax_dflash.cli.presets import PRESETS
from test_cli import run_cli

pytest.importorskip("ml_dtypes", reason="bfloat16 and FP8 pools need ml_dtypes")

MIXED = PRESETS["tiny-w16"]
RUN = ("run", "--preset", "tiny-w16", "--backend", "cpu", "--no-progress")


def _workload(**kw) -> workload.Workload:
    return workload.Workload(
        MIXED,
        batch=kw.pop("batch", 4),
        steps=kw.pop("steps", 16),
        seed=kw.pop("seed", 2),
        accept=parse_accept("geometric:0.8", MIXED.block_size),
        device=jax.devices("cpu")[0],
        contract="paged",
        window=kw.pop("window", MIXED.window),
        window_layers=MIXED.window_layers,
        **kw,
    )


def test_a_mixed_run_is_bit_exact_and_reads_back_with_each_layers_mask(capsys):
    status, out, err = run_cli(capsys, *RUN, "--json", "--compare")
    assert status == 0, err
    s = json.loads(out)
    assert s["contract"] == "paged" and s["window"] == 16
    assert s["window_layers"] == [True, False, True] and s["paged"]["ring"] == [True, False, True]
    kernel, baseline = s["results"]
    assert kernel["check"] == "bit-exact" and kernel["mismatched_elements_by_layer"] == [0, 0, 0]
    assert kernel["readback"]["passed"] and baseline["readback"]["passed"]
    windowed, full = s["paged"]["page_kinds"]
    assert (windowed["ring"], windowed["layers"], windowed["sequence_pages"]) == (True, [0, 2], 3)
    assert (full["ring"], full["layers"], full["sequence_pages"]) == (False, [1], 8)
    assert windowed["most_pages_per_sequence"] <= 3 < full["most_pages_per_sequence"]
    assert windowed["ring_page_reuses"] > 0 and s["paged"]["table_pages"] == 9
    assert "bit-exact vs reference" in err and "read-back (dflash kernel)" in err


def test_the_header_and_json_give_the_pool_by_layer_kind_against_every_layer_full(capsys):
    status, out, err = run_cli(capsys, *RUN, "--steps", "4", "--json", "--no-check")
    assert status == 0, err
    s = json.loads(out)
    kinds = s["pool_by_layer_kind"]
    page = 2 * MIXED.page_size * MIXED.num_kv_heads * MIXED.head_dim * 2  # bfloat16
    windowed, full = s["paged"]["page_kinds"]
    assert kinds["window_layers"] == [0, 2]
    w_pages, f_pages = windowed["num_pages"], full["num_pages"]
    assert kinds["pages_per_layer"] == [w_pages, f_pages, w_pages]
    assert kinds["bytes"] == (2 * windowed["num_pages"] + full["num_pages"]) * page
    assert kinds["all_full_pages_per_layer"] == full["num_pages"] == s["paged"]["num_pages"]
    assert kinds["all_full_bytes"] == 3 * full["num_pages"] * page
    assert kinds["ratio"] == pytest.approx(kinds["bytes"] / kinds["all_full_bytes"])
    assert 0 < kinds["ratio"] < 1
    # One layer-batched array: every layer has the full layer's pages.
    assert kinds["layer_batched_bytes"] == s["shape"]["pool_bytes"] == kinds["all_full_bytes"]
    header = err.split("\n\n")[0]
    line = next(x for x in header.splitlines() if x.startswith("  pool by layer kind: "))
    assert re.search(
        rf"2 window layers x {windowed['num_pages']} pages \(3 ring pages per sequence\) \+ "
        rf"1 full layer x {full['num_pages']} pages \(up to 8 pages per sequence\) = "
        rf"[\d.]+ KiB, against [\d.]+ KiB with every layer full \(3 x {full['num_pages']} "
        rf"pages\): {kinds['ratio']:.2f}x",
        line,
    ), line
    assert "one layer-batched array" in header


def test_an_all_window_run_prints_its_pool_against_every_layer_full(capsys):
    argv = ("run", "--preset", "tiny", "--contract", "paged", "--window", "16", "--steps", "4")
    status, out, err = run_cli(capsys, *argv, "--json", "--no-check", "--no-progress")
    assert status == 0, err
    kinds = json.loads(out)["pool_by_layer_kind"]
    assert kinds["window_layers"] == [0, 1] and kinds["bytes"] == kinds["layer_batched_bytes"]
    assert kinds["ratio"] < 1 and "pool by layer kind: 2 window layers x" in err
    status, out, _ = run_cli(capsys, "run", "--preset", "tiny", "--steps", "2", "--json")
    assert json.loads(out)["pool_by_layer_kind"] is None  # no window, nothing to compare


def test_the_window_flag_sets_the_sliding_layers_window(capsys):
    status, out, err = run_cli(capsys, *RUN, "--window", "24", "--steps", "12", "--json")
    assert status == 0, err
    s = json.loads(out)
    assert s["window"] == 24 and s["window_layers"] == [True, False, True]
    assert s["paged"]["page_kinds"][0]["sequence_pages"] == 4
    assert s["paged"]["table_pages"] == 8  # the full layer's 8 pages: two whole rings
    assert s["results"][0]["check"] == "bit-exact" and s["results"][0]["readback"]["passed"]


@pytest.mark.parametrize("argv", [["--contract", "slot"], ["--contract", "slot", "--window", "8"]])
def test_the_slot_contract_refuses_a_mixed_draft(capsys, monkeypatch, argv):
    monkeypatch.setattr(workload, "Workload", None)  # building it would raise TypeError
    status, out, err = run_cli(capsys, *RUN, *argv)
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert err == (
        "jax-dflash: error: --contract slot: preset tiny-w16 mixes sliding-window and full "
        "layers (layer_types: 2 sliding_attention, 1 full_attention); expected --contract paged "
        "(the default for it): the slot contract (Edge-LLM 0.10) has no ring pages for the "
        "window layers\n"
    )


def test_a_layer_that_differs_from_the_reference_is_named(capsys, monkeypatch):
    real = reference.target_kv_cache_update_paged

    def off_in_the_full_layer(*args, **kwargs):
        expected = real(*args, **kwargs)
        expected[1].view(np.uint16).flat[-1] = 0x7FC1  # a NaN: neither the pool nor a write
        return expected

    monkeypatch.setattr(reference, "target_kv_cache_update_paged", off_in_the_full_layer)
    status, out, err = run_cli(capsys, *RUN, "--steps", "3")
    assert status == 1
    assert "check FAILED: the kernel's pools differ from the NumPy reference in" in err
    assert "(layers 1)" in err


def test_the_memory_estimate_holds_a_mixed_runs_pool_and_tables():
    w = _workload(steps=16)
    settings = types.SimpleNamespace(
        contract="paged",
        window=MIXED.window,
        window_layers=MIXED.window_layers,
        batch=w.batch,
        steps=w.steps,
        pool_dtype="bfloat16",
        delta_dtype="bfloat16",
    )
    assert memory.pool_elements(MIXED, settings) >= int(np.prod(w.pool_shape))
    tables = w.plan.decode.tables
    per_step = (3 * w.tokens_per_step + tables[0].size) * 4
    assert memory._input_bytes(MIXED, settings, w.tokens_per_step) >= 2 * w.steps * per_step
    assert tables.shape[1:] == (3, w.batch, 2, w.plan.table_pages)


def test_the_workloads_step_passes_the_op_a_ring_per_layer():
    w = _workload(steps=4)
    assert w.spec.ring == (True, False, True)
    r = w.run("kernel", progress=False)
    assert r.check == "bit-exact" and r.readback.passed, r.readback.failure
