"""The benchmark of the update (issue 4): this project's kernel against what users pick instead.

One run on one device times the time per update of every contender at every shape:

- ``ours_jax``: :func:`jax_dflash.target_kv_cache_update` under ``jax.jit`` with the pool donated.
- ``ours_raw``: the same kernel through its raw launcher (``_dflash_cuda.launch`` over torch
  tensors, captured ``chain`` launches to a CUDA graph; on CPU the NumPy entry point of
  ``_dflash_cpu``).
- ``jax_baseline``: :func:`jax_dflash.baseline.target_kv_cache_update` (jnp RoPE +
  ``.at[].set(mode="drop")``), jitted the same way: what a JAX user writes without us.
- ``flashinfer``: FlashInfer's ``apply_rope_with_cos_sin_cache_inplace`` +
  ``append_paged_kv_cache`` (GPU only; skipped with the reason when it cannot be imported).
- ``copy``: a device-to-device copy moving the same number of bytes (read + written), the floor.

How time is measured. JAX contenders: one jitted function applies ``chain`` updates back to back
(the pool carried, inputs rotated), so XLA sees one program (on GPU it may run it as one command
buffer); it is called repeatedly without waiting (async dispatch keeps the device busy) and
timed with ``time.perf_counter`` up to ``block_until_ready``. Raw launcher, FlashInfer and the
copy on GPU: ``chain`` calls captured in one CUDA graph, replays timed with CUDA events. On CPU
every contender is timed with ``time.perf_counter``. A measurement lasts at least ``min_time``.
All contenders of a shape are set up first, then measured in turns (the order rotated every
round), so none is timed under conditions the others do not share; the reported time per update
is the median over ``repeats`` measurements of time / updates. Nothing is subtracted.

Inputs are rotated: ``num_sets`` sets of k/v deltas and start positions, enough that for large
shapes their bytes exceed the L2 cache (60 MB on the H200), so the benchmark does not measure the
cache. Bytes moved per update = K/V read + pool rows written (K and V) + cos/sin rows read.

Correctness is checked once per shape and contender before timing: one update from a known pool,
the first slots (a sample) compared against the NumPy reference (bit-exact for this project's
kernel, within two ulps for the others), and for ``ours_jax`` the whole pool against the
baseline's. A contender that fails is marked ``WRONG`` in the table.

Usage: ``python bench/bench_kv_update.py [--backend auto|cpu|gpu] [--shapes a,b] [--iters N]
[--out DIR] [--quick]`` (also ``jax-dflash bench``). Writes ``kv_update_<backend>.json`` and, when
matplotlib is importable, ``kv_update_<backend>.png`` into ``--out`` (default bench/results/).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

CONTENDERS = ("ours_jax", "ours_raw", "jax_baseline", "flashinfer", "copy")
DEFAULT_OUT = Path(".")  # the current directory; pass --out bench/results to refresh the committed results
L2_BYTES = {"gpu": 60e6, "cpu": 32e6}  # H200 L2; a typical CPU last-level cache
MAX_SETS = {"gpu": 32, "cpu": 8}
# Unused pool rows are filled with this value; a kernel that writes where it should not shows up.
POOL_FILL = 0.25
SAMPLE_SLOTS = 2  # slots compared against the NumPy reference


class Skip(Exception):
    """A contender that cannot run here; the message says why."""


# ---- shapes -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BenchShape:
    """One benchmarked update. fp16/bf16, H=8, D=128, R=128, P=128 unless stated."""

    name: str
    batch: int  # B
    delta_len: int  # L
    dtype: str = "float16"
    num_layers: int | None = None  # layer-batched form when set
    num_kv_heads: int = 8  # H
    head_dim: int = 128  # D
    rotary_dim: int = 128  # R
    page_size: int = 128  # P
    min_capacity: int = 2048  # tokens per slot at least (a decode-time cache is not tiny)

    @property
    def pages_per_slot(self) -> int:
        # Room for start positions in [0, cap - L] with cap >= 2 L.
        return math.ceil(max(self.min_capacity, 2 * self.delta_len) / self.page_size)

    @property
    def slot_capacity(self) -> int:
        return self.pages_per_slot * self.page_size

    @property
    def num_pages(self) -> int:
        return self.pages_per_slot * self.batch  # maxBatch = B

    @property
    def layers(self) -> int:
        return self.num_layers or 1

    @property
    def delta_shape(self) -> tuple[int, ...]:
        lead = (self.num_layers,) if self.num_layers else ()
        return (*lead, self.batch, self.delta_len, self.num_kv_heads, self.head_dim)

    @property
    def pool_shape(self) -> tuple[int, ...]:
        lead = (self.num_layers,) if self.num_layers else ()
        return (*lead, 2, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def np_dtype(self) -> np.dtype:
        import ml_dtypes

        return np.dtype({"float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
                         "float32": np.float32}[self.dtype])

    def describe(self) -> str:
        layers = f"{self.num_layers} layers, " if self.num_layers else ""
        return f"{layers}B={self.batch} L={self.delta_len} {self.dtype}"


def _gpu_shapes() -> list[BenchShape]:
    return [
        BenchShape("decode_b1", 1, 16),
        BenchShape("decode_b8", 8, 16),
        BenchShape("decode_b64", 64, 16),
        BenchShape("prefill_b1_l4096", 1, 4096),
        BenchShape("prefill_b8_l2048", 8, 2048),
        BenchShape("decode_b64_5layers", 64, 16, num_layers=5),
        BenchShape("decode_b64_bf16", 64, 16, dtype="bfloat16"),
        BenchShape("prefill_b8_l2048_bf16", 8, 2048, dtype="bfloat16"),
    ]


def _cpu_shapes() -> list[BenchShape]:
    """The GPU set scaled down so that a 2-core machine finishes in well under two minutes."""
    small = {"min_capacity": 512}
    return [
        BenchShape("decode_b1", 1, 16, **small),
        BenchShape("decode_b8", 8, 16, **small),
        BenchShape("prefill_b1_l512", 1, 512, **small),
        BenchShape("prefill_b4_l256", 4, 256, **small),
        BenchShape("decode_b8_5layers", 8, 16, num_layers=5, **small),
        BenchShape("decode_b8_bf16", 8, 16, dtype="bfloat16", **small),
        BenchShape("prefill_b4_l256_bf16", 4, 256, dtype="bfloat16", **small),
    ]


def shapes_for(backend: str) -> list[BenchShape]:
    return _gpu_shapes() if backend == "gpu" else _cpu_shapes()


# ---- problems -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Problem:
    """Host data of one shape: ``num_sets`` rotated input sets and the reference sample."""

    shape: BenchShape
    k_sets: list[np.ndarray]  # each delta_shape
    v_sets: list[np.ndarray]
    start_sets: list[np.ndarray]  # each [B] int32
    lengths: np.ndarray  # [B] int32
    rope: np.ndarray  # [1, S, R] float32, S = slot capacity (every written key is rotated)
    sample_init: np.ndarray  # [2, SAMPLE_SLOTS * pps, P, H, D]: layer 0's first slots before
    sample_expected: np.ndarray  # the same after one update with set 0 (NumPy reference)
    sample_slots: int
    bytes: dict[str, int]

    @property
    def num_sets(self) -> int:
        return len(self.k_sets)

    def sample_index(self) -> tuple:
        """Where the sample lies in the pool (layer 0 when layer-batched)."""
        region = (slice(None), slice(0, self.sample_slots * self.shape.pages_per_slot))
        return ((0,) if self.shape.num_layers else ()) + region


def bytes_moved(shape: BenchShape, starts: np.ndarray, lengths: np.ndarray) -> dict[str, int]:
    """K/V read + pool rows written + cos/sin rows read, for one update (all layers)."""
    from jax_dflash.reference import written_position

    elem = shape.np_dtype.itemsize
    row = shape.num_kv_heads * shape.head_dim * elem
    written = sum(
        written_position(starts[b], lengths[b], t, shape.slot_capacity) is not None
        for b in range(shape.batch) for t in range(shape.delta_len)
    )
    kv_read = 2 * shape.batch * shape.delta_len * row
    pool_write = 2 * written * row
    rope_read = written * shape.rotary_dim * 4  # every written position is < S here
    per_layer = {"kv_read": kv_read, "pool_write": pool_write, "rope_read": rope_read}
    out = {k: v * shape.layers for k, v in per_layer.items()}
    out["total"] = sum(out.values())
    out["written_tokens"] = written * shape.layers
    return out


def rope_table(seq_len: int, rotary_dim: int) -> np.ndarray:
    half = rotary_dim // 2
    inv_freq = 10000.0 ** (-np.arange(half, dtype=np.float64) / half)
    angles = np.arange(seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], -1).astype(np.float32)[None]


def make_problem(shape: BenchShape, backend: str, seed: int = 0) -> Problem:
    from jax_dflash import reference

    rng = np.random.default_rng(seed)
    dtype = shape.np_dtype
    set_bytes = 2 * math.prod(shape.delta_shape) * dtype.itemsize
    num_sets = int(min(MAX_SETS[backend], max(2, math.ceil(2 * L2_BYTES[backend] / set_bytes))))

    def delta():
        return rng.standard_normal(shape.delta_shape, dtype=np.float32).astype(dtype)

    k_sets = [delta() for _ in range(num_sets)]
    v_sets = [delta() for _ in range(num_sets)]
    high = shape.slot_capacity - shape.delta_len
    start_sets = [rng.integers(0, high + 1, shape.batch, dtype=np.int32) for _ in range(num_sets)]
    lengths = np.full(shape.batch, shape.delta_len, np.int32)
    rope = rope_table(shape.slot_capacity, shape.rotary_dim)

    slots = min(shape.batch, SAMPLE_SLOTS)
    pps = shape.pages_per_slot
    sample_init = rng.standard_normal(
        (2, slots * pps, shape.page_size, shape.num_kv_heads, shape.head_dim), dtype=np.float32
    ).astype(dtype)
    layer0 = (0,) if shape.num_layers else ()
    sample_expected = reference.target_kv_cache_update(
        k_sets[0][layer0][:slots], v_sets[0][layer0][:slots], sample_init, rope,
        start_sets[0][:slots], lengths[:slots], pages_per_slot=pps,
    )
    return Problem(shape, k_sets, v_sets, start_sets, lengths, rope, sample_init,
                   sample_expected, slots, bytes_moved(shape, start_sets[0], lengths))


# ---- correctness --------------------------------------------------------------------------------

_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23}


def compare_sample(got: np.ndarray, problem: Problem, exact_required: bool) -> dict:
    """The contender's sample region after one update against the NumPy reference."""
    want = problem.sample_expected
    got = np.asarray(got).reshape(want.shape).astype(want.dtype, copy=False)
    bits = np.uint16 if want.dtype.itemsize == 2 else np.uint32
    exact = bool(np.array_equal(got.view(bits), want.view(bits)))
    got32, want32 = got.astype(np.float32), want.astype(np.float32)
    diff = np.abs(got32 - want32)
    max_abs = float(np.nanmax(diff)) if diff.size else 0.0
    tol = 2 * _EPS[problem.shape.dtype] * np.maximum(np.abs(want32), 1.0)
    close = bool(np.all(diff <= tol)) and not np.isnan(got32).any()
    ok = exact if exact_required else close
    return {"ok": ok, "bit_exact": exact, "max_abs_diff": max_abs,
            "criterion": "bit-exact" if exact_required else "within 2 ulp"}


