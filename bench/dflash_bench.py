"""The benchmark of the update: this project's kernel, both contracts, against what users pick instead.

One run on one device times the time per update of every contender at every shape:

- ``ours_jax``: :func:`jax_dflash.target_kv_cache_update` (slot contract) under ``jax.jit`` with
  the pool donated.
- ``ours_raw``: the same kernel through its raw launcher (``_dflash_cuda.launch`` over torch
  tensors, ``chain`` launches captured in a CUDA graph; on CPU the NumPy entry of
  ``_dflash_cpu``).
- ``paged_jax`` / ``paged_raw``: the paged contract (Edge-LLM 0.11):
  :func:`jax_dflash.target_kv_cache_update_paged` and ``_dflash_cuda.launch_paged`` (CPU: the
  NumPy entry), ``T = B * L`` tokens, ``M`` pages per sequence, every sequence's pages a random
  permutation of the pool.
- ``knorm_jax``: the paged op with the fused k-norm (``k_norm_weight``).
- ``unfused_jax``: a jnp RMSNorm of the keys under the same jit, then the paged op;
  ``rmsnorm_jax``: that RMSNorm alone, host-timed. Only at the shapes marked ``unfused``. On the
  GPU every JAX contender's result also has ``kernels_us``, its kernels' device time per update
  (CUPTI through torch.profiler): the norm's own time is that of the pair's norm kernels.
- ``jax_baseline``: :func:`jax_dflash.baseline.target_kv_cache_update` (jnp RoPE +
  ``.at[].set(mode="drop")``), jitted the same way: what a JAX user writes without us.
- ``flashinfer``: FlashInfer's ``apply_rope_with_cos_sin_cache_inplace`` +
  ``append_paged_kv_cache`` (GPU only; skipped with the reason when it cannot be imported).
- ``copy``: a device-to-device copy moving the same number of bytes (read + written), the floor.

TensorRT Edge-LLM 0.11's own kernel cannot run here; its numbers measured on the H200
(``EDGE_LLM_0_11_US``) are quoted next to ours and enter the targets.

How time is measured. JAX contenders: one jitted function applies ``chain`` updates back to back
(the pool carried, inputs rotated), so XLA sees one program (on GPU it may run it as one command
buffer); it is called repeatedly without waiting (async dispatch keeps the device busy) and
timed with ``time.perf_counter`` up to ``block_until_ready``. Raw launchers, FlashInfer and the
copy on GPU: ``chain`` calls captured in one CUDA graph, replays timed with CUDA events. On CPU
every contender is timed with ``time.perf_counter``. A measurement lasts at least ``min_time``.
All contenders of a shape are set up first, then measured in turns (the order rotated every
round), so none is timed under conditions the others do not share; the reported time per update
is the median over ``repeats`` measurements of time / updates. Nothing is subtracted. On the GPU,
``nvidia-smi`` samples the SM clock and the power draw every 100 ms during the run; each result's
``clocks`` holds the samples taken during its own measurements, and the run lists the contenders
measured at a lower median SM clock than the others (a power limit slowing them down).

Inputs are rotated: ``num_sets`` sets of k/v deltas and positions, enough that for large shapes
their bytes exceed the L2 cache (60 MB on the H200), so the benchmark does not measure the
cache. Bytes moved per update = K/V read (delta dtype) + pool rows written (K and V, pool dtype)
+ cos/sin rows read.

Correctness is checked once per shape and contender before timing: one update from a known pool,
the first sequences' pages (a sample) compared against the NumPy reference of the contender's
contract (bit-exact for this project's kernel, within two ulps for the others); the whole pool
of ``ours_jax`` against the straightforward version's, and the whole pool of every paged
contender, gathered through its page table, against the slot op's of the same framework. A
contender that fails is marked ``WRONG`` in the table and the run exits 1.

Usage: ``python bench/bench_kv_update.py [--backend auto|cpu|gpu] [--shapes a,b]
[--contenders a,b] [--iters N] [--repeats N] [--min-time S] [--out DIR] [--quick]``. Writes
``kv_update_<backend>.json`` and, when matplotlib is importable, ``kv_update_<backend>.png``
into ``--out`` (default: the current directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

CONTENDERS = (
    "ours_jax",
    "ours_raw",
    "paged_jax",
    "paged_raw",
    "knorm_jax",
    "unfused_jax",
    "rmsnorm_jax",
    "jax_baseline",
    "flashinfer",
    "copy",
)
JAX_CONTENDERS = (
    "ours_jax",
    "paged_jax",
    "knorm_jax",
    "unfused_jax",
    "rmsnorm_jax",
    "jax_baseline",
)
DEFAULT_OUT = Path(
    "."
)  # the current directory; pass --out bench/results to refresh the committed results
L2_BYTES = {"gpu": 60e6, "cpu": 32e6}  # H200 L2; a typical CPU last-level cache
MAX_SETS = {"gpu": 32, "cpu": 8}
# Unused pool rows are filled with this value; a kernel that writes where it should not shows up.
POOL_FILL = 0.25
SAMPLE_SLOTS = 2  # sequences compared against the NumPy reference
NORM_EPS = 1e-6
# rmsnorm_jax writes every output once per call into a buffer it owns: at most this many bytes.
NORM_OUTPUT_BYTES = 4e9

# TensorRT Edge-LLM 0.11's kernel on this H200, fp16, H=8, D=128 (not runnable here: quoted).
EDGE_LLM_0_11_US = {
    "decode_b1": 2.64,
    "decode_b8": 3.17,
    "decode_b64": 8.38,
    "prefill_b1_l4096": 26.5,
    "prefill_b8_l2048": 103.4,
}


class Skip(Exception):
    """A contender that cannot run here; the message says why."""


# ---- shapes -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BenchShape:
    """One benchmarked update. fp16/bf16 deltas, H=8, D=128, R=128, P=128 unless stated.

    Both contracts use one pool of ``B * M`` pages: the slot op with ``pages_per_slot = M``,
    the paged op with ``M`` pages per sequence in its table."""

    name: str
    batch: int  # B
    delta_len: int  # L
    dtype: str = "float16"  # deltas
    pool_dtype: str | None = None  # the pool (default: the delta dtype); FP8 takes scales
    num_layers: int | None = None  # layer-batched form when set
    num_kv_heads: int = 8  # H
    head_dim: int = 128  # D
    rotary_dim: int = 128  # R
    page_size: int = 128  # P
    min_capacity: int = 8192  # tokens per sequence at least (M = 64 pages of 128)
    unfused: bool = False  # also time the unfused pair and the norm alone

    @property
    def pages_per_slot(self) -> int:  # M
        # Room for start positions in [0, cap - L] with cap >= 2 L.
        return math.ceil(max(self.min_capacity, 2 * self.delta_len) / self.page_size)

    @property
    def slot_capacity(self) -> int:
        return self.pages_per_slot * self.page_size

    @property
    def num_pages(self) -> int:  # N
        return self.pages_per_slot * self.batch  # maxBatch = B

    @property
    def tokens(self) -> int:  # T
        return self.batch * self.delta_len

    @property
    def layers(self) -> int:
        return self.num_layers or 1

    @property
    def lead(self) -> tuple[int, ...]:
        return (self.num_layers,) if self.num_layers else ()

    @property
    def delta_shape(self) -> tuple[int, ...]:
        return (*self.lead, self.batch, self.delta_len, self.num_kv_heads, self.head_dim)

    @property
    def paged_delta_shape(self) -> tuple[int, ...]:
        return (*self.lead, self.tokens, self.num_kv_heads, self.head_dim)

    @property
    def pool_shape(self) -> tuple[int, ...]:
        return (*self.lead, 2, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def pool_dtype_name(self) -> str:
        return self.pool_dtype or self.dtype

    @property
    def fp8(self) -> bool:
        return self.pool_dtype_name.startswith("float8")

    @property
    def np_dtype(self) -> np.dtype:
        return _np_dtype(self.dtype)

    @property
    def np_pool_dtype(self) -> np.dtype:
        return _np_dtype(self.pool_dtype_name)

    def describe(self) -> str:
        layers = f"{self.num_layers} layers, " if self.num_layers else ""
        pool = f", {self.pool_dtype} pool" if self.pool_dtype else ""
        return f"{layers}B={self.batch} L={self.delta_len} {self.dtype}{pool}"


def _np_dtype(name: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(
        {
            "float16": np.float16,
            "bfloat16": ml_dtypes.bfloat16,
            "float32": np.float32,
            "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
            "float8_e5m2": ml_dtypes.float8_e5m2,
        }[name]
    )


def _gpu_shapes() -> list[BenchShape]:
    fp8 = {"pool_dtype": "float8_e4m3fn"}
    return [
        BenchShape("decode_b1", 1, 16),
        BenchShape("decode_b8", 8, 16),
        BenchShape("decode_b64", 64, 16, unfused=True),
        BenchShape("prefill_b1_l4096", 1, 4096),
        BenchShape("prefill_b8_l2048", 8, 2048, unfused=True),
        BenchShape("decode_b64_5layers", 64, 16, num_layers=5),
        BenchShape("decode_b64_bf16", 64, 16, dtype="bfloat16"),
        BenchShape("prefill_b8_l2048_bf16", 8, 2048, dtype="bfloat16"),
        BenchShape("decode_b64_fp8", 64, 16, **fp8),
        BenchShape("prefill_b8_l2048_fp8", 8, 2048, **fp8),
    ]


def _cpu_shapes() -> list[BenchShape]:
    """The GPU set scaled down so that a 2-core machine finishes in a few minutes."""
    small = {"min_capacity": 512}
    fp8 = {"pool_dtype": "float8_e4m3fn", **small}
    return [
        BenchShape("decode_b1", 1, 16, **small),
        BenchShape("decode_b8", 8, 16, unfused=True, **small),
        BenchShape("prefill_b1_l512", 1, 512, **small),
        BenchShape("prefill_b4_l256", 4, 256, unfused=True, **small),
        BenchShape("decode_b8_5layers", 8, 16, num_layers=5, **small),
        BenchShape("decode_b8_bf16", 8, 16, dtype="bfloat16", **small),
        BenchShape("prefill_b4_l256_bf16", 4, 256, dtype="bfloat16", **small),
        BenchShape("decode_b8_fp8", 8, 16, **fp8),
        BenchShape("prefill_b4_l256_fp8", 4, 256, **fp8),
    ]


def shapes_for(backend: str) -> list[BenchShape]:
    return _gpu_shapes() if backend == "gpu" else _cpu_shapes()


# ---- problems -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Problem:
    """Host data of one shape: ``num_sets`` rotated input sets, the page table, the extras and
    the reference samples. Slot and paged forms address the same rows: token ``b * L + t`` of
    the paged form is token ``t`` of sequence ``b`` at position ``start[b] + t``."""

    shape: BenchShape
    k_sets: list[np.ndarray]  # each delta_shape (the paged form is a reshape)
    v_sets: list[np.ndarray]
    start_sets: list[np.ndarray]  # each [B] int32
    lengths: np.ndarray  # [B] int32
    rope: np.ndarray  # [1, S, R] float32, S = slot capacity (every written key is rotated)
    position_sets: list[np.ndarray]  # each [T] int32
    paged_rope_sets: list[np.ndarray]  # each [T, R] float32: rope rows gathered per token
    owners: np.ndarray  # [T] int32
    table: np.ndarray  # [B, 2, M] int32
    k_scale: np.ndarray | None  # [H] float32 for an FP8 pool
    v_scale: np.ndarray | None
    k_norm_weight: np.ndarray  # [D] delta dtype
    sample_init: np.ndarray  # [2, sample_slots * M, P, H, D]: layer 0's sampled pages before
    sample_slots: int
    bytes: dict[str, int]
    _expected: dict = dataclasses.field(default_factory=dict)

    @property
    def num_sets(self) -> int:
        return len(self.k_sets)

    def scales(self) -> dict:
        return {} if self.k_scale is None else {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def sample_pages(self, contract: str) -> tuple[np.ndarray, np.ndarray]:
        """(K pages, V pages in plane 1) of the sampled sequences, in slot order."""
        n = self.sample_slots * self.shape.pages_per_slot
        if contract == "slot":
            pages = np.arange(n, dtype=np.int32)
            return pages, pages
        rows = self.table[: self.sample_slots]
        return rows[:, 0].reshape(-1), rows[:, 1].reshape(-1) - self.shape.num_pages

    def gather_order(self) -> tuple[np.ndarray, np.ndarray]:
        """(K pages, V pages) of the whole table in slot order: the paged pool gathered by them
        is, page for page, the slot pool (every sequence's pages a permutation of the pool)."""
        return (self.table[:, 0].reshape(-1), self.table[:, 1].reshape(-1) - self.shape.num_pages)

    def expected(self, variant: str) -> np.ndarray:
        """The sample after one update with set 0, from the NumPy reference: ``slot``,
        ``paged`` or ``knorm`` (paged with the fused k-norm)."""
        if variant not in self._expected:
            self._expected[variant] = self._reference(variant)
        return self._expected[variant]

    def _reference(self, variant: str) -> np.ndarray:
        from jax_dflash import reference

        s, n = self.shape, self.sample_slots
        layer0 = (0,) if s.num_layers else ()
        k, v = self.k_sets[0][layer0][:n], self.v_sets[0][layer0][:n]
        if variant == "slot":
            return reference.target_kv_cache_update(
                k,
                v,
                self.sample_init,
                self.rope,
                self.start_sets[0][:n],
                self.lengths[:n],
                pages_per_slot=s.pages_per_slot,
                **self.scales(),
            )
        tokens = n * s.delta_len
        m = s.pages_per_slot
        pages = np.arange(n * m, dtype=np.int32).reshape(n, m)
        sub_table = np.stack([pages, pages + n * m], axis=1)  # the sample pages, in order
        norm = (
            {"k_norm_weight": self.k_norm_weight, "norm_eps": NORM_EPS}
            if variant == "knorm"
            else {}
        )
        return reference.target_kv_cache_update_paged(
            k.reshape(tokens, s.num_kv_heads, s.head_dim),
            v.reshape(tokens, s.num_kv_heads, s.head_dim),
            self.sample_init,
            self.paged_rope_sets[0][:tokens],
            self.position_sets[0][:tokens],
            self.owners[:tokens],
            sub_table,
            **self.scales(),
            **norm,
        )

    def expected_normed_keys(self) -> np.ndarray:
        """HF RMSNorm of set 0's first sampled keys (float32 normalize, round, times weight)."""
        s = self.shape
        x = self.k_sets[0][(0,) * len(s.lead)][: self.sample_slots].astype(np.float32)
        inv = 1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(NORM_EPS))
        u = (x * inv).astype(s.np_dtype)
        return (u.astype(np.float32) * self.k_norm_weight.astype(np.float32)).astype(s.np_dtype)


