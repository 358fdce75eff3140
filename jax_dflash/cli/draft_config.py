"""A DFlash draft's geometry from its ``config.json``, in z-lab's / Hugging Face's form: what
``run --draft-config PATH`` reads, and the form of the shipped presets (``configs/*.json``).

The fields, as z-lab's ``DFlashDraftModel`` reads them (through a ``Qwen3Config``; ``block_size``
and ``target_layer_ids`` from its ``dflash_config`` object first, then the top level):

- ``num_hidden_layers`` (draft layers), ``hidden_size``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``, ``rms_norm_eps`` (default 1e-6);
- RoPE: ``rope_parameters`` (``rope_theta``, ``rope_type``, ``partial_rotary_factor`` and the
  type's own keys) or the older ``rope_theta``, ``rope_scaling`` and ``partial_rotary_factor``;
- ``layer_types`` (``full_attention`` / ``sliding_attention``; without it, as ``Qwen3Config``
  derives it, sliding from layer ``max_window_layers`` on), ``sliding_window`` and
  ``use_sliding_window`` (without it ``Qwen3Config`` drops the window);
- ``block_size`` (default 16, z-lab's), ``target_layer_ids`` or ``num_target_layers`` (z-lab's
  ``build_target_layer_ids``): their count sizes the fc projection's input;
- ``torch_dtype`` or ``dtype`` (default bfloat16).

An optional ``jax_dflash`` object holds this simulation's choices: ``name``, ``summary``,
``source``, ``page_size``, ``pages_per_slot``, ``num_slots``, ``default_batch``, ``default_steps``
and ``gpu_sized``; without it, the GPU presets' (pages of 128 tokens, the TensorRT contract's).
Other fields are the model's business and are not read. A field that cannot be used is a
:class:`ConfigError` naming it, what was expected and what was given.
"""

from __future__ import annotations

import json
import math
import numbers
import pathlib

from jax_dflash.cli.formats import DTYPE_NAMES
from jax_dflash.contract import DEFAULT_NORM_EPS

FULL, SLIDING = "full_attention", "sliding_attention"
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # jax_dflash.rope_cos_sin's
FLOAT32_MIN_NORMAL = 1.17549435e-38  # the op refuses a smaller norm epsilon
# The simulation of a config without a ``jax_dflash`` object: the GPU presets' pool layout.
SIMULATION_DEFAULTS = dict(
    page_size=128, pages_per_slot=16, num_slots=64, default_batch=32, default_steps=200
)
SIMULATION_FIELDS = (*SIMULATION_DEFAULTS, "name", "summary", "source", "gpu_sized")


class ConfigError(ValueError):
    """A field of a draft config that cannot be used; the message names it."""


_MISSING = object()


def _got(value) -> str:
    return "nothing (the field is missing)" if value is _MISSING else repr(value)


def _int(config: dict, name: str, default=_MISSING, *, minimum: int = 1) -> int:
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}: expected an integer >= {minimum}, got {_got(value)}")
    return value


def _number(config: dict, name: str, default=_MISSING, *, minimum: float = 0.0) -> float:
    value = config.get(name, default)
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= minimum:
        raise ConfigError(f"{name}: expected a finite number > {minimum:g}, got {_got(value)}")
    return float(value)


def _draft_value(config: dict, name: str, default=_MISSING):
    """z-lab's lookup: the ``dflash_config`` object's field first, then the top level."""
    draft = config.get("dflash_config") or {}
    if not isinstance(draft, dict):
        raise ConfigError(f"dflash_config: expected an object, got {draft!r}")
    return draft.get(name, config.get(name, default))


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default: the draft layers spread over the target's layers 1 .. L - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _target_layers(config: dict, layers: int) -> int:
    ids = _draft_value(config, "target_layer_ids", None)
    if ids is None:
        if "num_target_layers" not in config:
            raise ConfigError(
                "target_layer_ids: expected a list of the target layers the draft reads (or "
                "num_target_layers), got nothing (neither field is there)"
            )
        ids = build_target_layer_ids(_int(config, "num_target_layers"), layers)
    if not isinstance(ids, list) or not ids or not all(_is_index(i) for i in ids):
        raise ConfigError(f"target_layer_ids: expected a list of layer indices >= 0, got {ids!r}")
    return len(ids)


def _is_index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _heads(config: dict) -> tuple[int, int, int]:
    """(KV heads, head_dim, hidden size). The KV heads and head_dim are required: where a
    config leaves them out, ``Qwen3Config`` fills in 32 and 128, not numbers of the draft."""
    hidden = _int(config, "hidden_size")
    heads = _int(config, "num_attention_heads")
    kv_heads = _int(config, "num_key_value_heads")
    if heads % kv_heads:
        raise ConfigError(
            f"num_key_value_heads: expected a divisor of num_attention_heads {heads}, got "
            f"{kv_heads}"
        )
    head_dim = _int(config, "head_dim", minimum=2)
    if head_dim % 2:
        raise ConfigError(f"head_dim: expected an even number (RoPE rotates pairs), got {head_dim}")
    return kv_heads, head_dim, hidden


def _rope(config: dict, head_dim: int) -> tuple[float, int, dict | None]:
    """(theta, rotary dim, the rope_scaling dict for jax_dflash.rope_cos_sin or None)."""
    params = config.get("rope_parameters")
    where = "rope_parameters"
    if params is None:
        params, where = dict(config.get("rope_scaling") or {}), "rope_scaling"
        for key in ("rope_theta", "partial_rotary_factor"):
            if key in config:
                params.setdefault(key, config[key])
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: expected an object, got {params!r}")
    params = dict(params)
    theta = _number(params, "rope_theta")
    factor = params.pop("partial_rotary_factor", 1.0)
    if not isinstance(factor, numbers.Real) or not 0 < factor <= 1:
        raise ConfigError(f"partial_rotary_factor: expected a number in (0, 1], got {factor!r}")
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(
            f"partial_rotary_factor: expected a share of head_dim {head_dim} that is an even "
            f"number of channels, got {factor!r} ({rotary_dim} channels)"
        )
    params.pop("rope_theta")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"{where}.rope_type: expected one of {', '.join(ROPE_TYPES)}, got {rope_type!r}"
        )
    return theta, rotary_dim, (None if rope_type == "default" else params)


