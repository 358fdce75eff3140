"""Per-layer rings in the layer-batched paged form: ``ring`` as one bool per layer, so that the
sliding-window and full layers of one draft are written by one launch. Layer ``l`` takes page
index ``(p // P) % M`` where ``ring[l]`` is true and ``p // P`` (dropped past ``M``) where it is
false, exactly as the single-layer call with that bool. Checked against the layers one by one,
the reference, the raw entries and the slot-mapping form, over hostile positions past the table."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dflash
from jax_dflash import _ext, _shapes, reference
from jax_dflash.ops import target_kv_cache_update_paged_p
from jax_dflash.testing import POOL_DTYPES, assert_bits_equal, gpu_devices, make_paged_problem

RINGS = (True, False, True, True, False)  # z-lab's drafts interleave window and full layers
PAGED = jax_dflash.target_kv_cache_update_paged


def _problem(seed, ring=RINGS, **kwargs):
    """A hostile layered problem: padding, foreign owners, negative positions and positions whole
    windows past the table, which a ring layer wraps and a full layer drops."""
    options = dict(tokens=16, batch=3, num_pages=8, page_size=4, table_pages=2, layers=len(ring))
    return make_paged_problem(np.random.default_rng(seed), **{**options, **kwargs}, ring=ring)


def _layer(problem, layer):
    """Layer ``layer``'s unbatched call: its operands and keywords, with its own bool ring."""
    args = list(problem.args())
    unbatched_ranks = (3, 3, 5, 2, 1, 1, 3)
    args = [x[layer] if x.ndim > rank else x for x, rank in zip(args, unbatched_ranks)]
    kwargs = problem.kwargs()
    for name, rank in (("k_scale", 1), ("v_scale", 1), ("k_norm_weight", 1)):
        if name in kwargs and np.ndim(kwargs[name]) > rank:
            kwargs[name] = kwargs[name][layer]
    kwargs["ring"] = problem.ring[layer]
    return args, kwargs


def _with_ring(problem, ring):
    return {**problem.kwargs(), "ring": ring}


def _assert_the_mix_matters(problem, got):
    """Neither every layer with ring nor every layer without gives this pool: the problem has
    tokens that only a ring layer writes, so a per-layer ring that any layer ignored would fail."""
    for uniform in (True, False):
        other = reference.target_kv_cache_update_paged(
            *problem.args(), **_with_ring(problem, uniform)
        )
        assert not np.array_equal(other.view(np.uint8), np.asarray(got).view(np.uint8)), uniform


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES, ids=str)
@pytest.mark.parametrize("per_layer_operands", [False, True], ids=["shared", "per_layer"])
def test_one_call_is_each_layer_alone_with_its_own_ring(pool_dtype, per_layer_operands):
    per_layer = dict(
        rope_per_layer=per_layer_operands,
        positions_per_layer=per_layer_operands,
        table_per_layer=per_layer_operands,
    )
    problem = _problem(1, pool_dtype=pool_dtype, k_norm=True, **per_layer)
    got = np.asarray(PAGED(*problem.args(), **problem.kwargs()))
    for layer in range(len(RINGS)):
        args, kwargs = _layer(problem, layer)
        assert_bits_equal(got[layer], np.asarray(PAGED(*args, **kwargs)))
    _assert_the_mix_matters(problem, got)


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES, ids=str)
def test_the_op_is_the_reference(pool_dtype):
    problem = _problem(2, pool_dtype=pool_dtype, v_norm=True, table_per_layer=True)
    got = jax.jit(lambda *a: PAGED(*a, **problem.kwargs()))(*problem.args())
    want = reference.target_kv_cache_update_paged(*problem.args(), **problem.kwargs())
    assert_bits_equal(np.asarray(got), want)
    for layer in range(len(RINGS)):  # the reference's layers are its unbatched calls too
        args, kwargs = _layer(problem, layer)
        assert_bits_equal(want[layer], reference.target_kv_cache_update_paged(*args, **kwargs))


def test_a_bool_and_its_per_layer_spelling_are_one_call():
    problem = _problem(3)
    for uniform in (True, False):
        as_bool = np.asarray(PAGED(*problem.args(), **_with_ring(problem, uniform)))
        spelled = _with_ring(problem, (uniform,) * len(RINGS))
        assert_bits_equal(np.asarray(PAGED(*problem.args(), **spelled)), as_bool)


