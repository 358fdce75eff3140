#!/usr/bin/env python3
"""Hostile positions through the GPU kernel, for ``compute-sanitizer --tool memcheck`` (issue 4).

Runs the CUDA op with start positions that are negative, past the slot or near int32's limits,
and lengths past L, zero or negative, through JAX (jit, with and without a donated pool; the
unbatched and the layer-batched forms) and through the raw launcher over torch (or cupy) device
tensors. Every result must equal the NumPy reference bit for bit: nothing is written outside the
accepted rows. Under memcheck, JAX and torch are told to give every buffer its own allocation
(no pooling), so an out-of-bounds access by the kernel is an access outside an allocation and
memcheck reports it.

  compute-sanitizer --tool memcheck --error-exitcode 9 python3 bench/sanitize_hostile.py

Exit status: 0 all cases matched, 1 a mismatch, 77 skipped (no GPU here; the reason is printed).
"""

from __future__ import annotations

import os

# Before jax / torch initialise CUDA: one allocation per buffer, nothing preallocated.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

import functools
import sys

import ml_dtypes
import numpy as np

INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)
DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))
DTYPE_CODE = {"float16": 0, "bfloat16": 1, "float32": 2}

# Small pool: P=16, 2 pages per slot (capacity 32), 13 slots of which B=11 are in use, so writes
# into the unused slots 11, 12 would show as mismatches. Rope covers S=24 < capacity (positions
# 24..31 pass through unrotated) on the first R=32 of D=64 channels.
BATCH, DELTA_LEN, HEADS, HEAD_DIM, PAGE, PAGES_PER_SLOT, SLOTS = 11, 16, 2, 64, 16, 2, 13
ROPE_LEN, ROTARY_DIM = 24, 32
CAPACITY = PAGE * PAGES_PER_SLOT

# Per slot: negative start (partly written), length past L, partly past the slot, at and past
# the slot, int32 extremes (no wrap-around into the slot), negative and zero lengths.
HOSTILE_STARTS = np.array(
    [-5, 3, 29, CAPACITY, CAPACITY + 100, INT32_MAX, INT32_MIN, -1000, 20, 7, 0], np.int32)
HOSTILE_LENGTHS = np.array(
    [DELTA_LEN, DELTA_LEN + 50, DELTA_LEN, DELTA_LEN, DELTA_LEN, INT32_MAX, DELTA_LEN, INT32_MIN,
     INT32_MAX, -3, 0], np.int32)


def make_case(rng, dtype, layers=None, rope_batch=1):
    """Operands (NumPy) of one hostile update; layered with per-layer rope and positions."""
    lead = (layers,) if layers else ()
    delta = (*lead, BATCH, DELTA_LEN, HEADS, HEAD_DIM)
    pool = (*lead, 2, SLOTS * PAGES_PER_SLOT, PAGE, HEADS, HEAD_DIM)

    def normal(shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)

    rope = rng.uniform(-1, 1, (*lead, rope_batch, ROPE_LEN, ROTARY_DIM)).astype(np.float32)
    if layers:  # a different hostile mix per layer
        starts = np.stack([np.roll(HOSTILE_STARTS, i) for i in range(layers)])
        lengths = np.stack([np.roll(HOSTILE_LENGTHS, 2 * i) for i in range(layers)])
    else:
        starts, lengths = HOSTILE_STARTS.copy(), HOSTILE_LENGTHS.copy()
    return (normal(delta), normal(delta), normal(pool), rope, starts, lengths)


def bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def same_bits(got, want, label) -> bool:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape == want.shape and np.array_equal(bits(got), bits(want)):
        print(f"  ok       {label}")
        return True
    if got.shape != want.shape:
        print(f"  MISMATCH {label}: shape {got.shape}, expected {want.shape}")
        return False
    where = np.argwhere(bits(got) != bits(want))
    print(f"  MISMATCH {label}: {len(where)} elements differ, first at {tuple(where[0])}: "
          f"{got[tuple(where[0])]!r} != {want[tuple(where[0])]!r}")
    return False


