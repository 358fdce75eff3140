"""The plugin node with the quantized pool formats, in every addressing form: int8 pools with
static scales, int8 and float8_e4m3fn pools with a scale pool (the attribute ``scale_pool = 1``:
input ``scale_pool``, second output ``present_scale_pool``), int4 pools (uint8 bytes
``[2, N, 128, H, D/2]``, a scale pool only). The ONNX reference run of each node equals the JAX op
on CPU and the NumPy reference bit for bit, pool and scale pool; bad nodes are refused as the
plugin refuses them, naming the input.
"""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest

onnx = pytest.importorskip(
    "onnx", reason="the 'onnx' package is not installed (pip install -e \".[onnx]\")"
)

from helpers.ops import FORM_OPS  # noqa: E402
from jax_dflash.interop import onnx as dflash_onnx  # noqa: E402
from jax_dflash.interop.onnx_reference import reference_evaluator  # noqa: E402
from jax_dflash.testing import assert_bits_equal  # noqa: E402

P = dflash_onnx.TRT_TOKENS_PER_PAGE
H, D, N, R = 2, 8, 4, 4
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FORMS = ("slot", "paged", "slot_mapping")
# (name, pool dtype, scale pool?, per-head static scales?)
FORMATS = (
    ("int8_per_head_scales", np.dtype(np.int8), False, True),
    ("int8_per_tensor_scales", np.dtype(np.int8), False, False),
    ("int8_scale_pool", np.dtype(np.int8), True, False),
    ("float8_e4m3fn_scale_pool", E4M3, True, False),
    ("int4_scale_pool", np.dtype(np.uint8), True, False),
)


def _base(rng, form, delta=np.float16):
    """The form's base operands (pool left out: index 2 is None) and attributes: every token
    lands on its own pool row."""
    if form == "slot":
        b, length = 2, 3
        k = rng.standard_normal((b, length, H, D)).astype(delta)
        v = rng.standard_normal((b, length, H, D)).astype(delta)
        rope = rng.standard_normal((1, 2 * P, R)).astype(np.float32)
        starts = np.array([5, 200], np.int32)
        lengths = np.array([3, 2], np.int32)
        return [k, v, None, rope, starts, lengths], {"pages_per_slot": 2}
    t = 6
    k = rng.standard_normal((t, H, D)).astype(delta)
    v = rng.standard_normal((t, H, D)).astype(delta)
    rope = rng.standard_normal((t, R)).astype(np.float32)
    if form == "paged":
        positions = np.array([0, 1, 130, 7, 255, 64], np.int32)
        owners = np.array([0, 0, 1, 1, 0, 1], np.int32)
        table = np.array([[[0, 1], [N, N + 1]], [[2, 3], [N + 2, N + 3]]], np.int32)
        return [k, v, None, rope, positions, owners, table], {}
    slots = np.array([3, 130, 511, 0, 260, 77], np.int64)
    return [k, v, None, rope, slots], {}


def _pool(rng, dtype):
    last = D // 2 if dtype == np.uint8 else D
    shape = (2, N, P, H, last)
    if dtype == E4M3:
        bits = rng.integers(0, 256, shape, dtype=np.uint8)
        bits[(bits & 0x7F) == 0x7F] = 0  # finite bytes only
        return bits.view(E4M3)
    return rng.integers(0, 256, shape, dtype=np.uint8).view(dtype)


def _case(form, fmt, seed=0):
    """(node, operands in node order, op args, op kwargs) of one call."""
    _, dtype, dynamic, per_head = fmt
    rng = np.random.default_rng(seed)
    base, attributes = _base(rng, form)
    base[2] = _pool(rng, dtype)
    extras, kwargs = [], dict(attributes)
    if dynamic:
        scales = rng.uniform(0.01, 1.0, (2, N, P, H)).astype(np.float32)
        extras.append(scales)
        kwargs["scale_pool"] = scales
    else:
        heads = H if per_head else 1
        k_scale = rng.uniform(0.004, 0.05, heads).astype(np.float32)
        v_scale = rng.uniform(0.004, 0.05, heads).astype(np.float32)
        extras += [k_scale, v_scale]
        # TensorRT's per-tensor scale is [1]; the JAX op's is [].
        kwargs["k_scale"] = k_scale if per_head else k_scale.reshape(())
        kwargs["v_scale"] = v_scale if per_head else v_scale.reshape(())
    node = dflash_onnx.make_form_node(form, fp8_pool=not dynamic, scale_pool=dynamic, **attributes)
    return node, [*base, *extras], base, kwargs


def _run_node(node, operands):
    model = dflash_onnx.make_node_model(node, operands)
    return reference_evaluator(model).run(None, dict(zip(node.input, operands)))


@pytest.mark.parametrize("fmt", FORMATS, ids=[f[0] for f in FORMATS])
@pytest.mark.parametrize("form", FORMS)
def test_the_node_equals_the_jax_op_and_the_reference(form, fmt):
    node, operands, args, kwargs = _case(form, fmt)
    dynamic = fmt[2]
    assert list(node.output) == (
        ["present_key_value", "present_scale_pool"] if dynamic else ["present_key_value"]
    )
    outputs = _run_node(node, operands)
    op, ref = FORM_OPS[form]
    wide = form == "slot_mapping"  # int64 slots stay int64
    with jax.enable_x64(wide), jax.default_device(jax.devices("cpu")[0]):
        expected = op(*args, **kwargs)
    wanted = ref(*args, **kwargs)
    expected = expected if dynamic else (expected,)
    wanted = wanted if dynamic else (wanted,)
    assert len(outputs) == len(expected) == len(wanted) == (2 if dynamic else 1)
    for got, jax_result, ref_result in zip(outputs, expected, wanted):
        assert_bits_equal(got, np.asarray(jax_result))
        assert_bits_equal(got, ref_result)
    # Something was written: the pool, and with a scale pool its scales.
    assert not np.array_equal(outputs[0].view(np.uint8), operands[2].view(np.uint8))
    if dynamic:
        assert not np.array_equal(outputs[1], kwargs["scale_pool"])