def bytes_moved(shape: BenchShape, starts: np.ndarray, lengths: np.ndarray) -> dict[str, int]:
    """K/V read + pool rows written + cos/sin rows read, for one update (all layers)."""
    cap = shape.slot_capacity
    t = np.arange(shape.delta_len)[None, :]
    pos = starts.astype(np.int64)[:, None] + t
    written = int(((t < lengths[:, None]) & (pos >= 0) & (pos < cap)).sum())
    heads = shape.num_kv_heads * shape.head_dim
    kv_read = 2 * shape.tokens * heads * shape.np_dtype.itemsize
    pool_write = 2 * written * heads * shape.np_pool_dtype.itemsize
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
    t = np.arange(shape.delta_len, dtype=np.int32)
    position_sets = [(s[:, None] + t[None, :]).reshape(-1).astype(np.int32) for s in start_sets]
    paged_rope_sets = [np.ascontiguousarray(rope[0][p]) for p in position_sets]
    owners = np.repeat(np.arange(shape.batch, dtype=np.int32), shape.delta_len)
    n, m = shape.num_pages, shape.pages_per_slot
    k_pages = rng.permutation(n).astype(np.int32).reshape(shape.batch, m)
    v_pages = rng.permutation(n).astype(np.int32).reshape(shape.batch, m) + n
    table = np.ascontiguousarray(np.stack([k_pages, v_pages], axis=1))
    k_scale = v_scale = None
    if shape.fp8:  # per head, so that unit-normal keys and values use the format's range
        k_scale = rng.uniform(1 / 96, 1 / 48, shape.num_kv_heads).astype(np.float32)
        v_scale = rng.uniform(1 / 96, 1 / 48, shape.num_kv_heads).astype(np.float32)
    k_norm_weight = rng.uniform(0.5, 1.5, shape.head_dim).astype(dtype)

    slots = min(shape.batch, SAMPLE_SLOTS)
    sample_init = rng.standard_normal(
        (2, slots * m, shape.page_size, shape.num_kv_heads, shape.head_dim), dtype=np.float32
    ).astype(shape.np_pool_dtype)
    return Problem(
        shape,
        k_sets,
        v_sets,
        start_sets,
        lengths,
        rope,
        position_sets,
        paged_rope_sets,
        owners,
        table,
        k_scale,
        v_scale,
        k_norm_weight,
        sample_init,
        slots,
        bytes_moved(shape, start_sets[0], lengths),
    )


# ---- correctness --------------------------------------------------------------------------------

_EPS = {
    "float16": 2.0**-10,
    "bfloat16": 2.0**-7,
    "float32": 2.0**-23,
    "float8_e4m3fn": 2.0**-3,
    "float8_e5m2": 2.0**-2,
}


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def compare_sample(
    got: np.ndarray, want: np.ndarray, exact_required: bool, magnitude: float = 1.0
) -> dict:
    """A contender's sample after one update against the NumPy reference's: bit-exact, or
    within two ulps of max(|expected|, ``magnitude``)."""
    got = np.asarray(got).reshape(want.shape)
    if got.dtype != want.dtype:
        got = got.view(want.dtype) if got.dtype.itemsize == want.dtype.itemsize else got
    exact = bool(np.array_equal(_bits(got), _bits(want)))
    got32, want32 = got.astype(np.float32), want.astype(np.float32)
    diff = np.abs(got32 - want32)
    max_abs = float(np.nanmax(diff)) if diff.size else 0.0
    tol = 2 * _EPS[want.dtype.name] * np.maximum(np.abs(want32), magnitude)
    close = bool(np.all(diff <= tol)) and not np.isnan(got32).any()
    ok = exact if exact_required else close
    return {
        "ok": ok,
        "bit_exact": exact,
        "max_abs_diff": max_abs,
        "criterion": "bit-exact"
        if exact_required
        else "within 2 ulp" + (f" at magnitude {magnitude:g}" if magnitude != 1 else ""),
    }


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


