"""The draft side of DFlash decoding, simulated: what ``jax-dflash run`` executes and checks.

Each decoding step, for every sequence of the batch, the target model accepts between 1 and
``block_size`` tokens. Their context features go through every draft layer's ``k_proj`` /
``v_proj`` (keys k-normed, no RoPE yet), and the resulting ``k_delta``/``v_delta`` are written
into that layer's paged KV pool by the update, which applies RoPE on the way. Here:

- the features are random (one ``[B, L, hidden]`` draw per step, shared by the layers, as in
  DFlash, where every draft layer reads the same fused target features); the projections and
  k-norm weights are random and fixed;
- the accepted lengths are drawn on the host up front (:class:`AcceptDistribution`), so the
  device never waits for the host; a sequence that fills its slot STOPS: its last step is
  clipped to the room left and it writes nothing afterwards (no wrap-around, so every position
  of a slot is written at most once);
- one jitted step computes the deltas of all layers and updates all layers' pools (the stacked
  ``[layers, 2, numPages, P, H, D]`` pool, donated, so the update is in place) and advances the
  positions on the device.

The check replays the run on the host in one call of the NumPy reference: since no position is
written twice, the whole run equals one update whose delta for sequence ``b`` is the
concatenation of its accepted tokens over all steps, starting at its initial position. The
kernel is bit-exact with the reference, so the final pools are compared bit for bit.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_dflash import baseline, reference
from jax_dflash.ops import target_kv_cache_update
from jax_dflash.cli.presets import Preset, dtype_from_name

K_NORM_EPS = 1e-6
# Steps allowed in flight before the loop waits for an older one: keeps the device busy while
# making the progress bar (and a Ctrl-C) follow the device, not just the dispatcher.
MAX_STEPS_IN_FLIGHT = 4
# Device memory the run may hold in not-yet-fetched deltas before it fetches them (the clock is
# paused meanwhile). Only used when checking.
HARVEST_BUDGET_BYTES = 1 << 30
# Untimed steps that write nothing, run on the run's own state before the timed loop.
WARMUP_STEPS = 5


# ---- accepted lengths ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AcceptDistribution:
    """How many tokens a verification step accepts per sequence, in ``1..block_size``.

    - ``uniform``: every length in ``1..block_size`` equally likely.
    - ``geometric:p``: each drafted token is accepted with probability ``p``, independently,
      until the first rejection; the step keeps the accepted drafts plus the target's own next
      token: ``1 + min(accepted drafts, block_size - 1)``. Mean about ``1 / (1 - p)``.
    - ``fixed:n``: always ``n``.
    """

    kind: str
    param: float | None = None

    def describe(self) -> str:
        if self.kind == "uniform":
            return "uniform"
        if self.kind == "fixed":
            return f"fixed:{int(self.param)}"
        return f"geometric:{self.param:g}"

    def sample(self, rng: np.random.Generator, shape, block_size: int) -> np.ndarray:
        if self.kind == "uniform":
            out = rng.integers(1, block_size + 1, shape)
        elif self.kind == "fixed":
            out = np.full(shape, int(self.param))
        elif self.param >= 1.0:
            out = np.full(shape, block_size)
        else:
            # numpy's geometric counts trials up to the first success (here: the first
            # rejection), so it is already 1 + the accepted drafts.
            out = np.minimum(rng.geometric(1.0 - self.param, shape), block_size)
        return out.astype(np.int32)


ACCEPT_HELP = ("uniform | geometric:P (each draft accepted with probability P until the first "
               "rejection; length = 1 + accepted drafts) | fixed:N")


def parse_accept(spec: str, block_size: int) -> AcceptDistribution:
    """``uniform``, ``geometric:p`` (0 <= p <= 1) or ``fixed:n`` (1 <= n <= block_size)."""
    kind, _, arg = spec.partition(":")
    if kind == "uniform" and not arg:
        return AcceptDistribution("uniform")
    if kind == "geometric":
        try:
            p = float(arg)
        except ValueError:
            p = float("nan")
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"--accept geometric:P expects 0 <= P <= 1, got {spec!r}")
        return AcceptDistribution("geometric", p)
    if kind == "fixed":
        try:
            n = int(arg)
        except ValueError:
            n = 0
        if not 1 <= n <= block_size:
            raise ValueError(
                f"--accept fixed:N expects 1 <= N <= block size {block_size}, got {spec!r}")
        return AcceptDistribution("fixed", n)
    raise ValueError(f"--accept expects {ACCEPT_HELP}; got {spec!r}")


# ---- the host-side plan of the run --------------------------------------------------------------


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


def rope_table(capacity: int, rotary_dim: int, theta: float) -> np.ndarray:
    """``[1, capacity, R]`` float32: ``R/2`` cosines then ``R/2`` sines per position."""
    inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    angles = np.arange(capacity, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)[None]


# ---- the jitted step ----------------------------------------------------------------------------


class Constants(NamedTuple):
    """Everything a step reads and nobody writes (device arrays)."""

    k_proj: jax.Array  # [layers, hidden, H * D]
    v_proj: jax.Array  # [layers, hidden, H * D]
    k_norm: jax.Array  # [layers, D] float32
    rope: jax.Array  # [1, capacity, D] float32
    lengths: jax.Array  # [steps + 1, B] int32; the last row is zeros (warm-up steps use it)
    key: jax.Array  # PRNG key of the context features


def _baseline_layered(k, v, pools, rope, starts, lengths, *, pages_per_slot):
    """The straightforward jnp update, one layer after the other (an unrolled loop: on CPU it
    ran about 3x faster than ``jax.vmap`` of the same function, whose batched scatter XLA did
    not do in place)."""
    for layer in range(pools.shape[0]):
        updated = baseline.target_kv_cache_update(
            k[layer], v[layer], pools[layer], rope, starts, lengths,
            pages_per_slot=pages_per_slot)
        pools = pools.at[layer].set(updated)
    return pools


# name -> (label, update function of the layer-batched form)
IMPLEMENTATIONS: dict[str, tuple[str, Callable]] = {
    "kernel": ("dflash kernel", target_kv_cache_update),
    "baseline": ("jnp baseline", _baseline_layered),
}


def _draft_deltas(consts: Constants, step_index, *, batch, block_size, heads, head_dim):
    """Random context features -> every layer's k_proj / v_proj -> k-norm: ``[layers, B, L, H,
    D]`` keys and values in the pool dtype."""
    layers, hidden, _ = consts.k_proj.shape
    dtype = consts.k_proj.dtype
    features = jax.random.normal(
        jax.random.fold_in(consts.key, step_index), (batch, block_size, hidden), jnp.float32
    ).astype(dtype)
    shape = (layers, batch, block_size, heads, head_dim)
    k = jnp.einsum("blc,nce->nble", features, consts.k_proj,
                   preferred_element_type=jnp.float32).reshape(shape)
    v = jnp.einsum("blc,nce->nble", features, consts.v_proj,
                   preferred_element_type=jnp.float32).reshape(shape)
    k = k * jax.lax.rsqrt(jnp.mean(k * k, axis=-1, keepdims=True) + K_NORM_EPS)
    k = k * consts.k_norm[:, None, None, None, :]
    return k.astype(dtype), v.astype(dtype)


def _lengths_at(consts: Constants, step_index):
    """The accepted lengths of a step; steps past the plan (the warm-up) accept nothing."""
    last = consts.lengths.shape[0] - 1
    return jax.lax.dynamic_index_in_dim(consts.lengths, jnp.minimum(step_index, last),
                                        keepdims=False)


def make_step(update: Callable, *, pages_per_slot, batch, block_size, heads, head_dim):
    """One decoding step: state ``(pools, positions, step)``; returns the new state and the
    deltas it wrote (all of them, padding included)."""
    deltas = functools.partial(_draft_deltas, batch=batch, block_size=block_size, heads=heads,
                               head_dim=head_dim)

    def step(state, consts: Constants):
        pools, positions, step_index = state
        lengths = _lengths_at(consts, step_index)
        k, v = deltas(consts, step_index)
        # Materialise the deltas in the pool dtype before the update: without the barrier XLA
        # may fuse the projection into a jnp update and skip the rounding to the pool dtype
        # (excess precision), and the pools would no longer follow from the deltas returned.
        k, v = jax.lax.optimization_barrier((k, v))
        pools = update(k, v, pools, consts.rope, positions, lengths,
                       pages_per_slot=pages_per_slot)
        return (pools, positions + lengths, step_index + 1), (k, v)

    return step


def make_update_only_step(update: Callable, *, pages_per_slot):
    """The update alone, on the run's positions and lengths, with fixed deltas: state ``(pools,
    positions, step, k, v)`` (k and v pass through, so donating them costs nothing). Times
    the update's share of a step and its bandwidth."""

    def update_only(state, consts: Constants):
        pools, positions, step_index, k, v = state
        lengths = _lengths_at(consts, step_index)
        pools = update(k, v, pools, consts.rope, positions, lengths,
                       pages_per_slot=pages_per_slot)
        # The lengths are a fresh (not donated) output the loop can wait on.
        return (pools, positions + lengths, step_index + 1, k, v), (lengths,)

    return update_only


