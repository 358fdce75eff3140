"""The raw entries by form name (``_dflash_cpu.update``, ``_dflash_cuda.launch_form``): any
addressing form of the core's table through one entry, bit for bit the reference's, with the
form's own keywords only."""

from __future__ import annotations

import numpy as np
import pytest

from jax_dflash import _ext, reference
from jax_dflash.testing import (
    POOL_DTYPES,
    gpu_devices,
    make_paged_problem,
    make_problem,
    with_scale_pool,
)

FORMS = {
    "slot": (make_problem, reference.target_kv_cache_update),
    "paged": (make_paged_problem, reference.target_kv_cache_update_paged),
}


def _call(form, pool_dtype, seed):
    make, ref = FORMS[form]
    problem = make(
        np.random.default_rng(seed), dtype=np.float16, pool_dtype=pool_dtype, k_norm=True
    )
    kwargs = problem.kwargs()
    want = ref(*problem.args(), **kwargs)
    extras = [kwargs.pop(name, None) for name in ("k_scale", "v_scale", "k_norm_weight")]
    return problem, extras, kwargs, want


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES, ids=str)
@pytest.mark.parametrize("form", FORMS)
def test_cpu_entry_by_form_name(form, pool_dtype):
    problem, extras, kwargs, want = _call(form, pool_dtype, 5)
    operands = [np.asarray(a) for a in problem.args()]
    operands[2] = pool = operands[2].copy()
    _ext.extension("cpu").update(form, operands, *extras, **kwargs)
    assert np.array_equal(pool.view(np.uint8), want.view(np.uint8))
    assert (want.view(np.uint8) != problem.past_key_value.view(np.uint8)).any(), "writes nothing"


@pytest.mark.skipif(not gpu_devices(), reason="no GPU backend in this JAX: runs on the H200")
@pytest.mark.parametrize("form", FORMS)
def test_cuda_entry_by_form_name(form):
    torch = pytest.importorskip("torch", reason="the CUDA raw entry is fed torch tensors here")
    problem, extras, kwargs, want = _call(form, np.float16, 6)
    operands = [torch.from_numpy(np.ascontiguousarray(a)).cuda() for a in problem.args()]
    extras = [None if e is None else torch.from_numpy(np.asarray(e)).cuda() for e in extras]
    stream = torch.cuda.current_stream().cuda_stream
    _ext.extension("cuda").launch_form(form, operands, *extras, **kwargs, stream=stream)
    torch.cuda.synchronize()
    assert np.array_equal(operands[2].cpu().numpy().view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda u, ops: u("vllm", ops), ValueError, "form: expected one of 'slot', 'paged'"),
        (lambda u, ops: u("paged", ops[:6]), ValueError, r"operands: expected 7 arrays \(k_delta"),
        (lambda u, ops: u("paged", ops, pages_per_slot=2), ValueError, "pages_per_slot: the paged"),
        (lambda u, ops: u("paged", "abc"), TypeError, "operands: expected a sequence of arrays"),
        (lambda u, ops: u("paged", ops, windw=3), TypeError, "windw"),
    ],
)
def test_cpu_entry_by_form_name_refuses_what_the_form_does_not_take(call, error, message):
    problem, _, _, _ = _call("paged", np.float16, 7)
    operands = [np.asarray(a) for a in problem.args()]
    operands[2] = pool = operands[2].copy()
    with pytest.raises(error, match=message):
        call(_ext.extension("cpu").update, operands)
    assert np.array_equal(pool.view(np.uint8), problem.past_key_value.view(np.uint8))


# ---- per-token-head scale pools ------------------------------------------------------------------

_SCALED = {"int8": np.dtype(np.int8), "e4m3": POOL_DTYPES[3], "int4": np.dtype(np.uint8)}