class GpuClocks:
    """The GPU's SM clock and power draw, sampled by ``nvidia-smi`` (a read-only query) every
    ``period_ms`` while the benchmark runs, so that each result can say at which clock it was
    measured: under a sustained load the H200 holds its power limit (700 W) by lowering the SM
    clock, and kernels with more arithmetic per byte slow down more than copies
    (BENCHMARKS.md, "Power"). ``start()`` returns why sampling is off, or None."""

    QUERY = "timestamp,clocks.sm,power.draw"

    def __init__(self, period_ms: int = 100):
        self.period_ms = period_ms
        self._proc = None
        self._log = None

    def start(self) -> str | None:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return "nvidia-smi is not on PATH"
        self._log = tempfile.TemporaryFile(mode="w+")
        command = [exe, f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits"]
        command += ["-i", self.gpu, "-lms", str(self.period_ms)]
        try:
            self._proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.DEVNULL)
        except OSError as e:  # found but not runnable here: the run goes on without clocks
            self._log.close()
            self._log = None
            return f"nvidia-smi could not be started ({e})"
        return None

    @property
    def gpu(self) -> str:
        return sampled_gpu(os.environ.get("CUDA_VISIBLE_DEVICES"))

    def samples(self) -> list[tuple[float, float, float]]:
        """(epoch seconds, SM MHz, watts) of every sample so far."""
        if self._log is None:
            return []
        self._log.flush()
        self._log.seek(0)
        return parse_clock_samples(self._log.read().splitlines())

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._proc = None


def sampled_gpu(visible: str | None) -> str:
    """The GPU nvidia-smi should sample (its ``-i``): the one the benchmark runs on, the first
    of ``CUDA_VISIBLE_DEVICES`` (an index or a UUID; nvidia-smi itself ignores that variable and
    would print a line per GPU of the host), else GPU 0."""
    first = (visible or "").split(",")[0].strip()
    return first or "0"


def parse_clock_samples(lines: list[str]) -> list[tuple[float, float, float]]:
    """nvidia-smi's ``timestamp, clocks.sm, power.draw`` lines (csv, no header, no units; the
    timestamp in this machine's local time, as ``time.time()`` counts) -> (epoch seconds, SM
    MHz, watts). Lines that are not such a sample (a last one cut short, [N/A]) are left out."""
    out = []
    for line in lines:
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f")
            out.append((stamp.timestamp(), float(parts[1]), float(parts[2])))
        except ValueError:
            continue
    return out


def clocks_during(
    windows: list[tuple[float, float]], samples: list[tuple[float, float, float]]
) -> dict | None:
    """The clock samples taken inside ``windows`` (one contender's measurements): how many, the
    lowest and the median SM clock, the highest power draw. None when no sample fell in them
    (a measurement is shorter than the sampling period at small settings)."""
    inside = [(mhz, watts) for t, mhz, watts in samples if any(a <= t <= b for a, b in windows)]
    if not inside:
        return None
    mhz = [m for m, _ in inside]
    return {
        "samples": len(inside),
        "sm_mhz_min": min(mhz),
        "sm_mhz_median": statistics.median(mhz),
        "power_w_max": max(w for _, w in inside),
    }


def _below_top_clock(results: dict) -> tuple[float | None, list[tuple[str, str, dict]]]:
    """The highest median SM clock of the run's results, and the (shape, contender, clocks) of
    every result measured at a lower median: the ones a power or thermal limit slowed down."""
    measured = [
        (e["name"], name, c["clocks"])
        for e in results["shapes"]
        for name, c in e["contenders"].items()
        if c.get("clocks")
    ]
    if not measured:
        return None, []
    top = max(k["sm_mhz_median"] for _, _, k in measured)
    return top, [(shape, name, k) for shape, name, k in measured if k["sm_mhz_median"] < top]


def clock_notes(results: dict) -> list[str]:
    """One line per contender measured at a median SM clock below the highest median of the run."""
    top, slow = _below_top_clock(results)
    return [
        f"{shape} {name}: SM clock median {k['sm_mhz_median']:.0f} MHz (min {k['sm_mhz_min']:.0f}, "
        f"{k['samples']} samples) against {top:.0f} MHz, power up to {k['power_w_max']:.0f} W"
        for shape, name, k in slow
    ]


def mark_clock_limited(results: dict) -> None:
    """Marks each target of a shape in which a contender was measured below the run's highest
    median SM clock (``clock_limited``: the contenders' names), so that a target met or missed
    under a power limit says so where it is printed."""
    by_shape: dict[str, list[str]] = {}
    for shape, name, _ in _below_top_clock(results)[1]:
        by_shape.setdefault(shape, []).append(name)
    for t in results["targets"]:
        shape = t["target"].split(":", 1)[0]
        if shape in by_shape:
            t["clock_limited"] = by_shape[shape]


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


def time_interleaved(
    prepared: dict[str, Prepared], settings: Settings, clocks: GpuClocks | None = None
) -> dict[str, dict]:
    """Times every prepared contender ``settings.repeats`` times, interleaved.

    Each contender is warmed up and calibrated (calls per measurement, so that one lasts at
    least ``min_time``); then the measurements go round the contenders, the order rotated by
    one each round, so that every contender is timed in every position. A contender timed on
    its own right after its setup can measure slow for reasons that have nothing to do with it
    (BENCHMARKS.md, "How the benchmark times"). Median seconds per update over the repeats.
    With ``clocks``, each result also gets ``clocks``: the GPU's clock samples taken during its
    own measurements (``clocks_during``)."""
    calls, out = {}, {}
    for name, p in prepared.items():
        try:
            calls[name] = _calibrate(p.run, settings.min_time)
        except Exception as e:  # noqa: BLE001 - one failing contender must not end the run
            out[name] = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
    names = [n for n in prepared if n in calls]
    samples = {n: [] for n in names}
    windows = {n: [] for n in names}  # wall-clock spans of each contender's measurements
    for r in range(settings.repeats if names else 0):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if name in out:
                continue  # failed in an earlier round
            p = prepared[name]
            try:
                start = time.time()
                seconds = p.run(calls[name])
                windows[name].append((start, time.time()))
            except Exception as e:  # noqa: BLE001
                out[name] = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
                continue
            samples[name].append(seconds / (calls[name] * p.updates_per_call))
    clock_samples = clocks.samples() if clocks is not None else []
    for name in names:
        if name in out:
            continue
        us = [x * 1e6 for x in samples[name]]
        result = dict(prepared[name].info)
        result.update(
            {
                "us": statistics.median(us),
                "us_min": min(us),
                "us_max": max(us),
                "samples_us": [round(x, 4) for x in us],
                "updates_per_measurement": calls[name] * prepared[name].updates_per_call,
            }
        )
        if clocks is not None:
            result["clocks"] = clocks_during(windows[name], clock_samples)
        if prepared[name].finish is not None:
            prepared[name].finish(result)
        out[name] = result
    return out


# ---- JAX contenders -------------------------------------------------------------------------------


def _jax_device(backend: str):
    import jax

    return jax.devices("gpu" if backend == "gpu" else "cpu")[0]


class JaxInputs:
    """One shape's operands on the JAX device, uploaded once and shared by the JAX contenders."""

    def __init__(self, problem: Problem, device):
        import jax

        put = functools.partial(jax.device_put, device=device)
        self.device = device
        self.ks = tuple(put(k) for k in problem.k_sets)
        self.vs = tuple(put(v) for v in problem.v_sets)
        self.starts = tuple(put(s) for s in problem.start_sets)
        self.positions = tuple(put(p) for p in problem.position_sets)
        self.paged_ropes = tuple(put(r) for r in problem.paged_rope_sets)
        self.rope, self.lengths = put(problem.rope), put(problem.lengths)
        self.owners, self.table = put(problem.owners), put(problem.table)
        self.scales = {k: put(v) for k, v in problem.scales().items()}
        self.k_norm_weight = put(problem.k_norm_weight)


def _jax_pool(problem: Problem, device, contract: str):
    """The known pool: POOL_FILL, with the sample in the sampled sequences' pages (layer 0)."""
    import jax
    import jax.numpy as jnp

    s = problem.shape
    k_pages, v_pages = problem.sample_pages(contract)
    at = (0,) * len(s.lead)

    @jax.jit
    def build(sample, k_pages, v_pages):
        pool = jnp.full(s.pool_shape, POOL_FILL, dtype=s.np_pool_dtype)
        pool = pool.at[(*at, 0, k_pages)].set(sample[0])
        return pool.at[(*at, 1, v_pages)].set(sample[1])

    put = functools.partial(jax.device_put, device=device)
    return build(put(problem.sample_init), put(k_pages), put(v_pages))


def rms_norm(x, weight, eps: float):
    """The model's RMSNorm (HF): normalize in float32, round to x's dtype, times the weight."""
    import jax
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + jnp.float32(eps))
    return weight * (x32 * inv).astype(x.dtype)


def _jax_update(name: str, shape: BenchShape, inputs: JaxInputs):
    """(update(pool, per_set, shared) -> pool, per-set operand tuples, shared operands)."""
    import jax

    import jax_dflash
    from jax_dflash import baseline

    m = shape.pages_per_slot
    if name in ("ours_jax", "jax_baseline"):
        sets = tuple(zip(inputs.ks, inputs.vs, inputs.starts))
        shared = (inputs.rope, inputs.lengths, inputs.scales)
        if name == "ours_jax":

            def update(pool, per_set, shared):
                (k, v, starts), (rope, lengths, scales) = per_set, shared
                return jax_dflash.target_kv_cache_update(
                    k, v, pool, rope, starts, lengths, pages_per_slot=m, **scales
                )

            return update, sets, shared
        one = functools.partial(baseline.target_kv_cache_update, pages_per_slot=m)
        if (
            shape.num_layers
        ):  # what a JAX user writes for stacked layers: vmap the one-layer version
            one = jax.vmap(one, in_axes=(0, 0, 0, None, None, None))

        def update(pool, per_set, shared):
            (k, v, starts), (rope, lengths, _) = per_set, shared
            return one(k, v, pool, rope, starts, lengths)

        return update, sets, shared

    sets = tuple(zip(inputs.ks, inputs.vs, inputs.positions, inputs.paged_ropes))
    shared = (inputs.owners, inputs.table, inputs.scales, inputs.k_norm_weight)
    tokens = shape.paged_delta_shape

    def update(pool, per_set, shared, step=None):
        (k, v, positions, rope), (owners, table, scales, weight) = per_set, shared
        k, v = k.reshape(tokens), v.reshape(tokens)  # a bitcast under jit
        extra = {}
        if name == "knorm_jax":
            extra = {"k_norm_weight": weight, "norm_eps": NORM_EPS}
        elif name == "unfused_jax":
            k = rms_norm(k if step is None else distinct(k, step), weight, NORM_EPS)
        return jax_dflash.target_kv_cache_update_paged(
            k, v, pool, rope, positions, owners, table, **scales, **extra
        )

    return update, sets, shared