# ---- progress -----------------------------------------------------------------------------------


class ProgressBar:
    """A plain text bar on stderr: redrawn in place on a terminal, a few lines otherwise."""

    def __init__(self, total: int, label: str, *, enabled: bool = True, stream=None,
                 width: int = 28):
        self.total, self.label, self.width = total, label, width
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()
        self.last_draw = -1.0
        self.next_quarter = 1

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self.last_draw >= 0.1 or done == self.total:
                self.last_draw = now
                self.stream.write("\r" + self._line(done, now))
                if done == self.total:
                    self.stream.write("\n")
                self.stream.flush()
        elif done * 4 >= self.next_quarter * self.total:
            while done * 4 >= self.next_quarter * self.total:
                self.next_quarter += 1
            self.stream.write(self._line(done, now) + "\n")
            self.stream.flush()

    def _line(self, done: int, now: float) -> str:
        filled = self.width * done // max(self.total, 1)
        rate = done / max(now - self.start, 1e-9)
        return (f"{self.label:<28} [{'#' * filled}{'.' * (self.width - filled)}] "
                f"{done}/{self.total} steps {rate:8.1f} steps/s")


# ---- collecting the deltas for the check --------------------------------------------------------


class _DeltaCollector:
    """Gathers each step's accepted deltas into one host-side delta per sequence: ``[layers, B,
    total, H, D]``, token ``j`` of sequence ``b`` at its position ``starts[b] + j``."""

    def __init__(self, schedule: Schedule, layers, heads, head_dim, dtype):
        self.schedule = schedule
        total = max(int(schedule.totals.max(initial=0)), 1)
        shape = (layers, len(schedule.starts), total, heads, head_dim)
        self.k = np.zeros(shape, dtype)
        self.v = np.zeros(shape, dtype)
        self.pending: list[tuple[int, jax.Array, jax.Array]] = []
        self.pending_bytes = 0

    def add(self, step_index: int, k: jax.Array, v: jax.Array) -> float:
        """Keeps the step's deltas; returns the seconds spent fetching (0 unless over budget)."""
        self.pending.append((step_index, k, v))
        self.pending_bytes += k.nbytes + v.nbytes
        if self.pending_bytes < HARVEST_BUDGET_BYTES:
            return 0.0
        start = time.perf_counter()
        self.flush()
        return time.perf_counter() - start

    def flush(self) -> None:
        host = jax.device_get([(k, v) for _, k, v in self.pending])
        for (i, _, _), (k, v) in zip(self.pending, host):
            offsets = self.schedule.positions[i] - self.schedule.starts
            for b, n in enumerate(self.schedule.lengths[i]):
                if n > 0:
                    o = offsets[b]
                    self.k[:, b, o:o + n] = k[:, b, :n]
                    self.v[:, b, o:o + n] = v[:, b, :n]
        self.pending, self.pending_bytes = [], 0


