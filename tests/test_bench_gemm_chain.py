"""The benchmark's GEMM chain (bench/dflash_bench/gemm_chain.py): the GEMM's product is what the
update writes, every step of a JAX chain does its work, the raw chain hands the launcher the
split product; and the added time, the targets and the report rows follow the numbers."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dflash_bench.contenders import GEMM_CHAINS, prepare_contender
from dflash_bench.dtypes import bits
from dflash_bench.gemm_chain import (
    gemm_sets,
    hidden_size,
    host_gemm_operands,
    jax_gemm_chain,
    rolled,
    torch_gemm_chain,
)
from dflash_bench.problem import make_problem
from dflash_bench.report import format_table, gemm_chain_rows
from dflash_bench.runner import derived, gemm_added_us
from dflash_bench.shapes import BenchShape
from dflash_bench.targets import evaluate_targets
from dflash_bench.timing import Prepared, Settings

TINY = {"num_kv_heads": 2, "head_dim": 16, "rotary_dim": 8, "page_size": 4, "min_capacity": 8}
SETTINGS = Settings("cpu", chain=5, baseline_chain=5, repeats=1, min_time=0.001)


def tiny_problem(**kw):
    return make_problem(BenchShape("tiny", 2, 4, gemm_chain=True, **TINY, **kw), "cpu")


def deltas():
    """A (k, v) buffer pair of a tiny problem's chain (distinct buffers: the state is donated)."""
    import jax.numpy as jnp

    return jnp.zeros((8, 32), jnp.float16), jnp.zeros((8, 32), jnp.float16)


def test_the_gemm_product_is_the_problems_deltas():
    problem = tiny_problem()
    s = problem.shape
    hidden, weight = host_gemm_operands(problem, 3)
    assert hidden_size(problem) == 4 * 2 * 16
    assert weight.shape == (128, 64) and weight.dtype == s.np_dtype
    for j, h in enumerate(hidden):
        assert h.shape == (s.tokens, 128) and h.dtype == s.np_dtype
        product = (h.astype(np.float32) @ weight.astype(np.float32)).astype(s.np_dtype)
        np.testing.assert_array_equal(bits(product[:, :32]), bits(problem.k_sets[j].reshape(8, 32)))
        np.testing.assert_array_equal(bits(product[:, 32:]), bits(problem.v_sets[j].reshape(8, 32)))
        assert np.abs(h[:, 64:].astype(np.float32)).sum() > 0  # the rest of hidden is not zero
    # The GPU shapes' weights are 16 MB (hidden 4096): the sets rotate beyond the 60 MB L2,
    # and never beyond the problem's own sets (their deltas are the products).
    gpu = SimpleNamespace(shape=BenchShape("decode_b64", 64, 16), num_sets=30)
    assert hidden_size(gpu) == 4096
    assert gemm_sets(gpu, "gpu") == 5  # (8 MB hidden + 16 MB weight + 4 MB product) x 5 > 120 MB
    assert gemm_sets(SimpleNamespace(shape=gpu.shape, num_sets=3), "gpu") == 3


@pytest.mark.parametrize(
    "name, contract",
    [("gemm_ours_jax", "slot"), ("gemm_paged_jax", "paged"), ("gemm_slots_jax", "slot_mapping")],
)
def test_jax_chain_writes_the_gemms_product_into_the_pool(name, contract):
    """The contender's own check passes bit for bit; the same chain on a hidden state whose
    delta columns are zero writes zero rows: the update reads the GEMM's product, not the
    problem's deltas."""
    import jax
    import jax.numpy as jnp

    from dflash_bench.check import sample_array
    from dflash_bench.jax_contenders import dflash_update, jax_inputs, jax_pool

    problem = tiny_problem()
    ctx = {}
    prepared = prepare_contender(name, problem, SETTINGS, ctx)
    assert isinstance(prepared, Prepared), prepared
    assert prepared.info["check"]["bit_exact"] and prepared.info["with_update"]
    assert prepared.info["gemm"] == "[8, 128] @ [128, 64] float16"

    inputs = jax_inputs(problem, SETTINGS, ctx)
    hidden, weight = host_gemm_operands(problem, 1)
    hidden[0][:, :64] = 0
    sets, shared = inputs.operands(contract)
    state = (jax_pool(problem, inputs.device, contract), (jnp.asarray(hidden[0]),), (deltas(),))
    step = jax_gemm_chain(dflash_update(contract, problem.shape), problem, 1, 1)
    pool = step(state, (jnp.asarray(weight),), sets[:1], shared)[0]
    got = sample_array(jax.device_get(pool), problem, contract).astype(np.float32)
    expected = problem.expected(contract).astype(np.float32)
    written = expected != problem.sample_init.astype(np.float32)
    assert written.any()
    assert (got[written] == 0).all()
    np.testing.assert_array_equal(got[~written], expected[~written])


