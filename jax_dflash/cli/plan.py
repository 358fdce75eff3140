"""The host-side plan of one ``jax-dflash run``: everything decided before the device runs.

The accepted lengths of every step and sequence, where each token lands (slot contract: a
:class:`Schedule`; paged contract: the allocator's :class:`~jax_dflash.cli.allocator.PagedPlan`),
the initial pool, the RoPE table, the draft's weights and the jitted step's static spec. The
device never waits for the host: the steps only read this plan.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_dflash.cli import allocator, pipeline
from jax_dflash.cli.accept import AcceptDistribution
from jax_dflash.cli.formats import (
    STATIC_SCALED_NAMES,
    bytes_per_element,
    element_bytes,
    elements_per_byte,
    is_dynamic,
    stored_shape,
)
from jax_dflash.cli.presets import Preset, dtype_from_name


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Where every sequence starts and how much it accepts at every step (host, int32)."""

    starts: np.ndarray  # [B]: initial position (the prompt the draft cache already holds)
    positions: np.ndarray  # [steps, B]: position of the first token written at each step
    lengths: np.ndarray  # [steps, B]: tokens written at each step (0 once the slot is full)
    capacity: int

    @property
    def totals(self) -> np.ndarray:  # [B]
        return self.lengths.sum(axis=0, dtype=np.int64).astype(np.int32)

    @property
    def accepted_tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))

    @property
    def stopped(self) -> int:
        """Sequences that filled their slot and stopped."""
        return int(np.count_nonzero(self.starts + self.totals >= self.capacity))