def jitted_chain(update: Callable, chain: int, per_step: bool = False):
    """``update`` applied ``chain`` times in one jitted function, pool donated, input sets
    rotated: ``step(pool, sets, shared) -> pool`` with ``update(pool, sets[j], shared)``.

    ``per_step``: ``step(pool, sets, shared, steps)`` with ``steps`` an int32 ``[chain]`` array
    of non-negative values, and ``update(pool, sets[j], shared, steps[i])``: a value XLA cannot
    know, for updates that must keep jnp work on the inputs from being computed once per set
    (see ``distinct``)."""
    import jax

    def chained(pool, sets, shared, steps=None):
        # Unrolled: each update reads its own operands (no slicing copies in front of the call).
        for i in range(chain):
            extra = (steps[i],) if per_step else ()
            pool = update(pool, sets[i % len(sets)], shared, *extra)
        return pool

    return jax.jit(chained, donate_argnums=0)


def distinct(x, step):
    """``x`` itself (``step >= 0`` at run time), as a value of its own per chain step.

    The chain repeats each input set, so XLA computes jnp work on a set's inputs (the unfused
    pair's RMSNorm) once per set and reuses it, and that work would not be timed. The select on
    a runtime scalar fuses into the work's own kernel and changes no bit."""
    import jax.numpy as jnp

    return jnp.where(step >= 0, x, jnp.zeros_like(x))


def _host_timed(step, state: dict, args: tuple, chain: int, settings: Settings) -> Prepared:
    """A jitted ``step(carried, *args) -> carried`` called back to back, timed from the host."""
    dispatch = []  # host seconds per call spent dispatching (the GPU runs behind it)

    def run(calls: int) -> float:
        import jax

        carried = state["carried"]
        jax.block_until_ready(carried)
        t0 = time.perf_counter()
        for _ in range(calls):
            carried = step(carried, *args)
        dispatched = time.perf_counter() - t0
        jax.block_until_ready(carried)
        elapsed = time.perf_counter() - t0
        state["carried"] = carried
        dispatch.append(dispatched / calls)
        return elapsed

    def finish(result: dict) -> None:
        # Wall time is device time only while the host dispatches faster than the GPU runs: when
        # dispatching a call takes most of its time, the number is host-bound (an upper bound).
        timed = dispatch[-len(result["samples_us"]) :]  # the measurements, not the calibration
        host_us = statistics.median(timed) / chain * 1e6
        result["host_dispatch_us"] = host_us
        result["host_bound"] = host_us >= 0.8 * result["us"]
        kernels = kernel_device_us(run, chain)
        if kernels is not None:
            result["kernels_us"] = kernels

    return Prepared(run, chain, {"chain": chain}, finish if settings.backend == "gpu" else None)


def kernel_device_us(run: Callable[[int], float], updates: int) -> dict[str, float] | None:
    """µs of device time per update of each kernel that one ``run(1)`` launches, by kernel name,
    from the CUDA profiling interface (CUPTI, through torch.profiler): what the kernels take
    themselves, without the gaps between launches. None without torch's CUDA profiler."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(1)
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", 0.0)
        if us > 0:
            times[event.key] = times.get(event.key, 0.0) + us / updates
    return times or None


def norm_kernels_us(kernels: dict[str, float]) -> float:
    """The unfused pair's kernels other than this project's update kernel: the RMSNorm's."""
    return sum(us for name, us in kernels.items() if "update_kernel" not in name)


def _bit_mismatches_jax(a, b) -> int:
    import jax
    import jax.numpy as jnp

    word = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
    return int(
        jax.jit(
            lambda x, y: jnp.sum(
                jax.lax.bitcast_convert_type(x, word) != jax.lax.bitcast_convert_type(y, word)
            )
        )(a, b)
    )


def _gather_jax(pool, problem: Problem):
    """The paged pool in slot order (see Problem.gather_order)."""
    import jax
    import jax.numpy as jnp

    k_pages, v_pages = (jax.device_put(p, pool.device) for p in problem.gather_order())
    lead = len(problem.shape.lead)

    @jax.jit
    def gather(pool, k_pages, v_pages):
        planes = jnp.moveaxis(pool, lead, 0)  # [2, (layers,) N, P, H, D]
        return jnp.moveaxis(
            jnp.stack(
                [jnp.take(planes[0], k_pages, axis=lead), jnp.take(planes[1], v_pages, axis=lead)]
            ),
            0,
            lead,
        )

    return gather(pool, k_pages, v_pages)


def _sample_of(pool, problem: Problem, contract: str) -> np.ndarray:
    """The sampled pages of layer 0 of a pool (JAX, torch or NumPy), on the host."""
    k_pages, v_pages = problem.sample_pages(contract)
    if problem.shape.num_layers:
        pool = pool[0]
    if hasattr(pool, "detach"):  # torch
        import torch

        dtype = problem.shape.np_pool_dtype
        k_pages, v_pages = (
            torch.from_numpy(p.astype(np.int64)).to(pool.device) for p in (k_pages, v_pages)
        )
        return (
            _from_torch(pool[0].index_select(0, k_pages), dtype),
            _from_torch(pool[1].index_select(0, v_pages), dtype),
        )
    return np.asarray(pool[0][k_pages]), np.asarray(pool[1][v_pages])


def _sample_array(pool, problem: Problem, contract: str) -> np.ndarray:
    k, v = _sample_of(pool, problem, contract)
    return np.stack([k, v])


def _prepare_jax(name: str, problem: Problem, settings: Settings, ctx: dict) -> Prepared:
    import jax
    import jax.numpy as jnp

    shape = problem.shape
    if name == "jax_baseline" and shape.fp8:
        raise Skip("the straightforward JAX version has no FP8 pool")
    if name in ("unfused_jax", "rmsnorm_jax") and not shape.unfused:
        return {"status": "n/a", "reason": "timed at the shapes marked unfused only"}
    inputs = ctx.get("jax_inputs")
    if inputs is None:
        inputs = ctx["jax_inputs"] = JaxInputs(problem, _jax_device(settings.backend))
    device = inputs.device
    if name == "rmsnorm_jax":
        return _prepare_rmsnorm(problem, settings, inputs)

    update, sets, shared = _jax_update(name, shape, inputs)
    contract = "slot" if name in ("ours_jax", "jax_baseline") else "paged"
    once = jax.jit(update)(_jax_pool(problem, device, contract), sets[0], shared)
    variant = {
        "ours_jax": "slot",
        "jax_baseline": "slot",
        "paged_jax": "paged",
        "knorm_jax": "knorm",
        "unfused_jax": "knorm",
    }[name]
    # The unfused pair's normed keys may differ from the fused ones by an ulp (SPEC.md, "Fused
    # norms"), which RoPE carries at the magnitude of the normed keys (below 8 here).
    check = compare_sample(
        _sample_array(once, problem, contract),
        problem.expected(variant),
        exact_required=name in ("ours_jax", "paged_jax", "knorm_jax"),
        magnitude=8.0 if name == "unfused_jax" else 1.0,
    )
    if name == "ours_jax" and not shape.fp8:  # the whole pool, against the baseline's
        base, _, _ = _jax_update("jax_baseline", shape, inputs)
        other = jax.jit(base)(_jax_pool(problem, device, "slot"), sets[0], shared)
        diff = jax.jit(
            lambda a, b: jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
        )(once, other)
        check["full_pool_max_abs_diff_vs_baseline"] = float(diff)
        tol = 2 * _EPS[shape.dtype] * 8  # |rotated keys| stay well below 8 here
        check["ok"] = check["ok"] and float(diff) <= tol
        del other
    if name in ("paged_jax", "knorm_jax"):  # the whole pool, against the slot op's
        twin = _slot_twin_jax(problem, inputs, knorm=name == "knorm_jax")
        mismatches = _bit_mismatches_jax(_gather_jax(once, problem), twin)
        check["full_pool_bits_differing_vs_slot_op"] = mismatches
        check["ok"] = check["ok"] and mismatches == 0
        del twin
    del once

    chain = settings.baseline_chain if name == "jax_baseline" else settings.chain
    # The unfused pair's norm is computed in every update, not once per input set.
    per_step = name == "unfused_jax"
    step = jitted_chain(update, chain, per_step=per_step)
    state = {"carried": _jax_pool(problem, device, contract)}
    args = (sets, shared) + ((jnp.arange(chain, dtype=jnp.int32),) if per_step else ())
    prepared = _host_timed(step, state, args, chain, settings)
    prepared.info["check"] = check
    return prepared