# ---- timing -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
    backend: str
    chain: int  # updates per jitted call / per CUDA graph
    baseline_chain: int  # the same for the (much slower to compile) straightforward JAX version
    repeats: int
    min_time: float  # seconds per measurement at least


@dataclasses.dataclass
class Prepared:
    """A contender set up for one shape and checked, ready to be timed.

    ``run(calls)`` -> seconds for ``calls`` back-to-back calls of ``updates_per_call`` updates
    each; ``info`` goes into the result as is; ``finish(result)``, when given, adds what only
    the timing runs reveal (host dispatch time of the JAX contenders). ``inputs`` holds what
    ``run`` reads without referencing it (the buffers a captured CUDA graph replays on)."""

    run: Callable[[int], float]
    updates_per_call: int
    info: dict
    finish: Callable[[dict], None] | None = None
    inputs: object = None


def _calibrate(run: Callable[[int], float], min_time: float) -> int:
    """Calls per measurement so that one lasts at least ``min_time``, found in the steady state.

    One call is not a good estimate: the first calls of a jitted chain on GPU measured over 10x
    slower than the steady state, and a single host-timed call also pays for filling the
    pipeline. So the count grows until a measurement lasts a quarter of ``min_time``."""
    run(2)  # warm-up (compiles, JITs, first-touch)
    calls = 1
    while True:
        seconds = run(calls)
        if seconds >= min_time / 4 or calls >= 1 << 20:
            return max(1, math.ceil(calls * min_time / max(seconds, 1e-9)))
        calls *= 4


