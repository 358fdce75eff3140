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

A :class:`Workload` is the run's plan (:mod:`~jax_dflash.cli.plan`) with its steps on a device
(:mod:`~jax_dflash.cli.steps`), each implementation's checked pass
(:mod:`~jax_dflash.cli.measure`), the checks (:mod:`~jax_dflash.cli.verify`) and the headline
timing (:mod:`~jax_dflash.cli.replays`).
"""

from __future__ import annotations

import jax
import numpy as np

from jax_dflash.cli import measure, readback
from jax_dflash.cli.plan import RunPlan
from jax_dflash.cli.presets import Preset
from jax_dflash.cli.steps import DeviceSteps
from jax_dflash.cli.verify import Checks


class Workload(RunPlan):
    """One ``jax-dflash run``: the plan, run and checked on ``device``."""

    def __init__(self, preset: Preset, *, device: jax.Device, **settings):
        """``settings``: :class:`~jax_dflash.cli.plan.RunPlan`'s keywords (batch, steps, seed,
        accept, dtype, kv_dtype, contract, window, fused_norm)."""
        super().__init__(preset, **settings)
        self.device = device
        self.device_steps = DeviceSteps(self, device)
        self.checks = Checks(self, self.device_steps)

    def run(
        self,
        impl: str,
        *,
        check: bool = True,
        progress: bool = True,
        check_readback: bool = True,
    ) -> measure.ImplResult:
        """The checked pass: see :func:`jax_dflash.cli.measure.run_impl`."""
        return measure.run_impl(
            self.device_steps,
            self.checks,
            impl,
            check=check,
            progress=progress,
            check_readback=check_readback,
        )

    def measure(self, results: list[measure.ImplResult], *, progress: bool = True) -> None:
        """The headline timing of the results' implementations: see
        :mod:`jax_dflash.cli.replays`."""
        measure.measure(self.device_steps, results, progress=progress)

    def estimate_seconds(self, impl: str, *, timed_steps: int = 3) -> tuple[float, float]:
        return measure.estimate_seconds(self.device_steps, impl, timed_steps=timed_steps)

    def deltas(self, impl: str = "kernel") -> dict[int, tuple[np.ndarray, np.ndarray]]:
        return self.device_steps.deltas(impl)

    def reference_pools(self, deltas: dict, impl: str = "kernel") -> np.ndarray:
        return self.checks.reference_pools(deltas, impl)

    def readback_views(self) -> list[readback.SequenceView]:
        return self.checks.readback_views()

    def readback(self, pools) -> readback.ReadbackResult:
        return self.checks.readback(pools)
