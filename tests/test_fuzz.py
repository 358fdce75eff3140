"""A bounded, seeded fuzz target for every addressing form (runs in CI).

Each seed draws a random problem: shapes, delta/pool dtype pair, FP8 scales (hostile ones
included: 0, negative, inf, NaN), fused norms, ring, layer-batched forms, hostile positions,
lengths, owners, page ids and flat slots (int32 extremes, negative, the other plane, past N;
flat slots distinct within a layer), and poisons the
pool, the deltas, the rope rows and the weights with NaNs carrying payloads, infinities and
subnormals. The update runs through the JAX op and through the raw CPU entry; both must equal
the NumPy reference over the whole pool, bit for bit.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from helpers.ops import FORM_OPS
from jax_dflash import _dflash_cpu
from jax_dflash.testing import (
    DELTA_DTYPES,
    FP8_DTYPES,
    POOL_DTYPES,
    PagedProblem,
    assert_bits_equal,
    make_paged_problem,
    make_problem,
)

SEEDS = range(256)  # per form; all three: about 30 s on 2 idle cores
I32_MIN, I32_MAX = np.iinfo(np.int32).min, np.iinfo(np.int32).max

# Bit patterns that arithmetic and copies must get right: NaNs with payloads and either sign,
# infinities, subnormals, the largest finite value, -0.
SPECIAL_BITS = {
    "float16": [0x7C01, 0x7D55, 0xFE01, 0x7FFF, 0x7C00, 0xFC00, 0x0001, 0x83FF, 0x7BFF, 0x8000],
    "bfloat16": [0x7F81, 0xFFC1, 0x7FFF, 0x7F80, 0xFF80, 0x0001, 0x807F, 0x7F7F, 0x8000],
    "float32": [
        0x7F800001,
        0xFFC00001,
        0x7FFFFFFF,
        0x7F800000,
        0xFF800000,
        0x00000001,
        0x807FFFFF,
        0x7F7FFFFF,
        0x80000000,
    ],
    "float8_e4m3fn": [0x7F, 0xFF, 0x7E, 0x01, 0x81],
    "float8_e5m2": [0x7D, 0x7E, 0xFF, 0x7C, 0xFC, 0x01, 0x83],
    "int8": [0x80, 0x7F, 0x81, 0x00, 0xFF],  # -128 (never stored), 127, -127, 0, -1
}


def _poison(rng, x, fraction):
    """``x`` (a copy) with ``fraction`` of its elements replaced by special bit patterns."""
    if x is None or x.size == 0:
        return x
    x = np.array(x)
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
    flat = x.reshape(-1).view(width)
    hit = rng.random(flat.size) < fraction
    flat[hit] = rng.choice(np.array(SPECIAL_BITS[str(x.dtype)], dtype=np.uint64), int(hit.sum()))
    return x


def _hostile_scale(rng, scale):
    """Occasionally a scale the arithmetic must take as written: 0, negative, inf, NaN, tiny."""
    if scale is None or rng.random() < 0.6:
        return scale
    scale = np.array(scale)
    flat = scale.reshape(-1)
    flat[rng.integers(flat.size)] = rng.choice([0.0, -1.5, np.inf, -np.inf, np.nan, 1e-40, 3e38])
    return scale


def _dtypes(rng):
    delta = DELTA_DTYPES[rng.integers(len(DELTA_DTYPES))]
    pool = POOL_DTYPES[rng.integers(len(POOL_DTYPES))]
    return delta, pool


def _extras_options(rng, pool_dtype, heads, layers):
    options = dict(
        k_norm=bool(rng.random() < 0.4),
        v_norm=bool(rng.random() < 0.3),
        norm_eps=float(rng.choice([1e-6, 1e-5, 1e-12, 0.5])),
    )
    if pool_dtype in FP8_DTYPES:
        shapes = [(), (heads,)] + ([(layers, 1), (layers, heads)] if layers else [])
        options["scale_shape"] = shapes[rng.integers(len(shapes))]
    if layers and options["k_norm"]:
        options["norm_weight_per_layer"] = bool(rng.random() < 0.5)
    return options


def _count(rng, high):
    """A size in ``[1, high]``, and now and then 0 (empty operands are valid too)."""
    if high <= 0 or rng.random() < 0.08:
        return 0
    return int(rng.integers(1, high + 1))


def _shape_options(rng):
    heads = int(rng.integers(1, 4))
    head_dim = int(rng.choice([1, 2, 3, 8, 15, 16, 33, 64]))
    rotary_dim = 2 * _count(rng, head_dim // 2)
    layers = None if rng.random() < 0.6 else int(rng.integers(1, 4))
    return heads, head_dim, rotary_dim, layers


def slot_problem(seed):
    rng = np.random.default_rng([7, seed])
    heads, head_dim, rotary_dim, layers = _shape_options(rng)
    delta_dtype, pool_dtype = _dtypes(rng)
    batch = int(rng.integers(1, 4))
    page_size, pages_per_slot = int(rng.integers(1, 6)), int(rng.integers(1, 4))
    capacity = page_size * pages_per_slot
    per_layer = layers is not None
    problem = make_problem(
        rng,
        batch=batch,
        delta_len=_count(rng, 5),
        heads=heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        page_size=page_size,
        pages_per_slot=pages_per_slot,
        max_batch=batch + int(rng.integers(0, 2)),
        rope_batch=int(rng.choice([1, batch])),
        rope_seq_len=_count(rng, capacity),
        dtype=delta_dtype,
        pool_dtype=pool_dtype,
        layers=layers,
        hostile=True,
        rope_per_layer=per_layer and bool(rng.random() < 0.5),
        positions_per_layer=per_layer and bool(rng.random() < 0.5),
        **_extras_options(rng, pool_dtype, heads, layers),
    )
    # int32 extremes: a start whose 32-bit sum with t would wrap back into the slot, lengths of
    # either sign's limit.
    starts, lengths = problem.delta_start_positions, problem.delta_lengths
    for array, values in (
        (starts, [I32_MIN, I32_MAX, I32_MAX - 1, I32_MIN + 1, -1, capacity]),
        (lengths, [I32_MIN, I32_MAX, 0, -1]),
    ):
        hit = rng.random(array.shape) < 0.25
        array[hit] = rng.choice(values, int(hit.sum()))
    return _poisoned(rng, problem)


def paged_problem(seed):
    rng = np.random.default_rng([8, seed])
    heads, head_dim, rotary_dim, layers = _shape_options(rng)
    delta_dtype, pool_dtype = _dtypes(rng)
    batch, table_pages, page_size = (
        int(rng.integers(1, 4)),
        int(rng.integers(1, 4)),
        int(rng.integers(1, 6)),
    )
    num_pages = batch * table_pages + int(rng.integers(0, 4))
    tokens = _count(rng, batch * table_pages * page_size)
    per_layer = layers is not None
    ring = bool(rng.random() < 0.4)
    # Some layered problems mix ring and full layers (their own generator: the other draws of a
    # seed stay as they were).
    mix = np.random.default_rng([10, seed])
    if per_layer and mix.random() < 0.4:
        ring = tuple(bool(r) for r in mix.random(layers) < 0.5)
    problem = make_paged_problem(
        rng,
        tokens=tokens,
        batch=batch,
        heads=heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        num_pages=num_pages,
        page_size=page_size,
        table_pages=table_pages,
        dtype=delta_dtype,
        pool_dtype=pool_dtype,
        layers=layers,
        hostile=True,
        ring=ring,
        rope_per_layer=per_layer and bool(rng.random() < 0.5),
        positions_per_layer=per_layer and bool(rng.random() < 0.5),
        table_per_layer=per_layer and bool(rng.random() < 0.5),
        **_extras_options(rng, pool_dtype, heads, layers),
    )
    # More hostility that only ever drops tokens (rows of valid tokens stay distinct): owners
    # at the int32 limits, negative positions, page ids of the other plane or past either end.
    owners, positions, table = (
        problem.delta_token_to_sequence,
        problem.delta_positions,
        problem.kv_page_table,
    )
    hit = rng.random(owners.shape) < 0.1
    owners[hit] = rng.choice([I32_MIN, I32_MAX, batch, -1], int(hit.sum()))
    hit = rng.random(positions.shape) < 0.1
    positions[hit] = rng.choice([I32_MIN, -1, -page_size], int(hit.sum()))
    n = num_pages
    for plane, bad in (
        (0, [n, 2 * n - 1, I32_MAX, I32_MIN, -1]),
        (1, [0, n - 1, 2 * n, I32_MAX, I32_MIN]),
    ):
        ids = table[..., plane, :]
        hit = rng.random(ids.shape) < 0.1
        ids[hit] = rng.choice(bad, int(hit.sum()))
    return _poisoned(rng, problem)


@dataclasses.dataclass
class SlotsProblem:
    """A slot-mapping update: a paged problem's deltas, pool, rope and extras, addressed by flat
    slots instead of positions, owners and a table."""

    paged: PagedProblem
    slot_mapping: np.ndarray

    def __getattr__(self, name):  # the operands and extras the forms share
        if name in ("paged", "ring") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.paged, name)

    def args(self):
        return (*self.paged.args()[:4], self.slot_mapping)

    def kwargs(self) -> dict:
        return self.paged.extra_kwargs()


def slot_mapping_problem(seed):
    rng = np.random.default_rng([9, seed])
    paged = paged_problem(seed)
    pool = paged.past_key_value
    rows = pool.shape[-4] * pool.shape[-3]
    tokens = paged.k_delta.shape[-3]
    per_layer = pool.ndim == 6 and bool(rng.random() < 0.5)
    shape = (pool.shape[0], tokens) if per_layer else (tokens,)

    # Valid slots drawn without repeats within a layer (of tokens with one slot the CPU stores the
    # last and the GPU any one, per element: test_slot_mapping checks both), -1 where the pool
    # has fewer rows than tokens; then hostile ones: negative, past the N * P rows, int32's limits.
    def distinct():
        valid = rng.permutation(rows)[:tokens]
        return rng.permutation(np.concatenate([valid, np.full(tokens - len(valid), -1)]))

    slots = np.stack([distinct() for _ in range(shape[0])]) if per_layer else distinct()
    slots = slots.astype(np.int32)
    hit = rng.random(shape) < 0.2
    bad = [I32_MIN, I32_MAX, -1, rows, rows + 1, -rows]
    slots[hit] = rng.choice(bad, int(hit.sum()))
    return SlotsProblem(paged, slots)


def _poisoned(rng, problem):
    problem.past_key_value = _poison(rng, problem.past_key_value, 0.1)
    problem.k_delta = _poison(rng, problem.k_delta, 0.05)
    problem.v_delta = _poison(rng, problem.v_delta, 0.05)
    problem.rope_cos_sin = _poison(rng, problem.rope_cos_sin, 0.02)
    problem.k_norm_weight = _poison(rng, problem.k_norm_weight, 0.05)
    problem.k_scale = _hostile_scale(rng, problem.k_scale)
    problem.v_scale = _hostile_scale(rng, problem.v_scale)
    return problem


# ---- the two paths -------------------------------------------------------------------------------


def _bits(x):
    if x is None or x.dtype in (np.float16, np.float32) or x.dtype.kind in "iu":
        return x, ""
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint8), str(x.dtype)


def run_raw(contract, problem):
    """The raw CPU entry on a copy of the pool; returns that copy."""
    pool = problem.past_key_value.copy()
    k, delta_dtype = _bits(problem.k_delta)
    v, _ = _bits(problem.v_delta)
    weight, _ = _bits(problem.k_norm_weight)
    pool_view, pool_dtype = _bits(pool)
    scales = [
        None if s is None else np.asarray(s, np.float32) for s in (problem.k_scale, problem.v_scale)
    ]
    kwargs = dict(
        v_norm=problem.v_norm,
        norm_eps=problem.norm_eps,
        delta_dtype=delta_dtype,
        pool_dtype=pool_dtype,
    )
    operands = [k, v, pool_view, *problem.args()[3:]]
    addressing = {
        "slot": {"pages_per_slot": getattr(problem, "pages_per_slot", None)},
        "paged": {"ring": getattr(problem, "ring", None)},
        "slot_mapping": {},
    }[contract]
    _dflash_cpu.update(contract, operands, *scales, weight, **addressing, **kwargs)
    return pool


OPS = FORM_OPS


def run_op(contract, problem):
    return np.asarray(OPS[contract][0](*problem.args(), **problem.kwargs()))


def expected(contract, problem):
    return OPS[contract][1](*problem.args(), **problem.kwargs())


BUILDERS = {"slot": slot_problem, "paged": paged_problem, "slot_mapping": slot_mapping_problem}


def _describe(problem):
    parts = [
        f"{name}={getattr(problem, name).shape}/{getattr(problem, name).dtype}"
        for name in ("k_delta", "past_key_value", "rope_cos_sin")
    ]
    extras = {k: v for k, v in problem.kwargs().items() if not hasattr(v, "shape")}
    return ", ".join(parts) + f", {extras}"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("contract", list(BUILDERS))
def test_fuzz_op_and_raw_entry_equal_the_reference(contract, seed):
    problem = BUILDERS[contract](seed)
    want = expected(contract, problem)
    failures = []
    for path, run in (("JAX op", run_op), ("raw entry", run_raw)):
        try:
            assert_bits_equal(run(contract, problem), want)
        except (AssertionError, ValueError, TypeError) as e:  # both paths are reported
            failures.append(f"{path}: {type(e).__name__}: {e}")
    assert not failures, f"{contract} seed {seed}: {_describe(problem)}\n" + "\n".join(failures)


def test_fuzz_covers_the_space():
    """The seeds above reach every dtype pair family, FP8 scales, both norms, ring, the layered
    forms, NaN-poisoned pools and writes that land (so a bounded run is still a broad one)."""
    seen = set()
    for contract, build in BUILDERS.items():
        for seed in SEEDS:
            p = build(seed)
            seen.add((contract, "pool", str(p.past_key_value.dtype)))
            seen.add(("delta", str(p.k_delta.dtype)))
            seen |= {("k_norm",)} if p.k_norm_weight is not None else set()
            seen |= {("v_norm",)} if p.v_norm else set()
            seen |= {(contract, "layered")} if p.past_key_value.ndim == 6 else set()
            seen |= {("ring",)} if getattr(p, "ring", False) else set()
            pool_bits = p.past_key_value.view(np.uint8)
            if np.isnan(p.past_key_value.astype(np.float32)).any():
                seen.add((contract, "nan pool"))
            if not np.array_equal(expected(contract, p).view(np.uint8), pool_bits):
                seen.add((contract, "writes"))
    wanted = {(c, "pool", str(d)) for c in BUILDERS for d in POOL_DTYPES}
    wanted |= {("delta", str(d)) for d in DELTA_DTYPES}
    wanted |= {("k_norm",), ("v_norm",), ("ring",)}
    wanted |= {(c, x) for c in BUILDERS for x in ("layered", "nan pool", "writes")}
    assert wanted <= seen, f"not covered: {sorted(wanted - seen)}"
