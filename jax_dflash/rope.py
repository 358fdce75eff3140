"""RoPE cos/sin tables in the layout the update reads: per position, R/2 cosines then R/2 sines.

The frequencies follow Hugging Face's ``rope_scaling`` definitions (default, linear, llama3, yarn).
Tables are computed on the host in float64 and rounded once to float32, so a table is the same
bits on every backend and machine, and accurate at large positions (a float32 angle at position
10^5 is already off by ~10^-2 rad). Positions must therefore be concrete (not traced): build the
table outside ``jax.jit`` and pass it in.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

# Keys each rope type takes: (required, optional with Hugging Face's defaults).
_SCALING_KEYS = {
    "default": ((), {}),
    "linear": (("factor",), {}),
    "llama3": (
        ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        {},
    ),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": None,
            "mscale_all_dim": None,
            "attention_factor": None,
            "truncate": True,
        },
    ),
}


def _number(name, value, *, positive=True):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(
            f"{name}: expected a finite real number, got {type(value).__name__} {value!r}"
        )
    if positive and value <= 0:
        raise ValueError(f"{name}: expected a number > 0, got {value!r}")
    return float(value)


def _scaling_params(scaling):
    """(rope type, {key: value}) from an HF ``rope_scaling`` dict (``rope_type`` or the older
    ``type`` key), with every required key present and no unknown key."""
    if scaling is None:
        return "default", {}
    if not isinstance(scaling, dict):
        raise TypeError(
            f"scaling: expected None or a rope_scaling dict, got {type(scaling).__name__}"
        )
    params = dict(scaling)
    rope_type = params.pop("rope_type", None)
    legacy = params.pop("type", None)
    if rope_type is not None and legacy is not None and rope_type != legacy:
        raise ValueError(f"scaling: 'rope_type' {rope_type!r} and 'type' {legacy!r} disagree")
    rope_type = rope_type if rope_type is not None else legacy
    if rope_type is None:
        raise ValueError(
            f"scaling: expected a 'rope_type' key (one of {sorted(_SCALING_KEYS)}), "
            f"got keys {sorted(scaling)}"
        )
    if rope_type not in _SCALING_KEYS:
        raise ValueError(
            f"scaling: unknown rope_type {rope_type!r}, expected one of {sorted(_SCALING_KEYS)}"
        )
    required, optional = _SCALING_KEYS[rope_type]
    missing = [k for k in required if k not in params]
    if missing:
        raise ValueError(
            f"scaling: rope_type {rope_type!r} needs {list(required)}, missing {missing}"
        )
    unknown = sorted(set(params) - set(required) - set(optional))
    if unknown:
        raise ValueError(
            f"scaling: unknown keys {unknown} for rope_type {rope_type!r} "
            f"(accepted: {list(required) + list(optional)})"
        )
    out = {**optional, **params}
    for key in required:
        out[key] = _number(f"scaling[{key!r}]", out[key])
    return rope_type, out


def _yarn_mscale(scale, mscale=1.0):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inverse_frequencies(
    rotary_dim: int, *, theta: float = 10000.0, scaling: dict | None = None
) -> tuple[np.ndarray, float]:
    """``(inv_freq [R/2] float64, attention_factor)`` of Hugging Face's rope initialisers
    (``_compute_default/linear/llama3/yarn_parameters``); cos and sin are multiplied by the
    attention factor (1 except for yarn)."""
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, numbers.Integral):
        raise TypeError(
            f"rotary_dim: expected an int, got {type(rotary_dim).__name__} {rotary_dim!r}"
        )
    rotary_dim = int(rotary_dim)
    if rotary_dim < 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected an even int >= 0, got {rotary_dim}")
    theta = _number("theta", theta)
    rope_type, p = _scaling_params(scaling)
    exponents = (
        np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim if rotary_dim else np.zeros(0)
    )
    inv_freq = 1.0 / theta**exponents
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / p["factor"], 1.0
    if rope_type == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_context = p["original_max_position_embeddings"]
        if high <= low:
            raise ValueError(
                f"scaling: expected high_freq_factor > low_freq_factor, got {high} and {low}"
            )
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_context / high) & ~(wavelen > old_context / low)
        return np.where(medium, smoothed, scaled), 1.0
    # yarn
    factor = p["factor"]
    original = p["original_max_position_embeddings"]
    attention_factor = p["attention_factor"]
    if attention_factor is None:
        if p["mscale"] and p["mscale_all_dim"]:
            attention_factor = _yarn_mscale(factor, p["mscale"]) / _yarn_mscale(
                factor, p["mscale_all_dim"]
            )
        else:
            attention_factor = _yarn_mscale(factor)
    attention_factor = _number("scaling['attention_factor']", attention_factor)
    beta_fast = _number("scaling['beta_fast']", p["beta_fast"])
    beta_slow = _number("scaling['beta_slow']", p["beta_slow"])

    def correction_dim(rotations):
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # HF: avoids a division by zero in the ramp
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, attention_factor


def rope_cos_sin(
    positions_or_seq_len, rotary_dim: int, *, theta: float = 10000.0, scaling: dict | None = None
) -> jax.Array:
    """The float32 cos/sin table of ``positions_or_seq_len``: an int ``S`` gives positions
    ``0..S-1`` as a ``[1, S, R]`` table (the slot op's ``[Rb, S, R]`` with ``Rb = 1``); an integer
    array of positions ``[..., S]`` gives ``[..., S, R]``. Each row is R/2 cosines then R/2 sines
    of ``position * inv_freq`` (times yarn's attention factor); ``scaling`` is an HF
    ``rope_scaling`` dict. Computed on the host in float64 (see the module docstring)."""
    inv_freq, attention_factor = inverse_frequencies(rotary_dim, theta=theta, scaling=scaling)
    if isinstance(positions_or_seq_len, jax.core.Tracer):
        raise TypeError(
            "positions_or_seq_len: expected concrete positions (the table is computed on the "
            "host in float64), got a traced array: build the table outside jax.jit"
        )
    if isinstance(positions_or_seq_len, numbers.Integral) and not isinstance(
        positions_or_seq_len, bool
    ):
        seq_len = int(positions_or_seq_len)
        if seq_len < 0:
            raise ValueError(f"positions_or_seq_len: expected a length >= 0, got {seq_len}")
        positions = np.arange(seq_len, dtype=np.int64)[None]
    else:
        positions = np.asarray(positions_or_seq_len)
        if not np.issubdtype(positions.dtype, np.integer) or positions.ndim < 1:
            raise TypeError(
                "positions_or_seq_len: expected an int or an integer array of positions "
                f"[..., S], got {positions.dtype} of shape {positions.shape}"
            )
    angles = positions.astype(np.float64)[..., None] * inv_freq
    table = np.concatenate([np.cos(angles), np.sin(angles)], axis=-1) * attention_factor
    return jnp.asarray(table.astype(np.float32))
