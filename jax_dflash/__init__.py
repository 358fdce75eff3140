"""jax-dflash: the DFlash target KV-cache update, one kernel for JAX and TensorRT."""

from __future__ import annotations

from importlib import metadata as _metadata

from jax_dflash import reference
from jax_dflash._ext import trt_plugin_library_path
from jax_dflash.ops import (
    target_kv_cache_update,
    target_kv_cache_update_p,
    target_kv_cache_update_paged,
    target_kv_cache_update_paged_p,
)
from jax_dflash.paged import gather_rope, identity_page_table, token_positions
from jax_dflash.rope import rope_cos_sin

__all__ = [
    "gather_rope",
    "identity_page_table",
    "reference",
    "rope_cos_sin",
    "target_kv_cache_update",
    "target_kv_cache_update_p",
    "target_kv_cache_update_paged",
    "target_kv_cache_update_paged_p",
    "token_positions",
    "trt_plugin_library_path",
]

try:
    __version__ = _metadata.version("jax-dflash")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