def _layer_types(config: dict, layers: int) -> list[str]:
    types = config.get("layer_types")
    if types is None:  # Qwen3Config's derivation: sliding from layer max_window_layers on
        first = _int(config, "max_window_layers", 28, minimum=0)
        return [SLIDING if i >= first else FULL for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {FULL, SLIDING}:
        raise ConfigError(
            f"layer_types: expected a list of {layers} (num_hidden_layers) entries, each "
            f"{FULL!r} or {SLIDING!r}, got {types!r}"
        )
    return types


def _window(config: dict, layers: int) -> int | None:
    """Every layer's sliding window, or None. As in ``Qwen3Config``, ``sliding_window`` counts
    only with ``use_sliding_window``; then a ``sliding_attention`` layer keeps that window.
    Windowed and full layers in one draft are refused: the run's page allocator keeps one table
    for every layer."""
    use = config.get("use_sliding_window", False)
    if not isinstance(use, bool):
        raise ConfigError(f"use_sliding_window: expected true or false, got {use!r}")
    if not use or config.get("sliding_window") is None:
        if config.get("layer_types") is not None:
            _layer_types(config, layers)  # still a list of the right kinds
        return None
    window = _int(config, "sliding_window")
    sliding = _layer_types(config, layers).count(SLIDING)
    if 0 < sliding < layers:
        raise ConfigError(
            f"layer_types: expected every layer of one kind (the run keeps one page table for "
            f"every layer: a window's ring pages or a sequence's growing pages, not both; the op "
            f"itself takes a per-layer ring), got {layers - sliding} {FULL} and {sliding} "
            f"{SLIDING} (with "
            f"use_sliding_window and sliding_window {window})"
        )
    return window if sliding else None


def _dtype(config: dict) -> str:
    name = "torch_dtype" if "torch_dtype" in config else "dtype"
    value = config.get(name, "bfloat16")
    if value not in DTYPE_NAMES:
        raise ConfigError(f"{name}: expected one of {', '.join(DTYPE_NAMES)}, got {value!r}")
    return value


def geometry(config: dict) -> dict:
    """The draft's geometry as :class:`~jax_dflash.cli.presets.Preset` fields."""
    if not isinstance(config, dict):
        raise ConfigError(f"the config: expected a JSON object, got {type(config).__name__}")
    layers = _int(config, "num_hidden_layers")
    kv_heads, head_dim, hidden = _heads(config)
    theta, rotary_dim, scaling = _rope(config, head_dim)
    eps = _number(config, "rms_norm_eps", DEFAULT_NORM_EPS)
    if eps < FLOAT32_MIN_NORMAL:
        raise ConfigError(
            f"rms_norm_eps: expected a normal float32 (at least {FLOAT32_MIN_NORMAL:g}), got {eps!r}"
        )
    block = {"block_size": _draft_value(config, "block_size", 16)}
    return dict(
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        block_size=_int(block, "block_size"),
        rope_theta=theta,
        rotary_dim=None if rotary_dim == head_dim else rotary_dim,
        rope_scaling=None if scaling is None else tuple(sorted(scaling.items())),
        norm_eps=eps,
        dtype=_dtype(config),
        target_layers=_target_layers(config, layers),
        window=_window(config, layers),
    )


def simulation(config: dict, *, name: str, source: str, window: int | None = None) -> dict:
    """The ``jax_dflash`` object's choices, the defaults for what it leaves out (with a sliding
    window, slots of at least four windows, so that the window slides)."""
    section = config.get("jax_dflash", {})
    if not isinstance(section, dict) or set(section) - set(SIMULATION_FIELDS):
        unknown = sorted(set(section) - set(SIMULATION_FIELDS)) if isinstance(section, dict) else []
        raise ConfigError(
            f"jax_dflash: expected an object of {', '.join(SIMULATION_FIELDS)}, got "
            + (f"the fields {unknown}" if unknown else repr(section))
        )
    defaults = dict(SIMULATION_DEFAULTS)
    page_size = _int(section, "page_size", defaults["page_size"])
    if window is not None:
        defaults["pages_per_slot"] = max(defaults["pages_per_slot"], 4 * -(-window // page_size))
    out = {key: _int(section, key, default) for key, default in defaults.items()}
    for key, default in (("name", name), ("summary", f"draft config {source}"), ("source", source)):
        value = section.get(key, default)
        if not isinstance(value, str) or not value:
            raise ConfigError(f"jax_dflash.{key}: expected a non-empty string, got {value!r}")
        out[key] = value
    gpu_sized = section.get("gpu_sized", True)
    if not isinstance(gpu_sized, bool):
        raise ConfigError(f"jax_dflash.gpu_sized: expected true or false, got {gpu_sized!r}")
    out["gpu_sized"] = gpu_sized
    return out


def parse(text: str) -> dict:
    """A config's JSON text as an object; ConfigError when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"expected JSON, got an error at line {e.lineno} column {e.colno}: {e.msg}"
        ) from None


def load(path: str | pathlib.Path) -> dict:
    """A config file's JSON object; ConfigError when it cannot be read or is not JSON."""
    try:
        text = pathlib.Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read it ({e.strerror})") from None
    return parse(text)
