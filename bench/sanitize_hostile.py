#!/usr/bin/env python3
"""Hostile runtime data through the GPU kernel, for ``compute-sanitizer --tool memcheck``.

Every addressing form, through JAX (jit, with and without a donated pool; the unbatched and the
layer-batched forms) and through the raw launchers (``launch`` / ``launch_paged`` over torch or
cupy device arrays):

- slot contract: start positions negative, past the slot or near int32's limits; lengths past
  L, zero or negative;
- paged contract: page-table ids that are negative, of the other plane or past N, and a table
  wider than the pages the tokens use (M > pages used); owners -1 and >= B; negative
  positions and positions past the table (also under ring addressing);
- slot-mapping form: flat slots negative, past the pool's N * P rows, at int32's limits, and
  repeated by tokens that carry the same rows (so that whichever the GPU stores, the bits are
  the reference's);
- each with 16/32-bit pools and FP8 pools (per-head scales, some saturating), and with the
  fused k-norm and v-norm.

Every result must equal the NumPy reference (``jax_dflash.reference``) bit for bit: nothing is
written outside the addressed rows. Under memcheck, JAX and torch are told to give every buffer
its own allocation (no pooling), so an out-of-bounds access by the kernel is an access outside
an allocation and memcheck reports it.

  compute-sanitizer --tool memcheck --error-exitcode 9 python3 bench/sanitize_hostile.py

Exit status: 0 all cases matched, 1 a mismatch or an error, 77 skipped (no GPU here; the reason
is printed). ``--platform cpu`` runs the same cases through XLA:CPU and the CPU extension's NumPy
entries instead (a local check of this script and of the CPU kernel).
"""

from __future__ import annotations

import os

# Before jax / torch initialise CUDA: one allocation per buffer, nothing preallocated.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

import dataclasses
import functools
import sys

import ml_dtypes
import numpy as np

INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)
F16, BF16, F32 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)
E4M3, E5M2 = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)
INT8, UINT8 = np.dtype(np.int8), np.dtype(np.uint8)

# Slot contract: P=16, 2 pages per slot (capacity 32), 13 slots of which B=11 are in use, so
# writes into the unused slots 11, 12 would show as mismatches. Rope covers S=24 < capacity
# (positions 24..31 pass through unrotated) on the first R=32 of D=64 channels.
BATCH, DELTA_LEN, HEADS, HEAD_DIM, PAGE, PAGES_PER_SLOT, SLOTS = 11, 16, 2, 64, 16, 2, 13
ROPE_LEN, ROTARY_DIM = 24, 32
CAPACITY = PAGE * PAGES_PER_SLOT

# Per slot: negative start (partly written), length past L, partly past the slot, at and past
# the slot, int32 extremes (no wrap-around into the slot), negative and zero lengths.
HOSTILE_STARTS = np.array(
    [-5, 3, 29, CAPACITY, CAPACITY + 100, INT32_MAX, INT32_MIN, -1000, 20, 7, 0], np.int32
)
HOSTILE_LENGTHS = np.array(
    [
        DELTA_LEN,
        DELTA_LEN + 50,
        DELTA_LEN,
        DELTA_LEN,
        DELTA_LEN,
        INT32_MAX,
        DELTA_LEN,
        INT32_MIN,
        INT32_MAX,
        -3,
        0,
    ],
    np.int32,
)

# Paged contract: N=12 pages of P=16, B=4 sequences with M=5 table entries (20 > 12 pages:
# ids repeat across sequences only on rows no valid token addresses, see paged_table_case).
PAGED_PAGES, PAGED_BATCH, PAGED_TABLE = 12, 4, 5
# The hostile builder's problems (paged and slot-mapping forms): 40 tokens over N=24 pages of
# P=16 (384 rows).
BUILDER_TOKENS, BUILDER_PAGES = 40, 24


@dataclasses.dataclass
class Case:
    label: str
    contract: str  # the addressing form: "slot", "paged" or "slot_mapping"
    args: tuple  # NumPy operands, in the op's order
    kwargs: dict  # pages_per_slot or ring, and the extras


