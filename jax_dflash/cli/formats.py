"""The delta and pool formats of ``run`` by name: one naming scheme, NumPy's and JAX's
(``float16``, ``float8_e4m3fn``, ...), the short names as aliases."""

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
    if name in ("float16", "float32"):
        return np.dtype(name)
    raise ValueError(f"dtype: expected one of {', '.join(POOL_DTYPE_NAMES)}, got {name!r}")


DTYPE_NAMES = ("float16", "bfloat16", "float32")  # delta dtypes (and 16/32-bit pools)
FP8_NAMES = ("float8_e4m3fn", "float8_e5m2")
POOL_DTYPE_NAMES = DTYPE_NAMES + FP8_NAMES
DTYPE_ALIASES = {
    "fp16": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
}