def test_the_node_attribute_and_inputs():
    node, operands, _, _ = _case("paged", FORMATS[2])
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attributes["scale_pool"] == 1 and node.domain == dflash_onnx.PLUGIN_DOMAIN
    assert list(node.input)[-1] == "scale_pool" and len(node.input) == len(operands) == 8
    # A static-scale node: no attribute, k_scale and v_scale after the base inputs.
    static, _, _, _ = _case("paged", FORMATS[0])
    assert "scale_pool" not in {a.name for a in static.attribute}
    assert list(static.input)[-2:] == ["k_scale", "v_scale"]


def _refused(node, operands, error, match):
    with pytest.raises(error, match=match):
        _run_node(node, operands)


def test_a_scale_pool_with_a_16_bit_pool_is_refused_naming_it():
    node, operands, _, _ = _case("slot", FORMATS[2])
    operands[2] = np.zeros((2, N, P, H, D), np.float16)
    _refused(node, operands, TypeError, "scale_pool: a float16 pool takes no scale pool")


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda s: s[:, :, :, :1], r"scale_pool: expected \[2, 4, 128, 2\]"),
        (lambda s: s[:, :2], r"scale_pool: expected \[2, 4, 128, 2\]"),
        (lambda s: s[..., None], r"scale_pool: expected \[2, 4, 128, 2\]"),
    ],
    ids=["heads", "pages", "rank"],
)
def test_a_scale_pool_of_another_shape_is_refused_naming_it(change, match):
    node, operands, _, _ = _case("paged", FORMATS[3])
    operands[-1] = change(operands[-1])
    _refused(node, operands, ValueError, match)


def test_a_scale_pool_of_another_dtype_is_refused_naming_it():
    node, operands, _, _ = _case("slot_mapping", FORMATS[4])
    operands[-1] = operands[-1].astype(np.float16)
    _refused(node, operands, TypeError, "scale_pool: expected dtype float32, got float16")


def test_static_and_dynamic_scales_together_are_refused():
    with pytest.raises(ValueError, match="scale_pool: per-token-head scales .* replace the static"):
        dflash_onnx.make_form_node("paged", fp8_pool=True, scale_pool=True)
    # A hand-made node with both: k_scale, v_scale and scale_pool.
    node, operands, _, _ = _case("paged", FORMATS[2])
    scales = np.ones(1, np.float32)
    names = [*node.input[:7], "k_scale", "v_scale", "scale_pool"]
    both = onnx.helper.make_node(
        node.op_type,
        names,
        list(node.output),
        domain=node.domain,
        scale_pool=1,
    )
    _refused(both, [*operands[:7], scales, scales, operands[7]], TypeError, "scale_pool")


def test_int4_with_an_odd_head_dim_is_refused_naming_the_pool():
    node, operands, _, _ = _case("paged", FORMATS[4])
    rng = np.random.default_rng(1)
    for i in (0, 1):  # D = 9 against a pool of D/2 = 4 bytes
        operands[i] = rng.standard_normal((*operands[i].shape[:-1], D + 1)).astype(np.float16)
    _refused(node, operands, ValueError, "past_key_value: an int4 pool packs 2 elements per byte")


def test_int4_without_a_scale_pool_is_refused_naming_the_pool():
    _, operands, _, _ = _case("slot", FORMATS[4])
    node = dflash_onnx.make_update_node(pages_per_slot=2)
    _refused(node, operands[:6], ValueError, "per-token-head dynamic scales only")
    with pytest.raises(ValueError, match="scale_pool: an int4 pool .* per-token-head"):
        dflash_onnx.make_paged_update_model(
            num_kv_heads=H, head_dim=D, num_pages=N, rotary_dim=R, max_pages_per_sequence=2,
            pool_dtype="uint8",
        )  # fmt: skip


def test_a_scale_pool_node_with_one_output_is_refused():
    node, operands, _, _ = _case("paged", FORMATS[2])
    one = onnx.helper.make_node(
        node.op_type, list(node.input), ["present_key_value"], domain=node.domain, scale_pool=1
    )
    model = dflash_onnx.make_node_model(one, operands)
    with pytest.raises(ValueError, match="outputs: expected 2"):
        reference_evaluator(model).run(None, dict(zip(one.input, operands)))


def test_the_paged_model_with_an_int4_pool():
    model = dflash_onnx.make_paged_update_model(
        num_kv_heads=H,
        head_dim=D,
        num_pages=N,
        rotary_dim=R,
        max_pages_per_sequence=2,
        pool_dtype="uint8",
        scale_pool=True,
    )
    onnx.checker.check_model(model)

    def dims(info):
        return [d.dim_value or d.dim_param for d in info.type.tensor_type.shape.dim]

    inputs = {i.name: i for i in model.graph.input}
    assert dims(inputs["past_key_value"]) == [2, N, P, H, D // 2]
    assert dims(inputs["scale_pool"]) == [2, N, P, H]
    assert [o.name for o in model.graph.output] == ["present_key_value", "present_scale_pool"]
    assert dims(model.graph.output[1]) == [2, N, P, H]
