"""``check``'s parity self-test: the op against the NumPy reference, bit for bit, on small
random shapes of every addressing form (hostile positions, padding, FP8 and int8 pools,
per-token-head scale pools, int4 pools, the fused norms).

Each case draws its operands from one generator, in the order listed in :func:`parity_cases`:
a seed gives the same cases every time."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

INT32_MAX, INT32_MIN = int(np.iinfo(np.int32).max), int(np.iinfo(np.int32).min)
# Keyword arguments of the ops that are static under jit (the rest are arrays).
STATIC_KEYWORDS = ("pages_per_slot", "ring", "norm_eps", "v_norm")


@dataclasses.dataclass(frozen=True)
class _Draws:
    """Random operands of one delta dtype."""

    rng: np.random.Generator
    dtype: np.dtype

    def normal(self, *shape):
        return self.rng.standard_normal(shape, dtype=np.float32).astype(self.dtype)

    def rope(self, *shape):
        return self.rng.uniform(-1, 1, shape).astype(np.float32)


def _i32(values):
    return np.asarray(values, np.int32)


def _slot_hostile_positions(draw: _Draws):
    """Unbatched; S < capacity (keys past S are written unrotated); R < D. Starts: negative,
    straddling the slot's end, near INT32_MAX and INT32_MIN, plain; lengths: past L, zero,
    negative."""
    b, length, h, d, page, pps = 6, 5, 2, 16, 4, 3  # capacity 12
    operands = (
        draw.normal(b, length, h, d),
        draw.normal(b, length, h, d),
        draw.normal(2, 7 * pps, page, h, d),
        draw.rope(1, 9, 8),
        _i32([-2, 9, INT32_MAX - 2, 3, INT32_MIN, 0]),
        _i32([5, 9, 4, 0, 5, -1]),
    )
    return ("slot: unbatched, hostile positions", "slot", operands, {"pages_per_slot": pps})


def _slot_layer_batched(draw: _Draws):
    """Layer-batched with per-layer positions and per-sequence RoPE."""
    layers, b, length, h, d, page, pps = 3, 2, 4, 3, 8, 2, 4  # capacity 8
    operands = (
        draw.normal(layers, b, length, h, d),
        draw.normal(layers, b, length, h, d),
        draw.normal(layers, 2, b * pps, page, h, d),
        draw.rope(b, page * pps, d),
        draw.rng.integers(-3, 11, (layers, b)).astype(np.int32),
        draw.rng.integers(-1, length + 3, (layers, b)).astype(np.int32),
    )
    name = "slot: layer-batched, per-layer positions, per-sequence RoPE"
    return (name, "slot", operands, {"pages_per_slot": pps})


def _slot_odd_shape(draw: _Draws):
    """Odd head dim, no rotation, one token per page; the second sequence runs off its slot."""
    b, length, h, d, page, pps = 2, 3, 1, 7, 1, 5
    operands = (
        draw.normal(b, length, h, d),
        draw.normal(b, length, h, d),
        draw.normal(2, b * pps, page, h, d),
        draw.rope(1, 5, 0),
        _i32([0, 3]),
        _i32([3, 3]),
    )
    return ("slot: odd head dim, no RoPE, page size 1", "slot", operands, {"pages_per_slot": pps})


def _slot_fp8(draw: _Draws):
    from jax_dflash import testing

    slot = testing.make_problem(
        draw.rng,
        batch=3,
        delta_len=4,
        heads=2,
        head_dim=16,
        page_size=4,
        pages_per_slot=3,
        dtype=draw.dtype,
        layers=2,
        pool_dtype="float8_e5m2",
        k_norm=True,
        scale_shape=(2, 2),
    )
    name = "slot: layer-batched, FP8 e5m2 pool, fused k-norm"
    return (name, "slot", slot.args(), slot.kwargs())


def _paged(draw: _Draws, name: str, **problem):
    """A paged case of 2 heads of 16 channels, pages of 4 tokens, tables of 3 pages."""
    from jax_dflash import testing

    paged = testing.make_paged_problem(
        draw.rng, heads=2, head_dim=16, page_size=4, table_pages=3, dtype=draw.dtype, **problem
    )
    return (name, "paged", paged.args(), paged.kwargs())


def _paged_ring(draw: _Draws):
    name = "paged: layer-batched, ring, hostile tokens and table"
    return _paged(draw, name, tokens=12, batch=3, rotary_dim=8, num_pages=10, layers=2, ring=True)


def _paged_fp8(draw: _Draws):
    name = "paged: FP8 e4m3 pool, fused k- and v-norm"
    return _paged(
        draw,
        name,
        tokens=10,
        batch=2,
        num_pages=6,
        pool_dtype="float8_e4m3fn",
        k_norm=True,
        v_norm=True,
    )


def _paged_int8(draw: _Draws):
    name = "paged: int8 pool, per-head scales, fused k-norm"
    return _paged(draw, name, tokens=10, batch=2, num_pages=6, pool_dtype="int8", k_norm=True)


def _with_scale_pool(draw: _Draws, case, pool_dtype: str):
    """``case`` (float32 pool) rewritten for a pool of ``pool_dtype`` (``"int4"``: uint8 bytes
    ``[.., D/2]``) of random bytes with a per-token-head scale pool of random bits."""
    from jax_dflash.testing import with_scale_pool

    name, contract, operands, keywords = case
    operands, keywords = with_scale_pool(draw.rng, operands, keywords, pool_dtype)
    return (name, contract, tuple(operands), keywords)


def _slot_int8_scale_pool(draw: _Draws):
    from jax_dflash import testing

    slot = testing.make_problem(
        draw.rng, batch=3, delta_len=4, heads=2, head_dim=16, page_size=4, pages_per_slot=3,
        dtype=draw.dtype, pool_dtype="float32", v_norm=True,
    )  # fmt: skip
    case = (
        "slot: int8 pool, per-token-head scales, fused v-norm",
        "slot",
        slot.args(),
        slot.kwargs(),
    )
    return _with_scale_pool(draw, case, "int8")


def _slot_mapping_e4m3_scale_pool(draw: _Draws):
    """Hostile flat slots (negative, past the pool) over a layer-batched pool."""
    from jax_dflash import testing

    paged = testing.make_paged_problem(
        draw.rng, tokens=10, batch=2, heads=2, head_dim=16, page_size=4, table_pages=3,
        num_pages=8, dtype=draw.dtype, pool_dtype="float32", layers=2, k_norm=True,
    )  # fmt: skip
    rows = 8 * 4
    slots = draw.rng.permutation(np.arange(-3, rows + 3))[:10].astype(np.int32)
    name = "slot mapping: layer-batched, FP8 e4m3 pool, per-token-head scales, hostile slots"
    case = (name, "slot_mapping", (*paged.args()[:4], slots), paged.extra_kwargs())
    return _with_scale_pool(draw, case, "float8_e4m3fn")


def _paged_int4(draw: _Draws):
    case = _paged(
        draw,
        "paged: int4 pool, per-token-head scales, fused k- and v-norm, ring",
        tokens=12, batch=3, num_pages=10, pool_dtype="float32", k_norm=True, v_norm=True,
        ring=True,
    )  # fmt: skip
    return _with_scale_pool(draw, case, "int4")


CASES = (
    _slot_hostile_positions,
    _slot_layer_batched,
    _slot_odd_shape,
    _slot_fp8,
    _paged_ring,
    _paged_fp8,
    _paged_int8,
    _slot_int8_scale_pool,
    _slot_mapping_e4m3_scale_pool,
    _paged_int4,
)


def parity_cases(rng: np.random.Generator, dtype: np.dtype) -> list[tuple[str, str, tuple, dict]]:
    """``(name, form, operands, keywords)``: small shapes with hostile positions, every form,
    the quantized pools and the fused norms."""
    draw = _Draws(rng, dtype)
    return [case(draw) for case in CASES]


# Each form's op (in jax_dflash) and NumPy reference (in jax_dflash.reference), by name.
_FORM_FUNCTIONS = {
    "slot": "target_kv_cache_update",
    "paged": "target_kv_cache_update_paged",
    "slot_mapping": "target_kv_cache_update_slots",
}


@functools.cache
def _jitted_op(contract: str, static: tuple[str, ...]):
    import jax

    import jax_dflash

    return jax.jit(getattr(jax_dflash, _FORM_FUNCTIONS[contract]), static_argnames=static)


def run_parity(backend: str, dtype: np.dtype, seed: int) -> tuple[int, list[str]]:
    """Runs every parity case on ``backend``: (cases passed, one line per failure)."""
    import jax

    from jax_dflash import reference
    from jax_dflash.testing import compare_bits

    device = jax.devices(backend)[0]
    passed, failures = 0, []
    for name, contract, operands, keywords in parity_cases(np.random.default_rng(seed), dtype):
        expected = getattr(reference, _FORM_FUNCTIONS[contract])(*operands, **keywords)
        try:
            args = [jax.device_put(x, device) for x in operands]
            kw = {
                k: (v if k in STATIC_KEYWORDS else jax.device_put(v, device))
                for k, v in keywords.items()
            }
            static = tuple(sorted(k for k in keywords if k in STATIC_KEYWORDS))
            actual = _jitted_op(contract, static)(*args, **kw)
        except Exception as e:  # noqa: BLE001 - reported as a failed case
            failures.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        # With a scale pool the op returns (pool, scale_pool): both are compared.
        pairs = zip(actual, expected) if isinstance(expected, tuple) else [(actual, expected)]
        differ = []
        for what, (got, want) in zip(("pool", "scale_pool"), pairs):
            mismatches, max_ulp = compare_bits(np.asarray(got), want)
            if mismatches:
                differ.append(
                    f"{what}: {mismatches} of {want.size} elements differ (max {max_ulp} ulp)"
                )
        if differ:
            failures.append(f"{name}: {'; '.join(differ)}")
        else:
            passed += 1
    return passed, failures
