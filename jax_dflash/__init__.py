"""jax-dflash: the DFlash target KV-cache update, one kernel for JAX and TensorRT."""

from __future__ import annotations

import importlib
from importlib import metadata as _metadata

from jax_dflash import reference
from jax_dflash._ext import trt_plugin_library_path
from jax_dflash.ops import (
    target_kv_cache_update,
    target_kv_cache_update_p,
    target_kv_cache_update_paged,
    target_kv_cache_update_paged_p,
)

# The jnp helpers, imported on first use.
_HELPERS = {
    "rope_cos_sin": "jax_dflash.rope",
    "token_positions": "jax_dflash.paged",
    "gather_rope": "jax_dflash.paged",
    "identity_page_table": "jax_dflash.paged",
}


def __getattr__(name):
    if name in _HELPERS:
        value = getattr(importlib.import_module(_HELPERS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jax_dflash' has no attribute {name!r}")


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
