"""The host memory a ``run`` holds at its peak, estimated before it starts, and its guard.

What the run holds (:mod:`jax_dflash.cli.measure`), at its two worst moments:

- while it runs: the initial pool (host), the device's pool (host memory too on a CPU
  backend) and, when checking, a host copy of the run's pools (the replays write on); with
  ``--compare`` on a CPU, the baseline's float32 copies of a bfloat16 or FP8 pool;
- while it checks: the initial pool, that copy, the reference's pools (the paged replay holds
  the previous group's pools besides the new ones) and the comparison's mask of one byte per
  element; and every step's deltas, collected on the host, plus the reference's merged copy
  of them.

Besides: the JAX runtime as it stands when the guard runs (measured), XLA's compilations and a
step's temporaries, the draft's weights (host, and device on a CPU), the per-step inputs, and
a tenth of all that as headroom.
``--compare`` runs a second implementation after the first; the deltas freed by the first are
counted again, as the allocator does not hand all of that memory back to the system.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import resource
import sys

from jax_dflash.cli.common import UsageError

HOST_MEMORY_SHARE = 0.5  # of the machine's physical memory
# XLA's compilations of the steps (with and without the update, per implementation) and of the
# checks: their working memory and the executables the process keeps.
COMPILE_BYTES = 256 << 20
# The deltas' copies at the check: the collected ones and the reference's merged copy.
CHECK_DELTA_COPIES = 2
# --compare: what the first implementation's freed deltas leave behind, in deltas.
COMPARE_DELTA_COPIES = 1.0
# On top of the parts: the allocators' overheads, and what the parts leave out.
HEADROOM = 0.1
# --compare's baseline writes the pool with XLA scatters, which XLA's CPU backend runs in
# float32 for these pool dtypes: float32 copies of the whole pool while its steps run.
FLOAT32_SCATTER_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
BASELINE_FLOAT32_POOL_COPIES = 2


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of the estimate: what it is, its bytes, and the flags that size it."""

    name: str
    bytes: int
    flags: str = ""


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    parts: tuple[Part, ...]
    limit: int  # the most the run may need: a share of the machine's memory

    @property
    def total(self) -> int:
        return sum(p.bytes for p in self.parts)

    @property
    def biggest(self) -> Part:
        return max(self.parts, key=lambda p: p.bytes)

    def as_dict(self) -> dict:
        return {
            "estimated_peak_bytes": self.total,
            "limit_bytes": self.limit,
            "parts": {p.name: p.bytes for p in self.parts},
        }


@functools.cache
def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 16 << 30


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS counts bytes, Linux KiB


def pool_elements(preset, settings) -> int:
    """Elements of the run's layer-batched pool; for the paged contract, of the largest pool
    its plan can draw (every prompt at its longest)."""
    from jax_dflash.cli import allocator

    p = preset
    if settings.contract == "slot":
        pages = p.num_pages
    else:  # a mixed draft's pool: every layer has its full layers' pages (one array)
        window = None if settings.window_layers is not None else settings.window
        table_pages = allocator.table_pages_for(p.page_size, p.pages_per_slot, window)
        pages = allocator.pool_pages_for(settings.batch, table_pages, _prompt_pages(p, settings))
    return p.num_layers * 2 * pages * p.page_size * p.num_kv_heads * p.head_dim