def time_interleaved(prepared: dict[str, Prepared], settings: Settings) -> dict[str, dict]:
    """Times every prepared contender ``settings.repeats`` times, interleaved.

    Each contender is warmed up and calibrated (calls per measurement, so that one lasts at
    least ``min_time``); then the measurements go round the contenders, the order rotated by
    one each round, so that every contender is timed in every position. A contender timed on
    its own right after its setup can measure slow for reasons that have nothing to do with it
    (BENCHMARKS.md, "How the benchmark times"). Median seconds per update over the repeats."""
    calls, out = {}, {}
    for name, p in prepared.items():
        try:
            calls[name] = _calibrate(p.run, settings.min_time)
        except Exception as e:  # noqa: BLE001 - one failing contender must not end the run
            out[name] = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
    names = [n for n in prepared if n in calls]
    samples = {n: [] for n in names}
    for r in range(settings.repeats if names else 0):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if name in out:
                continue  # failed in an earlier round
            p = prepared[name]
            try:
                seconds = p.run(calls[name])
            except Exception as e:  # noqa: BLE001
                out[name] = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
                continue
            samples[name].append(seconds / (calls[name] * p.updates_per_call))
    for name in names:
        if name in out:
            continue
        us = [x * 1e6 for x in samples[name]]
        result = dict(prepared[name].info)
        result.update({"us": statistics.median(us), "us_min": min(us), "us_max": max(us),
                       "samples_us": [round(x, 4) for x in us],
                       "updates_per_measurement": calls[name] * prepared[name].updates_per_call})
        if prepared[name].finish is not None:
            prepared[name].finish(result)
        out[name] = result
    return out


# ---- JAX contenders (ours and the baseline) -------------------------------------------------------


def _jax_device(backend: str):
    import jax

    return jax.devices("gpu" if backend == "gpu" else "cpu")[0]


def _jax_pool(problem: Problem, device):
    import jax
    import jax.numpy as jnp

    s = problem.shape
    pool = jnp.full(s.pool_shape, POOL_FILL, dtype=s.np_dtype, device=device)
    return pool.at[problem.sample_index()].set(jax.device_put(problem.sample_init, device))


def _jax_update_fn(name: str, shape: BenchShape):
    import jax

    import jax_dflash
    from jax_dflash import baseline

    if name == "ours_jax":
        return functools.partial(jax_dflash.target_kv_cache_update,
                                 pages_per_slot=shape.pages_per_slot)
    one = functools.partial(baseline.target_kv_cache_update, pages_per_slot=shape.pages_per_slot)
    if shape.num_layers:  # what a JAX user writes for stacked layers: vmap the one-layer version
        return jax.vmap(one, in_axes=(0, 0, 0, None, None, None))
    return one


def jitted_chain(update: Callable, chain: int):
    """``update`` applied ``chain`` times in one jitted function, pool donated, input sets
    (tuples) rotated: ``step(pool, ks, vs, rope, starts, lengths) -> pool``."""
    import jax

    def chained(pool, ks, vs, rope, starts, lengths):
        # Unrolled: each update reads its own operands (no slicing copies in front of the call).
        for i in range(chain):
            j = i % len(ks)
            pool = update(ks[j], vs[j], pool, rope, starts[j], lengths)
        return pool

    return jax.jit(chained, donate_argnums=0)


