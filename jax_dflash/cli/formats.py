"""The delta and pool formats of ``run`` by name: one naming scheme, NumPy's and JAX's
(``float16``, ``float8_e4m3fn``, ``int8``, ...), the short names as aliases. A pool format is its
storage dtype, stored with per-head scales calibrated once (FP8, int8) or, with the suffix
``-dynamic``, with a scale per token, head and plane kept beside the pool (``scale_pool``)."""

from __future__ import annotations

import numpy as np

try:
    from ml_dtypes import bfloat16 as _bfloat16
    from ml_dtypes import float8_e4m3fn as _e4m3
    from ml_dtypes import float8_e5m2 as _e5m2
except ImportError:  # pragma: no cover - jax always brings ml_dtypes
    _bfloat16 = _e4m3 = _e5m2 = None


def dtype_from_name(name: str) -> np.dtype:
    """A delta/pool dtype by its numpy name (``float16``, ``bfloat16``, ``float32``,
    ``float8_e4m3fn``, ``float8_e5m2``)."""
    if name == "bfloat16" and _bfloat16 is not None:
        return np.dtype(_bfloat16)
    if name == "float8_e4m3fn" and _e4m3 is not None:
        return np.dtype(_e4m3)
    if name == "float8_e5m2" and _e5m2 is not None:
        return np.dtype(_e5m2)
    if name in ("float16", "float32", "int8"):
        return np.dtype(name)
    if name.endswith(DYNAMIC_SUFFIX):
        return dtype_from_name(storage_name(name))
    raise ValueError(f"dtype: expected one of {', '.join(POOL_DTYPE_NAMES)}, got {name!r}")


DTYPE_NAMES = ("float16", "bfloat16", "float32")  # delta dtypes (and 16/32-bit pools)
FP8_NAMES = ("float8_e4m3fn", "float8_e5m2")
INT8_NAMES = ("int8",)
# Pools stored with per-head k/v scales, calibrated once.
STATIC_SCALED_NAMES = FP8_NAMES + INT8_NAMES
DYNAMIC_SUFFIX = "-dynamic"
DYNAMIC_NAMES = tuple(name + DYNAMIC_SUFFIX for name in ("int8",) + FP8_NAMES)
POOL_DTYPE_NAMES = DTYPE_NAMES + STATIC_SCALED_NAMES + DYNAMIC_NAMES
DTYPE_ALIASES = {
    "fp16": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "e4m3-dynamic": "float8_e4m3fn-dynamic",
    "e5m2-dynamic": "float8_e5m2-dynamic",
}
# Bytes of one dynamic scale (float32), per token, head and plane.
SCALE_BYTES = 4


def storage_name(name: str) -> str:
    """The dtype a pool format stores its elements in: ``int8`` for ``int8-dynamic``."""
    return name.removesuffix(DYNAMIC_SUFFIX)


def is_dynamic(name: str) -> bool:
    return name in DYNAMIC_NAMES


def bytes_per_element(name: str, head_dim: int) -> float:
    """Pool bytes per stored element of a format, its scales included (a dynamic format's scale
    is shared by the head's ``head_dim`` elements)."""
    extra = SCALE_BYTES / head_dim if is_dynamic(name) else 0.0
    return dtype_from_name(name).itemsize + extra