def test_a_list_of_numpy_bools_is_a_tuple():
    problem = _problem(4)
    want = reference.target_kv_cache_update_paged(*problem.args(), **problem.kwargs())
    as_list = _with_ring(problem, [np.bool_(r) for r in RINGS])
    assert_bits_equal(np.asarray(PAGED(*problem.args(), **as_list)), want)
    assert_bits_equal(reference.target_kv_cache_update_paged(*problem.args(), **as_list), want)


def test_the_lowering_carries_one_int8_entry_per_layer():
    problem = _problem(5)
    text = jax.jit(lambda *a: PAGED(*a, ring=RINGS)).lower(*problem.args()).as_text()
    assert "ring = dense<[1, 0, 1, 1, 0]> : tensor<5xi8>" in text


def test_more_than_64_layers():
    """Past the 64 layers whose ring bits one GPU launch carries; the CPU takes them in one."""
    rings = tuple(bool(r) for r in np.random.default_rng(6).random(70) < 0.5)
    problem = _problem(6, ring=rings, tokens=8, heads=1, head_dim=8)
    got = np.asarray(PAGED(*problem.args(), **problem.kwargs()))
    want = reference.target_kv_cache_update_paged(*problem.args(), **problem.kwargs())
    assert_bits_equal(got, want)
    _assert_the_mix_matters(problem, got)


# ---- vmap ---------------------------------------------------------------------------------------


def test_vmap_over_layered_calls_repeats_the_rings():
    """vmap of a layered call folds both axes into one layer axis: each call's rings repeat."""
    problems = [_problem(seed, positions_per_layer=True) for seed in (7, 8)]
    stacked = [np.stack(xs) for xs in zip(*(p.args() for p in problems))]
    fn = jax.vmap(lambda *a: PAGED(*a, ring=RINGS))
    got = np.asarray(jax.jit(fn)(*stacked))
    for i, problem in enumerate(problems):
        want = reference.target_kv_cache_update_paged(*problem.args(), **problem.kwargs())
        assert_bits_equal(got[i], want)


def test_vmap_of_one_layers_call_keeps_its_bool_ring():
    problem = _problem(9, ring=(True,) * 3)
    in_axes = tuple(
        0 if x.ndim > r else None for x, r in zip(problem.args(), (3, 3, 5, 2, 1, 1, 3))
    )
    for ring in (True, False):
        fn = jax.vmap(lambda *a, ring=ring: PAGED(*a, ring=ring), in_axes=in_axes)
        want = reference.target_kv_cache_update_paged(*problem.args(), **_with_ring(problem, ring))
        assert_bits_equal(np.asarray(jax.jit(fn)(*problem.args())), want)


def test_vmap_of_a_hand_bound_per_layer_ring_on_one_layer_is_refused():
    problem = _problem(10, ring=(True, False))
    args = [x[0] if i < 3 else x for i, x in enumerate(problem.args())]  # one layer each
    params = dict(ring=(True, False), k_norm=False, v_norm=False, norm_eps=1e-6)
    fn = jax.vmap(lambda *a: target_kv_cache_update_paged_p.bind(*a, **params))
    stacked = [jnp.stack([x, x]) for x in args]
    with pytest.raises(ValueError, match="ring: per-layer entries are for the layer-batched form"):
        fn(*stacked)


# ---- the raw entries ----------------------------------------------------------------------------


def test_the_raw_cpu_entries_take_per_layer_rings():
    problem = _problem(11, pool_dtype="float8_e4m3fn")
    want = reference.target_kv_cache_update_paged(*problem.args(), **problem.kwargs())
    cpu = _ext.extension("cpu")
    args, kwargs = list(problem.args()), problem.kwargs()
    scales = (kwargs.pop("k_scale"), kwargs.pop("v_scale"))
    by_form = problem.past_key_value.copy()
    cpu.update("paged", [*args[:2], by_form, *args[3:]], *scales, **kwargs)
    assert_bits_equal(by_form, want)
    by_name = problem.past_key_value.copy()
    cpu.target_kv_cache_update_paged(*args[:2], by_name, *args[3:], *scales, **kwargs)
    assert_bits_equal(by_name, want)


