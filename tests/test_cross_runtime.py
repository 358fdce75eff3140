"""One function, three runtimes: JAX, ONNX (reference evaluator) and TensorRT.

The function is a small DFlash draft's target-context update (examples/draft_update.py):
per layer, k/v projections of target features, the k-norm, then the update. What is compared,
and how:

* The update stage, bit for bit: fed the same k/v, the JAX op on CPU, the ONNX node on the
  reference evaluator (this project's CPU kernel) and the NumPy reference write identical pools,
  for the slot contract (with its FP8 and norm extensions) and for the paged draft's
  Edge-LLM 0.11 node.
* The projection stage (matmul, RMSNorm), within a bound: JAX (XLA) and the ONNX reference
  (NumPy) sum in different orders, so their k/v may differ by rounding. The bound is the
  standard floating-point error model of float32 arithmetic, plus one unit in the last place of
  the storage dtype (two float32 values that close can round to neighbouring 16-bit values).
* On the H200: the TensorRT plugin's ``enqueue`` (trt_plugin/'s contract harness, driven by
  tests/test_trt_plugin.py's helpers), the ONNX reference run of the same node and the JAX CUDA
  path, bit for bit. Where TensorRT is installed, the exported graph is built into an engine and
  run. Each skips, saying why, where it cannot run.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

onnx = pytest.importorskip(
    "onnx", reason="the 'onnx' package is not installed (pip install -e \".[onnx]\")"
)

import jax_dflash  # noqa: E402
from jax_dflash import reference  # noqa: E402
from jax_dflash.interop import onnx as dflash_onnx  # noqa: E402
from jax_dflash.interop import trt  # noqa: E402
from jax_dflash.interop.onnx_reference import reference_evaluator, run_update_kernel  # noqa: E402
from jax_dflash.testing import DELTA_DTYPES as DTYPES  # noqa: E402
from jax_dflash.testing import assert_bits_equal, gpu_devices, make_problem  # noqa: E402

ARG_NAMES = dflash_onnx.SLOT_INPUTS
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
P = dflash_onnx.TRT_TOKENS_PER_PAGE  # TensorRT's tokens per page

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_example():
    spec = importlib.util.spec_from_file_location(
        "draft_update", ROOT / "examples" / "draft_update.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("draft_update", module)
    spec.loader.exec_module(module)
    return module


draft = _load_example()
CONFIG = draft.DraftConfig()
BATCH, DELTA_LEN = 2, 5
FLOAT32_UNIT_ROUNDOFF = 2.0**-24

_ONNX_ELEM_TYPE = {
    np.dtype(np.float16): onnx.TensorProto.FLOAT16,
    np.dtype(ml_dtypes.bfloat16): onnx.TensorProto.BFLOAT16,
    np.dtype(np.float32): onnx.TensorProto.FLOAT,
    np.dtype(np.int32): onnx.TensorProto.INT32,
}


def _needs_jax2onnx():
    pytest.importorskip(
        "jax2onnx",
        reason="jax2onnx is not installed (the 'export' extra: pip install -e \".[export]\")",
    )
    from jax_dflash.interop import export

    return export


# ---- the node alone: ONNX reference == NumPy reference == JAX on CPU --------------------------


def _single_node_model(args, pages_per_slot, attribute_overrides=None):
    """A one-node graph typed for ``args``: make_update_node's node; an override of None removes
    the attribute."""
    node = dflash_onnx.make_update_node(ARG_NAMES, pages_per_slot=pages_per_slot)
    for key, value in (attribute_overrides or {}).items():
        kept = [a for a in node.attribute if a.name != key]
        del node.attribute[:]
        node.attribute.extend(kept)
        if value is not None:
            node.attribute.append(onnx.helper.make_attribute(key, value))
    return dflash_onnx.make_node_model(node, args, opset=23)


def _run_jax_cpu(args, pages_per_slot, **kwargs):
    cpu = jax.devices("cpu")[0]
    kwargs = {
        k: jax.device_put(v, cpu) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()
    }
    fn = jax.jit(
        lambda *a: jax_dflash.target_kv_cache_update(*a, pages_per_slot=pages_per_slot, **kwargs)
    )
    return np.asarray(fn(*[jax.device_put(a, cpu) for a in args]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_node_matches_numpy_and_jax(dtype, seed):
    # Hostile positions: padding, pass-through past S, drops past the slot, negative starts
    # (starts are drawn over the whole slot of 384 rows; S = 300 rotates most keys).
    problem = make_problem(
        np.random.default_rng(seed),
        dtype=dtype,
        batch=3,
        delta_len=5,
        heads=2,
        head_dim=12,
        rotary_dim=8,
        page_size=P,
        pages_per_slot=3,
        max_batch=4,
        rope_batch=3 if seed == 1 else 1,
        rope_seq_len=300,
    )
    pool_before = problem.past_key_value.copy()
    model = _single_node_model(problem.args(), problem.pages_per_slot)
    (onnx_out,) = reference_evaluator(model).run(None, dict(zip(ARG_NAMES, problem.args())))
    expected = reference.target_kv_cache_update(
        *problem.args(), pages_per_slot=problem.pages_per_slot
    )
    assert_bits_equal(onnx_out, expected)
    assert_bits_equal(_run_jax_cpu(problem.args(), problem.pages_per_slot), onnx_out)
    assert_bits_equal(problem.past_key_value, pool_before)  # ONNX semantics: a new value
    assert not np.array_equal(onnx_out.view(np.uint8), pool_before.view(np.uint8))


@pytest.mark.parametrize(
    "dtype, options",
    [
        (np.float16, dict(pool_dtype=FP8, scale_shape=())),
        (ml_dtypes.bfloat16, dict(pool_dtype=FP8, k_norm=True)),  # per-head scales
        (np.float32, dict(k_norm=True, v_norm=True, norm_eps=1e-5)),
    ],
    ids=["fp8", "fp8+k_norm", "k_norm+v_norm"],
)
def test_reference_slot_node_with_extensions_matches_numpy_and_jax(dtype, options):
    problem = make_problem(
        np.random.default_rng(7),
        dtype=dtype,
        batch=3,
        delta_len=5,
        heads=2,
        head_dim=16,
        rotary_dim=8,
        page_size=P,
        pages_per_slot=2,
        max_batch=3,
        **options,
    )
    kwargs = problem.kwargs()
    node = dflash_onnx.make_update_node(
        pages_per_slot=problem.pages_per_slot,
        fp8_pool=problem.k_scale is not None,
        k_norm=problem.k_norm_weight is not None,
        v_norm=problem.v_norm,
        **({"norm_eps": problem.norm_eps} if "norm_eps" in kwargs else {}),
    )
    operands = list(problem.args())
    if problem.k_scale is not None:  # TensorRT's per-tensor scale is [1]
        operands += [
            s.reshape(1) if s.shape == () else s for s in (problem.k_scale, problem.v_scale)
        ]
    if problem.k_norm_weight is not None:
        operands.append(problem.k_norm_weight)
    model = dflash_onnx.make_node_model(node, operands)
    (onnx_out,) = reference_evaluator(model).run(None, dict(zip(node.input, operands)))
    expected = reference.target_kv_cache_update(*problem.args(), **kwargs)
    assert_bits_equal(onnx_out, expected)
    extras = {k: v for k, v in kwargs.items() if k != "pages_per_slot"}
    assert_bits_equal(_run_jax_cpu(problem.args(), problem.pages_per_slot, **extras), onnx_out)
    assert not np.array_equal(onnx_out.view(np.uint8), problem.past_key_value.view(np.uint8))


def _trt_problem(**overrides):
    options = dict(dtype=np.float16, page_size=P)
    return make_problem(np.random.default_rng(0), **{**options, **overrides})


def test_reference_node_requires_pages_per_slot():
    problem = _trt_problem()
    model = _single_node_model(problem.args(), problem.pages_per_slot, {"pages_per_slot": None})
    with pytest.raises(ValueError, match="expected the attribute pages_per_slot"):
        reference_evaluator(model).run(None, dict(zip(ARG_NAMES, problem.args())))


def test_reference_node_rejects_other_plugin_version():
    problem = _trt_problem()
    model = _single_node_model(problem.args(), problem.pages_per_slot, {"plugin_version": "2"})
    with pytest.raises(ValueError, match=r"plugin_version: expected '1', got '2'"):
        reference_evaluator(model).run(None, dict(zip(ARG_NAMES, problem.args())))


def test_kernel_errors_name_the_argument():
    problem = _trt_problem()
    args = list(problem.args())
    args[1] = args[1].astype(np.float32)
    with pytest.raises(TypeError, match="v_delta"):
        run_update_kernel(*args, pages_per_slot=problem.pages_per_slot)


# ---- the exported draft function ----------------------------------------------------------------


def _export(export, dtype):
    fn = draft.make_draft_context_update(draft.random_weights(CONFIG, dtype), CONFIG)
    model = export.to_onnx(
        fn,
        draft.input_specs(CONFIG, BATCH, DELTA_LEN, dtype),
        input_names=draft.input_names(CONFIG),
        output_names=draft.output_names(CONFIG),
    )
    return fn, model


def _plugin_nodes(model):
    return [n for n in model.graph.node if n.op_type == dflash_onnx.PLUGIN_NAME]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_export_emits_the_plugin_node(dtype):
    export = _needs_jax2onnx()
    _, model = _export(export, dtype)
    onnx.checker.check_model(model, full_check=False)
    nodes = _plugin_nodes(model)
    assert len(nodes) == CONFIG.num_layers  # one node per layer, no decomposition
    for layer, node in enumerate(nodes):
        expected = dflash_onnx.make_update_node(
            node.input, node.output[0], pages_per_slot=CONFIG.pages_per_slot, name=node.name
        )
        assert node == expected  # op type, domain, attributes, input order: make_update_node's
        # The pool is a graph input and the node's output a graph output: TensorRT can alias them.
        assert node.input[2] == f"past_key_value_{layer}"
        assert node.output[0] == f"present_key_value_{layer}"
        assert list(node.input[3:]) == ["rope_cos_sin", "delta_start_positions", "delta_lengths"]
    others = {(n.domain, n.op_type) for n in model.graph.node if n not in nodes}
    assert others and all(domain == "" for domain, _ in others), others  # standard ONNX
    imports = {o.domain: o.version for o in model.opset_import}
    assert imports == {"": export.OPSET, dflash_onnx.PLUGIN_DOMAIN: export.PLUGIN_DOMAIN_VERSION}
    assert [o.name for o in model.graph.output] == draft.output_names(CONFIG)
    pool_type = model.graph.output[0].type.tensor_type
    assert pool_type.elem_type == _ONNX_ELEM_TYPE[np.dtype(dtype)]
    assert [d.dim_value for d in pool_type.shape.dim] == list(CONFIG.pool_shape())


def _ulp(x, dtype):
    """One unit in the last place of ``dtype`` at |x| (float64; normal range)."""
    info = ml_dtypes.finfo(dtype)
    magnitude = np.maximum(np.abs(x), float(info.tiny))
    return float(info.eps) * np.exp2(np.floor(np.log2(magnitude)))


def _projection_bounds(hidden, weights, k_jax, v_jax, dtype):
    """Elementwise bounds on |JAX - ONNX| for k and v: float32 error model + 1 storage ulp.

    Each float32 dot product of n terms is within gamma_n * (|h| @ |W|) of the exact one
    (gamma_n = n u / (1 - n u)), so two orders are within twice that. The RMSNorm scale
    r = rsqrt(mean(y^2) + eps) moves by at most half the relative change of mean(y^2) plus a
    few roundings (mean, add, sqrt and divide; 8 u), and k = y * r * w adds two more.
    """
    u = FLOAT32_UNIT_ROUNDOFF
    n = CONFIG.hidden
    gamma = n * u / (1 - n * u)
    shape = k_jax.shape
    h = np.abs(hidden.astype(np.float64))
    dy_k = 2 * gamma * (h @ np.abs(weights.wk.astype(np.float64))).reshape(shape)
    dy_v = 2 * gamma * (h @ np.abs(weights.wv.astype(np.float64))).reshape(shape)
    y = hidden.astype(np.float64) @ weights.wk.astype(np.float64)
    y = y.reshape(shape)
    mean_sq = np.mean(y * y, axis=-1, keepdims=True)
    d_mean_sq = np.mean(2 * np.abs(y) * dy_k + dy_k**2, axis=-1, keepdims=True)
    inv_rms = 1 / np.sqrt(mean_sq + CONFIG.rms_norm_eps)
    rel_r = 0.5 * d_mean_sq / (mean_sq + CONFIG.rms_norm_eps) + 8 * u
    k_abs = np.abs(k_jax.astype(np.float64))
    norm_weight = np.abs(weights.k_norm.astype(np.float64))
    bound_k = inv_rms * norm_weight * dy_k * (1 + rel_r) + k_abs * (rel_r + 2 * u)
    bound_v = dy_v + np.abs(v_jax.astype(np.float64)) * u
    if np.dtype(dtype).itemsize < 4:  # then rounded once to the storage dtype
        bound_k = bound_k + _ulp(k_abs + bound_k, dtype)
        bound_v = bound_v + _ulp(np.abs(v_jax.astype(np.float64)) + bound_v, dtype)
    return bound_k, bound_v


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_export_parity_jax_onnx_numpy(dtype):
    export = _needs_jax2onnx()
    dtype = np.dtype(dtype)
    fn, model = _export(export, dtype)
    weights = draft.random_weights(CONFIG, dtype)
    inputs = draft.random_inputs(CONFIG, BATCH, DELTA_LEN, dtype)
    hidden, rope, starts, lengths, *pools = inputs
    pools_before = [p.copy() for p in pools]
    nodes = _plugin_nodes(model)
    wanted = [name for node in nodes for name in node.input[:2]] + draft.output_names(CONFIG)
    results = reference_evaluator(model).run(wanted, dict(zip(draft.input_names(CONFIG), inputs)))
    onnx_kv = results[: 2 * len(nodes)]
    onnx_pools = results[2 * len(nodes) :]

    # JAX on CPU, as the issue states: on a GPU, XLA's float32 matmuls may use TF32, which is
    # outside the float32 error model used for the projection below.
    cpu = jax.devices("cpu")[0]
    jax_pools = [np.asarray(p) for p in jax.jit(fn)(*jax.device_put(inputs, cpu))]
    for layer, (pool, w) in enumerate(zip(pools, weights)):
        k_onnx, v_onnx = onnx_kv[2 * layer], onnx_kv[2 * layer + 1]
        # The same jitted projection as inside fn (weights closed over there and here).
        project = jax.jit(lambda h, w=w: draft.project_context(h, w, CONFIG, dtype))
        k_jax, v_jax = (np.asarray(a) for a in project(jax.device_put(hidden, cpu)))
        assert k_onnx.dtype == k_jax.dtype == dtype

        # Update stage, exact: same k/v in, same bits out, in all three runtimes.
        update_args = (pool, rope, starts, lengths)
        expected_onnx = reference.target_kv_cache_update(
            k_onnx, v_onnx, *update_args, pages_per_slot=CONFIG.pages_per_slot
        )
        assert_bits_equal(onnx_pools[layer], expected_onnx)
        assert_bits_equal(
            _run_jax_cpu((k_onnx, v_onnx, *update_args), CONFIG.pages_per_slot), expected_onnx
        )
        expected_jax = reference.target_kv_cache_update(
            k_jax, v_jax, *update_args, pages_per_slot=CONFIG.pages_per_slot
        )
        assert_bits_equal(jax_pools[layer], expected_jax)

        # Projection stage, within the float32 error bound (+1 storage ulp).
        bound_k, bound_v = _projection_bounds(hidden, w, k_jax, v_jax, dtype)
        for name, a, b, bound in (("k", k_jax, k_onnx, bound_k), ("v", v_jax, v_onnx, bound_v)):
            diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
            worst = np.unravel_index(np.argmax(diff - bound), diff.shape)
            assert np.all(diff <= bound), (
                f"layer {layer} {name}: |JAX - ONNX| = {diff[worst]:.3g} > bound "
                f"{bound[worst]:.3g} at {worst}"
            )
    for before, after in zip(pools_before, pools):
        assert_bits_equal(after, before)  # neither runtime wrote into the caller's arrays


def _export_paged(export, dtype):
    fn = draft.make_draft_context_update_paged(draft.random_weights(CONFIG, dtype), CONFIG)
    model = export.to_onnx(
        fn,
        draft.paged_input_specs(CONFIG, BATCH, DELTA_LEN, dtype),
        input_names=draft.paged_input_names(CONFIG),
        output_names=draft.output_names(CONFIG),
    )
    return fn, model


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_export_emits_edge_llm_nodes_and_matches_the_slot_draft(dtype):
    """The paged draft exports to Edge-LLM 0.11's node, one per layer; its update stage is bit
    exact against the NumPy reference (fed the ONNX run's own k/v), and, through the identity
    page table, the pools equal the slot draft's."""
    export = _needs_jax2onnx()
    dtype = np.dtype(dtype)
    _, model = _export_paged(export, dtype)
    onnx.checker.check_model(model, full_check=False)
    nodes = _plugin_nodes(model)
    assert len(nodes) == CONFIG.num_layers
    for layer, node in enumerate(nodes):
        assert (node.domain, list(node.attribute)) == (dflash_onnx.EDGE_LLM_DOMAIN, [])
        assert node.input[2] == f"past_key_value_{layer}"
        assert list(node.input[3:]) == draft.paged_input_names(CONFIG)[1:5]
        assert node.output[0] == f"present_key_value_{layer}"
    imports = {o.domain: o.version for o in model.opset_import}
    assert imports == {"": export.OPSET, dflash_onnx.EDGE_LLM_DOMAIN: 23}

    slot_inputs = draft.random_inputs(CONFIG, BATCH, DELTA_LEN, dtype)
    inputs = draft.paged_inputs(CONFIG, slot_inputs)
    _, rope, positions, owners, table, *pools = inputs
    wanted = [name for node in nodes for name in node.input[:2]] + draft.output_names(CONFIG)
    results = reference_evaluator(model).run(
        wanted, dict(zip(draft.paged_input_names(CONFIG), inputs))
    )
    for layer, pool in enumerate(pools):
        k_onnx, v_onnx = results[2 * layer], results[2 * layer + 1]
        expected = reference.target_kv_cache_update_paged(
            k_onnx, v_onnx, pool, rope, positions, owners, table
        )
        assert_bits_equal(results[2 * len(nodes) + layer], expected)
        # The same k/v through the slot contract: the identity table writes what slots do.
        _, slot_rope, starts, lengths, *_ = slot_inputs
        heads_shape = (BATCH, DELTA_LEN, *k_onnx.shape[1:])
        slot_pool = reference.target_kv_cache_update(
            k_onnx.reshape(heads_shape),
            v_onnx.reshape(heads_shape),
            pool,
            slot_rope,
            starts,
            lengths,
            pages_per_slot=CONFIG.pages_per_slot,
        )
        assert_bits_equal(expected, slot_pool)


def test_export_of_a_jitted_function_leaves_it_runnable():
    # jax2onnx traces with jnp patched; the export must not leave those traces in JAX's caches.
    export = _needs_jax2onnx()
    dtype = np.dtype(np.float16)
    jitted = jax.jit(draft.make_draft_context_update(draft.random_weights(CONFIG, dtype), CONFIG))
    model = export.to_onnx(
        jitted,
        draft.input_specs(CONFIG, BATCH, DELTA_LEN, dtype),
        input_names=draft.input_names(CONFIG),
    )
    assert len(_plugin_nodes(model)) == CONFIG.num_layers
    inputs = draft.random_inputs(CONFIG, BATCH, DELTA_LEN, dtype)
    onnx_pools = reference_evaluator(model).run(None, dict(zip(draft.input_names(CONFIG), inputs)))
    for jax_pool, onnx_pool in zip(jitted(*inputs), onnx_pools):
        # Projections may differ by 1 fp16 ulp (see test_export_parity_jax_onnx_numpy); RoPE
        # mixes two of them: 2 ulps.
        np.testing.assert_allclose(
            np.asarray(jax_pool, np.float32),
            onnx_pool.astype(np.float32),
            rtol=2.0**-9,
            atol=2.0**-14,
        )


def test_export_rejects_the_layer_batched_form():
    export = _needs_jax2onnx()
    # k, v and the pool per layer; rope, starts and lengths shared.
    problem = _trt_problem(layers=2)
    update = lambda *a: jax_dflash.target_kv_cache_update(*a, pages_per_slot=problem.pages_per_slot)
    fn = jax.vmap(update, in_axes=(0, 0, 0, None, None, None))
    with pytest.raises(NotImplementedError, match="unbatched form"):
        export.to_onnx(fn, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in problem.args()])


