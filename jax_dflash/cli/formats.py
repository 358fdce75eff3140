"""The delta and pool formats of ``run`` by name: one naming scheme, NumPy's and JAX's
(``float16``, ``float8_e4m3fn``, ``int8``, ...), the short names as aliases. A pool format is its
storage dtype, stored with per-head scales calibrated once (FP8, int8) or, with the suffix
``-dynamic``, with a scale per token, head and plane kept beside the pool (``scale_pool``).
``int4`` is stored with such scales only: two elements per byte of a uint8 pool ``[..., D/2]``.

What a format's storage is (elements per byte, whether the op's CUDA handler writes it) is the
contract's row of it (``jax_dflash._shapes.POOL_FORMATS``), read when asked: importing this module
loads no extension and no JAX."""

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
    ``float8_e4m3fn``, ``float8_e5m2``, ``int8``), or a pool format's storage dtype by the
    format's name (``int8-dynamic``: int8; ``int4``: uint8)."""
    if name == "bfloat16" and _bfloat16 is not None:
        return np.dtype(_bfloat16)
    if name == "float8_e4m3fn" and _e4m3 is not None:
        return np.dtype(_e4m3)
    if name == "float8_e5m2" and _e5m2 is not None:
        return np.dtype(_e5m2)
    if name in ("float16", "float32", "int8"):
        return np.dtype(name)
    if name in INT4_NAMES:
        return np.dtype(np.uint8)  # two int4 elements per byte
    if name.endswith(DYNAMIC_SUFFIX):
        return dtype_from_name(name.removesuffix(DYNAMIC_SUFFIX))
    raise ValueError(f"dtype: expected one of {', '.join(POOL_DTYPE_NAMES)}, got {name!r}")


DTYPE_NAMES = ("float16", "bfloat16", "float32")  # delta dtypes (and 16/32-bit pools)
FP8_NAMES = ("float8_e4m3fn", "float8_e5m2")
INT8_NAMES = ("int8",)
# Pools stored with per-head k/v scales, calibrated once.
STATIC_SCALED_NAMES = FP8_NAMES + INT8_NAMES
DYNAMIC_SUFFIX = "-dynamic"
# Pools stored with dynamic scales only: their name has no suffix (an alias adds it).
INT4_NAMES = ("int4",)
DYNAMIC_NAMES = tuple(name + DYNAMIC_SUFFIX for name in ("int8",) + FP8_NAMES) + INT4_NAMES
POOL_DTYPE_NAMES = DTYPE_NAMES + STATIC_SCALED_NAMES + DYNAMIC_NAMES
DTYPE_ALIASES = {
    "fp16": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "e4m3-dynamic": "float8_e4m3fn-dynamic",
    "e5m2-dynamic": "float8_e5m2-dynamic",
    "int4-dynamic": "int4",
}
# Bytes of one dynamic scale (float32), per token, head and plane.
SCALE_BYTES = 4


def storage_name(name: str) -> str:
    """The dtype a pool format stores its elements in: ``int8`` for ``int8-dynamic``, ``uint8``
    for ``int4``."""
    return str(dtype_from_name(name))


def is_dynamic(name: str) -> bool:
    return name in DYNAMIC_NAMES


def format_row(name: str) -> dict:
    """The contract's row of a pool format (``per_byte``, ``cuda``, ``scales``, ``name``)."""
    from jax_dflash._shapes import POOL_FORMATS

    return POOL_FORMATS[storage_name(name)]


def elements_per_byte(name: str) -> int:
    """Stored elements per byte of a pool format: 2 for int4, else 1 (8 bits and wider)."""
    return int(format_row(name)["per_byte"])


def runs_on_cuda(name: str) -> bool:
    """Whether the op's CUDA handler writes a pool format (the contract's ``cuda`` field)."""
    return bool(format_row(name)["cuda"])


def stored_shape(name: str, shape) -> tuple[int, ...]:
    """The pool array's shape for a format, of the pool ``[..., H, D]`` of elements: int4's last
    dim is ``D/2`` bytes."""
    *lead, head_dim = shape
    return (*lead, head_dim // elements_per_byte(name))


def element_bytes(name: str) -> float:
    """Bytes one stored element takes, without scales: 2 (16-bit), 1 (8-bit), 0.5 (int4)."""
    return dtype_from_name(name).itemsize / elements_per_byte(name)


def bytes_per_element(name: str, head_dim: int) -> float:
    """Pool bytes per stored element of a format, its scales included (a dynamic format's scale
    is shared by the head's ``head_dim`` elements)."""
    extra = SCALE_BYTES / head_dim if is_dynamic(name) else 0.0
    return element_bytes(name) + extra