def _prepare_jax(name: str, problem: Problem, settings: Settings, device) -> Prepared:
    import jax
    import jax.numpy as jnp

    shape = problem.shape
    update = _jax_update_fn(name, shape)
    put = functools.partial(jax.device_put, device=device)
    ks = tuple(put(k) for k in problem.k_sets)
    vs = tuple(put(v) for v in problem.v_sets)
    starts = tuple(put(s) for s in problem.start_sets)
    rope, lengths = put(problem.rope), put(problem.lengths)

    # Correctness: one update from the known pool.
    once = jax.jit(update)(ks[0], vs[0], _jax_pool(problem, device), rope, starts[0], lengths)
    check = compare_sample(np.asarray(once[problem.sample_index()]), problem,
                           exact_required=name == "ours_jax")
    if name == "ours_jax":  # the whole pool, against the baseline (catches stray writes anywhere)
        other = jax.jit(_jax_update_fn("jax_baseline", shape))(
            ks[0], vs[0], _jax_pool(problem, device), rope, starts[0], lengths)
        diff = jax.jit(lambda a, b: jnp.max(jnp.abs(a.astype(jnp.float32) -
                                                    b.astype(jnp.float32))))(once, other)
        check["full_pool_max_abs_diff_vs_baseline"] = float(diff)
        tol = 2 * _EPS[shape.dtype] * 8  # |rotated keys| stay well below 8 here
        check["ok"] = check["ok"] and float(diff) <= tol
        del other
    del once

    chain = settings.chain if name == "ours_jax" else settings.baseline_chain

    step = jitted_chain(update, chain)
    state = {"pool": _jax_pool(problem, device)}

    dispatch = []  # host seconds per call spent dispatching (the GPU runs behind it)

    def run(calls: int) -> float:
        pool = state["pool"]
        pool.block_until_ready()
        t0 = time.perf_counter()
        for _ in range(calls):
            pool = step(pool, ks, vs, rope, starts, lengths)
        dispatched = time.perf_counter() - t0
        pool.block_until_ready()
        elapsed = time.perf_counter() - t0
        state["pool"] = pool
        dispatch.append(dispatched / calls)
        return elapsed

    def finish(result: dict) -> None:
        # Wall time is device time only while the host dispatches faster than the GPU runs: when
        # dispatching a call takes most of its time, the number is host-bound (an upper bound).
        timed = dispatch[-len(result["samples_us"]):]  # the measurements, not the calibration
        host_us = statistics.median(timed) / chain * 1e6
        result["host_dispatch_us"] = host_us
        result["host_bound"] = host_us >= 0.8 * result["us"]

    return Prepared(run, chain, {"check": check, "chain": chain},
                    finish if settings.backend == "gpu" else None)


# ---- torch-side GPU contenders (raw launcher, FlashInfer, copy) -----------------------------------


def _torch():
    try:
        import torch
    except ImportError as e:
        raise Skip(f"torch is not importable ({e})") from e
    if not torch.cuda.is_available():
        raise Skip("torch sees no CUDA device")
    torch.cuda.empty_cache()  # what the previous contender left in torch's cache
    return torch


def _torch_dtype(torch, dtype: str):
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]


def _to_torch(torch, array: np.ndarray):
    """Host array -> CUDA tensor, 16-bit floats carried as int16 bits (torch lacks bf16 numpy)."""
    a = np.ascontiguousarray(array)
    if a.dtype.name in ("bfloat16", "float16"):
        return torch.from_numpy(a.view(np.int16)).cuda().view(_torch_dtype(torch, a.dtype.name))
    return torch.from_numpy(a).cuda()


def _from_torch(tensor, dtype: np.dtype) -> np.ndarray:
    t = tensor.detach().contiguous().cpu()
    if dtype.itemsize == 2:
        import torch

        return t.view(torch.int16).numpy().view(dtype)
    return t.numpy()


def _torch_pool(torch, problem: Problem):
    s = problem.shape
    pool = torch.full(s.pool_shape, POOL_FILL, dtype=_torch_dtype(torch, s.dtype), device="cuda")
    pool[problem.sample_index()] = _to_torch(torch, problem.sample_init)
    return pool


