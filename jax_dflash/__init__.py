"""jax-dflash: the DFlash target KV-cache update, one kernel for JAX and TensorRT."""

from __future__ import annotations

from jax_dflash import reference
from jax_dflash.ops import target_kv_cache_update, target_kv_cache_update_p
from jax_dflash._ext import trt_plugin_library_path

__all__ = [
    "reference",
    "target_kv_cache_update",
    "target_kv_cache_update_p",
    "trt_plugin_library_path",
]
__version__ = "0.1.0"