ULP_SAMPLE = 1 << 20


def compare_bits(actual: np.ndarray, expected: np.ndarray) -> tuple[int, int]:
    """``(elements whose bits differ, the largest difference in ulps)``: -0.0 != 0.0, and the
    ulp distance counts representable values between the two (across zero too). The ulps are
    taken over the first ``ULP_SAMPLE`` differing elements (a failed check need not be fast,
    but it should not need gigabytes either)."""
    bits = np.dtype(f"int{8 * expected.dtype.itemsize}")
    a, e = actual.view(bits).reshape(-1), expected.view(bits).reshape(-1)
    differ = np.flatnonzero(a != e)
    count = differ.size
    if not count:
        return 0, 0
    differ = differ[:ULP_SAMPLE]
    a, e = a[differ].astype(np.int64), e[differ].astype(np.int64)
    sign = np.int64(1) << (8 * expected.dtype.itemsize - 1)
    # Sign-magnitude to a monotonic integer line: negative values count down from zero.
    a = np.where(a < 0, -(a & (sign - 1)), a)
    e = np.where(e < 0, -(e & (sign - 1)), e)
    return count, int(np.abs(a - e).max())


# ---- the workload -------------------------------------------------------------------------------


@dataclasses.dataclass
class Timing:
    steps: int
    seconds: float  # the timed loop, fetches for the check excluded
    compile_seconds: float

    @property
    def step_seconds(self) -> float:
        return self.seconds / self.steps


