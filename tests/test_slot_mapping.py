"""The slot-mapping form (``jax_dflash.target_kv_cache_update_slots``): token ``t`` lands at
``pool[:, s // P, s % P]`` with ``s = slot_mapping[t]`` (vLLM's ``reshape_and_cache_flash``
addressing), ``s < 0`` or ``s >= N * P`` writes nothing. Checked against the reference, the
paged form (through ``slots_from_pages``) and the raw entry, over hostile slots."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_dflash
from jax_dflash import _ext, _shapes, reference
from jax_dflash.testing import POOL_DTYPES, assert_bits_equal, gpu_devices, make_paged_problem

T, H, D, N, P, R = 12, 2, 16, 5, 4, 8


def _problem(rng, pool_dtype=np.float16, delta=np.float16, layers=None):
    lead = () if layers is None else (layers,)
    k = rng.standard_normal((*lead, T, H, D)).astype(delta)
    v = rng.standard_normal((*lead, T, H, D)).astype(delta)
    pool = rng.standard_normal((*lead, 2, N, P, H, D)).astype(np.float32)
    if pool_dtype == np.int8:
        pool = np.clip(np.rint(pool * 40), -127, 127)
    pool = pool.astype(pool_dtype)
    rope = rng.uniform(-1, 1, (T, R)).astype(np.float32)
    # Hostile slots: negative, the last row, past the pool, int32 extremes. No slot repeats: of
    # tokens with one slot the GPU stores any one per element (the tests of duplicates are apart).
    slots = np.array([0, N * P - 1, -1, N * P, 7, 6, 2**31 - 1, -(2**31), 3, 18, 5, 11], np.int32)
    return k, v, pool, rope, rng.permutation(slots)


def _scales(pool_dtype):
    if pool_dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
        return {}
    scale = np.float32(1 / 32)
    return {"k_scale": scale, "v_scale": scale}


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES, ids=str)
def test_the_op_is_the_reference_over_hostile_slots(pool_dtype):
    k, v, pool, rope, slots = _problem(np.random.default_rng(1), pool_dtype)
    kwargs = {**_scales(pool_dtype), "k_norm_weight": np.ones(D, np.float16) * 1.5}
    got = np.asarray(jax_dflash.target_kv_cache_update_slots(k, v, pool, rope, slots, **kwargs))
    want = reference.target_kv_cache_update_slots(k, v, pool, rope, slots, **kwargs)
    assert_bits_equal(got, want)
    valid = sorted({int(s) for s in slots if 0 <= s < N * P})
    written = [r for r in range(N * P) if (want[:, r // P, r % P] != pool[:, r // P, r % P]).any()]
    assert written == valid, "the rows written are exactly the valid slots"


def test_of_two_tokens_with_one_slot_the_later_is_stored_on_cpu():
    k, v, pool, rope, _ = _problem(np.random.default_rng(2))
    slots = np.full(T, -1, np.int32)
    slots[[2, 9]] = 6  # token 9 comes later
    cpu = jax.devices("cpu")[0]
    args = [jax.device_put(a, cpu) for a in (k, v, pool, rope, slots)]
    out = np.asarray(jax_dflash.target_kv_cache_update_slots(*args))
    alone = slots.copy()
    alone[2] = -1
    want = reference.target_kv_cache_update_slots(k, v, pool, rope, alone)
    assert_bits_equal(out, want)


@pytest.mark.parametrize("ring", [False, True])
def test_the_three_forms_write_the_same_pool(ring):
    """The paged problem's writes through slots_from_pages give the paged op's pool bit for bit,
    over hostile positions and owners (tables whose V page is the K page, as vLLM's)."""
    rng = np.random.default_rng(3)
    problem = make_paged_problem(rng, tokens=16, batch=3, num_pages=8, page_size=4, ring=ring)
    num_pages, page_size = problem.past_key_value.shape[1:3]
    table = np.array(problem.kv_page_table)
    table[:, 1] = table[:, 0] + num_pages  # V page = K page
    args = list(problem.args())
    args[6] = table
    kwargs = problem.kwargs()
    paged = reference.target_kv_cache_update_paged(*args, **kwargs)
    slots = jax_dflash.slots_from_pages(
        args[4], args[5], table, num_pages, page_size, ring=kwargs.pop("ring")
    )
    got = np.asarray(
        jax_dflash.target_kv_cache_update_slots(*args[:4], np.asarray(slots), **kwargs)
    )
    assert_bits_equal(got, paged)


def test_layered_and_vmap_are_the_layers_one_by_one():
    rng = np.random.default_rng(4)
    k, v, pool, rope, slots = _problem(rng, layers=3)
    per_layer_slots = np.stack([slots, np.roll(slots, 1), np.roll(slots, 2)])  # none repeats
    fn = jax.vmap(jax_dflash.target_kv_cache_update_slots, in_axes=(0, 0, 0, None, 0))
    got = np.asarray(jax.jit(fn)(k, v, pool, rope, per_layer_slots))
    for layer in range(3):
        want = reference.target_kv_cache_update_slots(
            k[layer], v[layer], pool[layer], rope, per_layer_slots[layer]
        )
        assert_bits_equal(got[layer], want)


def test_the_raw_entry_by_form_name():
    k, v, pool, rope, slots = _problem(np.random.default_rng(5))
    want = reference.target_kv_cache_update_slots(k, v, pool, rope, slots)
    mine = pool.copy()
    _ext.extension("cpu").update("slot_mapping", [k, v, mine, rope, slots.astype(np.int64)])
    assert_bits_equal(mine, want)


def test_bad_slot_mappings_are_refused_naming_it():
    k, v, pool, rope, slots = _problem(np.random.default_rng(6))
    op = jax_dflash.target_kv_cache_update_slots
    with pytest.raises(TypeError, match="slot_mapping: expected dtype int32 or int64, got float32"):
        op(k, v, pool, rope, slots.astype(np.float32))
    with pytest.raises(TypeError, match="slot_mapping: expected int32 \\(or int64 with jax_enable"):
        op(k, v, pool, rope, slots.astype(np.int64))
    with pytest.raises(ValueError, match="slot_mapping: expected \\[12\\]"):
        op(k, v, pool, rope, slots[:5])
    with pytest.raises(ValueError, match="rope_cos_sin: expected one row per token"):
        op(k, v, pool, rope[:5], slots)


GPU = pytest.mark.skipif(not gpu_devices(), reason="no GPU backend in this JAX: runs on the H200")
CUDA_FORM = pytest.mark.skipif(
    not _shapes.FORMS["slot_mapping"]["cuda"],
    reason="the slot-mapping form's CUDA path is not turned on (contract.h: cuda = false)",
)


@GPU
@CUDA_FORM
@pytest.mark.parametrize("pool_dtype", POOL_DTYPES, ids=str)
@pytest.mark.parametrize("norms", [False, True])
def test_cuda_is_the_reference_over_hostile_slots(pool_dtype, norms):
    k, v, pool, rope, slots = _problem(np.random.default_rng(10), pool_dtype)
    kwargs = dict(_scales(pool_dtype))
    if norms:
        kwargs.update(k_norm_weight=np.full(D, 1.25, np.float16), v_norm=True)
    gpu = jax.devices("gpu")[0]
    args = [jax.device_put(a, gpu) for a in (k, v, pool, rope, slots)]
    got = np.asarray(
        jax.jit(lambda *a: jax_dflash.target_kv_cache_update_slots(*a, **kwargs))(*args)
    )
    assert_bits_equal(
        got, reference.target_kv_cache_update_slots(k, v, pool, rope, slots, **kwargs)
    )


@GPU
@CUDA_FORM
def test_cuda_duplicates_store_one_of_them_per_element():
    k, v, pool, rope, _ = _problem(np.random.default_rng(11))
    slots = np.full(T, -1, np.int32)
    slots[[1, 4, 8]] = 9
    gpu = jax.devices("gpu")[0]
    out = np.asarray(
        jax_dflash.target_kv_cache_update_slots(
            *[jax.device_put(a, gpu) for a in (k, v, pool, rope, slots)]
        )
    )
    candidates = []
    for token in (1, 4, 8):
        alone = np.full(T, -1, np.int32)
        alone[token] = 9
        candidates.append(reference.target_kv_cache_update_slots(k, v, pool, rope, alone))
    bits = out.view(np.uint16)
    assert np.logical_or.reduce([bits == c.view(np.uint16) for c in candidates]).all()


CHILD = textwrap.dedent(
    """
    import json
    import jax, numpy as np
    jax.config.update("jax_enable_x64", True)
    import jax_dflash
    from jax_dflash import reference
    t, h, d, n, p = 4, 1, 8, 3, 4
    k = np.arange(t * h * d, dtype=np.float32).reshape(t, h, d) + 1
    pool = np.zeros((2, n, p, h, d), np.float32)
    rope = np.zeros((t, 0), np.float32)
    # 2^32 + 1 would be 1 once narrowed to int32: it must write nothing, not row 1.
    slots = np.array([2**32 + 1, 5, 2**40, -(2**33)], np.int64)
    out = np.asarray(jax.jit(jax_dflash.target_kv_cache_update_slots)(k, k, pool, rope, slots))
    want = reference.target_kv_cache_update_slots(k, k, pool, rope, slots)
    rows = sorted({int(r) for r in np.nonzero(out[0].reshape(n * p, -1).any(axis=1))[0]})
    print(json.dumps({"equal": bool((out == want).all()), "rows": rows}))
    """
)


def test_int64_slots_past_2_to_the_31_are_never_narrowed():
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"equal": True, "rows": [5]}


