"""The raw entries by form name (``_dflash_cpu.update``, ``_dflash_cuda.launch_form``): any
addressing form of the core's table through one entry, bit for bit the reference's, with the
form's own keywords only."""

from __future__ import annotations

import numpy as np
import pytest

from jax_dflash import _ext, reference
from jax_dflash.testing import POOL_DTYPES, gpu_devices, make_paged_problem, make_problem

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