def slot_cases(rng) -> list[Case]:
    from jax_dflash import testing

    cases = []
    forms = ((None, 1), (None, BATCH), (3, BATCH))
    for dtype in (F16, BF16, F32):
        for layers, rope_batch in forms:
            lead = (layers,) if layers else ()
            delta = (*lead, BATCH, DELTA_LEN, HEADS, HEAD_DIM)
            pool = (*lead, 2, SLOTS * PAGES_PER_SLOT, PAGE, HEADS, HEAD_DIM)
            normal = lambda shape: rng.standard_normal(shape, dtype=np.float32).astype(dtype)  # noqa: E731
            rope = rng.uniform(-1, 1, (*lead, rope_batch, ROPE_LEN, ROTARY_DIM)).astype(np.float32)
            if layers:  # a different hostile mix per layer
                starts = np.stack([np.roll(HOSTILE_STARTS, i) for i in range(layers)])
                lengths = np.stack([np.roll(HOSTILE_LENGTHS, 2 * i) for i in range(layers)])
            else:
                starts, lengths = HOSTILE_STARTS.copy(), HOSTILE_LENGTHS.copy()
            form = f"{layers} layers" if layers else "one layer"
            cases.append(
                Case(
                    f"slot {dtype.name}, {form}, rope batch {rope_batch}",
                    "slot",
                    (normal(delta), normal(delta), normal(pool), rope, starts, lengths),
                    {"pages_per_slot": PAGES_PER_SLOT},
                )
            )
    # FP8 pools (hostile scales: saturation, subnormals) and the fused norms, through the
    # builder's own hostile positions and lengths.
    for pool_dtype, k_norm, v_norm, layers in (
        (E4M3, False, False, None),
        (E5M2, True, True, None),
        (F16, True, False, None),
        (BF16, True, True, 3),
        (E4M3, True, True, 3),
        (INT8, True, False, None),
    ):
        p = testing.make_problem(
            rng,
            batch=5,
            delta_len=9,
            heads=HEADS,
            head_dim=HEAD_DIM,
            rotary_dim=ROTARY_DIM,
            page_size=PAGE,
            pages_per_slot=2,
            max_batch=7,
            rope_seq_len=ROPE_LEN,
            dtype=BF16 if pool_dtype == E5M2 else F16,
            pool_dtype=pool_dtype,
            layers=layers,
            hostile=True,
            k_norm=k_norm,
            v_norm=v_norm,
            positions_per_layer=bool(layers),
        )
        label = _label(p.k_delta.dtype, pool_dtype, k_norm, v_norm, layers)
        cases.append(Case(f"slot {label}", "slot", p.args(), p.kwargs()))
    return cases


def paged_table_case(rng, dtype) -> Case:
    """Every hostile table entry and token kind at once, written out (not drawn)."""
    n, b, m = PAGED_PAGES, PAGED_BATCH, PAGED_TABLE
    # Sequence 0: valid pages 0..4 (K) / N+0..N+4 (V); sequence 1: K ids negative, of the V
    # plane, past N, and V ids of the K plane, past 2N, negative; sequence 2: valid but the
    # tokens use only 2 of its 5 pages (M > pages used); sequence 3: valid, ring-addressed.
    table = np.array(
        [
            [[0, 1, 2, 3, 4], [n + 0, n + 1, n + 2, n + 3, n + 4]],
            [[-1, n, 2 * n - 1, INT32_MIN, 5], [n + 5, 0, 2 * n, INT32_MAX, -1]],
            [[5, 6, 7, 8, 9], [n + 5, n + 6, n + 7, n + 8, n + 9]],
            [[10, 11, 10, 11, 10], [n + 10, n + 11, n + 10, n + 11, n + 10]],
        ],
        np.int32,
    )
    tokens = []  # (owner, position)
    tokens += [(0, p) for p in (0, 17, 33, 79)]  # valid, pages 0, 1, 2, 4
    tokens += [(0, m * PAGE), (0, m * PAGE + 3), (0, INT32_MAX)]  # past the table
    tokens += [(1, p) for p in (0, 16, 32, 48, 64)]  # every entry of sequence 1 is bad
    tokens += [(1, 65)]  # K page 5 valid but V id -1: neither plane is written
    tokens += [(2, 1), (2, 20)]  # two of its five pages
    tokens += [(3, 3), (3, 2 * PAGE + 4)]  # valid (entries 0 and 2: pages 10 and 10, rows 3, 4)
    tokens += [(-1, 0), (b, 0), (b + 7, 5), (INT32_MIN, 0), (INT32_MAX, 0)]  # owners
    tokens += [(0, -1), (2, -PAGE), (3, INT32_MIN)]  # negative positions
    order = rng.permutation(len(tokens))
    owners = np.array([tokens[i][0] for i in order], np.int32)
    positions = np.array([tokens[i][1] for i in order], np.int32)
    t = len(tokens)
    k = rng.standard_normal((t, HEADS, HEAD_DIM), dtype=np.float32).astype(dtype)
    v = rng.standard_normal((t, HEADS, HEAD_DIM), dtype=np.float32).astype(dtype)
    pool = rng.standard_normal((2, n, PAGE, HEADS, HEAD_DIM), dtype=np.float32).astype(dtype)
    rope = rng.uniform(-1, 1, (t, ROTARY_DIM)).astype(np.float32)
    return Case(
        f"paged {dtype.name}, written-out hostile table and tokens",
        "paged",
        (k, v, pool, rope, positions, owners, table),
        {"ring": False},
    )