@dataclasses.dataclass
class ImplResult:
    """One implementation's run: timing, derived rates and the check."""

    impl: str
    label: str
    timing: Timing
    accepted_tokens: int
    update_bytes: int
    update_only: Timing | None  # the same steps, only the update (see make_update_only_step)
    check: str  # "bit-exact", "differs" or "skipped"
    mismatched_elements: int | None
    max_ulp: int | None
    checked_elements: int | None

    @property
    def bit_exact_required(self) -> bool:
        """The kernel must match the reference bit for bit; the jnp baseline is only reported
        (XLA may contract its RoPE products into FMAs, which rounds differently)."""
        return self.impl == "kernel"

    @property
    def failed(self) -> bool:
        return self.bit_exact_required and self.check == "differs"

    @property
    def steps_per_s(self) -> float:
        return 1.0 / self.timing.step_seconds

    @property
    def accepted_tokens_per_s(self) -> float:
        return self.accepted_tokens / self.timing.seconds

    @property
    def update_seconds_per_step(self) -> float | None:
        return None if self.update_only is None else self.update_only.step_seconds

    @property
    def update_share(self) -> float | None:
        """Update-only step time / full step time (timed separately, so noise can push it a
        little past 1 when the step is almost all update)."""
        u = self.update_seconds_per_step
        return None if u is None else u / self.timing.step_seconds

    @property
    def update_gb_per_s(self) -> float | None:
        if self.update_only is None:
            return None
        return self.update_bytes / self.update_only.seconds / 1e9

    def as_dict(self) -> dict:
        return {
            "impl": self.impl,
            "label": self.label,
            "steps": self.timing.steps,
            "seconds": self.timing.seconds,
            "compile_seconds": self.timing.compile_seconds,
            "step_ms": self.timing.step_seconds * 1e3,
            "steps_per_s": self.steps_per_s,
            "accepted_tokens_per_s": self.accepted_tokens_per_s,
            "update_ms_per_step": _scaled(self.update_seconds_per_step, 1e3),
            "update_share": self.update_share,
            "update_gb_per_s": self.update_gb_per_s,
            "update_bytes": self.update_bytes,
            "check": self.check,
            "bit_exact_required": self.bit_exact_required,
            "mismatched_elements": self.mismatched_elements,
            "max_ulp": self.max_ulp,
            "checked_elements": self.checked_elements,
        }


def _scaled(x, factor):
    return None if x is None else x * factor


def _with_step_index(state: tuple, step_index) -> tuple:
    """Every state is ``(pools, positions, step, ...)``."""
    return (*state[:2], step_index, *state[3:])