# ---- the slot-mapping form writes the same draft -------------------------------------------------


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES, ids=str)
def test_one_layered_slot_mapping_call_writes_the_mixed_draft(pool_dtype):
    """The slot-mapping form has no ring: its per-layer slots ``[layers, T]``, each layer's from
    ``slots_from_pages`` with that layer's ring, write the paged per-layer-ring call's pool bit
    for bit, in one layered call (tables whose V page is the K page, as vLLM's)."""
    problem = _problem(12, pool_dtype=pool_dtype, table_per_layer=True)
    num_pages, page_size = problem.past_key_value.shape[2:4]
    table = np.array(problem.kv_page_table)
    table[:, :, 1] = table[:, :, 0] + num_pages  # V page = K page
    args = list(problem.args())
    args[6] = table
    kwargs = problem.kwargs()
    paged = np.asarray(PAGED(*args, **kwargs))
    slots = np.stack(
        [
            jax_dflash.slots_from_pages(
                args[4], args[5], table[layer], num_pages, page_size, ring=ring
            )
            for layer, ring in enumerate(kwargs.pop("ring"))
        ]
    )
    got = jax_dflash.target_kv_cache_update_slots(*args[:4], slots, **kwargs)
    assert_bits_equal(np.asarray(got), paged)
    assert_bits_equal(paged, reference.target_kv_cache_update_paged(*args, **problem.kwargs()))
    _assert_the_mix_matters(problem, PAGED(*problem.args(), **problem.kwargs()))


# ---- what is refused ----------------------------------------------------------------------------


def test_a_ring_per_layer_of_the_wrong_length_is_refused_naming_ring():
    problem = _problem(13)
    message = r"ring: expected one entry per layer, 5 \(past_key_value dim 0\), got entries for 4"
    short = _with_ring(problem, RINGS[:4])
    with pytest.raises(ValueError, match=message):
        PAGED(*problem.args(), **short)
    with pytest.raises(ValueError, match=message):
        reference.target_kv_cache_update_paged(*problem.args(), **short)
    with pytest.raises(ValueError, match=message):
        pool = problem.past_key_value.copy()
        args = problem.args()
        _ext.extension("cpu").update("paged", [*args[:2], pool, *args[3:]], ring=RINGS[:4])


def test_a_ring_per_layer_on_one_layer_is_refused_naming_ring():
    problem = make_paged_problem(np.random.default_rng(14))
    message = (
        r"ring: per-layer entries are for the layer-batched form .*expected a bool for "
        r"past_key_value of shape \[2, 8, 4, 2, 16\], got entries for 1 layer"
    )
    with pytest.raises(ValueError, match=message):
        PAGED(*problem.args(), ring=(True,))
    with pytest.raises(ValueError, match=message):
        reference.target_kv_cache_update_paged(*problem.args(), ring=(True,))


@pytest.mark.parametrize(
    "ring, message",
    [
        (
            (True, 1, False, True, False),
            "ring: expected a static bool per layer, got int 1 for layer 1",
        ),
        ((True, None), "ring: expected a static bool per layer, got NoneType None for layer 1"),
        (1, "ring: expected a static bool, or a tuple of static bools .*, got int 1"),
        ("yes", "ring: expected a static bool, or a tuple of static bools .*, got str 'yes'"),
        (
            np.array([True] * 5),
            "ring: expected a static bool, or a tuple of static bools .*ndarray",
        ),
    ],
)
def test_a_ring_that_is_not_bools_is_refused_naming_ring(ring, message):
    problem = _problem(15)
    with pytest.raises(TypeError, match=message):
        PAGED(*problem.args(), ring=ring)
    with pytest.raises(TypeError, match=message):
        reference.target_kv_cache_update_paged(*problem.args(), ring=ring)


def test_the_raw_entries_refuse_entries_that_are_not_bools():
    problem = _problem(16)
    args = problem.args()
    pool = problem.past_key_value.copy()
    cpu = _ext.extension("cpu")
    with pytest.raises(TypeError, match="ring: expected a bool per layer, got int 0 for layer 2"):
        cpu.update("paged", [*args[:2], pool, *args[3:]], ring=(True, False, 0, True, False))
    with pytest.raises(TypeError, match="ring: expected a bool, or a sequence of bools"):
        cpu.update("paged", [*args[:2], pool, *args[3:]], ring=1.0)
    with pytest.raises(ValueError, match="ring: the slot_mapping form takes none"):
        slots = np.zeros(problem.k_delta.shape[1], np.int32)
        cpu.update("slot_mapping", [*args[:2], pool, args[3], slots], ring=RINGS)
    assert_bits_equal(pool, problem.past_key_value)  # nothing refused wrote anything