def _graph(torch, enqueue: Callable[[int], None], chain: int, info: dict) -> Prepared:
    """Captures ``enqueue(i)`` for i < chain into one CUDA graph, replays timed with events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(min(chain, 3)):
            enqueue(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(chain):
            enqueue(i)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run(calls: int) -> float:
        start.record()
        for _ in range(calls):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    # The graph replays on the buffers enqueue's closure holds: they must outlive it.
    return Prepared(run, chain, {**info, "chain": chain}, inputs=enqueue)


_DTYPE_CODE = {"float16": 0, "bfloat16": 1, "float32": 2}


def _prepare_raw_gpu(problem: Problem, settings: Settings) -> Prepared:
    torch = _torch()
    from jax_dflash import _ext

    try:
        cuda = _ext.extension("cuda")
    except ImportError as e:
        raise Skip(str(e)) from e
    s = problem.shape
    ks = [_to_torch(torch, k) for k in problem.k_sets]
    vs = [_to_torch(torch, v) for v in problem.v_sets]
    starts = [_to_torch(torch, x) for x in problem.start_sets]
    rope, lengths = _to_torch(torch, problem.rope), _to_torch(torch, problem.lengths)

    def launch(pool, j: int) -> None:
        cuda.launch(
            k_delta=ks[j].data_ptr(), v_delta=vs[j].data_ptr(), pool=pool.data_ptr(),
            rope_cos_sin=rope.data_ptr(), delta_start_positions=starts[j].data_ptr(),
            delta_lengths=lengths.data_ptr(), dtype=_DTYPE_CODE[s.dtype], num_layers=s.layers,
            batch=s.batch, delta_len=s.delta_len, num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim, num_pages=s.num_pages, page_size=s.page_size,
            pages_per_slot=s.pages_per_slot, rotary_dim=s.rotary_dim, rope_batch=1,
            rope_seq_len=problem.rope.shape[1], rope_per_layer=False, positions_per_layer=False,
            stream=torch.cuda.current_stream().cuda_stream,
        )

    pool = _torch_pool(torch, problem)
    launch(pool, 0)
    torch.cuda.synchronize()
    check = compare_sample(_from_torch(pool[problem.sample_index()], s.np_dtype), problem,
                           exact_required=True)
    return _graph(torch, lambda i: launch(pool, i % len(ks)), settings.chain, {"check": check})


def _flashinfer():
    try:
        import flashinfer
    except Exception as e:  # any import failure means: not available here
        raise Skip(f"flashinfer is not importable ({type(e).__name__}: {e}); install "
                   "flashinfer-python==0.2.8 (see GPU_NOTES.md)") from e
    return flashinfer


def _prepare_flashinfer(problem: Problem, settings: Settings) -> Prepared:
    torch = _torch()
    flashinfer = _flashinfer()
    s = problem.shape
    nnz = s.batch * s.delta_len
    tokens = (nnz, s.num_kv_heads, s.head_dim)

    def layers_of(array):  # one [nnz, H, D] tensor per layer
        t = _to_torch(torch, array)
        if s.num_layers:
            return [t[layer].reshape(tokens) for layer in range(s.layers)]
        return [t.reshape(tokens)]

    ks = [layers_of(k) for k in problem.k_sets]
    vs = [layers_of(v) for v in problem.v_sets]
    t_index = torch.arange(s.delta_len, dtype=torch.int32, device="cuda")
    positions = [(_to_torch(torch, x)[:, None] + t_index[None, :]).reshape(nnz).contiguous()
                 for x in problem.start_sets]
    batch_indices = torch.arange(s.batch, dtype=torch.int32, device="cuda").repeat_interleave(
        s.delta_len)
    kv_indices = torch.arange(s.num_pages, dtype=torch.int32, device="cuda")
    kv_indptr = torch.arange(s.batch + 1, dtype=torch.int32, device="cuda") * s.pages_per_slot
    last_page_len = torch.full((s.batch,), s.page_size, dtype=torch.int32, device="cuda")
    cos_sin = _to_torch(torch, problem.rope[0])  # [S, R]: cos then sin, FlashInfer's layout

    # Keys only: the rope module the public call wraps, with a query of zero heads, is the
    # cheapest FlashInfer path (a 1-head query otherwise: the public API needs one).
    no_query = torch.empty((nnz, 0, s.head_dim), dtype=_torch_dtype(torch, s.dtype), device="cuda")

    def rope_keys_only(pos, key):
        flashinfer.rope._apply_rope_pos_ids_cos_sin_cache(
            q=no_query, k=key, q_rope=no_query, k_rope=key, cos_sin_cache=cos_sin,
            pos_ids=pos, interleave=False)

    one_head_query = torch.zeros((nnz, s.head_dim), dtype=_torch_dtype(torch, s.dtype),
                                 device="cuda")

    def rope_public(pos, key):
        flashinfer.apply_rope_with_cos_sin_cache_inplace(
            positions=pos, query=one_head_query, key=key.view(nnz, -1), head_size=s.head_dim,
            cos_sin_cache=cos_sin, is_neox=True)

    def update(pool, j: int, rope_fn) -> None:
        for layer in range(s.layers):
            layer_pool = pool[layer] if s.num_layers else pool
            rope_fn(positions[j], ks[j][layer])
            flashinfer.append_paged_kv_cache(
                ks[j][layer], vs[j][layer], batch_indices, positions[j],
                (layer_pool[0], layer_pool[1]), kv_indices, kv_indptr, last_page_len,
                kv_layout="NHD")

    # Correctness on a copy of set 0 (the rope is in place): the first variant that runs and
    # matches the reference is timed (if none matches, the last one that ran, marked wrong).
    original = [k.clone() for k in ks[0]]
    variant, check, pool, errors = None, None, None, []
    for name, rope_fn in (("keys only (rope module, 0 query heads)", rope_keys_only),
                          ("public API (1-head query)", rope_public)):
        for layer, k in enumerate(original):
            ks[0][layer].copy_(k)
        candidate = _torch_pool(torch, problem)
        try:
            update(candidate, 0, rope_fn)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - try the next variant
            errors.append(f"{name}: {type(e).__name__}: {e}")
            continue
        variant, pool = (name, rope_fn), candidate
        check = compare_sample(_from_torch(pool[problem.sample_index()], s.np_dtype), problem,
                               exact_required=False)
        if check["ok"]:
            break
        errors.append(f"{name}: result differs from the reference ({check})")
    if variant is None:
        raise Skip("flashinfer calls failed: " + " | ".join(errors))
    for layer, k in enumerate(original):
        ks[0][layer].copy_(k)
    info = {"check": check, "variant": variant[0],
            "version": getattr(flashinfer, "__version__", "unknown")}
    if errors:
        info["variant_notes"] = errors
    return _graph(torch, lambda i: update(pool, i % len(ks), variant[1]), settings.chain, info)


def _copy_sets(problem: Problem, backend: str) -> tuple[int, int]:
    """Bytes per copy (half the update's bytes: read + written = the same total) and sets.

    Sources and destinations both rotate over the sets. The update writes rows it has not
    written recently (new positions), so the floor writes to buffers that are not in the cache
    either: a fixed destination stays in L2 at decode sizes and its writes never reach DRAM
    while the timing runs (BENCHMARKS.md, "How the benchmark times")."""
    size = max(problem.bytes["total"] // 2, 1)
    return size, int(min(MAX_SETS[backend], max(2, math.ceil(2 * L2_BYTES[backend] / size))))


def _prepare_copy_gpu(problem: Problem, settings: Settings) -> Prepared:
    torch = _torch()
    size, num_sets = _copy_sets(problem, "gpu")
    sources = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(num_sets)]
    dests = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(num_sets)]
    return _graph(torch, lambda i: dests[i % num_sets].copy_(sources[i % num_sets]),
                  settings.chain, {"check": {"ok": True, "criterion": "none (the floor)"},
                                   "bytes_copied": size, "copy_sets": num_sets})


def peak_copy_bandwidth_gpu() -> dict:
    """Bytes read + written per second for 1 GiB device-to-device copies (torch)."""
    torch = _torch()
    size = 1 << 30
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes_per_s": 2 * size * reps / seconds, "method": "torch copy_ of 1 GiB, x20"}


# ---- CPU-only contenders ----------------------------------------------------------------------------


def _host_loop(fn: Callable[[int], None], chain: int, info: dict) -> Prepared:
    def run(calls: int) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            for i in range(chain):
                fn(i)
        return time.perf_counter() - t0

    return Prepared(run, chain, {**info, "chain": chain})


def _prepare_raw_cpu(problem: Problem, settings: Settings) -> Prepared:
    from jax_dflash import _ext

    cpu = _ext.extension("cpu")
    s = problem.shape
    bits = (lambda a: a.view(np.uint16)) if s.np_dtype.itemsize == 2 else (lambda a: a)
    pool = np.full(s.pool_shape, POOL_FILL, dtype=s.np_dtype)
    pool[problem.sample_index()] = problem.sample_init
    pool_bits = bits(pool)
    ks = [bits(k) for k in problem.k_sets]
    vs = [bits(v) for v in problem.v_sets]

    def update(j: int) -> None:
        # The NumPy entry takes one layer: stacked layers are one call each.
        for layer in range(s.layers):
            at = (layer,) if s.num_layers else ()
            cpu.target_kv_cache_update(ks[j][at], vs[j][at], pool_bits[at], problem.rope,
                                       problem.start_sets[j], problem.lengths, s.pages_per_slot,
                                       s.dtype)

    update(0)
    check = compare_sample(pool[problem.sample_index()], problem, exact_required=True)
    return _host_loop(lambda i: update(i % len(ks)), settings.chain, {"check": check})


def _prepare_copy_cpu(problem: Problem, settings: Settings) -> Prepared:
    size, num_sets = _copy_sets(problem, "cpu")
    sources = [np.ones(size, np.uint8) for _ in range(num_sets)]
    dests = [np.zeros(size, np.uint8) for _ in range(num_sets)]
    return _host_loop(lambda i: np.copyto(dests[i % num_sets], sources[i % num_sets]),
                      settings.chain, {"check": {"ok": True, "criterion": "none (the floor)"},
                                       "bytes_copied": size, "copy_sets": num_sets})


def peak_copy_bandwidth_cpu() -> dict:
    size = 128 << 20
    src, dst = np.ones(size, np.uint8), np.zeros(size, np.uint8)
    np.copyto(dst, src)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        samples.append(time.perf_counter() - t0)
    return {"bytes_per_s": 2 * size / min(samples), "method": "numpy copyto of 128 MiB, best of 5"}


# ---- one shape ----------------------------------------------------------------------------------


def prepare_contender(name: str, problem: Problem, settings: Settings) -> Prepared | dict:
    """The contender set up and checked, or its result when it cannot run (skipped / error)."""
    backend = settings.backend
    if name not in CONTENDERS:
        raise ValueError(f"--contenders: unknown contender {name!r}, expected {CONTENDERS}")
    try:
        if name in ("ours_jax", "jax_baseline"):
            return _prepare_jax(name, problem, settings, _jax_device(backend))
        if name == "ours_raw":
            return (_prepare_raw_gpu if backend == "gpu" else _prepare_raw_cpu)(problem, settings)
        if name == "flashinfer":
            if backend != "gpu":
                raise Skip("GPU only")
            return _prepare_flashinfer(problem, settings)
        return (_prepare_copy_gpu if backend == "gpu" else _prepare_copy_cpu)(problem, settings)
    except Skip as e:
        return {"status": "skipped", "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - one failing contender must not end the run
        return {"status": "error", "reason": f"{type(e).__name__}: {e}"}


def run_shape(shape: BenchShape, settings: Settings, contenders, peak_bw: float) -> dict:
    problem = make_problem(shape, settings.backend)
    entry = {
        "name": shape.name, "description": shape.describe(), "dtype": shape.dtype,
        "num_layers": shape.num_layers, "batch": shape.batch, "delta_len": shape.delta_len,
        "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
        "rotary_dim": shape.rotary_dim, "page_size": shape.page_size,
        "pages_per_slot": shape.pages_per_slot, "slot_capacity": shape.slot_capacity,
        "num_input_sets": problem.num_sets, "bytes": problem.bytes, "contenders": {},
    }
    # Every contender is set up first and they are timed together, interleaved (time_interleaved).
    prepared, results = {}, {}
    for name in contenders:
        t0 = time.perf_counter()
        ready = prepare_contender(name, problem, settings)
        setup_s = round(time.perf_counter() - t0, 2)
        if isinstance(ready, Prepared):
            ready.info["setup_s"] = setup_s
            prepared[name] = ready
        else:
            results[name] = {**ready, "setup_s": setup_s}
    results.update(time_interleaved(prepared, settings))
    del prepared  # frees this shape's buffers before the next shape's
    for name in contenders:
        result = results[name]
        if "check" in result:
            result["status"] = "ok" if result["check"]["ok"] else "wrong"
        entry["contenders"][name] = result
        shown = (f"{result['us']:.2f} us (min {result['us_min']:.2f}, max {result['us_max']:.2f})"
                 if "us" in result else result.get("reason", ""))
        print(f"  {shape.name:<24} {name:<13} {result['status']:<8} {shown}", flush=True)
    entry["derived"] = _derived(entry, peak_bw)
    return entry


def _us(entry: dict, name: str) -> float | None:
    c = entry["contenders"].get(name, {})
    return c.get("us") if c.get("status") in ("ok", "wrong") else None


def _derived(entry: dict, peak_bw: float) -> dict:
    total = entry["bytes"]["total"]
    floor = _us(entry, "copy")
    out = {}
    for name in ("ours_jax", "ours_raw"):
        t = _us(entry, name)
        if t is None:
            continue
        if floor is not None:
            out[f"floor_over_{name}"] = floor / t
        if peak_bw:
            out[f"{name}_bytes_per_s"] = total / (t * 1e-6)
            out[f"{name}_fraction_of_peak_copy_bw"] = total / (t * 1e-6) / peak_bw
    return out


# ---- targets (issue 4) ---------------------------------------------------------------------------


def evaluate_targets(results: dict) -> list[dict]:
    shapes = {e["name"]: e for e in results["shapes"]}
    peak = results.get("peak_copy_bandwidth", {}).get("bytes_per_s")
    targets = []

    def add(text, ok, measured):
        targets.append({"target": text, "met": ok, "measured": measured})

    def best_ours(entry):
        values = [v for v in (_us(entry, "ours_jax"), _us(entry, "ours_raw")) if v is not None]
        return values

    if results["backend"] == "cpu":
        for e in results["shapes"]:
            ours, base = _us(e, "ours_jax"), _us(e, "jax_baseline")
            if ours and base:
                add(f"{e['name']}: CPU kernel >= 2x the straightforward JAX version",
                    base / ours >= 2.0, f"{base / ours:.2f}x ({ours:.1f} vs {base:.1f} us)")
        return targets

    for name, limit in (("prefill_b8_l2048", 37.0), ("decode_b64", 3.5), ("decode_b1", 2.2)):
        if name in shapes:
            for who in ("ours_jax", "ours_raw"):
                t = _us(shapes[name], who)
                if t is not None:
                    add(f"{name}: {who} <= {limit} us", t <= limit, f"{t:.2f} us")
    e = shapes.get("prefill_b8_l2048")
    if e and peak:
        for who in ("ours_jax", "ours_raw"):
            t = _us(e, who)
            if t is not None:
                frac = e["bytes"]["total"] / (t * 1e-6) / peak
                add(f"prefill_b8_l2048: {who} >= 90% of measured copy bandwidth", frac >= 0.9,
                    f"{100 * frac:.1f}%")
    one, stacked = shapes.get("decode_b64"), shapes.get("decode_b64_5layers")
    if one and stacked:
        for who in ("ours_jax", "ours_raw"):
            a, b = _us(one, who), _us(stacked, who)
            if a and b:
                add(f"5 stacked layers at B=64 L=16: {who} <= 1.6x one layer", b <= 1.6 * a,
                    f"{b / a:.2f}x")
    for e in results["shapes"]:
        fi = _us(e, "flashinfer")
        for who in ("ours_jax", "ours_raw"):
            t = _us(e, who)
            if fi is not None and t is not None:
                add(f"{e['name']}: {who} faster than FlashInfer rope + append", t < fi,
                    f"{t:.2f} vs {fi:.2f} us")
        jax_t, raw_t = _us(e, "ours_jax"), _us(e, "ours_raw")
        if jax_t is not None and raw_t is not None:
            add(f"{e['name']}: JAX path within 10% of the raw launcher", jax_t <= 1.1 * raw_t,
                f"{jax_t:.2f} vs {raw_t:.2f} us ({100 * (jax_t / raw_t - 1):+.1f}%)")
    e = shapes.get("prefill_b8_l2048")
    if e:
        base = _us(e, "jax_baseline")
        for who in ("ours_jax", "ours_raw"):
            t = _us(e, who)
            if base is not None and t is not None:
                add(f"prefill_b8_l2048: {who} >= 5x faster than the straightforward JAX version",
                    base / t >= 5.0, f"{base / t:.1f}x")
    return targets


# ---- output -------------------------------------------------------------------------------------


def _fmt_us(entry: dict, name: str) -> str:
    c = entry["contenders"].get(name, {})
    if c.get("status") == "ok":
        return f"{c['us']:.2f}" + (" (host-bound)" if c.get("host_bound") else "")
    if c.get("status") == "wrong":
        return f"WRONG {c['us']:.2f}"
    return {"skipped": "skip", "error": "error"}.get(c.get("status"), "-")


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def format_table(results: dict) -> str:
    names = results["contenders"]
    head = (["shape", "bytes"] + [f"{n} (us)" for n in names]
            + ["% of floor (jax)", "% of floor (raw)", "% of copy BW (jax)",
               "% of copy BW (raw)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in results["shapes"]:
        d = e["derived"]

        def pct(key, d=d):
            return f"{100 * d[key]:.0f}%" if key in d else "-"

        row = ([e["description"], _fmt_bytes(e["bytes"]["total"])]
               + [_fmt_us(e, n) for n in names]
               + [pct("floor_over_ours_jax"), pct("floor_over_ours_raw"),
                  pct("ours_jax_fraction_of_peak_copy_bw"),
                  pct("ours_raw_fraction_of_peak_copy_bw")])
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> str | None:
    """Time per update against bytes moved, log-log, one series per contender."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: matplotlib is not importable ({e})"
    fig, ax = plt.subplots(figsize=(8, 5.5))
    markers = dict(zip(CONTENDERS, "o^sDv"))
    for name in results["contenders"]:
        points = sorted((e["bytes"]["total"], _us(e, name)) for e in results["shapes"]
                        if _us(e, name) is not None)
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker=markers.get(name, "x"), linestyle="none", label=name)
    peak = results.get("peak_copy_bandwidth", {}).get("bytes_per_s")
    sizes = [e["bytes"]["total"] for e in results["shapes"]]
    if peak and sizes:
        xs = np.geomspace(min(sizes), max(sizes), 50)
        ax.plot(xs, xs / peak * 1e6, "k--", linewidth=0.8,
                label=f"peak copy bandwidth ({peak / 1e12:.2f} TB/s)")
    for e in results["shapes"]:
        t = _us(e, "ours_jax")
        if t is not None:
            ax.annotate(e["name"], (e["bytes"]["total"], t), fontsize=7, xytext=(4, -10),
                        textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes moved per update (K/V read + pool write + cos/sin read)")
    ax.set_ylabel("time per update (us)")
    ax.set_title(f"DFlash target KV-cache update, {results['device']}")
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _versions() -> dict:
    import jax
    import jaxlib

    out = {"python": platform.python_version(), "jax": jax.__version__,
           "jaxlib": jaxlib.__version__, "numpy": np.__version__}
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        pass
    return out


def _device_name(backend: str) -> str:
    if backend == "gpu":
        import jax

        return jax.devices("gpu")[0].device_kind
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def _detect_backend() -> str:
    import jax

    try:
        return "gpu" if jax.devices("gpu") else "cpu"
    except RuntimeError:
        return "cpu"


# ---- command line -------------------------------------------------------------------------------


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Times the DFlash target KV-cache update against the straightforward JAX "
        "version, FlashInfer and a device copy; prints a table, writes JSON and a PNG plot.")
    p.add_argument("--backend", choices=("auto", "cpu", "gpu"), default="auto",
                   help="gpu when JAX sees one (auto), else cpu with scaled-down shapes")
    p.add_argument("--shapes", default="",
                   help="comma-separated subset of shape names (default: all for the backend)")
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help=f"comma-separated subset of {','.join(CONTENDERS)}")
    p.add_argument("--iters", type=int, default=None,
                   help="updates per jitted call / CUDA graph (default 512 GPU, so that JAX's "
                   "per-call dispatch stays hidden behind the GPU at decode sizes; 16 CPU); the "
                   "straightforward JAX version uses at most 32 on GPU (compile time)")
    p.add_argument("--repeats", type=int, default=None,
                   help="measurements per contender, interleaved with the other contenders' "
                   "(median; default 10 GPU, 5 CPU, 3 with --quick)")
    p.add_argument("--min-time", type=float, default=None,
                   help="seconds per measurement at least (default 0.05 GPU, 0.1 CPU)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where JSON and PNG go (default: the current directory)")
    p.add_argument("--quick", action="store_true",
                   help="fewer, shorter measurements (a smoke run, not for publishing)")
    p.add_argument("--list-shapes", action="store_true", help="print the shapes and exit")
    return p


