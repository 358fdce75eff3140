"""A shape's host data: rotated input sets, the addressing every contract derives its operands
from, the bytes one update moves and the NumPy reference of the sampled sequences."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from dflash_bench.contracts import CONTRACTS, PageOrder
from dflash_bench.dtypes import SCALE_BYTES
from dflash_bench.shapes import BenchShape
from jax_dflash.contract import DEFAULT_NORM_EPS

L2_BYTES = {"gpu": 60e6, "cpu": 32e6}  # H200 L2; a typical CPU last-level cache
MAX_SETS = {"gpu": 32, "cpu": 8}
# Unused pool rows are filled with this value; a kernel that writes where it should not shows up.
POOL_FILL = 0.25
# Unused entries of a scale pool likewise (the sampled pages' scales are drawn at random).
SCALE_FILL = 0.75
SAMPLE_SLOTS = 2  # sequences compared against the NumPy reference


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
    k_scale: np.ndarray | None  # [H] float32 for a pool format with static scales
    v_scale: np.ndarray | None
    k_norm_weight: np.ndarray  # [D] delta dtype
    # [2, sample_slots * M, P, H, D] (int4: D/2): layer 0's sampled pages before the update
    sample_init: np.ndarray
    # [2, sample_slots * M, P, H] float32: their scale pool's entries before (dynamic scales)
    sample_scale_init: np.ndarray | None
    sample_slots: int
    bytes: dict[str, int]
    # The references computed so far, by (contract, fused k-norm): the sampled pages, and with
    # dynamic scales their scale pool's entries.
    references: dict[tuple[str, bool], np.ndarray] = dataclasses.field(default_factory=dict)
    scale_references: dict[tuple[str, bool], np.ndarray] = dataclasses.field(default_factory=dict)

    @property
    def num_sets(self) -> int:
        return len(self.k_sets)

    def scales(self) -> dict:
        return {} if self.k_scale is None else {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def page_order(self, contract: str) -> PageOrder:
        """(K pages, V pages in plane 1) of the contract's pool in slot order: gathered by
        them, its pool is page for page the slot op's."""
        return CONTRACTS[contract].page_order(self)

    def sample_pages(self, contract: str) -> PageOrder:
        """(K pages, V pages in plane 1) of the sampled sequences, in slot order."""
        n = self.sample_slots * self.shape.pages_per_slot
        k_pages, v_pages = self.page_order(contract)
        return k_pages[:n], v_pages[:n]

    def expected(self, contract: str, fused_norm: bool = False) -> np.ndarray:
        """The sample after one update with set 0, from the NumPy reference of ``contract``
        (with the fused k-norm when asked)."""
        key = (contract, fused_norm)
        if key not in self.references:
            result = self._reference(contract, fused_norm)
            if self.shape.dynamic_scales:
                result, self.scale_references[key] = result
            self.references[key] = result
        return self.references[key]

    def expected_scales(self, contract: str, fused_norm: bool = False) -> np.ndarray | None:
        """The sample's scale pool entries after the update of ``expected`` (None without
        dynamic scales)."""
        if not self.shape.dynamic_scales:
            return None
        self.expected(contract, fused_norm)
        return self.scale_references[(contract, fused_norm)]

    def _reference(self, contract: str, fused_norm: bool):
        from jax_dflash import reference

        c, s, n = CONTRACTS[contract], self.shape, self.sample_slots
        layer0 = (0,) if s.num_layers else ()
        k, v = self.k_sets[0][layer0][:n], self.v_sets[0][layer0][:n]
        if c.token_major:
            k = k.reshape(n * s.delta_len, s.num_kv_heads, s.head_dim)
            v = v.reshape(n * s.delta_len, s.num_kv_heads, s.head_dim)
        norm = (
            {"k_norm_weight": self.k_norm_weight, "norm_eps": DEFAULT_NORM_EPS}
            if fused_norm
            else {}
        )
        if self.sample_scale_init is not None:
            norm["scale_pool"] = self.sample_scale_init
        return getattr(reference, c.reference)(
            k,
            v,
            self.sample_init,
            **c.sample_operands(self, n),
            **c.statics(s),
            **self.scales(),
            **norm,
        )

    def expected_normed_keys(self) -> np.ndarray:
        """HF RMSNorm of set 0's first sampled keys (float32 normalize, round, times weight)."""
        s = self.shape
        x = self.k_sets[0][(0,) * len(s.lead)][: self.sample_slots].astype(np.float32)
        inv = 1 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(DEFAULT_NORM_EPS))
        u = (x * inv).astype(s.np_dtype)
        return (u.astype(np.float32) * self.k_norm_weight.astype(np.float32)).astype(s.np_dtype)


