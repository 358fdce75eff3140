"""The ``run`` command's settings: every flag checked before anything runs (no JAX needed), then
the device and what the installed op and JAX support. A flag that cannot run is a UsageError
with a one-line reason naming it."""

from __future__ import annotations

import dataclasses

from jax_dflash.cli.common import UsageError

BACKENDS = ("default", "cpu", "gpu")
CONTRACTS = ("slot", "paged")
DEFAULT_ACCEPT = "geometric:0.8"
# Run bounds: a step costs milliseconds, so a million steps is already a long run; the memory
# the run needs is estimated and bounded separately (jax_dflash.cli.memory).
MAX_STEPS = 1_000_000
# The paged plan is simulated on the host: the bound on its sequence-steps, and the cost of one
# that the run's time estimate assumes.
MAX_PAGED_SEQUENCE_STEPS = 2_000_000
PAGED_PLAN_SECONDS_PER_SEQUENCE_STEP = 15e-6


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The run's flags resolved against its preset."""

    contract: str
    window: int | None
    window_layers: tuple[bool, ...] | None  # a mixed draft's windowed layers; None: all alike
    batch: int
    steps: int
    accept: object  # jax_dflash.cli.accept.AcceptDistribution
    delta_dtype: str
    pool_dtype: str


def _window(args, preset, contract: str) -> int | None:
    window = args.window if args.window is not None else preset.window
    if window is None:
        return None
    source = "--window" if args.window is not None else preset.window_origin
    if contract != "paged":
        raise UsageError(
            f"{source} {window} needs --contract paged (sliding windows live "
            f"in ring pages of a page table), got --contract {contract}"
        )
    if window % preset.page_size:
        raise UsageError(
            f"{source} {window}: expected a positive multiple of the page size {preset.page_size}"
        )
    if window > preset.slot_capacity:
        raise UsageError(
            f"{source} {window}: expected at most {preset.slot_capacity} tokens, the longest "
            f"sequence of {preset.origin} (a longer window never slides)"
        )
    return window


def _mixed_contract(preset, contract: str) -> None:
    """A draft mixing windowed and full layers needs a ring for some layers and growing pages
    for the others, which only page tables give."""
    if preset.mixed and contract != "paged":
        raise UsageError(
            f"--contract {contract}: {preset.origin} mixes sliding-window and full layers "
            f"(layer_types: {preset.layer_kinds()}); expected --contract paged (the default for "
            f"it): the slot contract (Edge-LLM 0.10) has no ring pages for the window layers"
        )


def validate(args, preset) -> RunSettings:
    """Every flag of ``run`` checked before anything runs (no JAX needed)."""
    from jax_dflash.cli.accept import parse_accept

    contract = args.contract or preset.default_contract
    _mixed_contract(preset, contract)
    window = _window(args, preset, contract)
    batch = args.batch if args.batch is not None else preset.default_batch
    steps = args.steps if args.steps is not None else preset.default_steps
    if batch > preset.num_slots:
        raise UsageError(
            f"--batch {batch} is larger than the pool's {preset.num_slots} slots of "
            f"{preset.origin} (expected --batch <= {preset.num_slots})"
        )
    try:
        accept = parse_accept(args.accept, preset.block_size)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if steps > MAX_STEPS:
        raise UsageError(f"--steps {steps}: expected at most {MAX_STEPS} steps")
    if contract == "paged" and steps * batch > MAX_PAGED_SEQUENCE_STEPS:
        seconds = steps * batch * PAGED_PLAN_SECONDS_PER_SEQUENCE_STEP
        raise UsageError(
            f"--steps {steps} --batch {batch}: the paged plan simulates every sequence's every "
            f"step on the host (about {seconds:.0f} s here); expected steps x "
            f"batch <= {MAX_PAGED_SEQUENCE_STEPS}"
        )
    delta = args.dtype or preset.dtype
    pool = args.kv_dtype or delta
    window_layers = preset.window_layers if window is not None else None
    return RunSettings(contract, window, window_layers, batch, steps, accept, delta, pool)