def test_jax_chain_alone_computes_every_step_and_leaves_hidden_as_it_was():
    """The GEMM and split alone, two rounds over three sets: each set's carried (k, v) is its
    product split in two, and the value written back into hidden is the one it held."""
    import jax.numpy as jnp

    problem = tiny_problem()
    hidden, weight = host_gemm_operands(problem, 3)
    state = (None, tuple(jnp.asarray(h) for h in hidden), tuple(deltas() for _ in range(3)))
    weights = tuple(jnp.asarray(weight) for _ in range(3))
    sets = ((None, None, {}),) * 3
    pool, new_hidden, products = jax_gemm_chain(None, problem, 3, 2)(state, weights, sets, None)
    assert pool is None
    for j in range(3):
        np.testing.assert_array_equal(bits(np.asarray(new_hidden[j])), bits(hidden[j]))
        k, v = (np.asarray(x) for x in products[j])
        np.testing.assert_array_equal(bits(k), bits(problem.k_sets[j].reshape(8, 32)))
        np.testing.assert_array_equal(bits(v), bits(problem.v_sets[j].reshape(8, 32)))


def test_a_chain_whose_loop_xla_unrolled_is_refused():
    import jax
    import jax.numpy as jnp

    x, w = jnp.ones(4), (jnp.full(4, 2.0),)
    straight = jax.jit(lambda c, w: c * w)
    with pytest.raises(RuntimeError, match="unrolled the GEMM chain's loop of 3 rounds"):
        rolled(straight, x, w, 3)
    assert rolled(straight, x, w, 1)(x, *w).tolist() == [2.0] * 4  # one round needs no loop
    loop = jax.jit(lambda c, w: jax.lax.fori_loop(0, 3, lambda i, c: c * w, c))
    assert rolled(loop, x, w, 3)(x, *w).tolist() == [8.0] * 4