def bytes_moved(shape: BenchShape, starts: np.ndarray, lengths: np.ndarray) -> dict[str, int]:
    """K/V read + pool rows written + scale pool entries written + cos/sin rows read, for one
    update (all layers). A pool row of H heads is ``H * D / per_byte`` stored elements (int4:
    D/2 bytes a head); with dynamic scales each written row also writes H float32 scales, in
    each plane (K and V)."""
    cap = shape.slot_capacity
    t = np.arange(shape.delta_len)[None, :]
    pos = starts.astype(np.int64)[:, None] + t
    written = int(((t < lengths[:, None]) & (pos >= 0) & (pos < cap)).sum())
    heads = shape.num_kv_heads * shape.head_dim
    kv_read = 2 * shape.tokens * heads * shape.np_dtype.itemsize
    pool_write = 2 * written * heads // shape.pool_spec.per_byte * shape.np_pool_dtype.itemsize
    scales = shape.num_kv_heads * SCALE_BYTES if shape.dynamic_scales else 0
    scale_write = 2 * written * scales
    rope_read = written * shape.rotary_dim * 4  # every written position is < S here
    per_layer = {
        "kv_read": kv_read,
        "pool_write": pool_write,
        "scale_write": scale_write,
        "rope_read": rope_read,
    }
    out = {k: v * shape.layers for k, v in per_layer.items()}
    out["total"] = sum(out.values())
    out["written_tokens"] = written * shape.layers
    return out


def rope_table(seq_len: int, rotary_dim: int) -> np.ndarray:
    half = rotary_dim // 2
    inv_freq = 10000.0 ** (-np.arange(half, dtype=np.float64) / half)
    angles = np.arange(seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], -1).astype(np.float32)[None]


def rotated_sets(total_bytes: int, backend: str) -> int:
    """How many rotated sets of ``total_bytes`` each: together twice the last-level cache (at
    least 2, at most ``MAX_SETS``), so that a timing loop does not measure the cache."""
    return int(min(MAX_SETS[backend], max(2, math.ceil(2 * L2_BYTES[backend] / total_bytes))))


def make_problem(shape: BenchShape, backend: str, seed: int = 0) -> Problem:
    rng = np.random.default_rng(seed)
    dtype = shape.np_dtype
    num_sets = rotated_sets(2 * math.prod(shape.delta_shape) * dtype.itemsize, backend)

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
    if shape.pool_spec.quantized:  # per head, so that unit-normal keys and values fit its range
        k_scale = rng.uniform(*shape.pool_spec.scale_range, shape.num_kv_heads).astype(np.float32)
        v_scale = rng.uniform(*shape.pool_spec.scale_range, shape.num_kv_heads).astype(np.float32)
    k_norm_weight = rng.uniform(0.5, 1.5, shape.head_dim).astype(dtype)

    slots = min(shape.batch, SAMPLE_SLOTS)
    sample_shape = (2, slots * m, *shape.pool_shape[len(shape.lead) + 2 :])
    if shape.pool_spec.per_byte > 1:  # packed elements: any bytes
        sample_init = rng.integers(0, 256, sample_shape, dtype=np.uint8).view(shape.np_pool_dtype)
    else:
        sample_init = rng.standard_normal(sample_shape, dtype=np.float32).astype(
            shape.np_pool_dtype
        )
    sample_scale_init = None
    if shape.dynamic_scales:
        sample_scale_init = rng.uniform(0.01, 1.0, sample_shape[:-1]).astype(np.float32)
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
        sample_scale_init,
        slots,
        bytes_moved(shape, start_sets[0], lengths),
    )


def host_pool(problem: Problem, contract: str) -> np.ndarray:
    """The known pool on the host: POOL_FILL, with the sample in the sampled sequences' pages
    of layer 0."""
    s = problem.shape
    pool = np.full(s.pool_shape, POOL_FILL, dtype=np.float32).astype(s.np_pool_dtype)
    k_pages, v_pages = problem.sample_pages(contract)
    layer = pool[0] if s.num_layers else pool
    layer[0, k_pages] = problem.sample_init[0]
    layer[1, v_pages] = problem.sample_init[1]
    return pool


def host_scale_pool(problem: Problem, contract: str) -> np.ndarray | None:
    """The known scale pool on the host (dynamic scales; else None): SCALE_FILL, with the
    sample's scales in the sampled sequences' pages of layer 0."""
    s = problem.shape
    if problem.sample_scale_init is None:
        return None
    scales = np.full(s.scale_pool_shape, SCALE_FILL, dtype=np.float32)
    k_pages, v_pages = problem.sample_pages(contract)
    layer = scales[0] if s.num_layers else scales
    layer[0, k_pages] = problem.sample_scale_init[0]
    layer[1, v_pages] = problem.sample_scale_init[1]
    return scales