def make_schedule(rng, accept: AcceptDistribution, *, steps, batch, block_size, capacity):
    starts = rng.integers(0, capacity // 4 + 1, batch).astype(np.int32)
    drawn = accept.sample(rng, (steps, batch), block_size)
    positions = np.empty((steps, batch), np.int32)
    lengths = np.empty((steps, batch), np.int32)
    pos = starts.astype(np.int64)
    for i in range(steps):
        positions[i] = pos
        lengths[i] = np.minimum(drawn[i], capacity - pos)  # stop at the slot's end
        pos = pos + lengths[i]
    return Schedule(starts, positions, lengths, capacity)


def random_pool(rng, shape, dtype: np.dtype) -> np.ndarray:
    """Random finite values (|x| < 2) as random bits with the top exponent bit cleared: fast
    enough for gigabyte pools, and no two writes are likely to leave the same bits."""
    bits = np.dtype(f"uint{8 * dtype.itemsize}")
    count = int(np.prod(shape))
    words = -(-count * dtype.itemsize // 8)  # 64-bit draws: several times faster than 16-bit
    raw = rng.integers(0, np.iinfo(np.uint64).max, size=words, dtype=np.uint64, endpoint=True)
    raw = raw.view(bits)[:count].reshape(shape)
    raw &= bits.type(np.iinfo(bits).max ^ (1 << (8 * dtype.itemsize - 2)))
    return raw.view(dtype)


def random_int4_pool(rng, shape) -> np.ndarray:
    """Random int4 levels in ``[-7, 7]`` (what the writer stores), packed two per byte: the uint8
    pool ``[..., D/2]`` of the element shape ``shape`` ``[..., D]``."""
    from jax_dflash.reference import pack_int4

    return pack_int4(rng.integers(-7, 8, shape, dtype=np.int8))


def rope_table(capacity: int, rotary_dim: int, theta: float, scaling=None) -> np.ndarray:
    """``[1, capacity, R]`` float32: ``R/2`` cosines then ``R/2`` sines per position; a scaled
    RoPE (``scaling``: an HF rope_scaling's (key, value) pairs) is jax_dflash.rope_cos_sin's."""
    if scaling is not None:
        import jax_dflash

        return np.asarray(
            jax_dflash.rope_cos_sin(capacity, rotary_dim, theta=theta, scaling=dict(scaling))
        )
    inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    angles = np.arange(capacity, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)[None]


class RunPlan:
    """The host-side plan and data of one run (see the module docstring)."""

    def __init__(
        self,
        preset: Preset,
        *,
        batch: int,
        steps: int,
        seed: int,
        accept: AcceptDistribution,
        dtype: str | None = None,
        kv_dtype: str | None = None,
        contract: str = "slot",
        window: int | None = None,
        window_layers: tuple[bool, ...] | None = None,
        fused_norm: bool = True,
    ):
        """``window_layers``: per layer, whether it keeps the window, for a draft that mixes
        windowed and full layers (None: every layer alike)."""
        self.preset = preset
        self.batch, self.steps, self.seed, self.accept = batch, steps, seed, accept
        self.contract, self.window, self.fused_norm = contract, window, fused_norm
        self.window_layers = window_layers
        self.delta_dtype_name = dtype or preset.dtype
        self.pool_dtype_name = kv_dtype or self.delta_dtype_name
        self.dtype_name = self.pool_dtype_name
        self.delta_dtype = dtype_from_name(self.delta_dtype_name)
        self.dtype = self.pool_dtype = dtype_from_name(self.pool_dtype_name)
        # Static per-head scales (FP8, int8), calibrated once; or a scale pool beside the pool.
        self.fp8 = self.pool_dtype_name in STATIC_SCALED_NAMES
        self.dynamic = is_dynamic(self.pool_dtype_name)
        p = preset
        self.geometry = pipeline.Geometry(
            p.num_layers,
            p.num_kv_heads,
            p.head_dim,
            p.rope_dim,
            p.feature_size,
            p.hidden_size,
            p.norm_eps,
        )
        rng = np.random.default_rng(seed)
        # The pool's elements [layers, 2, N, P, H, D]; the array's shape (int4: D/2 bytes).
        self.schedule, self.plan, self.element_shape = self._addressing(rng)
        self.pool_shape = stored_shape(self.pool_dtype_name, self.element_shape)
        # The initial pool from a stream of its own: the weights and features drawn after it
        # are then the same for every pool format (run --compare-formats writes one workload).
        pool_rng = np.random.default_rng([seed, 3])
        if elements_per_byte(self.pool_dtype_name) == 2:
            self.initial_pool = random_int4_pool(pool_rng, self.element_shape)
        else:
            self.initial_pool = random_pool(pool_rng, self.pool_shape, self.pool_dtype)
        # Rows nobody writes keep these scales; positive and finite, as a reader expects.
        self.initial_scale_pool = (
            pool_rng.uniform(1e-3, 1e-2, self.pool_shape[:-1]).astype(np.float32)
            if self.dynamic
            else None
        )
        self.rope = rope_table(p.slot_capacity, p.rope_dim, p.rope_theta, p.rope_scaling)
        self.host_weights = pipeline.random_weights(rng, self.geometry, self.delta_dtype)
        self.spec = pipeline.StepSpec(
            contract,
            self.geometry,
            batch,
            p.block_size,
            pages_per_slot=p.pages_per_slot if contract == "slot" else None,
            ring=False if self.plan is None else self.plan.ring,
            fused_norm=fused_norm,
            fp8=self.fp8,
            dynamic=self.dynamic,
        )

    def _addressing(self, rng):
        """``(schedule, paged plan, pool shape)``: one of the first two is None."""
        p = self.preset
        run = dict(steps=self.steps, batch=self.batch, block_size=p.block_size)
        if self.contract == "slot":
            schedule = make_schedule(rng, self.accept, capacity=p.slot_capacity, **run)
            return schedule, None, p.pool_shape()
        plan = allocator.plan_paged_run(
            rng,
            self.accept,
            page_size=p.page_size,
            max_length=p.slot_capacity,
            window=self.window,
            window_layers=self.window_layers,
            **run,
        )
        shape = (p.num_layers, 2, plan.num_pages, p.page_size, p.num_kv_heads, p.head_dim)
        return None, plan, shape

    # ---- sizes of the summary

    @property
    def prefill_steps(self) -> int:
        return 0 if self.plan is None else self.plan.prefill.count

    @property
    def accepted_tokens(self) -> int:
        s = self.schedule if self.plan is None else self.plan
        return s.accepted_tokens

    @property
    def written_tokens(self) -> int:
        if self.plan is None:
            return self.schedule.accepted_tokens
        return int(self.plan.written.sum())

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.preset.block_size

    @property
    def update_bytes(self) -> int:
        """Bytes the update must move in the decode steps: per written token and layer, read
        its key and value, write both into the pool (with a dynamic format, their scales too),
        and read its RoPE row (float32)."""
        p = self.preset
        stored = element_bytes(self.pool_dtype_name)  # int4: half a byte
        per_token = int(
            2 * p.num_kv_heads * p.head_dim * (self.delta_dtype.itemsize + stored) + 4 * p.rope_dim
        )
        if self.dynamic:  # and its float32 scale per head and plane
            per_token += 2 * p.num_kv_heads * 4
        return self.written_tokens * p.num_layers * per_token

    def pool_bytes(self, dtype: np.dtype | str | None = None) -> int:
        """The pool's bytes in ``dtype`` (a dtype, or a format's name: a dynamic format counts
        its scale pool); the run's format by default."""
        if dtype is None:
            dtype = self.pool_dtype_name
        if isinstance(dtype, str):
            per = bytes_per_element(dtype, self.preset.head_dim)
        else:
            per = np.dtype(dtype).itemsize
        return int(round(int(np.prod(self.element_shape)) * per))

    def pool_by_layer_kind(self) -> dict | None:
        """With sliding-window layers (paged): the pool the draft's layers need, each layer
        the pages of its kind (a windowed layer its rings, a full layer its growing lists, both
        the prompt cache), against the same draft with every layer full. None without a window.

        The run's own pool is one layer-batched array (one launch for every layer), so every
        layer in it has the largest kind's pages: with a full layer in the draft, the all-full
        size; the saving is what per-kind pools (an engine's pool per window size) hold."""
        if self.plan is None or self.window is None:
            return None
        p, plan = self.preset, self.plan
        per = bytes_per_element(self.pool_dtype_name, p.head_dim)
        page = int(round(2 * p.page_size * p.num_kv_heads * p.head_dim * per))
        layers = [plan.kinds[plan.kind_of(n)].num_pages for n in range(p.num_layers)]
        windowed = [n for n in range(p.num_layers) if plan.kinds[plan.kind_of(n)].ring]
        mixed_bytes = sum(layers) * page
        full_bytes = p.num_layers * plan.full_layer_pages * page
        return dict(
            window_layers=windowed,
            pages_per_layer=layers,
            bytes=mixed_bytes,
            all_full_pages_per_layer=plan.full_layer_pages,
            all_full_bytes=full_bytes,
            ratio=mixed_bytes / full_bytes,
            layer_batched_bytes=self.pool_bytes(),
        )