def test_to_onnx_leaves_jax2onnx_plugins_as_they_were():
    export = _needs_jax2onnx()
    from jax2onnx.plugins import plugin_system

    def own_binding_specs():
        return {
            type(p): type(p).__dict__.get("binding_specs")
            for p in plugin_system.PLUGIN_REGISTRY.values()
            if isinstance(p, plugin_system.PrimitiveLeafPlugin)
        }

    plugin_system.import_all_plugins()
    export.register_jax2onnx_plugin()
    before = own_binding_specs()
    _export(export, np.float16)
    assert own_binding_specs() == before  # patches of absent modules are dropped per call only


# ---- TensorRT ----------------------------------------------------------------------------------


def _harness_or_skip():
    """The contract harness of trt_plugin/, found and run by tests/helpers/trt_harness.py."""
    if not gpu_devices():
        pytest.skip("no GPU backend in this JAX: the TensorRT enqueue parity runs on the H200")
    from helpers import trt_harness

    return trt_harness, trt_harness._built(trt_harness._harness_path)


def _node_for_case(meta):
    """The ONNX node of a dumped harness case: the slot node, or the paged one (Edge-LLM's
    field-less node when the case uses no extension)."""
    norms = meta["k_norm"] or meta["v_norm"]
    options = dict(
        fp8_pool="scale_heads" in meta,  # static k_scale, v_scale
        scale_pool="scale_output" in meta,
        k_norm=meta["k_norm"],
        v_norm=meta["v_norm"],
        **({"norm_eps": meta["norm_eps"]} if norms else {}),
    )
    if meta["contract"] == "slot":
        return dflash_onnx.make_update_node(pages_per_slot=meta["pages_per_slot"], **options)
    if meta["contract"] == "paged":
        return dflash_onnx.make_paged_update_node(ring=meta["ring"], **options)
    return dflash_onnx.make_form_node(meta["contract"], **options)


