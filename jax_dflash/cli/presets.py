"""Draft-cache shapes for ``jax-dflash run``: two CPU-sized ones and the public DFlash drafts.

A DFlash draft layer attends to the target's context features: each draft layer projects them
with its own ``k_proj``/``v_proj`` (``num_key_value_heads * head_dim`` outputs each, k-normed)
and keeps them in its KV cache. So the cache this project updates has, per draft layer, ``H =
num_key_value_heads`` heads of ``D = head_dim``, and every verification step writes between 1
and ``block_size`` accepted tokens per sequence into it.

Where the numbers of the public drafts come from (the draft's ``config.json`` on Hugging Face
is the authority; these are the public places it was read from, found with a code search):

- ``z-lab/Qwen3-4B-DFlash-b16``: 5 layers, hidden 2560, 32 query heads, 8 KV heads, head_dim
  128, block_size 16, target_layer_ids [1, 9, 17, 25, 33]. Quoted from the model's config.json
  by two independent public projects (an inference engine's DFlash port notes "block_size=16, 5
  layers, hidden 2560, 32 Q heads, 8 KV heads"; a SpecForge NPU recipe "matches
  z-lab/Qwen3-4B-DFlash-b16/config.json: hidden_size=2560, num_key_value_heads=8, head_dim=128,
  num_hidden_layers=5, block_size=16").
- ``z-lab/Qwen3-8B-DFlash-b16``: 5 layers, hidden 4096, 32 query heads, 8 KV heads, head_dim
  128, block_size 16, num_target_layers 36. From the config fixture in vLLM speculators' DFlash
  converter tests (``_source_config``, converted against ``Qwen/Qwen3-8B``); the KV geometry
  equals Qwen3-8B's own (num_key_value_heads 8, head_dim 128), as the DFlash drafts copy their
  target's attention geometry (z-lab/dflash ``model/dflash.py`` builds the draft from a
  ``Qwen3Config``).
- ``z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat``: block size 10, from its model card (vLLM
  ``"num_speculative_tokens": 9``, i.e. 9 drafted tokens after the anchor) and Google's
  DFlash-on-TPU write-up (``K=10``); 5 target layers [1, 8, 15, 22, 29] from public replication
  scripts. ASSUMPTIONS (its config.json was not found): 5 draft layers, like every other z-lab
  DFlash draft; 8 KV heads, head_dim 128 and hidden 4096 taken from the target
  ``meta-llama/Llama-3.1-8B-Instruct`` (num_key_value_heads 8, hidden 4096 / 32 heads = 128).

The page size of the GPU presets is 128 (the TensorRT contract's ``P``); the CPU presets use
small pages, which the JAX op allows. Pool sizes (slots, pages per slot) are choices of this
simulation, not properties of the drafts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

try:
    from ml_dtypes import bfloat16 as _bfloat16
except ImportError:  # pragma: no cover - jax always brings ml_dtypes
    _bfloat16 = None


@dataclasses.dataclass(frozen=True)
class Preset:
    """One draft model's cache shape and this simulation's defaults for it."""

    name: str
    summary: str
    num_layers: int  # draft layers, each with its own KV pool
    num_kv_heads: int  # H
    head_dim: int  # D (RoPE rotates all of it: rotary_dim = D)
    hidden_size: int  # width of the context features the k/v projections read
    block_size: int  # L: the most tokens one verification step can accept
    page_size: int  # P
    pages_per_slot: int
    num_slots: int  # max batch: sequences the pool has room for
    rope_theta: float
    dtype: str
    default_batch: int
    default_steps: int
    source: str

    @property
    def slot_capacity(self) -> int:
        return self.page_size * self.pages_per_slot

    @property
    def num_pages(self) -> int:
        return self.num_slots * self.pages_per_slot

    @property
    def np_dtype(self) -> np.dtype:
        return dtype_from_name(self.dtype)

    def pool_shape(self) -> tuple[int, ...]:
        """The layer-batched pool: ``[layers, 2, numPages, P, H, D]``."""
        return (self.num_layers, 2, self.num_pages, self.page_size, self.num_kv_heads,
                self.head_dim)

    def pool_bytes(self, dtype: str | None = None) -> int:
        itemsize = dtype_from_name(dtype or self.dtype).itemsize
        return int(np.prod(self.pool_shape())) * itemsize

    def describe(self) -> str:
        """One line: the shape a reader needs to judge the workload."""
        return (
            f"{self.num_layers} layers x {self.num_kv_heads} KV heads x D {self.head_dim}, "
            f"hidden {self.hidden_size}, block {self.block_size}, P {self.page_size}, "
            f"{self.num_slots} slots x "
            f"{self.slot_capacity} tokens, {self.dtype} "
            f"(pool {_human_bytes(self.pool_bytes())}; defaults: batch {self.default_batch}, "
            f"{self.default_steps} steps)"
        )


def dtype_from_name(name: str) -> np.dtype:
    if name == "bfloat16":
        if _bfloat16 is None:  # pragma: no cover
            raise ValueError("dtype: bfloat16 needs ml_dtypes (it comes with jax)")
        return np.dtype(_bfloat16)
    if name in ("float16", "float32"):
        return np.dtype(name)
    raise ValueError(f"dtype: expected float16, bfloat16 or float32, got {name!r}")


DTYPE_NAMES = ("float16", "bfloat16", "float32")


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_QWEN3_4B_SOURCE = "z-lab/Qwen3-4B-DFlash-b16 config.json (see jax_dflash/presets.py)"
_QWEN3_8B_SOURCE = "z-lab/Qwen3-8B-DFlash-b16 config.json (see jax_dflash/presets.py)"
_LLAMA_SOURCE = ("z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat model card (block 10); layers and "
                 "KV geometry ASSUMED from Llama-3.1-8B (see jax_dflash/presets.py)")

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="tiny", summary="test-sized: a few milliseconds per step on one CPU core",
            num_layers=2, num_kv_heads=2, head_dim=32, hidden_size=64, block_size=8,
            page_size=8, pages_per_slot=8, num_slots=4, rope_theta=1e6, dtype="bfloat16",
            default_batch=4, default_steps=8, source="made up for tests",
        ),
        Preset(
            name="small",
            summary="a DFlash-shaped draft (5 layers, block 16) scaled down for CPUs",
            num_layers=5, num_kv_heads=4, head_dim=64, hidden_size=256, block_size=16,
            page_size=16, pages_per_slot=64, num_slots=16, rope_theta=1e6, dtype="bfloat16",
            default_batch=8, default_steps=160,
            source="the Qwen3 DFlash drafts' layer count and block size, narrowed",
        ),
        # GPU presets: 64 slots of 2048 tokens (16 pages of 128) per layer.
        Preset(
            name="qwen3-4b-b16", summary="z-lab/Qwen3-4B-DFlash-b16 (GPU-sized)",
            num_layers=5, num_kv_heads=8, head_dim=128, hidden_size=2560, block_size=16,
            page_size=128, pages_per_slot=16, num_slots=64, rope_theta=1e6, dtype="bfloat16",
            default_batch=32, default_steps=200, source=_QWEN3_4B_SOURCE,
        ),
        Preset(
            name="qwen3-8b-b16", summary="z-lab/Qwen3-8B-DFlash-b16 (GPU-sized)",
            num_layers=5, num_kv_heads=8, head_dim=128, hidden_size=4096, block_size=16,
            page_size=128, pages_per_slot=16, num_slots=64, rope_theta=1e6, dtype="bfloat16",
            default_batch=32, default_steps=200, source=_QWEN3_8B_SOURCE,
        ),
        Preset(
            name="llama3.1-8b-b10",
            summary="z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat (GPU-sized; partly assumed)",
            num_layers=5, num_kv_heads=8, head_dim=128, hidden_size=4096, block_size=10,
            page_size=128, pages_per_slot=16, num_slots=64, rope_theta=5e5, dtype="bfloat16",
            default_batch=32, default_steps=200, source=_LLAMA_SOURCE,
        ),
    )
}

DEFAULT_PRESET = "small"


def presets_help() -> str:
    """The preset list for ``--help``: name, shape, where it comes from."""
    lines = ["presets:"]
    for p in PRESETS.values():
        default = " [default]" if p.name == DEFAULT_PRESET else ""
        lines.append(f"  {p.name}{default}: {p.summary}")
        lines.append(f"      {p.describe()}")
        lines.append(f"      source: {p.source}")
    return "\n".join(lines)