def _settings(args, backend: str) -> Settings:
    gpu = backend == "gpu"
    chain = args.iters or (512 if gpu else 16)
    if chain < 1:
        raise SystemExit(f"--iters: expected an int >= 1, got {chain}")
    repeats = args.repeats or (3 if args.quick else 10 if gpu else 5)
    if repeats < 1:
        raise SystemExit(f"--repeats: expected an int >= 1, got {repeats}")
    min_time = args.min_time if args.min_time is not None else (
        (0.01 if args.quick else 0.05) if gpu else (0.01 if args.quick else 0.1))
    if args.quick and not args.iters:
        chain = 64 if gpu else 4
    baseline_chain = min(chain, 32) if gpu else chain
    return Settings(backend, chain, baseline_chain, repeats, min_time)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    # JAX must not grab most of the GPU: torch (raw launcher, FlashInfer, copy) shares it.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    args = build_parser(prog).parse_args(argv)
    backend = _detect_backend() if args.backend == "auto" else args.backend
    if backend == "gpu" and _detect_backend() != "gpu":
        print("--backend gpu: JAX sees no GPU here", file=sys.stderr)
        return 2
    available = {s.name: s for s in shapes_for(backend)}
    if args.list_shapes:
        for s in available.values():
            print(f"{s.name:<24} {s.describe()}, pages_per_slot={s.pages_per_slot}")
        return 0
    wanted = [n for n in args.shapes.split(",") if n] or list(available)
    unknown = [n for n in wanted if n not in available]
    if unknown:
        print(f"--shapes: unknown {unknown} for backend {backend}; expected names from "
              f"{list(available)}", file=sys.stderr)
        return 2
    contenders = [n for n in args.contenders.split(",") if n]
    if bad := [n for n in contenders if n not in CONTENDERS]:
        print(f"--contenders: unknown {bad}; expected names from {list(CONTENDERS)}",
              file=sys.stderr)
        return 2
    settings = _settings(args, backend)

    device = _device_name(backend)
    print(f"DFlash KV-update benchmark: backend {backend}, device {device}; "
          f"{settings.chain} updates per call (baseline {settings.baseline_chain}), "
          f"{settings.repeats} interleaved measurements of >= {settings.min_time} s per contender", flush=True)
    try:
        peak = peak_copy_bandwidth_gpu() if backend == "gpu" else peak_copy_bandwidth_cpu()
    except Skip as e:
        peak = {"bytes_per_s": None, "method": f"not measured: {e}"}
    if peak["bytes_per_s"]:
        print(f"measured copy bandwidth: {peak['bytes_per_s'] / 1e9:.1f} GB/s ({peak['method']})")

    t0 = time.perf_counter()
    results = {
        "backend": backend, "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable), *sys.argv]),
        "arguments": list(sys.argv[1:] if argv is None else argv),
        "versions": _versions(),
        "env": {k: os.environ[k] for k in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE",
                                           "CUDA_VISIBLE_DEVICES") if k in os.environ},
        "settings": dataclasses.asdict(settings), "quick": args.quick,
        "contenders": contenders, "peak_copy_bandwidth": peak, "shapes": [],
    }
    for name in wanted:
        results["shapes"].append(run_shape(available[name], settings, contenders,
                                           peak["bytes_per_s"]))
    results["targets"] = evaluate_targets(results)
    results["wall_s"] = round(time.perf_counter() - t0, 1)

    print()
    print(format_table(results))
    print()
    for t in results["targets"]:
        print(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['measured']}")
    wrong = [(e["name"], n) for e in results["shapes"] for n, c in e["contenders"].items()
             if c.get("status") == "wrong"]
    for e in results["shapes"]:
        for n, c in e["contenders"].items():
            if c.get("status") == "wrong":
                print(f"  WRONG RESULT: {n} at {e['name']}: {c['check']}")
    for e in results["shapes"]:
        for n, c in e["contenders"].items():
            if c.get("status") in ("skipped", "error"):
                print(f"  {c['status']}: {n} at {e['name']}: {c['reason']}")

    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"kv_update_{backend}.json"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {json_path}")
    png_path = args.out / f"kv_update_{backend}.png"
    message = plot(results, png_path)
    print(message or f"wrote {png_path}")
    print(f"total {results['wall_s']} s")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
