"""The paged contract (Edge-LLM 0.11) in ONNX: the reference runtime's nodes against the JAX op
and the NumPy reference, bit for bit; the nodes' strictness; the export of the paged op.

The reference runtime runs the nodes on the project's CPU kernel, so JAX on CPU, the ONNX
reference evaluator and ``jax_dflash.reference`` must agree on every bit of the pool, on
hostile tables and positions (padding owners, owners past B, negative positions, positions
past the table, page ids out of their plane).
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

onnx = pytest.importorskip(
    "onnx", reason="the 'onnx' package is not installed (pip install -e \".[onnx]\")"
)

import jax_dflash  # noqa: E402
from jax_dflash import reference  # noqa: E402
from jax_dflash.interop import onnx as dflash_onnx  # noqa: E402
from jax_dflash.interop.onnx_reference import (  # noqa: E402
    reference_evaluator,
    run_paged_update_kernel,
)
from jax_dflash.testing import (  # noqa: E402
    DELTA_DTYPES,
    assert_bits_equal,
    gpu_devices,
    make_paged_problem,
    make_problem,
)

P = dflash_onnx.TRT_TOKENS_PER_PAGE
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _paged_problem(seed, dtype=np.float16, **overrides):
    options = dict(
        tokens=12,
        batch=3,
        heads=2,
        head_dim=16,
        rotary_dim=8,
        num_pages=8,
        page_size=P,
        table_pages=2,
        dtype=dtype,
        hostile=True,
    )
    options.update(overrides)
    return make_paged_problem(np.random.default_rng(seed), **options)


def _trt_scale(scale):
    """TensorRT's per-tensor scale is [1]; the JAX op's is []."""
    return scale.reshape(1) if scale.shape == () else scale


def _node_operands(problem):
    """The node's inputs: the base operands, then the extras in use, in the node's order."""
    operands = list(problem.args())
    if problem.k_scale is not None:
        operands += [_trt_scale(problem.k_scale), _trt_scale(problem.v_scale)]
    if problem.k_norm_weight is not None:
        operands.append(problem.k_norm_weight)
    return operands


def _paged_node(problem, **overrides):
    options = dict(
        ring=problem.ring,
        fp8_pool=problem.k_scale is not None,
        k_norm=problem.k_norm_weight is not None,
        v_norm=problem.v_norm,
    )
    if options["k_norm"] or options["v_norm"]:
        options["norm_eps"] = problem.norm_eps
    options.update(overrides)
    return dflash_onnx.make_paged_update_node(**options)


def _run_node(node, operands):
    model = dflash_onnx.make_node_model(node, operands)
    (out,) = reference_evaluator(model).run(None, dict(zip(node.input, operands)))
    return out


def _run_jax_cpu(problem):
    cpu = jax.devices("cpu")[0]
    kwargs = {
        k: jax.device_put(v, cpu) if isinstance(v, np.ndarray) else v
        for k, v in problem.kwargs().items()
    }
    fn = jax.jit(lambda *a: jax_dflash.target_kv_cache_update_paged(*a, **kwargs))
    return np.asarray(fn(*[jax.device_put(a, cpu) for a in problem.args()]))


def _assert_three_agree(problem, node):
    pool_before = problem.past_key_value.copy()
    onnx_out = _run_node(node, _node_operands(problem))
    expected = reference.target_kv_cache_update_paged(*problem.args(), **problem.kwargs())
    assert_bits_equal(onnx_out, expected)
    assert_bits_equal(_run_jax_cpu(problem), onnx_out)
    assert_bits_equal(problem.past_key_value, pool_before)  # ONNX semantics: a new value
    assert not np.array_equal(onnx_out.view(np.uint8), pool_before.view(np.uint8))


# ---- parity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DELTA_DTYPES, ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_edge_llm_node_matches_numpy_and_jax(dtype, seed):
    problem = _paged_problem(seed, dtype)
    node = _paged_node(problem)
    assert node.domain == dflash_onnx.EDGE_LLM_DOMAIN and not node.attribute
    _assert_three_agree(problem, node)


@pytest.mark.parametrize(
    "dtype, options",
    [
        (np.float16, dict(ring=True)),
        (ml_dtypes.bfloat16, dict(ring=True, k_norm=True)),
        (np.float32, dict(k_norm=True, v_norm=True, norm_eps=1e-5)),
        (np.float16, dict(pool_dtype=FP8, scale_shape=())),
        (ml_dtypes.bfloat16, dict(pool_dtype=FP8, k_norm=True, v_norm=True)),  # per-head scales
        (np.float32, dict(pool_dtype=FP8, ring=True, scale_shape=())),
    ],
    ids=str,
)
def test_plugin_domain_paged_node_matches_numpy_and_jax(dtype, options):
    problem = _paged_problem(3, dtype, **options)
    node = _paged_node(problem)
    assert node.domain == dflash_onnx.PLUGIN_DOMAIN
    _assert_three_agree(problem, node)


def test_paged_node_in_a_namespace_runs_the_same_update():
    problem = _paged_problem(4)
    edge_llm = _run_node(_paged_node(problem), _node_operands(problem))
    namespaced = _run_node(_paged_node(problem, plugin_namespace="dflash"), _node_operands(problem))
    assert_bits_equal(namespaced, edge_llm)


def test_paged_kernel_errors_name_the_argument():
    problem = _paged_problem(0)
    args = list(problem.args())
    args[5] = args[5].astype(np.int64)
    with pytest.raises(TypeError, match="delta_token_to_sequence"):
        run_paged_update_kernel(*args)


# ---- strictness: each a build-time error of the plugin, named -----------------------------------


def _node(domain, inputs, **attributes):
    return onnx.helper.make_node(
        dflash_onnx.PLUGIN_NAME,
        list(inputs),
        ["present_key_value"],
        name="update",
        domain=domain,
        **attributes,
    )


def _plugin_attributes(**extra):
    return dict(plugin_version="1", plugin_namespace="", **extra)


def _slot_problem(**overrides):
    options = dict(
        batch=2,
        delta_len=3,
        heads=2,
        head_dim=8,
        page_size=P,
        pages_per_slot=2,
        max_batch=2,
        dtype=np.float16,
    )
    options.update(overrides)
    return make_problem(np.random.default_rng(0), **options)


def _run_slot(operands, inputs=dflash_onnx.SLOT_INPUTS, **attributes):
    return _run_node(_node(dflash_onnx.PLUGIN_DOMAIN, inputs, **attributes), operands)


@pytest.mark.parametrize(
    "attributes, error, match",
    [
        (
            _plugin_attributes(pages_per_slot=2.9),
            TypeError,
            "pages_per_slot: expected an attribute of type INT, got a FLOAT attribute 2.9",
        ),
        (
            _plugin_attributes(pages_per_slot="2"),
            TypeError,
            "pages_per_slot: expected an attribute of type INT, got a STRING attribute",
        ),
        (_plugin_attributes(), ValueError, "pages_per_slot: expected the attribute pages_per_slot"),
        (_plugin_attributes(pages_per_slot=0), ValueError, "pages_per_slot: expected an int in"),
        (
            _plugin_attributes(pages_per_slot=2**31),
            ValueError,
            "pages_per_slot: expected an int in",
        ),
        (
            dict(plugin_version="2", pages_per_slot=2),
            ValueError,
            "plugin_version: expected '1', got '2'",
        ),
        (
            dict(plugin_version=1, pages_per_slot=2),
            TypeError,
            "plugin_version: expected an attribute of type STRING",
        ),
        (
            _plugin_attributes(pages_per_slot=2, window=4),
            ValueError,
            "window: not an attribute of the slot-contract node",
        ),
        (
            _plugin_attributes(pages_per_slot=2, ring=1),
            ValueError,
            "ring: not an attribute of the slot-contract node",
        ),
        (
            _plugin_attributes(pages_per_slot=2, k_norm=2),
            ValueError,
            "k_norm: expected 0 or 1, got 2",
        ),
        (
            _plugin_attributes(pages_per_slot=2, v_norm=1, norm_eps=1),
            TypeError,
            "norm_eps: expected an attribute of type FLOAT",
        ),
        (
            _plugin_attributes(pages_per_slot=2, v_norm=1, norm_eps=-1.0),
            ValueError,
            "norm_eps: expected a finite float > 0",
        ),
    ],
)
def test_slot_node_rejects_bad_attributes(attributes, error, match):
    problem = _slot_problem()
    with pytest.raises(error, match=match):
        _run_slot(list(problem.args()), **attributes)


def test_slot_node_accepts_the_parsers_defaults():
    # plugin_version and plugin_namespace may be left out: TensorRT's parser defaults them.
    problem = _slot_problem()
    out = _run_slot(list(problem.args()), pages_per_slot=2)
    expected = reference.target_kv_cache_update(*problem.args(), pages_per_slot=2)
    assert_bits_equal(out, expected)


def _with(operands, index, value):
    operands = list(operands)
    operands[index] = value
    return operands


@pytest.mark.parametrize(
    "case, error, match",
    [
        ("k_delta float64", TypeError, "k_delta: expected dtype float16, bfloat16 or float32"),
        ("v_delta other dtype", TypeError, "v_delta"),
        ("starts int64", TypeError, "delta_start_positions"),
        ("rope float16", TypeError, "rope_cos_sin"),
        ("page size 64", ValueError, r"past_key_value: expected dim 2 == 128 tokens per page"),
        ("S > cap", ValueError, "rope_cos_sin"),
        ("more sequences than slots", ValueError, "k_delta"),
        ("e5m2 pool", TypeError, "past_key_value: .*e5m2 pools are JAX-only"),
        ("missing delta_lengths", TypeError, "delta_lengths is missing: expected 6 operands"),
        ("scales on a 16-bit pool", ValueError, "float16 pool takes no k_scale, v_scale"),
    ],
)
def test_slot_node_rejects_bad_inputs(case, error, match):
    problem = _slot_problem()
    operands = list(problem.args())
    inputs = list(dflash_onnx.SLOT_INPUTS)
    if case == "k_delta float64":
        operands = _with(operands, 0, operands[0].astype(np.float64))
    elif case == "v_delta other dtype":
        operands = _with(operands, 1, operands[1].astype(np.float32))
    elif case == "starts int64":
        operands = _with(operands, 4, operands[4].astype(np.int64))
    elif case == "rope float16":
        operands = _with(operands, 3, operands[3].astype(np.float16))
    elif case == "page size 64":
        operands = list(_slot_problem(page_size=64).args())
    elif case == "S > cap":
        rope = np.zeros((1, 2 * P + 1, operands[3].shape[-1]), np.float32)
        operands = _with(operands, 3, rope)
    elif case == "more sequences than slots":
        operands = list(_slot_problem(batch=3, max_batch=2).args())
    elif case == "e5m2 pool":
        operands = _with(operands, 2, operands[2].astype(ml_dtypes.float8_e5m2))
        operands += [np.ones(1, np.float32)] * 2
        inputs += ["k_scale", "v_scale"]
    elif case == "missing delta_lengths":
        operands, inputs = operands[:5], inputs[:5]
    elif case == "scales on a 16-bit pool":
        operands += [np.ones(1, np.float32)] * 2
        inputs += ["k_scale", "v_scale"]
    with pytest.raises(error, match=match):
        _run_slot(operands, inputs, **_plugin_attributes(pages_per_slot=2))


@pytest.mark.parametrize(
    "domain, attributes, error, match",
    [
        (
            dflash_onnx.EDGE_LLM_DOMAIN,
            dict(ring=1),
            ValueError,
            r"ring: not an attribute of the Edge-LLM 0.11 \(trt_edgellm\) node",
        ),
        (
            dflash_onnx.EDGE_LLM_DOMAIN,
            dict(plugin_version="1"),
            ValueError,
            "plugin_version: not an attribute of the Edge-LLM",
        ),
        (
            dflash_onnx.PLUGIN_DOMAIN,
            _plugin_attributes(pages_per_slot=2),
            ValueError,
            "pages_per_slot: not an attribute of the paged-contract node",
        ),
        (
            dflash_onnx.PLUGIN_DOMAIN,
            _plugin_attributes(window=4),
            ValueError,
            "window: not an attribute of the paged-contract node",
        ),
        (
            dflash_onnx.PLUGIN_DOMAIN,
            dict(plugin_version="2"),
            ValueError,
            "plugin_version: expected '1', got '2'",
        ),
        (
            dflash_onnx.PLUGIN_DOMAIN,
            _plugin_attributes(ring=1.0),
            TypeError,
            "ring: expected an attribute of type INT, got a FLOAT attribute 1.0",
        ),
        (
            dflash_onnx.PLUGIN_DOMAIN,
            _plugin_attributes(ring=-1),
            ValueError,
            "ring: expected 0 or 1",
        ),
    ],
)
def test_paged_node_rejects_bad_attributes(domain, attributes, error, match):
    problem = _paged_problem(0)
    with pytest.raises(error, match=match):
        _run_node(_node(domain, dflash_onnx.PAGED_INPUTS, **attributes), list(problem.args()))


@pytest.mark.parametrize(
    "case, error, match",
    [
        ("positions int64", TypeError, "delta_positions"),
        ("table float32", TypeError, "kv_page_table"),
        ("k_delta int16", TypeError, "k_delta: expected dtype float16, bfloat16 or float32"),
        ("page size 64", ValueError, r"past_key_value: expected dim 2 == 128 tokens per page"),
        ("M > N", ValueError, "kv_page_table"),
        ("missing kv_page_table", TypeError, "kv_page_table is missing: expected 7 operands"),
        ("FP8 pool without scales", ValueError, "pool needs k_scale and v_scale"),
        (
            "k_norm without its weight",
            TypeError,
            "then k_norm_weight \\(k_norm is on\\); got 7 operands",
        ),
        ("scale of a wrong shape", ValueError, r"k_scale: expected 1 or H = 2 scales"),
        ("layer-batched", ValueError, "TensorRT's contract has no layers axis"),
        (
            "scales of two shapes",
            ValueError,
            r"v_scale: expected k_scale's shape \[1\], got shape \[2\]",
        ),
        (
            "Edge-LLM 0.10.1's call",
            ValueError,
            r"k_delta: expected rank 3 .* Edge-LLM 0\.10\.1's call",
        ),
    ],
)
def test_paged_node_rejects_bad_inputs(case, error, match):
    problem = _paged_problem(0)
    operands = list(problem.args())
    inputs = list(dflash_onnx.PAGED_INPUTS)
    attributes = {}
    if case == "positions int64":
        operands = _with(operands, 4, operands[4].astype(np.int64))
    elif case == "table float32":
        operands = _with(operands, 6, operands[6].astype(np.float32))
    elif case == "k_delta int16":
        operands = _with(operands, 0, operands[0].view(np.int16))
    elif case == "page size 64":
        operands = list(_paged_problem(0, page_size=64).args())
    elif case == "M > N":
        operands = _with(operands, 6, np.zeros((3, 2, 9), np.int32))
    elif case == "missing kv_page_table":
        operands, inputs = operands[:6], inputs[:6]
    elif case == "FP8 pool without scales":
        operands = list(_paged_problem(0, pool_dtype=FP8).args())
    elif case == "k_norm without its weight":
        attributes = _plugin_attributes(k_norm=1)
    elif case == "scale of a wrong shape":
        fp8 = _paged_problem(0, pool_dtype=FP8)
        operands = [*fp8.args(), np.ones(3, np.float32), np.ones(3, np.float32)]
        inputs += ["k_scale", "v_scale"]
    elif case == "layer-batched":
        operands = list(_paged_problem(0, layers=2).args())
    elif case == "scales of two shapes":
        fp8 = _paged_problem(0, pool_dtype=FP8)
        operands = [*fp8.args(), np.ones(1, np.float32), np.ones(2, np.float32)]
        inputs += ["k_scale", "v_scale"]
    elif case == "Edge-LLM 0.10.1's call":
        operands = [*_slot_problem().args()[:6], operands[6]]
    domain = dflash_onnx.PLUGIN_DOMAIN if attributes else dflash_onnx.EDGE_LLM_DOMAIN
    with pytest.raises(error, match=match):
        _run_node(_node(domain, inputs, **attributes), operands)


# ---- export ------------------------------------------------------------------------------------


def _needs_jax2onnx():
    pytest.importorskip(
        "jax2onnx",
        reason="jax2onnx is not installed (the 'export' extra: pip install -e \".[export]\")",
    )
    from jax_dflash.interop import export

    return export


def _paged_update_fn(**options):
    """k/v come flat ([T, H*D]) and are reshaped; padding owners get position -1 as well: a few
    standard ONNX nodes around the plugin node, all exact."""

    def fn(k_flat, v_flat, pool, rope, positions, owners, table, *extras):
        heads, dim = pool.shape[-2:]
        k = k_flat.reshape(k_flat.shape[0], heads, dim)
        v = v_flat.reshape(v_flat.shape[0], heads, dim)
        positions = jax.numpy.where(owners >= 0, positions, -1)
        names = (["k_scale", "v_scale"] if len(extras) >= 2 else []) + (
            ["k_norm_weight"] if len(extras) % 2 else []
        )
        return jax_dflash.target_kv_cache_update_paged(
            k, v, pool, rope, positions, owners, table, **dict(zip(names, extras)), **options
        )

    return fn


def _flat_args(problem):
    k, v, *rest = problem.args()
    extras = [e for e in (problem.k_scale, problem.v_scale, problem.k_norm_weight) if e is not None]
    return [k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1), *rest, *extras]


def _export_problem(export, problem, options):
    args = _flat_args(problem)
    names = [f"arg{i}" for i in range(len(args))]
    model = export.to_onnx(
        _paged_update_fn(**options),
        [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args],
        input_names=names,
        output_names=["present_key_value"],
    )
    return model, dict(zip(names, args))


@pytest.mark.parametrize("dtype", DELTA_DTYPES, ids=str)
def test_export_of_the_paged_op_is_edge_llm_node_and_bit_exact(dtype):
    export = _needs_jax2onnx()
    problem = _paged_problem(5, dtype)
    model, feeds = _export_problem(export, problem, {})
    onnx.checker.check_model(model, full_check=False)
    nodes = [n for n in model.graph.node if n.op_type == dflash_onnx.PLUGIN_NAME]
    assert len(nodes) == 1
    (node,) = nodes
    assert node.domain == dflash_onnx.EDGE_LLM_DOMAIN and not node.attribute
    assert len(node.input) == 7 and node.input[2] == "arg2"
    assert node.output[0] == "present_key_value"
    others = {(n.domain, n.op_type) for n in model.graph.node if n is not node}
    assert others and all(domain == "" for domain, _ in others), others
    imports = {o.domain: o.version for o in model.opset_import}
    assert imports == {"": export.OPSET, dflash_onnx.EDGE_LLM_DOMAIN: 23}

    (onnx_out,) = reference_evaluator(model).run(None, feeds)
    cpu = jax.devices("cpu")[0]
    jax_out = np.asarray(jax.jit(_paged_update_fn())(*jax.device_put(list(feeds.values()), cpu)))
    expected = reference.target_kv_cache_update_paged(*problem.args())
    assert_bits_equal(onnx_out, expected)
    assert_bits_equal(jax_out, expected)


@pytest.mark.parametrize(
    "options, problem_options",
    [
        (dict(ring=True, v_norm=True), dict(ring=True, v_norm=True)),
        (dict(norm_eps=1e-5), dict(k_norm=True, norm_eps=1e-5, pool_dtype=FP8, scale_shape=())),
    ],
    ids=["ring+v_norm", "fp8+k_norm"],
)
def test_export_of_the_paged_op_with_extensions(options, problem_options):
    export = _needs_jax2onnx()
    problem = _paged_problem(6, np.float16, **problem_options)
    model, feeds = _export_problem(export, problem, options)
    onnx.checker.check_model(model, full_check=False)
    (node,) = [n for n in model.graph.node if n.op_type == dflash_onnx.PLUGIN_NAME]
    expected_node = _paged_node(problem, name=node.name)
    del expected_node.input[:]
    expected_node.input.extend(node.input)
    del expected_node.output[:]
    expected_node.output.extend(node.output)
    assert node == expected_node  # domain trt.plugins, the extension attributes, the extras
    if problem.k_scale is not None:  # [] scales reach the node reshaped to TensorRT's [1]
        shapes = {
            v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in (*model.graph.value_info, *model.graph.input)
        }
        assert shapes.get(node.input[7]) == [1]
    (onnx_out,) = reference_evaluator(model).run(None, feeds)
    expected = reference.target_kv_cache_update_paged(*problem.args(), **problem.kwargs())
    assert_bits_equal(onnx_out, expected)


def test_export_without_a_norm_ignores_norm_eps():
    # norm_eps without k_norm/v_norm changes nothing the op computes: still Edge-LLM's node.
    export = _needs_jax2onnx()
    problem = _paged_problem(0)
    model, _ = _export_problem(export, problem, dict(norm_eps=1e-3))
    (node,) = [n for n in model.graph.node if n.op_type == dflash_onnx.PLUGIN_NAME]
    assert node.domain == dflash_onnx.EDGE_LLM_DOMAIN and not node.attribute


def test_export_rejects_what_the_plugin_cannot_build():
    export = _needs_jax2onnx()
    problem = _paged_problem(0, page_size=64)
    with pytest.raises(ValueError, match="past_key_value: expected dim 2 == 128 tokens per page"):
        _export_problem(export, problem, {})
    e5m2 = _paged_problem(0, pool_dtype=ml_dtypes.float8_e5m2, scale_shape=())
    with pytest.raises(TypeError, match="e5m2 pools are JAX-only"):
        _export_problem(export, e5m2, {})


def test_export_rejects_the_layer_batched_paged_form():
    export = _needs_jax2onnx()
    problem = _paged_problem(0, layers=2)
    fn = jax.vmap(
        jax_dflash.target_kv_cache_update_paged, in_axes=(0, 0, 0, None, None, None, None)
    )
    with pytest.raises(NotImplementedError, match="unbatched form"):
        export.to_onnx(fn, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in problem.args()])


def test_read_only_inputs_are_read_not_written():
    # Feeds are often read-only (np.asarray of a jax.Array); the node still runs, on a copy.
    problem = _paged_problem(8)
    operands = _node_operands(problem)
    for a in operands:
        a.flags.writeable = False
    out = _run_node(_paged_node(problem), operands)
    assert_bits_equal(out, reference.target_kv_cache_update_paged(*problem.args()))
    assert out.flags.writeable and not operands[2].flags.writeable


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_paged_node_matches_numpy_over_shapes(data):
    """Random geometry, dtypes and options: the ONNX node and the NumPy reference agree."""
    draw = data.draw
    batch = draw(st.integers(1, 4), label="batch")
    table_pages = draw(st.integers(1, 3), label="table_pages")
    head_dim = draw(st.sampled_from([2, 6, 8, 16, 24]), label="head_dim")
    options = dict(
        tokens=draw(st.integers(1, 40), label="tokens"),
        batch=batch,
        heads=draw(st.integers(1, 3), label="heads"),
        head_dim=head_dim,
        rotary_dim=draw(st.sampled_from(range(0, head_dim + 1, 2)), label="rotary_dim"),
        num_pages=batch * table_pages + draw(st.integers(0, 3), label="spare pages"),
        table_pages=table_pages,
        ring=draw(st.booleans(), label="ring"),
        k_norm=draw(st.booleans(), label="k_norm"),
        v_norm=draw(st.booleans(), label="v_norm"),
        hostile=draw(st.booleans(), label="hostile"),
    )
    dtype = draw(st.sampled_from(DELTA_DTYPES), label="dtype")
    if draw(st.booleans(), label="fp8 pool"):
        options.update(
            pool_dtype=FP8, scale_shape=draw(st.sampled_from([(), None]), label="scale_shape")
        )
    problem = _paged_problem(draw(st.integers(0, 2**16), label="seed"), dtype, **options)
    out = _run_node(_paged_node(problem), _node_operands(problem))
    assert_bits_equal(
        out, reference.target_kv_cache_update_paged(*problem.args(), **problem.kwargs())
    )


@pytest.mark.parametrize(
    "dtype, options",
    [
        (np.float16, {}),
        (ml_dtypes.bfloat16, {}),
        (np.float32, {}),
        (np.float16, dict(ring=True, k_norm=True, v_norm=True)),
        (ml_dtypes.bfloat16, dict(pool_dtype=FP8, scale_shape=())),
    ],
    ids=str,
)
def test_onnx_reference_matches_jax_cuda(dtype, options):
    """On a GPU: the ONNX reference run (CPU kernel) and the JAX op on CUDA, bit for bit."""
    gpus = gpu_devices()
    if not gpus:
        pytest.skip("no GPU backend in this JAX: the CUDA parity runs on the H200")
    problem = _paged_problem(9, dtype, **options)
    onnx_out = _run_node(_paged_node(problem), _node_operands(problem))
    kwargs = {
        k: jax.device_put(v, gpus[0]) if isinstance(v, np.ndarray) else v
        for k, v in problem.kwargs().items()
    }
    update = jax.jit(lambda *a: jax_dflash.target_kv_cache_update_paged(*a, **kwargs))
    cuda_out = np.asarray(update(*[jax.device_put(a, gpus[0]) for a in problem.args()]))
    assert_bits_equal(cuda_out, onnx_out)


def test_the_short_module_name_reads_the_interop_module():
    import sys

    import jax_dflash.onnx as short

    assert sys.modules["jax_dflash.onnx"] is short  # its own module, not a swapped one
    assert jax_dflash.onnx is short
    assert short.make_paged_update_model is dflash_onnx.make_paged_update_model
    assert short.PLUGIN_NAME == dflash_onnx.PLUGIN_NAME
    assert set(dir(dflash_onnx)) <= set(dir(short))