def select_device(backend: str):
    """The first device of ``backend`` ('default', 'cpu' or 'gpu'); UsageError if there is none
    or the op cannot run there."""
    import jax

    if backend == "default":
        device = jax.devices()[0]
    else:
        try:
            device = jax.devices(backend)[0]
        except RuntimeError:
            raise UsageError(
                f"--backend {backend}: JAX has no {backend} device here (JAX's default backend "
                f"is {jax.default_backend()})"
            ) from None
    if device.platform not in ("cpu", "gpu", "cuda"):
        raise UsageError(
            f"--backend {backend}: the op runs on cpu and CUDA GPUs, JAX's device "
            f"here is {device.platform}"
        )
    return device


def op_supports(name: str) -> bool:
    """Whether the installed JAX op takes the keyword ``name`` (k_norm_weight, k_scale)."""
    import inspect

    import jax_dflash

    return name in inspect.signature(jax_dflash.target_kv_cache_update).parameters


def format_runs_on(name: str, device) -> bool:
    """Whether the op writes pool format ``name`` on ``device``: every format on the CPU; on a
    GPU, those whose contract row says the CUDA handler writes them (its ``cuda`` field)."""
    from jax_dflash.cli.formats import runs_on_cuda

    return device.platform == "cpu" or runs_on_cuda(name)


def check_format_runs(what: str, name: str, device) -> None:
    """UsageError naming ``what`` and the format when the op cannot write it on ``device``."""
    if not format_runs_on(name, device):
        raise UsageError(
            f"{what}: the op's CUDA handler does not write {name} pools yet (the CPU backend "
            f"does); expected --backend cpu, got a {device.platform} device"
        )


def check_runtime(args, settings: RunSettings, preset, device) -> bool:
    """The checks that need JAX: FP8 support, the fused norm, GPU-sized presets on a CPU.
    Returns whether the norm is fused."""
    import jax
    import jax.numpy as jnp

    from jax_dflash.cli.formats import is_dynamic
    from jax_dflash.cli.presets import FP8_NAMES, human_bytes

    pool = settings.pool_dtype
    check_format_runs(f"--kv-dtype {args.kv_dtype}", pool, device)
    if is_dynamic(pool):
        if args.compare:
            raise UsageError(
                f"--compare: the jnp baseline has no dynamic scales; expected a --kv-dtype "
                f"without them, got --kv-dtype {args.kv_dtype}"
            )
    if pool in FP8_NAMES:
        if not hasattr(jnp, pool):
            raise UsageError(
                f"--kv-dtype {args.kv_dtype}: this JAX ({jax.__version__}) has no "
                f"jnp.{pool}; FP8 pools need a JAX with FP8 dtypes"
            )
        if not op_supports("k_scale"):
            raise UsageError(
                f"--kv-dtype {args.kv_dtype}: the installed jax_dflash op takes no "
                f"k_scale/v_scale (FP8 pools need them)"
            )
    supported = op_supports("k_norm_weight")
    fused = supported if args.fused_norm is None else args.fused_norm
    if fused and not supported:
        raise UsageError(
            "--fused-norm: the installed jax_dflash op takes no k_norm_weight; use --no-fused-norm"
        )
    if preset.gpu_sized and device.platform == "cpu" and not args.force:
        tokens = settings.batch * preset.block_size
        kv_width = 2 * preset.num_layers * preset.num_kv_heads * preset.head_dim
        flops = 2 * tokens * preset.hidden_size * (preset.feature_size + kv_width)
        raise UsageError(
            f"{preset.origin} is GPU-sized (pool {human_bytes(preset.pool_bytes(pool))}, "
            f"{flops / 1e9:.0f} GFLOP per step): on a CPU it would take minutes; pass --force "
            f"to run it anyway"
        )
    return fused