class Workload:
    """The host-side plan and data of one ``jax-dflash run`` (see the module docstring)."""

    def __init__(self, preset: Preset, *, batch: int, steps: int, seed: int,
                 accept: AcceptDistribution, device: jax.Device, dtype: str | None = None):
        self.preset = preset
        self.batch, self.steps, self.seed, self.accept = batch, steps, seed, accept
        self.device = device
        self.dtype_name = dtype or preset.dtype
        self.dtype = dtype_from_name(self.dtype_name)
        rng = np.random.default_rng(seed)
        p = preset
        self.schedule = make_schedule(rng, accept, steps=steps, batch=batch,
                                      block_size=p.block_size, capacity=p.slot_capacity)
        self.pool_shape = p.pool_shape()
        self.initial_pool = random_pool(rng, self.pool_shape, self.dtype)
        self.rope = rope_table(p.slot_capacity, p.head_dim, p.rope_theta)
        width = p.num_kv_heads * p.head_dim
        scale = 1.0 / np.sqrt(p.hidden_size)
        self._host_consts = dict(
            k_proj=(rng.standard_normal((p.num_layers, p.hidden_size, width), np.float32)
                    * scale).astype(self.dtype),
            v_proj=(rng.standard_normal((p.num_layers, p.hidden_size, width), np.float32)
                    * scale).astype(self.dtype),
            k_norm=(1.0 + 0.1 * rng.standard_normal((p.num_layers, p.head_dim), np.float32)),
            rope=self.rope,
            lengths=np.concatenate(
                [self.schedule.lengths, np.zeros((1, batch), np.int32)]),
        )
        self._consts: Constants | None = None

    # Sizes of the summary.
    @property
    def accepted_tokens(self) -> int:
        return self.schedule.accepted_tokens

    @property
    def update_bytes(self) -> int:
        """Bytes the update must move: per accepted token and layer, read its key and value and
        write both into the pool, and read its RoPE row (float32)."""
        p = self.preset
        per_token = (4 * p.num_kv_heads * p.head_dim * self.dtype.itemsize
                     + 4 * p.head_dim)
        return self.accepted_tokens * p.num_layers * per_token

    def consts(self) -> Constants:
        if self._consts is None:
            host = {k: jax.device_put(v, self.device) for k, v in self._host_consts.items()}
            key = jax.device_put(jax.random.key(self.seed), self.device)
            self._consts = Constants(key=key, **host)
        return self._consts

    def _step_kwargs(self):
        p = self.preset
        return dict(pages_per_slot=p.pages_per_slot, batch=self.batch,
                    block_size=p.block_size, heads=p.num_kv_heads, head_dim=p.head_dim)

    def _positions_state(self):
        return (jax.device_put(self.schedule.starts, self.device),
                jax.device_put(np.int32(0), self.device))

    def _timed(self, step, make_state, label, *, collector=None,
               progress=True) -> tuple[Timing, tuple]:
        consts = self.consts()
        state = make_state()
        start = time.perf_counter()
        compiled = jax.jit(step, donate_argnums=0).lower(state, consts).compile()
        compile_seconds = time.perf_counter() - start
        # Warm up on the run's own buffers: the first executions are slow (allocations, packed
        # weights). Warm-up steps run past the plan, where nothing is accepted, so they write
        # nothing and leave the positions as they are; then the step counter restarts at 0.
        state = _with_step_index(state, jax.device_put(np.int32(self.steps), self.device))
        for _ in range(WARMUP_STEPS):
            state, _ = compiled(state, consts)
        state = jax.block_until_ready(
            _with_step_index(state, jax.device_put(np.int32(0), self.device)))
        bar = ProgressBar(self.steps, label, enabled=progress)
        in_flight: collections.deque = collections.deque()
        paused = 0.0
        start = time.perf_counter()
        for i in range(self.steps):
            state, outputs = compiled(state, consts)
            in_flight.append(outputs[0])
            if collector is not None:
                paused += collector.add(i, *outputs)
            if len(in_flight) > MAX_STEPS_IN_FLIGHT:
                in_flight.popleft().block_until_ready()
            bar.update(i + 1)
        jax.block_until_ready(state)
        seconds = time.perf_counter() - start - paused
        return Timing(self.steps, seconds, compile_seconds), state

    def run(self, impl: str, *, check: bool = True, measure_update: bool = True,
            progress: bool = True) -> ImplResult:
        """The timed, checked run of one implementation, then (``measure_update``) the same
        steps again with only the update, on the run's final pools (after the check fetched
        them), to time the update alone."""
        label, update = IMPLEMENTATIONS[impl]
        step = make_step(update, **self._step_kwargs())

        def make_state():
            return (jax.device_put(self.initial_pool, self.device), *self._positions_state())

        p = self.preset
        collector = (_DeltaCollector(self.schedule, p.num_layers, p.num_kv_heads, p.head_dim,
                                     self.dtype) if check else None)
        timing, state = self._timed(step, make_state, label, collector=collector,
                                    progress=progress)
        final_positions = np.asarray(state[1])
        expected_positions = self.schedule.starts + self.schedule.totals
        if not np.array_equal(final_positions, expected_positions):
            raise AssertionError(  # a bug of this simulation, not of the op
                f"positions after the run: expected {expected_positions}, got {final_positions}")
        actual = None
        if check:
            actual = np.asarray(state[0])
            if self.device.platform == "cpu":
                # On CPU the host array may be the device buffer itself; the update-only run
                # below writes into that buffer.
                actual = actual.copy()
        update_only = None
        if measure_update:
            pools, _, _ = state
            del state
            p = self.preset
            zeros = np.zeros((p.num_layers, self.batch, p.block_size, p.num_kv_heads, p.head_dim),
                             self.dtype)

            def update_only_state():
                return (pools, *self._positions_state(), jax.device_put(zeros, self.device),
                        jax.device_put(zeros, self.device))

            update_only, _ = self._timed(
                make_update_only_step(update, pages_per_slot=p.pages_per_slot),
                update_only_state, f"{label} (update only)", progress=progress)
            del pools
        else:
            del state
        mismatches = max_ulp = elements = None
        verdict = "skipped"
        if check:
            collector.flush()
            expected = reference.target_kv_cache_update(
                collector.k, collector.v, self.initial_pool, self.rope, self.schedule.starts,
                self.schedule.totals, pages_per_slot=p.pages_per_slot)
            mismatches, max_ulp = compare_bits(actual, expected)
            elements = expected.size
            verdict = "bit-exact" if mismatches == 0 else "differs"
        return ImplResult(impl, label, timing, self.accepted_tokens, self.update_bytes,
                          update_only, verdict, mismatches, max_ulp, elements)