def _scale_pool_call(form, fmt, seed):
    """A hostile call of ``form`` on a pool of ``fmt`` (int4: uint8 bytes ``[.., D/2]``) of
    random bytes with a scale pool of random bits: ``(operands, keywords, (pool, scales) wanted)``."""
    rng = np.random.default_rng(seed)
    make, ref = FORMS[form]
    # The slot form not hostile: a small hostile slot problem may write nothing.
    hostile = form == "paged"
    problem = make(
        rng, dtype=np.float16, pool_dtype=np.float32, k_norm=True, layers=2, hostile=hostile
    )
    pool_format = "int4" if fmt == "int4" else _SCALED[fmt]
    operands, keywords = with_scale_pool(rng, problem.args(), problem.kwargs(), pool_format)
    return operands, keywords, ref(*operands, **keywords)


@pytest.mark.parametrize("fmt", _SCALED)
@pytest.mark.parametrize("form", FORMS)
def test_cpu_entry_writes_a_scale_pool_in_place(form, fmt):
    operands, keywords, (want_pool, want_scales) = _scale_pool_call(form, fmt, 7)
    before = keywords["scale_pool"].copy()
    _ext.extension("cpu").update(form, operands, **keywords)
    assert np.array_equal(operands[2].view(np.uint8), want_pool.view(np.uint8))
    assert np.array_equal(keywords["scale_pool"].view(np.uint32), want_scales.view(np.uint32))
    assert (want_scales.view(np.uint32) != before.view(np.uint32)).any(), "writes no scale"


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (dict(k_scale=np.ones(2, np.float32), v_scale=np.ones(2, np.float32)), ValueError,
         "scale_pool: per-token-head scales take the place of k_scale and v_scale"),
        ("float16", ValueError, "scale_pool: expected dtype float32, got float16"),
        ("read-only", ValueError, "scale_pool"),
    ],
    ids=["with static scales", "float16", "read-only"],
)  # fmt: skip
def test_cpu_entry_refuses_a_bad_scale_pool_and_writes_nothing(change, error, message):
    operands, keywords, _ = _scale_pool_call("paged", "int8", 8)
    pool_before = operands[2].copy()
    if change == "float16":
        keywords["scale_pool"] = np.ones(keywords["scale_pool"].shape, np.float16)
    elif change == "read-only":
        keywords["scale_pool"].flags.writeable = False
    else:
        keywords.update(change)
    with pytest.raises(error, match=message):
        _ext.extension("cpu").update("paged", operands, **keywords)
    assert np.array_equal(operands[2].view(np.uint8), pool_before.view(np.uint8))


@pytest.mark.skipif(not gpu_devices(), reason="no GPU backend in this JAX: runs on the H200")
@pytest.mark.parametrize("fmt", _SCALED)
@pytest.mark.parametrize("form", FORMS)
def test_cuda_entry_writes_a_scale_pool_in_place(form, fmt):
    torch = pytest.importorskip("torch", reason="the CUDA raw entry is fed torch tensors here")
    operands, keywords, (want_pool, want_scales) = _scale_pool_call(form, fmt, 9)
    bits = [a.view(np.uint8) if a.dtype == POOL_DTYPES[3] else a for a in operands]
    dev = [torch.from_numpy(np.ascontiguousarray(a)).cuda() for a in bits]
    extras = {
        k: torch.from_numpy(np.asarray(v)).cuda() if isinstance(v, np.ndarray) else v
        for k, v in keywords.items()
    }
    names = {"pool_dtype": "float8_e4m3fn"} if fmt == "e4m3" else {}
    stream = torch.cuda.current_stream().cuda_stream
    _ext.extension("cuda").launch_form(form, dev, **extras, **names, stream=stream)
    torch.cuda.synchronize()
    assert np.array_equal(dev[2].cpu().numpy().view(np.uint8), want_pool.view(np.uint8))
    scales = extras["scale_pool"].cpu().numpy()
    assert np.array_equal(scales.view(np.uint32), want_scales.view(np.uint32))