def test_the_checker_reports_each_layers_ring():
    problem = _problem(17)
    shape = _shapes.check_update_paged(*problem.args(), ring=list(RINGS))
    assert shape.ring == RINGS
    assert _shapes.check_update_paged(*problem.args(), ring=True).ring is True


def test_the_tensorrt_profile_has_no_layers_so_no_per_layer_ring():
    problem = make_paged_problem(np.random.default_rng(18))
    with pytest.raises(ValueError, match="ring: per-layer entries are for the layer-batched form"):
        _shapes.check_update_paged(*problem.args(), ring=(True,))
    # The plugin's profile refuses the layered pool itself, whatever the ring.
    layered = _problem(18)
    with pytest.raises(ValueError, match="past_key_value: expected rank 5"):
        _shapes.check_update_paged(*layered.args(), ring=RINGS, tensorrt=True)


# ---- CUDA ---------------------------------------------------------------------------------------

GPU = pytest.mark.skipif(not gpu_devices(), reason="no GPU backend in this JAX: runs on the H200")


@GPU
@pytest.mark.parametrize("pool_dtype", POOL_DTYPES, ids=str)
@pytest.mark.parametrize("norms", [False, True])
def test_cuda_is_the_reference(pool_dtype, norms):
    extra = dict(k_norm=True, v_norm=True, head_dim=64) if norms else {}
    problem = _problem(20, pool_dtype=pool_dtype, positions_per_layer=True, **extra)
    gpu = jax.devices("gpu")[0]
    args = [jax.device_put(a, gpu) for a in problem.args()]
    kwargs = problem.kwargs()
    got = np.asarray(jax.jit(lambda *a: PAGED(*a, **kwargs))(*args))
    want = reference.target_kv_cache_update_paged(*problem.args(), **kwargs)
    assert_bits_equal(got, want)
    _assert_the_mix_matters(problem, got)


@GPU
def test_cuda_past_64_layers_splits_the_launch():
    rings = tuple(bool(r) for r in np.random.default_rng(21).random(150) < 0.5)
    problem = _problem(21, ring=rings, tokens=8, heads=1, head_dim=8, table_per_layer=True)
    gpu = jax.devices("gpu")[0]
    args = [jax.device_put(a, gpu) for a in problem.args()]
    got = np.asarray(jax.jit(lambda *a: PAGED(*a, ring=rings))(*args))
    assert_bits_equal(got, reference.target_kv_cache_update_paged(*problem.args(), ring=rings))


@GPU
def test_the_raw_cuda_entry_takes_per_layer_rings():
    if not _ext.cuda_extension_available():
        pytest.skip("jax_dflash._dflash_cuda was not built (no CUDA toolkit at build time)")
    torch = pytest.importorskip("torch", reason="the CUDA raw entry is fed torch tensors here")
    problem = _problem(22)
    operands = [torch.from_numpy(np.ascontiguousarray(a)).cuda() for a in problem.args()]
    stream = torch.cuda.current_stream().cuda_stream
    _ext.extension("cuda").launch_form("paged", operands, ring=RINGS, stream=stream)
    torch.cuda.synchronize()
    want = reference.target_kv_cache_update_paged(*problem.args(), ring=RINGS)
    assert_bits_equal(operands[2].cpu().numpy(), want)


def test_the_onnx_reference_runner_takes_a_ring_per_layer():
    """run_paged_update_kernel (the ONNX reference runtime's CPU kernel call) keeps each layer's
    ring: a tuple is not one bool."""
    from jax_dflash.interop.onnx_reference import run_paged_update_kernel

    problem = _problem(9, k_norm=True)
    got = run_paged_update_kernel(*problem.args(), **problem.kwargs())
    assert_bits_equal(
        got, reference.target_kv_cache_update_paged(*problem.args(), **problem.kwargs())
    )
    _assert_the_mix_matters(problem, got)
