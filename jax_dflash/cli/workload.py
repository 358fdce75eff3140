"""The draft side of DFlash decoding, simulated: what ``jax-dflash run`` executes and checks.

Each decoding step, every sequence of the batch accepts between 1 and ``block_size`` tokens.
Their target features go through the draft's ``fc`` and norm, every draft layer's k/v
projection (one matmul) and the update with its fused k-norm, all in one jitted step
(:mod:`jax_dflash.cli.pipeline`) that updates every layer's pool in place (layer-batched,
donated). The host decides everything up front, so the device never waits for it:

- slot contract: sequence ``b`` owns slot ``b`` (the TensorRT Edge-LLM 0.10 layout); it starts
  at a random position and STOPS when its slot is full (its last step is clipped, later steps
  write nothing; no wrap), so every position is written at most once;
- paged contract: a page allocator (:mod:`jax_dflash.cli.allocator`) hands out pages as
  sequences grow and takes them back when they finish; new sequences start from a prompt pool
  whose full pages are prefilled once and shared; with ``--window`` every layer keeps a
  sliding window in ring pages (the op's ``ring=True``).

Checks at the end: the pools against the NumPy reference, bit for bit (replayed on the host in
step order, merged into one call where no pool row is written twice); and the read-back check
(:mod:`jax_dflash.cli.readback`): attention over the pool equals attention over keys and values
recomputed without a cache, within the pool dtype's rounding.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_dflash import reference
from jax_dflash.cli import allocator, pipeline, readback
from jax_dflash.cli.presets import FP8_NAMES, Preset, dtype_from_name
from jax_dflash.testing import compare_bits  # noqa: F401  (the run's check; also this module's API)

K_NORM_EPS = pipeline.NORM_EPS
# Steps allowed in flight before the loop waits for an older one: keeps the device busy while
# making the progress bar (and a Ctrl-C) follow the device, not just the dispatcher.
MAX_STEPS_IN_FLIGHT = 4
# Device memory the run may hold in not-yet-fetched deltas before it fetches them (the clock is
# paused meanwhile). Only used when checking.
HARVEST_BUDGET_BYTES = 1 << 30
# Untimed steps that write nothing, run on the run's own state before the timed loop.
WARMUP_STEPS = 5
# Timed replays of the decode steps, with and without the update, for the update's share:
# rounds alternate between the two until each has run this long (within the round limits);
# the best round of each counts, which drops the noise of a busy machine.
SHARE_SECONDS = 0.5
SHARE_ROUNDS = (2, 200)
# Sequences the read-back check samples.
READBACK_SEQUENCES = 4


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


ACCEPT_HELP = (
    "uniform | geometric:P (each draft accepted with probability P until the first "
    "rejection; length = 1 + accepted drafts) | fixed:N"
)


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
                f"--accept fixed:N expects 1 <= N <= block size {block_size}, got {spec!r}"
            )
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


# ---- progress -----------------------------------------------------------------------------------


class ProgressBar:
    """A plain text bar on stderr: redrawn in place on a terminal, a few lines otherwise."""

    def __init__(
        self, total: int, label: str, *, enabled: bool = True, stream=None, width: int = 28
    ):
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
        return (
            f"{self.label:<28} [{'#' * filled}{'.' * (self.width - filled)}] "
            f"{done}/{self.total} steps {rate:8.1f} steps/s"
        )


# ---- collecting the deltas for the check --------------------------------------------------------


class _StepCollector:
    """Keeps every step's deltas (``[layers, T, H, D]`` as the update got them) on the host,
    fetching them in batches so the device never holds more than the budget."""

    def __init__(self):
        self.steps: dict[int, tuple[np.ndarray, np.ndarray]] = {}
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
            self.steps[i] = (np.asarray(k), np.asarray(v))
        self.pending, self.pending_bytes = [], 0


def slot_deltas(steps: dict, schedule, block_size: int):
    """Slot contract: every step's deltas as one per-sequence delta ``[layers, B, total, H, D]``,
    token ``j`` of sequence ``b`` at its position ``starts[b] + j`` (no position is written
    twice, so the whole run is one update)."""
    k0, _ = steps[0]
    layers, _, heads, head_dim = k0.shape
    batch = len(schedule.starts)
    total = max(int(schedule.totals.max(initial=0)), 1)
    k_all = np.zeros((layers, batch, total, heads, head_dim), k0.dtype)
    v_all = np.zeros_like(k_all)
    for i, (k, v) in sorted(steps.items()):
        k = k.reshape(layers, batch, block_size, heads, head_dim)
        v = v.reshape(layers, batch, block_size, heads, head_dim)
        offsets = schedule.positions[i] - schedule.starts
        for b, n in enumerate(schedule.lengths[i]):
            if n > 0:
                o = offsets[b]
                k_all[:, b, o : o + n] = k[:, b, :n]
                v_all[:, b, o : o + n] = v[:, b, :n]
    return k_all, v_all


def gather_rope_host(rope: np.ndarray, positions: np.ndarray, owners: np.ndarray) -> np.ndarray:
    """NumPy twin of ``jax_dflash.gather_rope``: row ``positions[t]`` of ``rope[0]``, zeros for
    padding and positions outside the table (a copy either way, so the bits agree)."""
    table = rope[0]
    ok = (owners >= 0) & (positions >= 0) & (positions < table.shape[0])
    rows = table[np.clip(positions, 0, table.shape[0] - 1)]
    return np.where(ok[:, None], rows, np.float32(0))


def paged_replay_groups(plan: allocator.PagedPlan, steps: range):
    """Consecutive steps merged into groups in which no pool row is written twice (a freed page
    reused, or a ring page overwritten, starts a new group): each group is one reference call,
    and the groups in step order reproduce the run."""
    P = plan.page_size
    group: list[int] = []
    seen: set[int] = set()
    for i in steps:
        pos, own, table = _step_arrays(plan, i)
        mine = own >= 0
        slot = pos[mine] // P
        if plan.ring:
            slot = slot % plan.table_pages
        pages = table[own[mine], 0, slot].astype(np.int64)
        rows = set((pages * P + pos[mine] % P).tolist())
        if group and (rows & seen):
            yield group
            group, seen = [], set()
        group.append(i)
        seen |= rows
    if group:
        yield group


def _step_arrays(plan: allocator.PagedPlan, i: int):
    n_pre = plan.prefill.count
    s = plan.prefill if i < n_pre else plan.decode
    j = i if i < n_pre else i - n_pre
    return s.positions[j], s.owners[j], s.tables[j]


def _recompute(weights, rope, streams, positions, *, geometry, tokens_per_step):
    """See :meth:`Workload.recompute`."""

    def chunk(sp):
        return pipeline.project(weights, sp[0], sp[1], geometry)

    split = (streams.reshape(-1, tokens_per_step), positions.reshape(-1, tokens_per_step))
    k, v = jax.lax.map(chunk, split)  # [chunks, layers, T, H, D]
    k = jnp.moveaxis(k, 0, 1).reshape(geometry.layers, -1, *k.shape[3:])
    v = jnp.moveaxis(v, 0, 1).reshape(geometry.layers, -1, *v.shape[3:])
    x = pipeline.k_normed(weights, k).astype(jnp.float32)
    rows = rope[0][jnp.clip(positions, 0, rope.shape[1] - 1)]
    y = pipeline.rope_jnp(x, rows[None], geometry.rotary_dim)
    return x, y, v.astype(jnp.float32)


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
    """One implementation's run: timing, derived rates and the checks."""

    impl: str
    label: str
    timing: Timing
    accepted_tokens: int
    update_bytes: int
    # Best per-step seconds of the step with and without the update (the same jitted step
    # minus the op), over the timed run and the replays.
    best_step_seconds: float | None
    best_step_without_update_seconds: float | None
    check: str  # "bit-exact", "differs" or "skipped"
    mismatched_elements: int | None
    max_ulp: int | None
    checked_elements: int | None
    readback: readback.ReadbackResult | None = None

    @property
    def bit_exact_required(self) -> bool:
        """The kernel must match the reference bit for bit; the jnp baseline is only reported
        (XLA may contract its RoPE products into FMAs, which rounds differently)."""
        return self.impl == "kernel"

    @property
    def failed(self) -> bool:
        bits = self.bit_exact_required and self.check == "differs"
        return bits or (self.readback is not None and not self.readback.passed)

    @property
    def steps_per_s(self) -> float:
        return 1.0 / self.timing.step_seconds

    @property
    def accepted_tokens_per_s(self) -> float:
        return self.accepted_tokens / self.timing.seconds

    @property
    def update_seconds_per_step(self) -> float | None:
        """The step's time minus the same step's time without the update (>= 0: a difference
        below the timing noise reads as 0)."""
        if self.best_step_without_update_seconds is None:
            return None
        return max(self.best_step_seconds - self.best_step_without_update_seconds, 0.0)

    @property
    def update_share(self) -> float | None:
        """``1 - (step without the update) / (step)``: both times are non-negative, so the share
        is at most 100% by construction (unlike timing the update alone, whose own launch and
        dispatch costs could add up to more than the step it is part of)."""
        u = self.update_seconds_per_step
        return None if u is None else u / self.best_step_seconds

    @property
    def update_gb_per_s(self) -> float | None:
        u = self.update_seconds_per_step
        if not u:
            return None
        return self.update_bytes / (u * self.timing.steps) / 1e9

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
            "best_step_ms": _scaled(self.best_step_seconds, 1e3),
            "best_step_without_update_ms": _scaled(self.best_step_without_update_seconds, 1e3),
            "update_ms_per_step": _scaled(self.update_seconds_per_step, 1e3),
            "update_share": self.update_share,
            "update_gb_per_s": self.update_gb_per_s,
            "update_bytes": self.update_bytes,
            "check": self.check,
            "bit_exact_required": self.bit_exact_required,
            "mismatched_elements": self.mismatched_elements,
            "max_ulp": self.max_ulp,
            "checked_elements": self.checked_elements,
            "readback": None if self.readback is None else self.readback.as_dict(),
        }