def run_jax(case, expected, label, platform="gpu") -> bool:
    import jax

    import jax_dflash

    gpu = jax.devices(platform)[0]
    op = functools.partial(jax_dflash.target_kv_cache_update, pages_per_slot=PAGES_PER_SLOT)
    ok = True
    for donate in (False, True):
        args = [jax.device_put(a, gpu) for a in case]
        fn = jax.jit(op, donate_argnums=(2,) if donate else ())
        out = np.asarray(fn(*args))
        ok &= same_bits(out, expected, f"{label}, JAX jit{' donated' if donate else ''}")
    return ok


def _device_module():
    """torch or cupy, whichever can hold CUDA tensors here, as (name, module)."""
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


def run_raw(case, expected, label) -> bool | None:
    from jax_dflash import _ext

    kind, mod = _device_module()
    if kind is None:
        print(f"  skipped  {label}, raw launcher: neither torch (with CUDA) nor cupy is importable")
        return None
    cuda = _ext.extension("cuda")
    k, _, pool, rope, starts, _ = case
    layered = pool.ndim == 6

    def upload(a):
        a = np.ascontiguousarray(a)
        host = a.view(np.int16) if a.dtype.itemsize == 2 else a
        if kind == "torch":
            return mod.from_numpy(host).cuda()
        return mod.asarray(host)

    def pointer(t):
        return t.data_ptr() if kind == "torch" else t.data.ptr

    dev = [upload(a) for a in case]
    stream = (mod.cuda.current_stream().cuda_stream if kind == "torch"
              else mod.cuda.get_current_stream().ptr)
    lead = 1 if layered else 0
    cuda.launch(
        k_delta=pointer(dev[0]), v_delta=pointer(dev[1]), pool=pointer(dev[2]),
        rope_cos_sin=pointer(dev[3]), delta_start_positions=pointer(dev[4]),
        delta_lengths=pointer(dev[5]), dtype=DTYPE_CODE[k.dtype.name],
        num_layers=k.shape[0] if layered else 1, batch=k.shape[lead],
        delta_len=k.shape[lead + 1], num_kv_heads=HEADS, head_dim=HEAD_DIM,
        num_pages=pool.shape[lead + 1], page_size=PAGE, pages_per_slot=PAGES_PER_SLOT,
        rotary_dim=rope.shape[-1], rope_batch=rope.shape[-3], rope_seq_len=rope.shape[-2],
        rope_per_layer=layered and rope.ndim == 4, positions_per_layer=layered and starts.ndim == 2,
        stream=stream,
    )
    if kind == "torch":
        mod.cuda.synchronize()
        host = dev[2].cpu().numpy()
    else:
        mod.cuda.runtime.deviceSynchronize()
        host = mod.asnumpy(dev[2])
    return same_bits(host.view(pool.dtype), expected, f"{label}, raw launcher ({kind})")


def main(argv: list[str] | None = None) -> int:
    import argparse

    import jax

    from jax_dflash import reference

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platform", choices=("gpu", "cpu"), default="gpu",
                        help="cpu: the JAX part on XLA:CPU only (a local check of this script)")
    platform = parser.parse_args(argv).platform
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        devices = []
    if not devices:
        print("SKIPPED: JAX sees no GPU here; run this on the H200 under compute-sanitizer")
        return 77
    print(f"hostile positions on {devices[0].device_kind}: starts {HOSTILE_STARTS.tolist()}, "
          f"lengths {HOSTILE_LENGTHS.tolist()}, slot capacity {CAPACITY}, rope length {ROPE_LEN}")
    rng = np.random.default_rng(2026)
    results = []
    for dtype in DTYPES:
        for layers, rope_batch in ((None, 1), (None, BATCH), (3, BATCH)):
            case = make_case(rng, dtype, layers, rope_batch)
            expected = reference.target_kv_cache_update(*case, pages_per_slot=PAGES_PER_SLOT)
            assert not np.array_equal(bits(expected), bits(case[2])), "the case writes nothing"
            form = f"{layers} layers" if layers else "one layer"
            label = f"{dtype.name}, {form}, rope batch {rope_batch}"
            results.append(run_jax(case, expected, label, platform))
            if platform == "gpu":
                results.append(run_raw(case, expected, label))
    failed = sum(r is False for r in results)
    skipped = sum(r is None for r in results)
    print(f"{len(results) - failed - skipped} groups matched, {failed} mismatched, "
          f"{skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