def test_trt_enqueue_matches_onnx_reference_and_jax_cuda(tmp_path):
    """The plugin node, three ways: TensorRT's enqueue (CUDA), ONNX's reference run (the CPU
    kernel through the OpRun) and the JAX op on CUDA, on the harness's hostile inputs of both
    contracts (every pool dtype, FP8 scales, norms, ring)."""
    trt_harness, harness = _harness_or_skip()
    from helpers.ops import FORM_OPS as form_ops

    report = trt_harness._run_harness(
        harness,
        "--gpu",
        "--dump",
        str(tmp_path / "dump"),
        report=tmp_path / "report.json",
        timeout=600,
    )
    dumps = report["dumps"]
    assert {d["contract"] for d in dumps} == {"slot", "paged", "slot_mapping"}, dumps
    gpu = gpu_devices()[0]
    edge_llm_cases = 0
    for entry in dumps:
        meta, arrays = trt_harness._load_case(entry["dir"])
        node = _node_for_case(meta)
        assert list(node.input) == meta["inputs"], meta["name"]  # the plugin's input order
        edge_llm_cases += node.domain == dflash_onnx.EDGE_LLM_DOMAIN
        operands = [arrays[name] for name in node.input]
        model = dflash_onnx.make_node_model(node, operands)
        onnx_outputs = reference_evaluator(model).run(None, dict(zip(node.input, operands)))
        args, kwargs = trt_harness._op_arguments(meta, arrays)
        op = form_ops[meta["contract"]][0]
        on_gpu = {
            k: jax.device_put(v, gpu) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()
        }
        with trt_harness.jax_mode(meta):
            jax_outputs = jax.jit(lambda *a, op=op, kw=on_gpu: op(*a, **kw))(
                *[jax.device_put(a, gpu) for a in args]
            )
        jax_outputs = jax_outputs if isinstance(jax_outputs, tuple) else (jax_outputs,)
        trt_outputs = [arrays[meta["output"]]]
        if "scale_output" in meta:  # present_scale_pool, compared too
            trt_outputs.append(trt_harness._load_scale_output(meta, entry["dir"]))
        try:
            assert len(onnx_outputs) == len(jax_outputs) == len(trt_outputs)
            for onnx_out, jax_out, trt_out in zip(onnx_outputs, jax_outputs, trt_outputs):
                assert_bits_equal(onnx_out, trt_out)
                assert_bits_equal(np.asarray(jax_out), trt_out)
        except AssertionError as e:
            raise AssertionError(f"case {meta['name']}: {e}") from None
    assert edge_llm_cases > 0  # Edge-LLM 0.11's own node ran against the plugin too