def _scaled(x, factor):
    return None if x is None else x * factor


LABELS = {"kernel": "dflash kernel", "baseline": "jnp baseline"}


class Workload:
    """The host-side plan and data of one ``jax-dflash run`` (see the module docstring)."""

    def __init__(
        self,
        preset: Preset,
        *,
        batch: int,
        steps: int,
        seed: int,
        accept,
        device: jax.Device,
        dtype: str | None = None,
        kv_dtype: str | None = None,
        contract: str = "slot",
        window: int | None = None,
        fused_norm: bool = True,
    ):
        self.preset = preset
        self.batch, self.steps, self.seed, self.accept = batch, steps, seed, accept
        self.device = device
        self.contract, self.window, self.fused_norm = contract, window, fused_norm
        self.delta_dtype_name = dtype or preset.dtype
        self.pool_dtype_name = kv_dtype or self.delta_dtype_name
        self.dtype_name = self.pool_dtype_name
        self.delta_dtype = dtype_from_name(self.delta_dtype_name)
        self.dtype = self.pool_dtype = dtype_from_name(self.pool_dtype_name)
        self.fp8 = self.pool_dtype_name in FP8_NAMES
        p = preset
        self.geometry = pipeline.Geometry(
            p.num_layers, p.num_kv_heads, p.head_dim, p.rope_dim, p.feature_size, p.hidden_size
        )
        rng = np.random.default_rng(seed)
        self.schedule = self.plan = None
        if contract == "slot":
            self.schedule = make_schedule(
                rng,
                accept,
                steps=steps,
                batch=batch,
                block_size=p.block_size,
                capacity=p.slot_capacity,
            )
            self.pool_shape = p.pool_shape()
        else:
            self.plan = allocator.plan_paged_run(
                rng,
                accept,
                steps=steps,
                batch=batch,
                block_size=p.block_size,
                page_size=p.page_size,
                max_length=p.slot_capacity,
                window=window,
            )
            self.pool_shape = (
                p.num_layers,
                2,
                self.plan.num_pages,
                p.page_size,
                p.num_kv_heads,
                p.head_dim,
            )
        self.initial_pool = random_pool(rng, self.pool_shape, self.pool_dtype)
        self.rope = rope_table(p.slot_capacity, p.rope_dim, p.rope_theta)
        self._host_weights = pipeline.random_weights(rng, self.geometry, self.delta_dtype)
        self.spec = pipeline.StepSpec(
            contract,
            self.geometry,
            batch,
            p.block_size,
            pages_per_slot=p.pages_per_slot if contract == "slot" else None,
            ring=window is not None,
            fused_norm=fused_norm,
            fp8=self.fp8,
        )
        self._consts: pipeline.Constants | None = None
        self._compiled: dict = {}

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
        its key and value, write both into the pool, and read its RoPE row (float32)."""
        p = self.preset
        per_token = (
            2 * p.num_kv_heads * p.head_dim * (self.delta_dtype.itemsize + self.pool_dtype.itemsize)
            + 4 * p.rope_dim
        )
        return self.written_tokens * p.num_layers * per_token

    def pool_bytes(self, dtype: np.dtype | None = None) -> int:
        itemsize = (self.pool_dtype if dtype is None else np.dtype(dtype)).itemsize
        return int(np.prod(self.pool_shape)) * itemsize

    # ---- device data

    def consts(self) -> pipeline.Constants:
        if self._consts is not None:
            return self._consts
        put = lambda x: jax.device_put(x, self.device)  # noqa: E731
        w = self._host_weights
        weights = pipeline.DraftWeights(
            put(w["fc"]),
            put(w["hidden_norm"]),
            put(w["kv_proj"]),
            put(w["k_norm"]),
            put(np.uint32(self.seed % 2**32)),
        )
        k_scale = v_scale = None
        if self.fp8:
            with jax.default_device(self.device):
                k_scale, v_scale = jax.jit(pipeline.calibrate_scales, static_argnums=(1, 2))(
                    weights, self.geometry, self.pool_dtype_name
                )
        lengths = positions = owners = streams = tables = None
        if self.plan is None:
            lengths = put(
                np.concatenate([self.schedule.lengths, np.zeros((1, self.batch), np.int32)])
            )
        else:
            pre, dec = self.plan.prefill, self.plan.decode

            def stack(name, pad):
                parts = [getattr(pre, name), getattr(dec, name)]
                pad_row = np.full((1, *parts[0].shape[1:]), pad, np.int32)
                return put(np.concatenate([*parts, pad_row]))

            positions, owners = stack("positions", -1), stack("owners", -1)
            streams, tables = stack("streams", -1), stack("tables", -1)
        self._consts = pipeline.Constants(
            weights, put(self.rope), k_scale, v_scale, lengths, positions, owners, streams, tables
        )
        return self._consts

    def scales_host(self):
        c = self.consts()
        if c.k_scale is None:
            return None, None
        return np.asarray(c.k_scale), np.asarray(c.v_scale)

    def _state(self, pools, step_index: int):
        i = jax.device_put(np.int32(step_index), self.device)
        if self.plan is None:
            return (pools, i, jax.device_put(self.schedule.starts, self.device))
        return (pools, i)

    def _compiled_step(self, impl: str, with_update: bool):
        key = (impl, with_update)
        if key not in self._compiled:
            step = pipeline.make_step(self.spec, impl, with_update=with_update)
            pools = jax.device_put(self.initial_pool, self.device)
            start = time.perf_counter()
            compiled = (
                jax.jit(step, donate_argnums=0)
                .lower(self._state(pools, 0), self.consts())
                .compile()
            )
            self._compiled[key] = (compiled, time.perf_counter() - start)
            del pools
        return self._compiled[key]

    # ---- running

    def _loop(self, compiled, state, first: int, count: int, *, collector=None, bar=None):
        """Runs steps ``first .. first + count``; returns (state, seconds, paused)."""
        consts = self.consts()
        state = jax.block_until_ready(state)
        in_flight: collections.deque = collections.deque()
        paused = 0.0
        start = time.perf_counter()
        for n in range(count):
            state, outputs = compiled(state, consts)
            in_flight.append(outputs[0])
            if collector is not None:
                paused += collector.add(first + n, *outputs)
            if len(in_flight) > MAX_STEPS_IN_FLIGHT:
                in_flight.popleft().block_until_ready()
            if bar is not None:
                bar.update(n + 1)
        state = jax.block_until_ready(state)
        return state, time.perf_counter() - start - paused

    def _warm_up(self, compiled, pools):
        """Untimed steps past the plan (nothing accepted: they write nothing)."""
        past = self.prefill_steps + self.steps
        state = self._state(pools, past)
        for _ in range(WARMUP_STEPS):
            state, _ = compiled(state, self.consts())
        return jax.block_until_ready(state)[0]

    def estimate_seconds(self, impl: str, *, timed_steps: int = 3) -> tuple[float, float]:
        """``(estimated seconds of run(impl), seconds per step)`` from a few timed steps on a
        scratch pool, compilation excluded."""
        compiled, compile_s = self._compiled_step(impl, True)
        pools = self._warm_up(compiled, jax.device_put(self.initial_pool, self.device))
        state = self._state(pools, self.prefill_steps)
        n = max(1, min(timed_steps, self.steps))
        _, seconds = self._loop(compiled, state, self.prefill_steps, n)
        per_step = seconds / n
        run_seconds = per_step * self.steps
        rounds = int(np.clip(np.ceil(SHARE_SECONDS / max(run_seconds, 1e-9)), *SHARE_ROUNDS))
        total_steps = self.prefill_steps + self.steps * (1 + 2 * rounds)
        return compile_s + per_step * total_steps, per_step

    def run(
        self,
        impl: str,
        *,
        check: bool = True,
        measure_update: bool = True,
        progress: bool = True,
        check_readback: bool = True,
    ) -> ImplResult:
        """The timed, checked run of one implementation; then (``measure_update``) replays of
        the decode steps with and without the update, for the update's share."""
        label = LABELS[impl]
        compiled, compile_seconds = self._compiled_step(impl, True)
        pools = jax.device_put(self.initial_pool, self.device)
        collector = _StepCollector() if check else None
        state = self._state(pools, 0)
        if self.prefill_steps:  # the prompt cache: untimed, as the engine's prefill
            state, _ = self._loop(compiled, state, 0, self.prefill_steps, collector=collector)
        pools = self._warm_up(compiled, state[0])
        state = self._state(pools, self.prefill_steps)
        bar = ProgressBar(self.steps, label, enabled=progress)
        state, seconds = self._loop(
            compiled, state, self.prefill_steps, self.steps, collector=collector, bar=bar
        )
        timing = Timing(self.steps, seconds, compile_seconds)
        if self.plan is None:
            final_positions = np.asarray(state[2])
            expected_positions = self.schedule.starts + self.schedule.totals
            if not np.array_equal(final_positions, expected_positions):
                raise AssertionError(  # a bug of this simulation, not of the op
                    f"positions after the run: expected {expected_positions}, got {final_positions}"
                )
        pools = state[0]
        del state
        actual = None
        if check:
            actual = np.array(pools)  # a copy: the replays below write into the device buffer
        rb = self.readback(pools) if check_readback else None
        best = timing.step_seconds
        best_without = None
        if measure_update:
            without, _ = self._compiled_step(impl, False)
            low, high = SHARE_ROUNDS
            rounds = int(np.clip(np.ceil(SHARE_SECONDS / max(seconds, 1e-9)), low, high))
            for _ in range(rounds):
                state, s = self._loop(
                    without, self._state(pools, self.prefill_steps), self.prefill_steps, self.steps
                )
                pools = state[0]
                best_without = (
                    s / self.steps if best_without is None else min(best_without, s / self.steps)
                )
                state, s = self._loop(
                    compiled, self._state(pools, self.prefill_steps), self.prefill_steps, self.steps
                )
                pools = state[0]
                best = min(best, s / self.steps)
            best_without = min(best_without, best)
        del pools
        mismatches = max_ulp = elements = None
        verdict = "skipped"
        if check:
            collector.flush()
            expected = self.reference_pools(collector.steps, impl)
            mismatches, max_ulp = compare_bits(actual, expected)
            elements = expected.size
            verdict = "bit-exact" if mismatches == 0 else "differs"
        return ImplResult(
            impl,
            label,
            timing,
            self.accepted_tokens,
            self.update_bytes,
            best,
            best_without,
            verdict,
            mismatches,
            max_ulp,
            elements,
            rb,
        )

    def deltas(self, impl: str = "kernel") -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """The deltas every step (prefill included) gives the update, as the check collects
        them, computed by the same step without the update."""
        compiled, _ = self._compiled_step(impl, False)
        collector = _StepCollector()
        state = self._state(jax.device_put(self.initial_pool, self.device), 0)
        self._loop(compiled, state, 0, self.prefill_steps + self.steps, collector=collector)
        collector.flush()
        return collector.steps

    # ---- the checks

    def _reference_extras(self, impl: str) -> dict:
        extras = {}
        if self.fp8:
            extras["k_scale"], extras["v_scale"] = self.scales_host()
        if not pipeline.norms_in_step(self.spec, impl):
            extras["k_norm_weight"] = self._host_weights["k_norm"]
            extras["norm_eps"] = K_NORM_EPS
        return extras

    def reference_pools(self, steps: dict, impl: str = "kernel") -> np.ndarray:
        """The NumPy reference's pools after the run, from the deltas each step gave the update."""
        extras = self._reference_extras(impl)
        if self.plan is None:
            k, v = slot_deltas(steps, self.schedule, self.preset.block_size)
            return reference.target_kv_cache_update(
                k,
                v,
                self.initial_pool,
                self.rope,
                self.schedule.starts,
                self.schedule.totals,
                pages_per_slot=self.preset.pages_per_slot,
                **extras,
            )
        pool = self.initial_pool
        B = self.batch
        for group in paged_replay_groups(self.plan, range(self.prefill_steps + self.steps)):
            pos, own, tables, ks, vs = [], [], [], [], []
            for g, i in enumerate(group):
                p, o, t = _step_arrays(self.plan, i)
                pos.append(p)
                own.append(np.where(o >= 0, o + g * B, -1).astype(np.int32))
                tables.append(t)
                ks.append(steps[i][0])
                vs.append(steps[i][1])
            pos, own = np.concatenate(pos), np.concatenate(own)
            pool = reference.target_kv_cache_update_paged(
                np.concatenate(ks, axis=1),
                np.concatenate(vs, axis=1),
                pool,
                gather_rope_host(self.rope, pos, own),
                pos,
                own,
                np.concatenate(tables),
                ring=self.plan.ring,
                **extras,
            )
        return pool

    def readback_views(self) -> list[readback.SequenceView]:
        """The sequences the read-back check samples (the same ones for a given seed), with the
        positions the run wrote and the pool still holds: in a slot, from the sequence's start
        (what lies before it was never written); in pages, the whole sequence, its shared prompt
        pages included, or with a window what the ring still holds."""
        rng = np.random.default_rng([self.seed, 1])
        p = self.preset
        views = []
        if self.plan is None:
            s = self.schedule
            live = np.flatnonzero(s.totals > 0)
            for b in rng.permutation(live)[:READBACK_SEQUENCES]:
                b = int(b)
                views.append(
                    readback.slot_view(
                        f"sequence {b}",
                        b,
                        int(s.starts[b]),
                        int(s.starts[b] + s.totals[b]),
                        p.pages_per_slot,
                        p.page_size,
                        b,
                    )
                )
            return views
        final = self.plan.final
        table = self.plan.decode.tables[-1]
        for n in rng.permutation(len(final))[:READBACK_SEQUENCES]:
            f = final[int(n)]
            pos = np.arange(f.visible_start, f.length)
            streams = np.where(pos < f.prompt_length, f.prompt_id, f.stream)
            views.append(
                readback.paged_view(
                    f"sequence in table row {f.row}",
                    table[f.row],
                    pos,
                    streams,
                    p.page_size,
                    self.plan.num_pages,
                    self.plan.ring,
                )
            )
        return views

    def recompute(self, streams, positions, at_least: int = 0):
        """Keys and values of tokens from their features, without a cache: ``(normed keys,
        RoPE'd keys, values)`` float32 ``[layers, n_padded, H, D]``, the tokens padded to a step's
        token count times a power of two. The projection runs chunk by chunk in the step's
        own token count, the shape the step ran."""
        T = self.tokens_per_step
        n = len(positions)
        chunks = 1 << max(0, int(np.ceil(np.log2(max(n, at_least, 1) / T))))
        pad = chunks * T - n
        s = np.concatenate([np.asarray(streams, np.int32), np.zeros(pad, np.int32)])
        q = np.concatenate([np.asarray(positions, np.int32), np.zeros(pad, np.int32)])
        if "recompute" not in self._compiled:
            self._compiled["recompute"] = jax.jit(
                functools.partial(_recompute, geometry=self.geometry, tokens_per_step=T)
            )
        consts = self.consts()
        return self._compiled["recompute"](
            consts.weights,
            consts.rope,
            jax.device_put(s, self.device),
            jax.device_put(q, self.device),
        )

    def readback(self, pools) -> readback.ReadbackResult:
        k_scale, v_scale = self.scales_host()
        return readback.check_sequences(
            pools,
            self.readback_views(),
            self.recompute,
            delta_dtype=self.delta_dtype,
            rotary_dim=self.geometry.rotary_dim,
            k_scale=k_scale,
            v_scale=v_scale,
            rng=np.random.default_rng([self.seed, 2]),
        )
