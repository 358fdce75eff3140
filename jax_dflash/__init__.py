"""jax-dflash: the DFlash target KV-cache update, one kernel for JAX and TensorRT."""

from __future__ import annotations

from jax_dflash import reference
from jax_dflash.ops import target_kv_cache_update, target_kv_cache_update_p

__all__ = [
    "reference",
    "target_kv_cache_update",
    "target_kv_cache_update_p",
]
__version__ = "0.1.0"