def test_jax_chain_alone_runs_in_the_benchmark_and_is_not_checked_against_a_reference():
    prepared = prepare_contender("gemm_jax", tiny_problem(), SETTINGS, {})
    assert prepared.info["with_update"] is False
    assert prepared.info["check"] == {
        "ok": True,
        "criterion": "none (the GEMM and its split alone)",
    }
    # 5 steps asked, 3 sets at most in a tiny CPU problem's rotation: whole rounds of them.
    sets = prepared.info["gemm_sets"]
    assert prepared.updates_per_call == sets * -(-5 // sets)
    assert prepared.run(1) > 0


def test_stacked_layers_and_the_cpu_skip_the_raw_chain_with_the_reason():
    problem = tiny_problem()
    for name in ("gemm_raw", "gemm_paged_raw"):
        assert prepare_contender(name, problem, SETTINGS, {}) == {
            "status": "skipped",
            "reason": "GPU only",
        }
    layered = make_problem(BenchShape("tiny", 2, 4, num_layers=2, gemm_chain=True, **TINY), "cpu")
    got = prepare_contender("gemm_paged_jax", layered, SETTINGS, {})
    assert got == {"status": "skipped", "reason": "one layer's GEMM: not timed at stacked layers"}
    unmarked = make_problem(BenchShape("tiny", 2, 4, **TINY), "cpu")
    got = prepare_contender("gemm_jax", unmarked, SETTINGS, {})
    assert got == {"status": "n/a", "reason": "timed at the shapes marked gemm_chain only"}


@pytest.mark.parametrize("contract", ["slot", "paged", "slot_mapping"])
def test_raw_chain_hands_the_launcher_the_split_product(monkeypatch, contract):
    """The raw chain's steps on CPU torch (``.cuda()`` the identity): the launcher gets set j's
    deltas in the contract's layout, contiguous views of the split buffer; without a launcher
    the GEMM and split run alone."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self: self)
    problem = tiny_problem()
    s = problem.shape
    calls = []

    def launch(j, k_delta, v_delta):
        calls.append((j, k_delta.clone(), v_delta.clone(), k_delta.is_contiguous()))

    enqueue = torch_gemm_chain(torch, problem, contract, 3, launch)
    for i in range(4):
        enqueue(i)
    layout = s.delta_shape if contract == "slot" else s.paged_delta_shape
    assert [j for j, *_ in calls] == [0, 1, 2, 0]
    for j, k, v, contiguous in calls:
        assert contiguous and tuple(k.shape) == layout and k.dtype == torch.float16
        want_k, want_v = (x.reshape(layout) for x in (problem.k_sets[j], problem.v_sets[j]))
        np.testing.assert_array_equal(k.view(torch.int16).numpy(), want_k.view(np.int16))
        np.testing.assert_array_equal(v.view(torch.int16).numpy(), want_v.view(np.int16))
    torch_gemm_chain(torch, problem, contract, 3)(0)  # the GEMM and split alone


def _entry(name, **us):
    return {
        "name": name,
        "description": name,
        "bytes": {"total": 1e6},
        "contenders": {n: {"status": "ok", "us": t} for n, t in us.items()},
    }


def test_added_time_is_the_chain_with_the_update_minus_the_chain_without():
    e = _entry(
        "decode_b64",
        copy=4.0,
        ours_jax=4.7,
        gemm_jax=20.0,
        gemm_ours_jax=24.5,
        gemm_paged_jax=25.0,
        gemm_raw=19.0,
        gemm_ours_raw=23.0,
    )
    e["contenders"]["gemm_slots_jax"] = {"status": "error", "reason": "boom"}
    assert gemm_added_us(e, "gemm_ours_jax") == pytest.approx(4.5)
    assert gemm_added_us(e, "gemm_ours_raw") == pytest.approx(4.0)  # against gemm_raw, not _jax
    assert gemm_added_us(e, "gemm_slots_jax") is None
    d = derived(e, 0.0)
    assert d["gemm_ours_jax_added_us"] == pytest.approx(4.5)
    assert d["gemm_ours_jax_added_over_floor"] == pytest.approx(4.5 / 4.0)
    assert "gemm_slots_jax_added_us" not in d and "gemm_paged_raw_added_us" not in d
    assert GEMM_CHAINS["gemm_paged_raw"] == ("gemm_raw", "paged_raw")


def test_gemm_chain_targets_are_met_or_missed_by_the_numbers():
    b64 = _entry("decode_b64", copy=4.0, gemm_jax=20.0, gemm_ours_jax=24.75, gemm_paged_jax=24.4)
    b64["contenders"].update({"gemm_raw": {"status": "ok", "us": 19.0}})
    b64["contenders"]["gemm_ours_raw"] = {"status": "ok", "us": 23.7}
    b1 = _entry("decode_b1", copy=1.1, gemm_jax=6.0, gemm_ours_jax=6.79, gemm_paged_jax=6.81)
    results = {"backend": "gpu", "shapes": [b64, b1]}
    rows = {t["target"]: t for t in evaluate_targets(results)}
    floor = "decode_b64: in the GEMM chain the update adds at most 1.2x its copy floor"
    # Against 1.2 x 4.0 = 4.8: 4.75 and 4.4 met, raw 4.7 met; then 4.9 missed.
    assert rows[f"{floor} (gemm_ours_jax)"]["met"]
    assert rows[f"{floor} (gemm_paged_jax)"]["met"]
    assert rows[f"{floor} (gemm_ours_raw)"]["met"]
    assert rows[f"{floor} (gemm_paged_jax)"]["measured"] == (
        "4.40 us (24.40 - 20.00 of gemm_jax), floor 4.00 us (1.10x)"
    )
    b64["contenders"]["gemm_ours_jax"]["us"] = 24.9
    rows = {t["target"]: t for t in evaluate_targets(results)}
    assert not rows[f"{floor} (gemm_ours_jax)"]["met"]
    # B=1: 0.79 met, 0.81 missed.
    us = "decode_b1: in the GEMM chain the update adds at most 0.8 us"
    assert rows[f"{us} (gemm_ours_jax)"]["met"]
    assert not rows[f"{us} (gemm_paged_jax)"]["met"]
    assert rows[f"{us} (gemm_paged_jax)"]["measured"] == "0.81 us (6.81 - 6.00 of gemm_jax)"
    # Chains that did not run have no target row.
    assert not any("gemm_slots" in t for t in rows)
    assert f"{us} (gemm_ours_raw)" not in rows


def test_report_puts_the_gemm_chains_in_a_table_of_their_own():
    e = _entry("decode_b64", copy=4.0, ours_jax=4.7, gemm_jax=20.0, gemm_ours_jax=24.5)
    e["derived"] = derived(e, 0.0)
    results = {
        "backend": "cpu",
        "contenders": ["ours_jax", "copy", "gemm_jax", "gemm_ours_jax"],
        "shapes": [e],
    }
    assert gemm_chain_rows(results) == [
        ["decode_b64", "gemm_ours_jax", "20.00", "24.50", "4.50", "4.70", "4.00", "1.12x"]
    ]
    table = format_table(results)
    main, gemm = table.split("GEMM chain: the update right after the k/v GEMM producing its deltas")
    assert "| shape | bytes | ours_jax (us) | copy (us) |" in main
    assert "gemm" not in main
    assert "| decode_b64 | gemm_ours_jax | 20.00 | 24.50 | 4.50 | 4.70 | 4.00 | 1.12x |" in gemm
    e["contenders"].pop("gemm_ours_jax")
    e["derived"] = derived(e, 0.0)
    assert "GEMM chain" not in format_table(results)