def _built_problem(rng, dtype, pool_dtype, k_norm, v_norm, layers, *, ring=False, hostile=False):
    """The hostile builder's paged problem (jax_dflash.testing.make_paged_problem)."""
    from jax_dflash import testing

    return testing.make_paged_problem(
        rng,
        tokens=BUILDER_TOKENS,
        batch=PAGED_BATCH,
        heads=HEADS,
        head_dim=HEAD_DIM,
        rotary_dim=ROTARY_DIM,
        num_pages=BUILDER_PAGES,
        page_size=PAGE,
        table_pages=PAGED_TABLE,
        dtype=dtype,
        pool_dtype=pool_dtype,
        layers=layers,
        hostile=hostile,
        k_norm=k_norm,
        v_norm=v_norm,
        ring=ring,
        positions_per_layer=hostile and bool(layers),
        table_per_layer=hostile and bool(layers),
    )


def _label(dtype, pool_dtype, k_norm, v_norm, layers) -> str:
    norms = "+".join(n for n, on in (("k-norm", k_norm), ("v-norm", v_norm)) if on) or "no norm"
    form = f"{layers} layers" if layers else "one layer"
    return f"{dtype.name} -> {(pool_dtype or dtype).name} pool, {norms}, {form}"


def paged_cases(rng) -> list[Case]:
    cases = [paged_table_case(rng, dtype) for dtype in (F16, BF16, F32)]
    configs = [
        # (delta dtype, pool dtype, k_norm, v_norm, layers, ring)
        (F16, None, False, False, None, False),
        (BF16, None, False, False, None, True),
        (F32, None, True, True, None, False),
        (F16, E4M3, False, False, None, False),
        (BF16, E5M2, True, True, None, True),
        (F16, None, True, False, 3, False),
        (F16, E4M3, True, True, 3, True),
        (BF16, INT8, False, True, None, True),
    ]
    for dtype, pool_dtype, k_norm, v_norm, layers, ring in configs:
        p = _built_problem(rng, dtype, pool_dtype, k_norm, v_norm, layers, ring=ring, hostile=True)
        label = _label(dtype, pool_dtype, k_norm, v_norm, layers)
        cases.append(
            Case(f"paged {label}{', ring' if ring else ''}", "paged", p.args(), p.kwargs())
        )
    return cases