def test_slots_from_pages_refuses_what_int32_cannot_hold():
    positions = jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match="N \\* P < 2\\^31"):
        jax_dflash.slots_from_pages(positions, positions, jnp.zeros((1, 2, 1), jnp.int32), 2**30, 4)


# ---- the ONNX node (the plugin's field `form` names the form) -----------------------------------


def _onnx_run(node, operands):
    pytest.importorskip("onnx", reason="the ONNX node needs the 'onnx' extra")
    from jax_dflash.interop import onnx as dflash_onnx
    from jax_dflash.interop.onnx_reference import reference_evaluator

    model = dflash_onnx.make_node_model(node, operands)
    (out,) = reference_evaluator(model).run(None, dict(zip(node.input, operands)))
    return out


@pytest.mark.parametrize("k_norm", [False, True])
def test_the_onnx_node_runs_the_form_as_the_op(k_norm):
    from jax_dflash.interop import onnx as dflash_onnx

    k, v, pool128, rope, slots = _problem(np.random.default_rng(8))
    pool128 = np.zeros((2, N, 128, H, D), np.float16)  # TensorRT's 128 tokens a page
    slots = np.array([0, 129, -1, N * 128, 5, 5, 300, 2**31 - 1, 7, 640, 3, 11], np.int32)
    operands = [k, v, pool128, rope, slots]
    kwargs = {}
    if k_norm:
        operands.append(np.full(D, 0.75, np.float16))
        kwargs["k_norm_weight"] = operands[-1]
    node = dflash_onnx.make_slots_update_node(k_norm=k_norm)
    assert {a.name: a for a in node.attribute}["form"].s == b"slot_mapping"
    got = _onnx_run(node, operands)
    want = reference.target_kv_cache_update_slots(k, v, pool128, rope, slots, **kwargs)
    assert_bits_equal(got, want)


def test_the_onnx_node_applies_tensorrts_profile():
    from jax_dflash.interop import onnx as dflash_onnx

    k, v, pool, rope, slots = _problem(np.random.default_rng(9))  # P = 4, not 128
    node = dflash_onnx.make_slots_update_node()
    with pytest.raises(ValueError, match="past_key_value: expected dim 2 == 128 tokens per page"):
        _onnx_run(node, [k, v, pool, rope, slots])
    import onnx

    bad = onnx.helper.make_node(
        dflash_onnx.PLUGIN_NAME,
        list(dflash_onnx._shapes.BASE_NAMES["slot_mapping"]),
        ["present_key_value"],
        domain=dflash_onnx.PLUGIN_DOMAIN,
        form="vllm",
    )
    with pytest.raises(ValueError, match="form: expected 'slot_mapping'"):
        _onnx_run(bad, [k, v, np.zeros((2, N, 128, H, D), np.float16), rope, slots])
