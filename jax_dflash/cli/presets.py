"""Draft-cache shapes for ``jax-dflash run``: two CPU-sized ones and the public DFlash drafts,
each a draft ``config.json`` in ``configs/`` read by :mod:`jax_dflash.cli.draft_config` (the
reader of ``--draft-config``), named ``<target>-b<block size>[-w<window>]``.

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

- ``z-lab/Kimi-K2.5-DFlash`` (the draft named by public Kimi-K2.6 serving recipes): its
  config.json was not found. KNOWN: the target's hidden size 7168 (Kimi K2's config.json); a
  third-party DFlash draft for a Kimi-K2.7 target documents "5 layers, hidden 7168, train block
  size 16 / infer 8". ASSUMED: 6 draft layers, 8 KV heads of head_dim 128 (a Qwen3-style dense
  attention stack: the draft does not use the target's MLA), 5 target layers, block 8 at
  inference, RoPE theta 5e4.
- A Qwen3.5-27B draft: KNOWN from the target (Qwen3.5-27B: 24 query heads, 4 KV groups,
  kv-channels 256, hidden 5120, rotary percent 0.25, rotary base 1e7, as in a public training
  recipe's model arguments): H 4, D 256, a partial RoPE of R = 64 channels. ASSUMED: 5 draft
  layers and block 16, like the other DFlash drafts.
- DFlash2-style: block 8 and a 2048-token sliding window on every draft layer (``--window``,
  the paged contract with ring pages). ASSUMED: Qwen3-8B's draft geometry otherwise.
- A mixed draft, ``qwen3-8b-b16-w2048``: Qwen3-8B's draft geometry (as above) with
  ``layer_types`` of four ``sliding_attention`` layers (a 2048-token window) and a last
  ``full_attention`` one, the mix z-lab's config reader allows. ASSUMED: no public DFlash
  draft with this layout was read; it stands for the drafts whose layers mix the two kinds.
  ``tiny-w16`` is its CPU-sized twin (2 sliding layers of a 16-token window, 1 full).

Where a draft's target layers are not known, its ``target_layer_ids`` stand for the assumed count
(what the simulation reads: the width of the fc projection's input), not for known layers.
The Llama draft's RoPE is assumed to be its target's (``rope_scaling`` llama3, factor 8).

The page size of the GPU presets is 128 (the TensorRT contract's ``P``); the CPU presets use
small pages, which the JAX op allows. Pool sizes (slots, pages per slot) are choices of this
simulation, not properties of the drafts.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import pathlib

import numpy as np

from jax_dflash.cli import draft_config
from jax_dflash.cli.common import UsageError
from jax_dflash.cli.formats import (  # noqa: F401  (the names every module takes from here)
    DTYPE_ALIASES,
    DTYPE_NAMES,
    FP8_NAMES,
    POOL_DTYPE_NAMES,
    dtype_from_name,
)
from jax_dflash.contract import DEFAULT_NORM_EPS


@dataclasses.dataclass(frozen=True)
class Preset:
    """One draft model's cache shape and this simulation's defaults for it."""

    name: str
    summary: str
    num_layers: int  # draft layers, each with its own KV pool
    num_kv_heads: int  # H
    head_dim: int  # D
    hidden_size: int  # the draft's hidden width (what the k/v projections read)
    block_size: int  # L: the most tokens one verification step can accept
    page_size: int  # P
    pages_per_slot: int  # pages of one sequence at its longest (slot: the slot's pages)
    num_slots: int  # max batch: sequences the pool has room for
    rope_theta: float
    dtype: str
    default_batch: int
    default_steps: int
    source: str
    rotary_dim: int | None = None  # R; None: all of D
    target_layers: int = 5  # target hidden states concatenated into one feature (DFlash's fc)
    window: int | None = None  # sliding window (tokens) of the windowed layers, paged + ring
    # Per layer, whether it keeps the window, when the draft mixes windowed and full layers
    # (layer_types); None: every layer alike (all windowed with a window, else all full).
    window_layers: tuple[bool, ...] | None = None
    gpu_sized: bool = False
    rope_scaling: tuple | None = None  # (key, value) pairs of an HF rope_scaling; None: default
    norm_eps: float = DEFAULT_NORM_EPS  # rms_norm_eps: the hidden norm's and the k-norm's
    config_path: str | None = None  # the --draft-config file it was read from

    @property
    def default_contract(self) -> str:
        """Sliding windows live in ring pages of a page table; every other draft in slots."""
        return "slot" if self.window is None else "paged"

    @property
    def mixed(self) -> bool:
        """Whether the draft mixes sliding-window and full layers."""
        return self.window_layers is not None

    def layer_kinds(self) -> str:
        """``"4 sliding_attention, 1 full_attention"``: a mixed draft's layer counts."""
        sliding = sum(self.window_layers or ())
        return f"{sliding} {draft_config.SLIDING}, {self.num_layers - sliding} {draft_config.FULL}"

    def _named(self, preset: str, config: str) -> str:
        """``preset`` for a shipped preset, ``config`` for a --draft-config file."""
        return preset if self.config_path is None else config

    @property
    def origin(self) -> str:
        return self._named(f"preset {self.name}", f"draft config {self.config_path}")

    @property
    def flag(self) -> str:
        return self._named(f"--preset {self.name}", f"--draft-config {self.config_path}")

    @property
    def window_origin(self) -> str:
        return self._named(
            f"preset {self.name}'s window", f"--draft-config {self.config_path}: sliding_window"
        )

    @property
    def rope_dim(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def feature_size(self) -> int:
        """Width of one token's target features: the concatenated target hidden states (the
        DFlash drafts' targets share the draft's hidden size)."""
        return self.target_layers * self.hidden_size

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
        return (
            self.num_layers,
            2,
            self.num_pages,
            self.page_size,
            self.num_kv_heads,
            self.head_dim,
        )

    def pool_bytes(self, dtype: str | None = None) -> int:
        """The pool's bytes in a format (a dynamic one's scales included)."""
        from jax_dflash.cli.formats import bytes_per_element

        per = bytes_per_element(dtype or self.dtype, self.head_dim)
        return int(round(int(np.prod(self.pool_shape())) * per))

    def describe(self) -> str:
        """One line: the shape a reader needs to judge the workload."""
        scaling = "" if self.rope_scaling is None else dict(self.rope_scaling).get("rope_type", "")
        rope = ", ".join(
            part
            for part in (
                "" if self.rotary_dim is None else f"RoPE on {self.rotary_dim}",
                f"RoPE {scaling}" if scaling else "",
            )
            if part
        )
        rope = f" ({rope})" if rope else ""
        window = "" if self.window is None else f", window {self.window} (paged, ring)"
        if self.mixed:
            window = f", window {self.window} on {self.layer_kinds()} layers (paged, ring)"
        return (
            f"{self.num_layers} layers x {self.num_kv_heads} KV heads x D {self.head_dim}{rope}, "
            f"hidden {self.hidden_size}, block {self.block_size}, P {self.page_size}, "
            f"{self.num_slots} slots x "
            f"{self.slot_capacity} tokens{window}, {self.dtype} "
            f"(pool {human_bytes(self.pool_bytes())}; defaults: batch {self.default_batch}, "
            f"{self.default_steps} steps)"
        )


def from_config(config: dict, *, name: str, source: str, config_path: str | None = None):
    """A :class:`Preset` from a draft ``config.json``'s object (see
    :mod:`jax_dflash.cli.draft_config`); ConfigError naming the field that cannot be used."""
    geometry = draft_config.geometry(config)
    simulation = draft_config.simulation(
        config, name=name, source=source, window=geometry["window"]
    )
    return Preset(**geometry, **simulation, config_path=config_path)


def read_draft_config(path: str) -> Preset:
    """``--draft-config PATH``: a draft's config.json as a preset named after its folder (or the
    file); UsageError naming ``--draft-config``, the field, what was expected and what was given."""
    file = pathlib.Path(path)
    name = file.parent.resolve().name if file.name == "config.json" else file.stem
    try:
        preset = from_config(draft_config.load(file), name=name, source=path, config_path=path)
        if preset.rope_scaling is not None:  # its keys, as jax_dflash.rope_cos_sin takes them
            from jax_dflash.rope import inverse_frequencies

            scaling = dict(preset.rope_scaling)
            try:
                inverse_frequencies(preset.rope_dim, theta=preset.rope_theta, scaling=scaling)
            except (TypeError, ValueError) as e:
                raise draft_config.ConfigError(f"rope_scaling / rope_parameters: {e}") from None
    except draft_config.ConfigError as e:
        raise UsageError(f"--draft-config {path}: {e}") from None
    return preset


def _shipped_presets() -> dict[str, Preset]:
    """The configs in ``configs/``, CPU-sized first, each group by pool size."""
    found = []
    for entry in importlib.resources.files(__package__).joinpath("configs").iterdir():
        if entry.name.endswith(".json"):
            name = entry.name.removesuffix(".json")
            try:
                found.append(
                    from_config(draft_config.parse(entry.read_text()), name=name, source=name)
                )
            except draft_config.ConfigError as e:
                raise draft_config.ConfigError(f"configs/{entry.name}: {e}") from None
    found.sort(key=lambda p: (p.gpu_sized, p.pool_bytes(), p.name))
    return {p.name: p for p in found}


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


PRESETS: dict[str, Preset] = _shipped_presets()
# Other names accepted for presets: the model names without the block size.
PRESET_ALIASES = {"kimi-k2.5-dflash": "kimi-k2.5-b8", "qwen3.5-27b": "qwen3.5-27b-b16"}
DEFAULT_PRESET = "small"


def presets_help() -> str:
    """The preset list for ``--help``: name, shape, where it comes from."""
    lines = ["presets (their config.json files are in jax_dflash/cli/configs/):"]
    for p in PRESETS.values():
        default = " [default]" if p.name == DEFAULT_PRESET else ""
        lines.append(f"  {p.name}{default}: {p.summary}")
        lines.append(f"      {p.describe()}")
        lines.append(f"      source: {p.source}")
    return "\n".join(lines)