def slot_mapping_cases(rng) -> list[Case]:
    cases = []
    for dtype, pool_dtype, k_norm, v_norm, layers in (
        (F16, None, False, False, None),
        (BF16, None, True, True, None),
        (F32, None, False, False, 3),
        (F16, E4M3, True, False, None),
        (BF16, INT8, False, True, 3),
    ):
        p = _built_problem(rng, dtype, pool_dtype, k_norm, v_norm, layers)
        rows = BUILDER_PAGES * PAGE
        # Distinct valid slots, then the hostile ones over the first tokens; tokens 0 and 1 share
        # slot 7 and carry the same rows (deltas of every layer, rope), so that the result does
        # not depend on which of them the GPU stores.
        hostile = [7, 7, -1, -PAGE, rows, rows + 1, INT32_MAX, INT32_MIN, 0, rows - 1]
        valid = rng.permutation(np.setdiff1d(np.arange(rows), hostile))
        slots = np.concatenate([hostile, valid, np.full(BUILDER_TOKENS, -1)])[:BUILDER_TOKENS]
        slots = slots.astype(np.int32)
        for name in ("k_delta", "v_delta", "rope_cos_sin"):
            a = getattr(p, name)
            token_axis = a.ndim - (2 if name == "rope_cos_sin" else 3)
            index = [slice(None)] * a.ndim
            index[token_axis] = 0
            src = a[tuple(index)].copy()
            index[token_axis] = 1
            a[tuple(index)] = src
        if layers:  # a different hostile mix per layer (the shared slot 7 in every one)
            slots = np.stack(
                [np.concatenate([slots[:2], np.roll(slots[2:], 3 * i)]) for i in range(layers)]
            )
        label = _label(dtype, pool_dtype, k_norm, v_norm, layers)
        cases.append(
            Case(f"slot_mapping {label}", "slot_mapping", (*p.args()[:4], slots), p.extra_kwargs())
        )
    return cases


def scale_pool_cases(rng) -> list[Case]:
    """Per-token-head dynamic scales (int8, FP8 and int4 pools) on the hostile cases of every
    form: the scale pool of random bits (NaN payloads included) must keep the unwritten rows'
    scales; every fourth case's deltas carry zero and non-finite rows."""
    from jax_dflash import testing

    cases = []
    sources = slot_cases(rng)[-3:] + paged_cases(rng)[-3:] + slot_mapping_cases(rng)[-3:]
    formats = (INT8, E4M3, UINT8, E5M2)
    for i, case in enumerate(sources):
        pool_dtype = formats[i % len(formats)]
        name = "int4" if pool_dtype == UINT8 else pool_dtype.name
        args = [np.array(a) for a in case.args]
        args, kwargs = testing.with_scale_pool(rng, args, case.kwargs, name)
        if i % 4 == 0:  # tokens past the slot-mapping cases' shared pair (tokens 0 and 1)
            for delta in (args[0], args[1]):
                tokens = delta.shape[-3]
                delta[..., 9 % tokens, 0, :] = 0
                delta[..., 10 % tokens, 1, 3] = np.nan
                delta[..., 11 % tokens, 0, 1] = np.inf
        label = f"{case.label.split(' -> ')[0]}, {name} pool with a scale pool"
        cases.append(Case(label, case.contract, tuple(args), kwargs))
    return cases


# The JAX op and the NumPy reference of each form.
OPS = {
    "slot": ("target_kv_cache_update", "target_kv_cache_update"),
    "paged": ("target_kv_cache_update_paged", "target_kv_cache_update_paged"),
    "slot_mapping": ("target_kv_cache_update_slots", "target_kv_cache_update_slots"),
}


def expected_of(case: Case) -> np.ndarray:
    from jax_dflash import reference

    return getattr(reference, OPS[case.contract][1])(*case.args, **case.kwargs)


def cuda_serves(contract: str) -> bool:
    """Whether the form's descriptor says its CUDA kernel is on (else it is refused on GPU)."""
    from jax_dflash import _ext

    return _ext.extension("cpu").ADDRESSING_FORMS[contract]["cuda"]


def bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def same_bits(got, want, label) -> bool:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape == want.shape and np.array_equal(bits(got), bits(want)):
        print(f"  ok       {label}")
        return True
    if got.shape != want.shape:
        print(f"  MISMATCH {label}: shape {got.shape}, expected {want.shape}")
        return False
    where = np.argwhere(bits(got) != bits(want))
    print(
        f"  MISMATCH {label}: {len(where)} elements differ, first at {tuple(where[0])}: "
        f"{got[tuple(where[0])]!r} != {want[tuple(where[0])]!r}"
    )
    return False


