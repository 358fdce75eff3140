"""The device side of a run: the plan's constants on the device, the jitted step compiled with
and without the update, and the loop that runs it (with the check's delta collection and the
progress bar)."""

from __future__ import annotations

import collections
import sys
import time

import jax
import numpy as np

from jax_dflash.cli import pipeline
from jax_dflash.cli.plan import RunPlan

# Steps allowed in flight before the loop waits for an older one: keeps the device busy while
# making the progress bar (and a Ctrl-C) follow the device, not just the dispatcher.
MAX_STEPS_IN_FLIGHT = 4
# Device memory the run may hold in not-yet-fetched deltas before it fetches them (the clock is
# paused meanwhile). Only used when checking.
HARVEST_BUDGET_BYTES = 1 << 30
# Untimed steps that write nothing, run on the run's own state before the timed loop.
WARMUP_STEPS = 5


class ProgressBar:
    """A plain text bar on stderr: redrawn in place on a terminal, a few lines otherwise.

    Its rate is the caller's: units done over the seconds the caller measured for them, so a
    pass's bar ends on the same steps/s the pass reports (steps the device has finished, over
    the seconds until it finished them)."""

    def __init__(
        self,
        total: int,
        label: str,
        *,
        enabled: bool = True,
        stream=None,
        width: int = 28,
        unit: str = "steps",
    ):
        self.total, self.label, self.width, self.unit = total, label, width, unit
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.last_draw = -1.0
        self.next_quarter = 1

    def update(self, done: int, seconds: float) -> None:
        """``done`` of ``total`` units finished in ``seconds``."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self.last_draw >= 0.1 or done == self.total:
                self.last_draw = now
                self.stream.write("\r" + self._line(done, seconds))
                if done == self.total:
                    self.stream.write("\n")
                self.stream.flush()
        elif done * 4 >= self.next_quarter * self.total:
            while done * 4 >= self.next_quarter * self.total:
                self.next_quarter += 1
            self.stream.write(self._line(done, seconds) + "\n")
            self.stream.flush()

    def _line(self, done: int, seconds: float) -> str:
        filled = self.width * done // max(self.total, 1)
        rate = done / max(seconds, 1e-9)
        return (
            f"{self.label:<28} [{'#' * filled}{'.' * (self.width - filled)}] "
            f"{done}/{self.total} {self.unit} {rate:8.1f} {self.unit}/s"
        )


class StepCollector:
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


class DeviceSteps:
    """The plan's jitted steps on one device."""

    def __init__(self, plan: RunPlan, device: jax.Device):
        self.plan, self.device = plan, device
        self._consts: pipeline.Constants | None = None
        self._compiled: dict = {}

    def put(self, x) -> jax.Array:
        return jax.device_put(x, self.device)

    def consts(self) -> pipeline.Constants:
        if self._consts is None:
            self._consts = self._make_consts()
        return self._consts

    def _make_consts(self) -> pipeline.Constants:
        plan, put = self.plan, self.put
        w = plan.host_weights
        weights = pipeline.DraftWeights(
            put(w["fc"]),
            put(w["hidden_norm"]),
            put(w["kv_proj"]),
            put(w["k_norm"]),
            put(np.uint32(plan.seed % 2**32)),
        )
        k_scale = v_scale = None
        if plan.fp8:
            with jax.default_device(self.device):
                k_scale, v_scale = jax.jit(pipeline.calibrate_scales, static_argnums=(1, 2))(
                    weights, plan.geometry, plan.pool_dtype_name
                )
        lengths = positions = owners = streams = tables = None
        if plan.plan is None:
            pad = np.zeros((1, plan.batch), np.int32)  # the warm-up steps' row: nothing written
            lengths = put(np.concatenate([plan.schedule.lengths, pad]))
        else:
            pre, dec = plan.plan.prefill, plan.plan.decode

            def stack(name, pad):
                parts = [getattr(pre, name), getattr(dec, name)]
                pad_row = np.full((1, *parts[0].shape[1:]), pad, np.int32)
                return put(np.concatenate([*parts, pad_row]))

            positions, owners = stack("positions", -1), stack("owners", -1)
            streams, tables = stack("streams", -1), stack("tables", -1)
        return pipeline.Constants(
            weights, put(plan.rope), k_scale, v_scale, lengths, positions, owners, streams, tables
        )

    def scales_host(self):
        c = self.consts()
        if c.k_scale is None:
            return None, None
        return np.asarray(c.k_scale), np.asarray(c.v_scale)

    def fresh_pools(self):
        """The initial pool on the device; with dynamic scales, ``(pool, scale_pool)``."""
        if self.plan.dynamic:
            return (self.put(self.plan.initial_pool), self.put(self.plan.initial_scale_pool))
        return self.put(self.plan.initial_pool)

    def state(self, pools, step_index: int):
        i = self.put(np.int32(step_index))
        if self.plan.plan is None:
            return (pools, i, self.put(self.plan.schedule.starts))
        return (pools, i)

    def compiled(self, impl: str, with_update: bool = True):
        """``(executable, compile seconds)`` of the step, compiled once. Lowered against the
        pools' shape alone, so compiling needs no copy of the pool."""
        key = (impl, with_update)
        if key not in self._compiled:
            step = pipeline.make_step(self.plan.spec, impl, with_update=with_update)
            sharding = jax.sharding.SingleDeviceSharding(self.device)
            pools = jax.ShapeDtypeStruct(
                self.plan.pool_shape, self.plan.pool_dtype, sharding=sharding
            )
            if self.plan.dynamic:
                scales = jax.ShapeDtypeStruct(
                    self.plan.pool_shape[:-1], np.float32, sharding=sharding
                )
                pools = (pools, scales)
            start = time.perf_counter()
            lowered = jax.jit(step, donate_argnums=0).lower(self.state(pools, 0), self.consts())
            compiled = lowered.compile()
            self._compiled[key] = (compiled, time.perf_counter() - start)
        return self._compiled[key]

    def loop(self, compiled, state, first: int, count: int, *, collector=None, bar=None):
        """Runs steps ``first .. first + count``; returns (state, seconds until the device has
        finished them, fetches for the check excluded). The bar counts finished steps only, on
        the same clock, so its last line is this pass's steps/s."""
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
                bar.update(n + 1 - len(in_flight), time.perf_counter() - start - paused)
        state = jax.block_until_ready(state)
        seconds = time.perf_counter() - start - paused
        if bar is not None:
            bar.update(count, seconds)
        return state, seconds

    def warm_up(self, compiled, pools):
        """Untimed steps past the plan (nothing accepted: they write nothing)."""
        state = self.state(pools, self.plan.prefill_steps + self.plan.steps)
        for _ in range(WARMUP_STEPS):
            state, _ = compiled(state, self.consts())
        return jax.block_until_ready(state)[0]

    def deltas(self, impl: str = "kernel") -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """The deltas every step (prefill included) gives the update, as the check collects
        them, computed by the same step without the update."""
        compiled, _ = self.compiled(impl, False)
        collector = StepCollector()
        state = self.state(self.fresh_pools(), 0)
        total = self.plan.prefill_steps + self.plan.steps
        self.loop(compiled, state, 0, total, collector=collector)
        collector.flush()
        return collector.steps