def _prompt_pages(preset, settings) -> int:
    """Pages of the paged plan's prompt cache, every prompt at its longest."""
    longest = preset.slot_capacity // 2
    if settings.window is not None:
        longest = min(longest, settings.window)
    prompts = max(1, settings.batch // 2)
    return prompts * (max(longest, preset.page_size) // preset.page_size)


def collected_steps(preset, settings) -> int:
    """Steps whose deltas the check collects: the decode steps, and the paged plan's prefill
    (its prompt tokens a step's worth at a time, one prompt per table row at most)."""
    if settings.contract == "slot":
        return settings.steps
    tokens = settings.batch * preset.block_size
    prompt_tokens = _prompt_pages(preset, settings) * preset.page_size
    return settings.steps + -(-prompt_tokens // tokens) + max(1, settings.batch // 2)


def estimate(preset, settings, *, check: bool, compare: bool, host_device: bool, runtime: int):
    """The parts of the run's peak host memory (see the module docstring). ``host_device``:
    the device's memory is the host's (a CPU backend); ``runtime``: the process's memory now."""
    from jax_dflash.cli.formats import bytes_per_element
    from jax_dflash.cli.presets import dtype_from_name

    p, s = preset, settings
    elements = pool_elements(p, s)
    pool = int(round(elements * bytes_per_element(s.pool_dtype, p.head_dim)))  # scales included
    delta_itemsize = dtype_from_name(s.delta_dtype).itemsize
    tokens = s.batch * p.block_size
    running = (1 + host_device + check) * pool  # initial, the device's, the checked copy
    if compare and host_device and s.pool_dtype in FLOAT32_SCATTER_DTYPES:
        running += BASELINE_FLOAT32_POOL_COPIES * elements * 4
    checking = 3 + (s.contract == "paged") if check else 0  # + reference, + replay's previous
    pools = max(running, checking * pool + check * elements)
    deltas = 0
    if check:
        one_step = 2 * p.num_layers * tokens * p.num_kv_heads * p.head_dim * delta_itemsize
        copies = CHECK_DELTA_COPIES + (COMPARE_DELTA_COPIES if compare else 0)
        deltas = int(copies * collected_steps(p, s) * one_step)
    kv_width = 2 * p.num_layers * p.num_kv_heads * p.head_dim
    weights = (p.feature_size + 1 + kv_width) * p.hidden_size + p.num_layers * p.head_dim
    # A step's float32 temporaries: features, hidden states and all layers' k/v, and their copies.
    temporaries = 2 * tokens * (p.feature_size + p.hidden_size + kv_width) * 4 if host_device else 0
    parts = [
        Part("the JAX runtime and compilations", runtime + COMPILE_BYTES + temporaries),
        Part("pools", pools, _pool_flags(p, s)),
        Part("checked deltas", deltas, f"--steps {s.steps} --batch {s.batch}"),
        Part("weights", weights * delta_itemsize * (1 + host_device), p.flag),
        Part("per-step inputs", _input_bytes(p, s, tokens), f"--steps {s.steps} --batch {s.batch}"),
    ]
    return parts + [Part("headroom", int(HEADROOM * sum(part.bytes for part in parts)))]


def _pool_flags(preset, settings) -> str:
    """The flags that size the pools: the window (paged), else the batch (paged) or the preset."""
    mixed = settings.window_layers is not None  # its full layers size the pool
    if settings.contract == "paged" and settings.window is not None and not mixed:
        return f"--window {settings.window}"
    if settings.contract == "paged":
        return f"--batch {settings.batch}"
    return preset.flag


def _input_bytes(preset, settings, tokens: int) -> int:
    """The per-step addressing, stacked over the steps, on the host and on the device."""
    from jax_dflash.cli import allocator

    if settings.contract == "slot":
        return (settings.steps + 1) * settings.batch * 4 * 3  # lengths, positions, a copy
    tables = 1
    if settings.window_layers is None:
        table_pages = allocator.table_pages_for(
            preset.page_size, preset.pages_per_slot, settings.window
        )
    else:  # a table per layer, as wide as the full layers' pages rounded to whole rings
        tables = preset.num_layers
        table_pages = allocator.mixed_table_pages(
            preset.page_size, preset.pages_per_slot, settings.window
        )
    # positions, owners, streams [T] and the tables [B, 2, M] per step (and the warm-up's row)
    per_step = (3 * tokens + tables * 2 * settings.batch * table_pages) * 4
    return 2 * (collected_steps(preset, settings) + 1) * per_step


def check_host_memory(preset, settings, device, *, check: bool, compare: bool) -> MemoryEstimate:
    """The estimate of the run's peak host memory; UsageError, naming the flags that size its
    biggest part, when it exceeds ``HOST_MEMORY_SHARE`` of the machine's memory."""
    from jax_dflash.cli.presets import human_bytes

    parts = estimate(
        preset,
        settings,
        check=check,
        compare=compare,
        host_device=device.platform == "cpu",
        runtime=peak_rss(),
    )
    result = MemoryEstimate(tuple(parts), int(physical_memory() * HOST_MEMORY_SHARE))
    if result.total > result.limit:
        biggest = result.biggest
        hint = "; --no-check drops the deltas kept for the check"
        raise UsageError(
            (f"{biggest.flags}: " if biggest.flags else "")
            + f"the run would need about {human_bytes(result.total)} of host memory (mostly "
            f"{biggest.name}: {human_bytes(biggest.bytes)}); expected at most "
            f"{human_bytes(result.limit)}, half of this machine's"
            + (hint if biggest.name == "checked deltas" else "")
        )
    return result