def _one_line(e: Exception) -> str:
    lines = [x for x in str(e).splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def run_jax(case: Case, expected, platform="gpu") -> list[bool]:
    import jax

    import jax_dflash

    device = jax.devices(platform)[0]
    if platform == "gpu" and not cuda_serves(case.contract):
        print(f"  skipped  {case.label}: JAX: the {case.contract} form has no CUDA kernel yet")
        return [None, None]
    fn = getattr(jax_dflash, OPS[case.contract][0])
    arrays = {k: v for k, v in case.kwargs.items() if isinstance(v, np.ndarray)}
    static = {k: v for k, v in case.kwargs.items() if k not in arrays}
    op = functools.partial(fn, **static)
    results = []
    for donate in (False, True):
        label = f"{case.label}: JAX jit{' donated' if donate else ''}"
        try:
            args = [jax.device_put(a, device) for a in case.args]
            extras = {k: jax.device_put(v, device) for k, v in arrays.items()}
            jitted = jax.jit(lambda *a, **kw: op(*a, **kw), donate_argnums=(2,) if donate else ())
            out = jitted(*args, **extras)
        except Exception as e:  # noqa: BLE001 - report the case, run the others
            print(f"  ERROR    {label}: {_one_line(e)}")
            results.append(False)
            continue
        if isinstance(expected, tuple):  # (pool, scale_pool)
            results.append(
                same_bits(out[0], expected[0], label)
                and same_bits(out[1], expected[1], f"{label}: scale_pool")
            )
        else:
            results.append(same_bits(out, expected, label))
    return results


def _device_module():
    """torch or cupy, whichever can hold CUDA arrays here, as (name, module)."""
    try:
        import torch

        if torch.cuda.is_available():
            return "torch", torch
    except ImportError:
        pass
    try:
        import cupy

        return "cupy", cupy
    except ImportError:
        return None, None


def _raw_dtype_names(case: Case, kind: str) -> dict:
    """delta_dtype / pool_dtype for what is passed as bits: FP8 (uint8), and bfloat16 (uint16)
    with cupy, which has no bfloat16 (torch passes its own bfloat16 through DLPack)."""
    k, pool = case.args[0], case.args[2]
    out = {}
    if k.dtype == BF16 and kind == "cupy":
        out["delta_dtype"] = "bfloat16"
    if pool.dtype in (E4M3, E5M2) or (pool.dtype == BF16 and kind == "cupy"):
        out["pool_dtype"] = pool.dtype.name
    return out


def run_raw(case: Case, expected) -> bool | None:
    from jax_dflash import _ext

    label = f"{case.label}: raw launcher"
    if not cuda_serves(case.contract):
        print(f"  skipped  {label}: the {case.contract} form has no CUDA kernel yet")
        return None
    kind, mod = _device_module()
    if kind is None:
        print(f"  skipped  {label}: neither torch (with CUDA) nor cupy is importable")
        return None
    try:
        cuda = _ext.extension("cuda")

        def upload(a):
            a = np.ascontiguousarray(a)
            if a.dtype in (E4M3, E5M2):
                a = a.view(np.uint8)
            if kind == "torch":
                if a.dtype == BF16:  # torch.from_numpy has no bfloat16: carry the bits
                    return mod.from_numpy(a.view(np.int16)).cuda().view(mod.bfloat16)
                return mod.from_numpy(a).cuda()
            return mod.asarray(a.view(np.uint16) if a.dtype == BF16 else a)

        dev = [upload(a) for a in case.args]
        extras = {k: upload(v) if isinstance(v, np.ndarray) else v for k, v in case.kwargs.items()}
        stream = (
            mod.cuda.current_stream().cuda_stream
            if kind == "torch"
            else mod.cuda.get_current_stream().ptr
        )
        cuda.launch_form(
            case.contract, dev, **extras, **_raw_dtype_names(case, kind), stream=stream
        )
        if kind == "torch":
            mod.cuda.synchronize()
            pool = dev[2]
            host = (pool.view(mod.int16) if pool.dtype == mod.bfloat16 else pool).cpu().numpy()
            scales = extras["scale_pool"].cpu().numpy() if "scale_pool" in extras else None
        else:
            mod.cuda.runtime.deviceSynchronize()
            host = mod.asnumpy(dev[2])
            scales = mod.asnumpy(extras["scale_pool"]) if "scale_pool" in extras else None
    except Exception as e:  # noqa: BLE001
        print(f"  ERROR    {label} ({kind}): {_one_line(e)}")
        return False
    return _same_results(host.view(case.args[2].dtype), scales, expected, f"{label} ({kind})")


def _same_results(pool, scales, expected, label) -> bool:
    """The pool (and the scale pool, where the case has one) against the reference's."""
    if scales is None:
        return same_bits(pool, expected, label)
    return same_bits(pool, expected[0], label) and same_bits(
        scales, expected[1], f"{label}: scale_pool"
    )


def run_raw_cpu(case: Case, expected) -> bool:
    """The CPU extension's NumPy entries (bfloat16 / FP8 as bit views, named by dtype)."""
    from jax_dflash import _ext

    label = f"{case.label}: CPU NumPy entry"
    try:
        cpu = _ext.extension("cpu")
        views = [np.ascontiguousarray(a) for a in case.args]
        names = {}
        for i, a in enumerate(views[:3]):
            if a.dtype in (BF16, E4M3, E5M2):
                names["pool_dtype" if i == 2 else "delta_dtype"] = a.dtype.name
                views[i] = a.view(np.uint16 if a.dtype == BF16 else np.uint8)
        extras = {}
        for k, v in case.kwargs.items():
            if isinstance(v, np.ndarray) and v.dtype == BF16:
                v = v.view(np.uint16)
            extras[k] = v.copy() if k == "scale_pool" else v  # updated in place
        cpu.update(case.contract, views, **extras, **names)
    except Exception as e:  # noqa: BLE001
        print(f"  ERROR    {label}: {_one_line(e)}")
        return False
    pool = views[2].view(case.args[2].dtype)
    return _same_results(pool, extras.get("scale_pool"), expected, label)


def main(argv: list[str] | None = None) -> int:
    import argparse

    import jax

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--platform",
        choices=("gpu", "cpu"),
        default="gpu",
        help="cpu: XLA:CPU and the CPU NumPy entries (a local check of this script)",
    )
    platform = parser.parse_args(argv).platform
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        devices = []
    if not devices:
        print("SKIPPED: JAX sees no GPU here; run this on the H200 under compute-sanitizer")
        return 77
    print(
        f"hostile runtime data on {devices[0].device_kind}. Slot: starts "
        f"{HOSTILE_STARTS.tolist()}, lengths {HOSTILE_LENGTHS.tolist()}, slot capacity "
        f"{CAPACITY}, rope length {ROPE_LEN}. Paged: written-out hostile tables and tokens, "
        f"and the hostile builder's (jax_dflash.testing.make_paged_problem). Slot mapping: "
        f"hostile flat slots over {BUILDER_PAGES * PAGE} rows"
    )
    rng = np.random.default_rng(2026)
    summary = {"matched": 0, "mismatched": 0, "skipped": 0}
    per_contract = {}
    cases = slot_cases(rng) + paged_cases(rng) + slot_mapping_cases(rng) + scale_pool_cases(rng)
    for case in cases:
        expected = expected_of(case)
        written = expected[0] if isinstance(expected, tuple) else expected
        assert not np.array_equal(bits(written), bits(case.args[2])), (
            f"{case.label}: the case writes nothing"
        )
        results = run_jax(case, expected, platform)
        results.append(
            run_raw(case, expected) if platform == "gpu" else run_raw_cpu(case, expected)
        )
        for r in results:
            key = {True: "matched", False: "mismatched", None: "skipped"}[r]
            summary[key] += 1
            per_contract.setdefault(case.contract, {"matched": 0, "mismatched": 0, "skipped": 0})
            per_contract[case.contract][key] += 1
    for contract, counts in per_contract.items():
        print(
            f"{contract}: {counts['matched']} matched, {counts['mismatched']} mismatched, "
            f"{counts['skipped']} skipped"
        )
    print(
        f"SUMMARY: {summary['matched']} runs matched the reference bit for bit, "
        f"{summary['mismatched']} mismatched or failed, {summary['skipped']} skipped"
        + ("" if platform == "gpu" else " (XLA:CPU and the CPU entries: no GPU kernel ran)")
    )
    return 1 if summary["mismatched"] else 0


if __name__ == "__main__":
    sys.exit(main())