def _slot_twin_jax(problem: Problem, inputs: JaxInputs, knorm: bool):
    """The slot op's pool after set 0 from the known slot pool (with the k-norm when asked)."""
    import jax

    import jax_dflash

    s = problem.shape
    extra = {"k_norm_weight": inputs.k_norm_weight, "norm_eps": NORM_EPS} if knorm else {}
    op = functools.partial(
        jax_dflash.target_kv_cache_update, pages_per_slot=s.pages_per_slot, **inputs.scales, **extra
    )
    return jax.jit(op)(
        inputs.ks[0],
        inputs.vs[0],
        _jax_pool(problem, inputs.device, "slot"),
        inputs.rope,
        inputs.starts[0],
        inputs.lengths,
    )


def _prepare_rmsnorm(problem: Problem, settings: Settings, inputs: JaxInputs) -> Prepared:
    """The keys' RMSNorm alone: every call writes ``chain`` normed copies into the slices of one
    carried, donated buffer, each slice once, so no write is dead and none is elided (one
    buffer, not ``chain``: per-buffer dispatch cost made a tuple of outputs host-bound). On the
    H200 XLA also copies the whole carried buffer once per call (a device-to-device copy in the
    result's ``kernels_us``), so this time is an upper bound of the norm's own; the norm's
    kernels are the rest of ``kernels_us``, and the unfused pair's own (``norm_kernels_us``)."""
    import jax
    import jax.numpy as jnp

    s = problem.shape
    key_bytes = math.prod(s.delta_shape) * s.np_dtype.itemsize
    chain = int(max(1, min(settings.chain, NORM_OUTPUT_BYTES // key_bytes)))

    def chained(out, ks, weight, steps):
        for i in range(chain):
            out = out.at[i].set(rms_norm(distinct(ks[i % len(ks)], steps[i]), weight, NORM_EPS))
        return out

    step = jax.jit(chained, donate_argnums=0)
    got = np.asarray(
        jax.jit(rms_norm, static_argnums=2)(inputs.ks[0], inputs.k_norm_weight, NORM_EPS)
    )
    want = problem.expected_normed_keys()
    got = got[(0,) * len(s.lead)][: problem.sample_slots]
    check = compare_sample(got, want, exact_required=False)
    out = jnp.zeros((chain, *s.delta_shape), s.np_dtype, device=inputs.device)
    steps = jnp.arange(chain, dtype=jnp.int32)
    prepared = _host_timed(
        step, {"carried": out}, (inputs.ks, inputs.k_norm_weight, steps), chain, settings
    )
    prepared.info.update({"check": check, "what": "jnp RMSNorm of the keys alone"})
    return prepared


# ---- torch-side GPU contenders (raw launchers, FlashInfer, copy) ----------------------------------


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
    return {
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float32": torch.float32,
        "float8_e4m3fn": torch.uint8,
        "float8_e5m2": torch.uint8,
    }[dtype]


def _to_torch(torch, array: np.ndarray):
    """Host array -> CUDA tensor. 16-bit floats carried as int16 bits (torch lacks bf16 NumPy);
    FP8 stays uint8 bits (what the raw launcher takes, with pool_dtype naming the format)."""
    a = np.ascontiguousarray(array)
    if a.dtype.name in ("bfloat16", "float16"):
        return torch.from_numpy(a.view(np.int16)).cuda().view(_torch_dtype(torch, a.dtype.name))
    if a.dtype.itemsize == 1:
        return torch.from_numpy(a.view(np.uint8)).cuda()
    return torch.from_numpy(a).cuda()


def _from_torch(tensor, dtype: np.dtype) -> np.ndarray:
    import torch

    t = tensor.detach().contiguous().cpu()
    if dtype.itemsize == 2:
        return t.view(torch.int16).numpy().view(dtype)
    if dtype.itemsize == 1:
        return t.view(torch.uint8).numpy().view(dtype)
    return t.numpy()


def _torch_pool(torch, problem: Problem, contract: str):
    s = problem.shape
    fill = np.full((), POOL_FILL, np.float32).astype(s.np_pool_dtype)
    if s.fp8:
        pool = torch.full(s.pool_shape, int(fill.view(np.uint8)), dtype=torch.uint8, device="cuda")
    else:
        pool = torch.full(
            s.pool_shape, POOL_FILL, dtype=_torch_dtype(torch, s.dtype), device="cuda"
        )
    k_pages, v_pages = (
        torch.from_numpy(p.astype(np.int64)).cuda() for p in problem.sample_pages(contract)
    )
    layer = pool[0] if s.num_layers else pool
    sample = _to_torch(torch, problem.sample_init)
    layer[0].index_copy_(0, k_pages, sample[0])
    layer[1].index_copy_(0, v_pages, sample[1])
    return pool


def _graph(torch, enqueue: Callable[[int], None], chain: int, info: dict) -> Prepared:
    """Captures ``enqueue(i)`` for i < chain into one CUDA graph, replays timed with events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(min(chain, 3)):
            enqueue(i)
    torch.cuda.current_stream().wait_stream(side)
    gc.collect()  # JAX frees the buffers of earlier contenders now, not during the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # Thread-local: JAX's own threads (frees, event polling) may call CUDA during the capture; in
    # torch's default global mode such a call invalidates the capture and leaves JAX's stream in
    # an error state (seen on the H200 at the 5-layer shape).
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
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


class TorchInputs:
    """One shape's operands as CUDA tensors, uploaded once and shared by the raw contenders."""

    def __init__(self, torch, problem: Problem):
        s = problem.shape
        up = functools.partial(_to_torch, torch)
        self.ks = [up(k) for k in problem.k_sets]
        self.vs = [up(v) for v in problem.v_sets]
        self.paged_ks = [k.view(s.paged_delta_shape) for k in self.ks]
        self.paged_vs = [v.view(s.paged_delta_shape) for v in self.vs]
        self.starts = [up(x) for x in problem.start_sets]
        self.positions = [up(p) for p in problem.position_sets]
        self.paged_ropes = [up(r) for r in problem.paged_rope_sets]
        self.rope, self.lengths = up(problem.rope), up(problem.lengths)
        self.owners, self.table = up(problem.owners), up(problem.table)
        self.scales = {k: up(v) for k, v in problem.scales().items()}


def _raw_launchers(problem: Problem, torch, inputs: TorchInputs):
    """{contract: launch(pool, j)} over the raw CUDA entries (arrays through DLPack)."""
    from jax_dflash import _ext

    try:
        cuda = _ext.extension("cuda")
    except ImportError as e:
        raise Skip(str(e)) from e
    s = problem.shape
    dtypes = {"pool_dtype": s.pool_dtype_name if s.fp8 else ""}

    def slot(pool, j: int) -> None:
        cuda.launch(
            k_delta=inputs.ks[j],
            v_delta=inputs.vs[j],
            pool=pool,
            rope_cos_sin=inputs.rope,
            delta_start_positions=inputs.starts[j],
            delta_lengths=inputs.lengths,
            **inputs.scales,
            pages_per_slot=s.pages_per_slot,
            **dtypes,
            stream=torch.cuda.current_stream().cuda_stream,
        )

    def paged(pool, j: int) -> None:
        cuda.launch_paged(
            k_delta=inputs.paged_ks[j],
            v_delta=inputs.paged_vs[j],
            pool=pool,
            rope_cos_sin=inputs.paged_ropes[j],
            delta_positions=inputs.positions[j],
            delta_token_to_sequence=inputs.owners,
            kv_page_table=inputs.table,
            **inputs.scales,
            **dtypes,
            stream=torch.cuda.current_stream().cuda_stream,
        )

    return {"slot": slot, "paged": paged}


def _torch_mismatches(torch, a, b) -> int:
    """Elements whose bits differ, in chunks (a whole-pool mask summed in int64 is 8x the pool)."""
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    a, b = a.reshape(-1).view(word), b.reshape(-1).view(word)
    if torch.equal(a, b):
        return 0
    return sum(int(torch.count_nonzero(x != y)) for x, y in zip(a.split(1 << 28), b.split(1 << 28)))


def _prepare_raw_gpu(name: str, problem: Problem, settings: Settings, ctx: dict) -> Prepared:
    torch = _torch()
    s = problem.shape
    if "torch_inputs" not in ctx:
        ctx["torch_inputs"] = TorchInputs(torch, problem)
    inputs = ctx["torch_inputs"]
    launchers = _raw_launchers(problem, torch, inputs)
    contract = "slot" if name == "ours_raw" else "paged"
    launch = launchers[contract]
    pool = _torch_pool(torch, problem, contract)
    launch(pool, 0)
    torch.cuda.synchronize()
    check = compare_sample(
        _sample_array(pool, problem, contract), problem.expected(contract), exact_required=True
    )
    if contract == "paged":  # the whole pool, gathered in slot order, against the slot launcher's
        twin = _torch_pool(torch, problem, "slot")
        launchers["slot"](twin, 0)
        k_pages, v_pages = (
            torch.from_numpy(p.astype(np.int64)).cuda() for p in problem.gather_order()
        )
        lead = len(s.lead)
        gathered = torch.stack(
            [
                pool.select(lead, 0).index_select(lead, k_pages),
                pool.select(lead, 1).index_select(lead, v_pages),
            ],
            dim=lead,
        )
        mismatches = _torch_mismatches(torch, gathered, twin)
        check["full_pool_bits_differing_vs_slot_op"] = mismatches
        check["ok"] = check["ok"] and mismatches == 0
        del twin, gathered
    info = {"check": check}
    return _graph(torch, lambda i: launch(pool, i % len(inputs.ks)), settings.chain, info)


def _flashinfer():
    try:
        import flashinfer
    except Exception as e:  # any import failure means: not available here
        raise Skip(
            f"flashinfer is not importable ({type(e).__name__}: {e}); install "
            "flashinfer-python==0.2.8 (BENCHMARKS.md, Reproducing)"
        ) from e
    return flashinfer


def _prepare_flashinfer(problem: Problem, settings: Settings) -> Prepared:
    s = problem.shape
    if s.fp8:
        raise Skip("FP8 pool: FlashInfer's append writes the cache in the key's dtype")
    torch = _torch()
    flashinfer = _flashinfer()
    nnz = s.tokens
    tokens = (nnz, s.num_kv_heads, s.head_dim)

    def layers_of(array):  # one [nnz, H, D] tensor per layer
        t = _to_torch(torch, array)
        if s.num_layers:
            return [t[layer].reshape(tokens) for layer in range(s.layers)]
        return [t.reshape(tokens)]

    ks = [layers_of(k) for k in problem.k_sets]
    vs = [layers_of(v) for v in problem.v_sets]
    t_index = torch.arange(s.delta_len, dtype=torch.int32, device="cuda")
    positions = [
        (_to_torch(torch, x)[:, None] + t_index[None, :]).reshape(nnz).contiguous()
        for x in problem.start_sets
    ]
    batch_indices = torch.arange(s.batch, dtype=torch.int32, device="cuda").repeat_interleave(
        s.delta_len
    )
    kv_indices = torch.arange(s.num_pages, dtype=torch.int32, device="cuda")
    kv_indptr = torch.arange(s.batch + 1, dtype=torch.int32, device="cuda") * s.pages_per_slot
    last_page_len = torch.full((s.batch,), s.page_size, dtype=torch.int32, device="cuda")
    cos_sin = _to_torch(torch, problem.rope[0])  # [S, R]: cos then sin, FlashInfer's layout

    # Keys only: the rope module the public call wraps, with a query of zero heads, is the
    # cheapest FlashInfer path (a 1-head query otherwise: the public API needs one).
    no_query = torch.empty((nnz, 0, s.head_dim), dtype=_torch_dtype(torch, s.dtype), device="cuda")

    def rope_keys_only(pos, key):
        flashinfer.rope._apply_rope_pos_ids_cos_sin_cache(
            q=no_query,
            k=key,
            q_rope=no_query,
            k_rope=key,
            cos_sin_cache=cos_sin,
            pos_ids=pos,
            interleave=False,
        )

    one_head_query = torch.zeros(
        (nnz, s.head_dim), dtype=_torch_dtype(torch, s.dtype), device="cuda"
    )

    def rope_public(pos, key):
        flashinfer.apply_rope_with_cos_sin_cache_inplace(
            positions=pos,
            query=one_head_query,
            key=key.view(nnz, -1),
            head_size=s.head_dim,
            cos_sin_cache=cos_sin,
            is_neox=True,
        )

    def update(pool, j: int, rope_fn) -> None:
        for layer in range(s.layers):
            layer_pool = pool[layer] if s.num_layers else pool
            rope_fn(positions[j], ks[j][layer])
            flashinfer.append_paged_kv_cache(
                ks[j][layer],
                vs[j][layer],
                batch_indices,
                positions[j],
                (layer_pool[0], layer_pool[1]),
                kv_indices,
                kv_indptr,
                last_page_len,
                kv_layout="NHD",
            )

    # Correctness on a copy of set 0 (the rope is in place): the first variant that runs and
    # matches the reference is timed (if none matches, the last one that ran, marked wrong).
    original = [k.clone() for k in ks[0]]
    variant, check, pool, errors = None, None, None, []
    for name, rope_fn in (
        ("keys only (rope module, 0 query heads)", rope_keys_only),
        ("public API (1-head query)", rope_public),
    ):
        for layer, k in enumerate(original):
            ks[0][layer].copy_(k)
        candidate = _torch_pool(torch, problem, "slot")
        try:
            update(candidate, 0, rope_fn)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - try the next variant
            errors.append(f"{name}: {type(e).__name__}: {e}")
            continue
        variant, pool = (name, rope_fn), candidate
        check = compare_sample(
            _sample_array(pool, problem, "slot"), problem.expected("slot"), exact_required=False
        )
        if check["ok"]:
            break
        errors.append(f"{name}: result differs from the reference ({check})")
    if variant is None:
        raise Skip("flashinfer calls failed: " + " | ".join(errors))
    for layer, k in enumerate(original):
        ks[0][layer].copy_(k)
    info = {
        "check": check,
        "variant": variant[0],
        "version": getattr(flashinfer, "__version__", "unknown"),
    }
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
    return _graph(
        torch,
        lambda i: dests[i % num_sets].copy_(sources[i % num_sets]),
        settings.chain,
        {
            "check": {"ok": True, "criterion": "none (the floor)"},
            "bytes_copied": size,
            "copy_sets": num_sets,
        },
    )


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


def _raw_view(a: np.ndarray) -> np.ndarray:
    """What the NumPy entries take: bfloat16 as uint16 bits, FP8 as uint8 bits."""
    if a.dtype.name == "bfloat16":
        return a.view(np.uint16)
    if a.dtype.name.startswith("float8"):
        return a.view(np.uint8)
    return a


def _prepare_raw_cpu(name: str, problem: Problem, settings: Settings) -> Prepared:
    from jax_dflash import _ext

    cpu = _ext.extension("cpu")
    s = problem.shape
    contract = "slot" if name == "ours_raw" else "paged"
    pool = np.full(s.pool_shape, POOL_FILL, dtype=np.float32).astype(s.np_pool_dtype)
    k_pages, v_pages = problem.sample_pages(contract)
    layer = pool[0] if s.num_layers else pool
    layer[0, k_pages] = problem.sample_init[0]
    layer[1, v_pages] = problem.sample_init[1]
    raw_pool = _raw_view(pool)
    ks = [_raw_view(k) for k in problem.k_sets]
    vs = [_raw_view(v) for v in problem.v_sets]
    paged_ks = [k.reshape(s.paged_delta_shape) for k in ks]
    paged_vs = [v.reshape(s.paged_delta_shape) for v in vs]
    dtypes = {"delta_dtype": s.dtype, "pool_dtype": s.pool_dtype_name}
    scales = problem.scales()

    def update(j: int) -> None:
        if contract == "slot":
            cpu.target_kv_cache_update(
                ks[j],
                vs[j],
                raw_pool,
                problem.rope,
                problem.start_sets[j],
                problem.lengths,
                **scales,
                pages_per_slot=s.pages_per_slot,
                **dtypes,
            )
        else:
            cpu.target_kv_cache_update_paged(
                paged_ks[j],
                paged_vs[j],
                raw_pool,
                problem.paged_rope_sets[j],
                problem.position_sets[j],
                problem.owners,
                problem.table,
                **scales,
                **dtypes,
            )

    update(0)
    check = compare_sample(
        _sample_array(pool, problem, contract), problem.expected(contract), exact_required=True
    )
    return _host_loop(lambda i: update(i % len(ks)), settings.chain, {"check": check})


def _prepare_copy_cpu(problem: Problem, settings: Settings) -> Prepared:
    size, num_sets = _copy_sets(problem, "cpu")
    sources = [np.ones(size, np.uint8) for _ in range(num_sets)]
    dests = [np.zeros(size, np.uint8) for _ in range(num_sets)]
    return _host_loop(
        lambda i: np.copyto(dests[i % num_sets], sources[i % num_sets]),
        settings.chain,
        {
            "check": {"ok": True, "criterion": "none (the floor)"},
            "bytes_copied": size,
            "copy_sets": num_sets,
        },
    )


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


def prepare_contender(
    name: str, problem: Problem, settings: Settings, ctx: dict | None = None
) -> Prepared | dict:
    """The contender set up and checked, or its result when it does not run (skipped, error,
    n/a). ``ctx`` holds what the contenders of one shape share (device copies of the inputs)."""
    backend = settings.backend
    ctx = {} if ctx is None else ctx
    if name not in CONTENDERS:
        raise ValueError(f"--contenders: unknown contender {name!r}, expected {CONTENDERS}")
    try:
        if name in JAX_CONTENDERS:
            return _prepare_jax(name, problem, settings, ctx)
        if name in ("ours_raw", "paged_raw"):
            if backend == "gpu":
                return _prepare_raw_gpu(name, problem, settings, ctx)
            return _prepare_raw_cpu(name, problem, settings)
        if name == "flashinfer":
            if backend != "gpu":
                raise Skip("GPU only")
            return _prepare_flashinfer(problem, settings)
        return (_prepare_copy_gpu if backend == "gpu" else _prepare_copy_cpu)(problem, settings)
    except Skip as e:
        return {"status": "skipped", "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - one failing contender must not end the run
        return {"status": "error", "reason": f"{type(e).__name__}: {e}"}


def run_shape(
    shape: BenchShape,
    settings: Settings,
    contenders,
    peak_bw: float,
    clocks: GpuClocks | None = None,
) -> dict:
    problem = make_problem(shape, settings.backend)
    entry = {
        "name": shape.name,
        "description": shape.describe(),
        "dtype": shape.dtype,
        "pool_dtype": shape.pool_dtype_name,
        "num_layers": shape.num_layers,
        "batch": shape.batch,
        "delta_len": shape.delta_len,
        "tokens": shape.tokens,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "rotary_dim": shape.rotary_dim,
        "page_size": shape.page_size,
        "pages_per_slot": shape.pages_per_slot,
        "slot_capacity": shape.slot_capacity,
        "num_pages": shape.num_pages,
        "num_input_sets": problem.num_sets,
        "bytes": problem.bytes,
        "contenders": {},
    }
    # Every contender is set up first and they are timed together, interleaved (time_interleaved).
    prepared, results, ctx = {}, {}, {}
    for name in contenders:
        t0 = time.perf_counter()
        ready = prepare_contender(name, problem, settings, ctx)
        setup_s = round(time.perf_counter() - t0, 2)
        if isinstance(ready, Prepared):
            ready.info["setup_s"] = setup_s
            prepared[name] = ready
        else:
            results[name] = {**ready, "setup_s": setup_s}
    del ctx  # the shared uploads stay alive as long as a prepared contender holds them
    results.update(time_interleaved(prepared, settings, clocks))
    del prepared  # frees this shape's buffers before the next shape's
    if {"slot", "paged"} <= problem._expected.keys():  # both contracts' references agree
        entry["references_agree"] = bool(
            np.array_equal(_bits(problem.expected("slot")), _bits(problem.expected("paged")))
        )
    for name in contenders:
        result = results[name]
        if "check" in result and "us" in result:
            result["status"] = "ok" if result["check"]["ok"] else "wrong"
        entry["contenders"][name] = result
        if result["status"] == "n/a":
            continue
        shown = (
            f"{result['us']:.2f} us (min {result['us_min']:.2f}, max {result['us_max']:.2f})"
            if "us" in result
            else result.get("reason", "")
        )
        print(f"  {shape.name:<24} {name:<13} {result['status']:<8} {shown}", flush=True)
    entry["derived"] = _derived(entry, peak_bw)
    return entry


def _us(entry: dict, name: str) -> float | None:
    c = entry["contenders"].get(name, {})
    return c.get("us") if c.get("status") in ("ok", "wrong") else None


OURS = ("ours_jax", "ours_raw", "paged_jax", "paged_raw", "knorm_jax")


def _derived(entry: dict, peak_bw: float) -> dict:
    total = entry["bytes"]["total"]
    floor = _us(entry, "copy")
    out = {}
    for name in OURS:
        t = _us(entry, name)
        if t is None:
            continue
        if floor is not None:
            out[f"floor_over_{name}"] = floor / t
        if peak_bw:
            out[f"{name}_bytes_per_s"] = total / (t * 1e-6)
            out[f"{name}_fraction_of_peak_copy_bw"] = total / (t * 1e-6) / peak_bw
    return out


# ---- targets -------------------------------------------------------------------------------------


def evaluate_targets(results: dict) -> list[dict]:
    shapes = {e["name"]: e for e in results["shapes"]}
    peak = results.get("peak_copy_bandwidth", {}).get("bytes_per_s")
    targets = []

    def add(text, ok, measured):
        targets.append({"target": text, "met": bool(ok), "measured": measured})

    def bandwidth(e, who):
        t = _us(e, who)
        return None if t is None or not peak else e["bytes"]["total"] / (t * 1e-6) / peak

    def ratio_target(e, who, other, limit, text):
        a, b = _us(e, who), _us(e, other)
        if a is not None and b is not None:
            add(
                f"{e['name']}: {text}",
                a <= limit * b,
                f"{a:.2f} vs {b:.2f} us ({100 * (a / b - 1):+.1f}%)",
            )

    if results["backend"] == "cpu":
        for e in results["shapes"]:
            ours, base = _us(e, "ours_jax"), _us(e, "jax_baseline")
            if ours and base:
                add(
                    f"{e['name']}: CPU kernel >= 2x the straightforward JAX version",
                    base / ours >= 2.0,
                    f"{base / ours:.2f}x ({ours:.1f} vs {base:.1f} us)",
                )
        return targets

    for name, limit in (("prefill_b8_l2048", 37.0), ("decode_b64", 3.5), ("decode_b1", 2.2)):
        if name in shapes:
            for who in ("ours_jax", "ours_raw"):
                t = _us(shapes[name], who)
                if t is not None:
                    add(f"{name}: {who} <= {limit} us", t <= limit, f"{t:.2f} us")
    for name, whos in (
        ("prefill_b8_l2048", ("ours_jax", "ours_raw", "paged_jax", "paged_raw")),
        ("prefill_b8_l2048_fp8", ("ours_jax", "ours_raw", "paged_jax", "paged_raw")),
    ):
        e = shapes.get(name)
        for who in whos if e else ():
            frac = bandwidth(e, who)
            if frac is not None:
                add(
                    f"{name}: {who} >= 90% of measured copy bandwidth (its bytes)",
                    frac >= 0.9,
                    f"{100 * frac:.1f}%",
                )
    one, stacked = shapes.get("decode_b64"), shapes.get("decode_b64_5layers")
    if one and stacked:
        for who in ("ours_jax", "ours_raw"):
            a, b = _us(one, who), _us(stacked, who)
            if a and b:
                add(
                    f"5 stacked layers at B=64 L=16: {who} <= 1.6x one layer",
                    b <= 1.6 * a,
                    f"{b / a:.2f}x",
                )
    for e in results["shapes"]:
        fi = _us(e, "flashinfer")
        for who in ("ours_jax", "ours_raw"):
            t = _us(e, who)
            if fi is not None and t is not None:
                add(
                    f"{e['name']}: {who} faster than FlashInfer rope + append",
                    t < fi,
                    f"{t:.2f} vs {fi:.2f} us",
                )
        ratio_target(e, "ours_jax", "ours_raw", 1.10, "JAX path within 10% of the raw launcher")
        ratio_target(
            e, "paged_jax", "paged_raw", 1.05, "paged JAX path within 5% of the paged raw launcher"
        )
        ratio_target(e, "paged_jax", "ours_jax", 1.10, "paged op within 10% of the slot op (JAX)")
        ratio_target(
            e, "paged_raw", "ours_raw", 1.10, "paged launcher within 10% of the slot launcher"
        )
        ratio_target(
            e, "knorm_jax", "paged_jax", 1.10, "fused k-norm at most +10% over the op without it"
        )
        fused, pair, norm = (_us(e, n) for n in ("knorm_jax", "unfused_jax", "rmsnorm_jax"))
        if None not in (fused, pair, norm):
            add(
                f"{e['name']}: fused k-norm faster than the unfused pair by at least the norm's "
                f"own time (the RMSNorm jitted alone, host-timed)",
                pair - fused >= norm,
                f"pair {pair:.2f} - fused {fused:.2f} = {pair - fused:.2f} us, norm {norm:.2f} us",
            )
        kernels = (e["contenders"].get("unfused_jax") or {}).get("kernels_us")
        if None not in (fused, pair) and kernels:
            norm = norm_kernels_us(kernels)
            add(
                f"{e['name']}: fused k-norm faster than the unfused pair by at least the norm's "
                f"own time (its kernels' device time in the pair)",
                pair - fused >= norm,
                f"pair {pair:.2f} - fused {fused:.2f} = {pair - fused:.2f} us, norm kernels "
                f"{norm:.2f} us",
            )
    for name in ("prefill_b8_l2048", "decode_b64"):
        e, peer = shapes.get(name), EDGE_LLM_0_11_US.get(name)
        for who in ("paged_jax", "paged_raw") if e else ():
            t = _us(e, who)
            if t is not None:
                add(
                    f"{name}: {who} >= 2.5x faster than Edge-LLM 0.11 (quoted {peer} us)",
                    peer / t >= 2.5,
                    f"{peer / t:.2f}x ({t:.2f} us)",
                )
    fp8, fp16 = shapes.get("decode_b64_fp8"), shapes.get("decode_b64")
    if fp8 and fp16:
        for who in ("ours_jax", "ours_raw", "paged_jax", "paged_raw"):
            a, b = _us(fp8, who), _us(fp16, who)
            if a is not None and b is not None:
                add(
                    f"decode_b64_fp8: {who} within 10% of the fp16-pool time",
                    a <= 1.1 * b,
                    f"{a:.2f} vs {b:.2f} us ({100 * (a / b - 1):+.1f}%)",
                )
    e = shapes.get("prefill_b8_l2048")
    if e:
        base = _us(e, "jax_baseline")
        for who in ("ours_jax", "ours_raw"):
            t = _us(e, who)
            if base is not None and t is not None:
                add(
                    f"prefill_b8_l2048: {who} >= 5x faster than the straightforward JAX version",
                    base / t >= 5.0,
                    f"{base / t:.1f}x",
                )
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
    """Times per update, then (second table) the fractions of the floor and of copy bandwidth."""
    names = results["contenders"]
    peer = results["backend"] == "gpu"
    head = (
        ["shape", "bytes"]
        + [f"{n} (us)" for n in names]
        + (["Edge-LLM 0.11, quoted (us)"] if peer else [])
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in results["shapes"]:
        row = [e["description"], _fmt_bytes(e["bytes"]["total"])] + [_fmt_us(e, n) for n in names]
        if peer:
            row.append(f"{EDGE_LLM_0_11_US[e['name']]}" if e["name"] in EDGE_LLM_0_11_US else "-")
        lines.append("| " + " | ".join(row) + " |")
    ours = [n for n in OURS if n in names]
    head = ["shape"] + [f"% of floor ({n})" for n in ours] + [f"% of copy BW ({n})" for n in ours]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in results["shapes"]:
        d = e["derived"]

        def pct(key, d=d):
            return f"{100 * d[key]:.0f}%" if key in d else "-"

        row = (
            [e["description"]]
            + [pct(f"floor_over_{n}") for n in ours]
            + [pct(f"{n}_fraction_of_peak_copy_bw") for n in ours]
        )
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> str | None:
    """Time per update against bytes moved, log-log, one series per contender (and the quoted
    Edge-LLM numbers)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: matplotlib is not importable ({e})"
    fig, ax = plt.subplots(figsize=(9, 6))
    markers = dict(zip(CONTENDERS, "o^sv<>*Dph"))
    for name in results["contenders"]:
        points = sorted(
            (e["bytes"]["total"], _us(e, name))
            for e in results["shapes"]
            if _us(e, name) is not None
        )
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker=markers.get(name, "x"), linestyle="none", label=name, alpha=0.8)
    if results["backend"] == "gpu":
        points = sorted(
            (e["bytes"]["total"], EDGE_LLM_0_11_US[e["name"]])
            for e in results["shapes"]
            if e["name"] in EDGE_LLM_0_11_US
        )
        if points:
            xs, ys = zip(*points)
            ax.plot(
                xs, ys, marker="X", color="black", linestyle="none", label="Edge-LLM 0.11 (quoted)"
            )
    peak = results.get("peak_copy_bandwidth", {}).get("bytes_per_s")
    sizes = [e["bytes"]["total"] for e in results["shapes"]]
    if peak and sizes:
        xs = np.geomspace(min(sizes), max(sizes), 50)
        ax.plot(
            xs,
            xs / peak * 1e6,
            "k--",
            linewidth=0.8,
            label=f"peak copy bandwidth ({peak / 1e12:.2f} TB/s)",
        )
    for e in results["shapes"]:
        t = _us(e, "paged_jax") or _us(e, "ours_jax")
        if t is not None:
            ax.annotate(
                e["name"],
                (e["bytes"]["total"], t),
                fontsize=7,
                xytext=(4, -10),
                textcoords="offset points",
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes moved per update (K/V read + pool write + cos/sin read)")
    ax.set_ylabel("time per update (us)")
    ax.set_title(f"DFlash target KV-cache update, {results['device']}")
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _versions() -> dict:
    import jax
    import jaxlib

    out = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": np.__version__,
    }
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


def _positive_int(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
        return value

    parse.__name__ = flag
    return parse


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a finite number of seconds > 0, got {text!r}"
        ) from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text}")
    return value


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Times the DFlash target KV-cache update (slot and paged contracts, FP8 "
        "pools, the fused k-norm) against the straightforward JAX version, FlashInfer and a "
        "device copy; prints a table, writes JSON and a PNG plot.",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="gpu when JAX sees one (auto), else cpu with scaled-down shapes",
    )
    p.add_argument(
        "--shapes",
        default="",
        help="comma-separated subset of shape names (default: all for the backend)",
    )
    p.add_argument(
        "--contenders",
        default=",".join(CONTENDERS),
        help=f"comma-separated subset of {','.join(CONTENDERS)}",
    )
    p.add_argument(
        "--iters",
        type=_positive_int("iters"),
        default=None,
        help="updates per jitted call / CUDA graph, >= 1 (default 512 GPU, so that "
        "JAX's per-call dispatch stays hidden behind the GPU at decode sizes; 16 "
        "CPU); the straightforward JAX version uses at most 32 on GPU (compile time)",
    )
    p.add_argument(
        "--repeats",
        type=_positive_int("repeats"),
        default=None,
        help="measurements per contender, >= 1, interleaved with the other "
        "contenders' (median; default 10 GPU, 5 CPU, 3 with --quick)",
    )
    p.add_argument(
        "--min-time",
        type=_positive_seconds,
        default=None,
        help="seconds per measurement at least, finite and > 0 (default 0.05 GPU, "
        "0.1 CPU, 0.01 with --quick)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="directory for the JSON and PNG, created if missing (default: the current directory)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer, shorter measurements (a smoke run, not for publishing)",
    )
    p.add_argument("--list-shapes", action="store_true", help="print the shapes and exit")
    return p


def _settings(args, backend: str) -> Settings:
    gpu = backend == "gpu"
    chain = args.iters or ((64 if gpu else 4) if args.quick else (512 if gpu else 16))
    repeats = args.repeats or (3 if args.quick else 10 if gpu else 5)
    min_time = (
        args.min_time
        if args.min_time is not None
        else (0.01 if args.quick else 0.05 if gpu else 0.1)
    )
    baseline_chain = min(chain, 32) if gpu else chain
    return Settings(backend, chain, baseline_chain, repeats, min_time)


def _check_out_dir(out: Path) -> str | None:
    """None when ``out`` is (now) a writable directory, else why not."""
    if out.exists() and not out.is_dir():
        return "it exists and is not a directory"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create it ({e.strerror or e})"
    if not out.is_dir():
        return "it is not a directory"
    if not os.access(out, os.W_OK | os.X_OK):
        return "it is not writable"
    return None


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    # JAX must not grab most of the GPU: torch (raw launcher, FlashInfer, copy) shares it.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    args = build_parser(prog).parse_args(argv)  # bad --iters/--repeats/--min-time exit 2 here
    contenders = [n for n in args.contenders.split(",") if n]
    if bad := [n for n in contenders if n not in CONTENDERS]:
        print(
            f"--contenders: unknown {bad}; expected names from {list(CONTENDERS)}", file=sys.stderr
        )
        return 2
    if not contenders:
        print(
            f"--contenders: expected at least one of {list(CONTENDERS)}, got none", file=sys.stderr
        )
        return 2
    if not args.list_shapes and (why := _check_out_dir(args.out)):
        print(
            f"--out: expected a writable directory, got {str(args.out)!r}: {why}", file=sys.stderr
        )
        return 2
    backend = _detect_backend() if args.backend == "auto" else args.backend
    if backend == "gpu" and _detect_backend() != "gpu":
        print("--backend gpu: expected JAX to see a GPU, it sees none here", file=sys.stderr)
        return 2
    available = {s.name: s for s in shapes_for(backend)}
    if args.list_shapes:
        for s in available.values():
            print(
                f"{s.name:<24} {s.describe()}, M = pages_per_slot = {s.pages_per_slot}, "
                f"{s.num_pages} pages{', unfused pair' if s.unfused else ''}"
            )
        return 0
    wanted = [n for n in args.shapes.split(",") if n] or list(available)
    unknown = [n for n in wanted if n not in available]
    if unknown:
        print(
            f"--shapes: unknown {unknown} for backend {backend}; expected names from "
            f"{list(available)}",
            file=sys.stderr,
        )
        return 2
    settings = _settings(args, backend)

    device = _device_name(backend)
    print(
        f"DFlash KV-update benchmark: backend {backend}, device {device}; "
        f"{settings.chain} updates per call (baseline {settings.baseline_chain}), "
        f"{settings.repeats} interleaved measurements of >= {settings.min_time} s per "
        f"contender",
        flush=True,
    )
    try:
        peak = peak_copy_bandwidth_gpu() if backend == "gpu" else peak_copy_bandwidth_cpu()
    except Skip as e:
        peak = {"bytes_per_s": None, "method": f"not measured: {e}"}
    if peak["bytes_per_s"]:
        print(f"measured copy bandwidth: {peak['bytes_per_s'] / 1e9:.1f} GB/s ({peak['method']})")

    t0 = time.perf_counter()
    results = {
        "backend": backend,
        "device": device,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable), *sys.argv]),
        "arguments": list(sys.argv[1:] if argv is None else argv),
        "versions": _versions(),
        "env": {
            k: os.environ[k]
            for k in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE", "CUDA_VISIBLE_DEVICES")
            if k in os.environ
        },
        "settings": dataclasses.asdict(settings),
        "quick": args.quick,
        "contenders": contenders,
        "peak_copy_bandwidth": peak,
        "edge_llm_0_11_quoted_us": EDGE_LLM_0_11_US if backend == "gpu" else {},
        "shapes": [],
    }
    clocks = GpuClocks() if backend == "gpu" else None
    off = clocks.start() if clocks is not None else "not sampled on the CPU backend"
    results["clock_sampling"] = (
        f"nvidia-smi --query-gpu={GpuClocks.QUERY} -i {clocks.gpu} every {clocks.period_ms} ms"
        if off is None
        else f"off: {off}"
    )
    try:
        for name in wanted:
            results["shapes"].append(
                run_shape(available[name], settings, contenders, peak["bytes_per_s"], clocks)
            )
    finally:
        if clocks is not None:
            clocks.stop()
    results["targets"] = evaluate_targets(results)
    results["clock_notes"] = clock_notes(results)
    mark_clock_limited(results)
    results["wall_s"] = round(time.perf_counter() - t0, 1)

    print()
    print(format_table(results))
    print()
    for t in results["targets"]:
        limited = (
            " (this shape ran below the top SM clock: see clocks)" if "clock_limited" in t else ""
        )
        print(f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['measured']}{limited}")
    print(f"  clocks: {results['clock_sampling']}")
    for note in results["clock_notes"]:
        print(f"  clocks: {note}")
    wrong = [
        (e["name"], n)
        for e in results["shapes"]
        for n, c in e["contenders"].items()
        if c.get("status") == "wrong"
    ]
    for e in results["shapes"]:
        if e.get("references_agree") is False:
            print(f"  WRONG REFERENCE: slot and paged references differ at {e['name']}")
            wrong.append((e["name"], "reference"))
        for n, c in e["contenders"].items():
            if c.get("status") == "wrong":
                print(f"  WRONG RESULT: {n} at {e['name']}: {c['check']}")
    for e in results["shapes"]:
        for n, c in e["contenders"].items():
            if c.get("status") in ("skipped", "error"):
                print(f"  {c['status']}: {n} at {e['name']}: {c['reason']}")

    json_path = args.out / f"kv_update_{backend}.json"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {json_path}")
    png_path = args.out / f"kv_update_{backend}.png"
    message = plot(results, png_path)
    print(message or f"wrote {png_path}")
    print(f"total {results['wall_s']} s")
    # A contender that could not run is no result either: the run fails (skips are reasoned).
    errors = [
        (e["name"], n)
        for e in results["shapes"]
        for n, c in e["contenders"].items()
        if c.get("status") == "error"
    ]
    if errors:
        print(f"{len(errors)} contender-shape(s) failed with an error: the run exits 1")
    return 1 if wrong or errors else 0


if __name__ == "__main__":
    sys.exit(main())