def test_trt_engine_runs_the_exported_graph():
    """Where TensorRT (with its builder) is installed: the exported draft graph is built into an
    engine with the plugin library and run; it agrees with the ONNX reference run."""
    tensorrt = pytest.importorskip(
        "tensorrt", reason="the 'tensorrt' Python package (with its builder) is not installed"
    )
    torch = pytest.importorskip("torch", reason="torch provides the CUDA buffers for the engine")
    export = _needs_jax2onnx()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for torch: the TensorRT engine cannot run here")
    try:
        trt.trt_plugin_library_path()
    except FileNotFoundError as e:
        pytest.skip(f"the TensorRT plugin library was not built: {e}")
    config = draft.DraftConfig(max_batch=2)
    dtype = np.dtype(np.float16)
    fn = draft.make_draft_context_update(draft.random_weights(config, dtype), config)
    model = export.to_onnx(
        fn,
        draft.input_specs(config, BATCH, DELTA_LEN, dtype),
        input_names=draft.input_names(config),
        output_names=draft.output_names(config),
    )
    engine = tensorrt.Runtime(tensorrt.Logger(tensorrt.Logger.WARNING)).deserialize_cuda_engine(
        trt.build_engine(model)
    )
    context = engine.create_execution_context()

    inputs = draft.random_inputs(config, BATCH, DELTA_LEN, dtype)
    expected = reference_evaluator(model).run(None, dict(zip(draft.input_names(config), inputs)))
    buffers = {
        name: torch.from_numpy(np.ascontiguousarray(a)).cuda()
        for name, a in zip(draft.input_names(config), inputs)
    }
    for name, like in zip(draft.output_names(config), expected):
        buffers[name] = torch.empty(like.shape, dtype=torch.float16, device="cuda")
    for name, buffer in buffers.items():
        context.set_tensor_address(name, buffer.data_ptr())
    stream = torch.cuda.current_stream()
    assert context.execute_async_v3(stream.cuda_stream)
    stream.synchronize()

    hidden, rope, starts, lengths, *pools = inputs
    written = np.zeros(config.pool_shape(), bool)  # [2, numPages, P, H, D]
    for b in range(BATCH):
        for t in range(DELTA_LEN):
            pos = reference.written_position(starts[b], lengths[b], t, config.slot_capacity)
            if pos is not None:
                page = b * config.pages_per_slot + pos // config.page_size
                written[:, page, pos % config.page_size] = True
    for name, pool, want in zip(draft.output_names(config), pools, expected):
        got = buffers[name].cpu().numpy()
        # Untouched elements: exactly the input pool. Written ones: TensorRT's own matmul and
        # norm (TF32 allowed by default) against NumPy's, stored in fp16.
        assert_bits_equal(np.where(written, 0, got), np.where(written, 0, pool))
        np.testing.assert_allclose(
            got[written].astype(np.float32), want[written].astype(np.float32), rtol=2e-2, atol=2e-2
        )
