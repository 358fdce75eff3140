"""jax-dflash: the DFlash target KV-cache update, one kernel for JAX and TensorRT."""

from __future__ import annotations

import importlib

# Imported on first use, so that `import jax_dflash` (and the command line's Ctrl-C handler,
# installed before it) does not wait for jax to import.
_EXPORTS = {
    "gather_kv": "jax_dflash.paged",
    "gather_kv_paged": "jax_dflash.read",
    "gather_kv_rows": "jax_dflash.read",
    "gather_kv_slot": "jax_dflash.read",
    "gather_kv_slots": "jax_dflash.read",
    "gather_rope": "jax_dflash.paged",
    "identity_page_table": "jax_dflash.paged",
    "onnx": None,  # the module jax_dflash.onnx: jax_dflash.interop.onnx under its short name
    "reference": None,  # the module jax_dflash.reference itself
    "rope_cos_sin": "jax_dflash.rope",
    "sequence_positions": "jax_dflash.read",
    "slots_from_pages": "jax_dflash.paged",
    "target_kv_cache_update": "jax_dflash.ops",
    "target_kv_cache_update_p": "jax_dflash.ops",
    "target_kv_cache_update_paged": "jax_dflash.ops",
    "target_kv_cache_update_paged_p": "jax_dflash.ops",
    "target_kv_cache_update_slots": "jax_dflash.ops",
    "target_kv_cache_update_slots_p": "jax_dflash.ops",
    "token_positions": "jax_dflash.paged",
    "trt_plugin_library_path": "jax_dflash._ext",
}

__all__ = sorted(_EXPORTS)


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("jax-dflash")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def __getattr__(name: str):
    # The version too is read on first use: the command line's Ctrl-C handler is installed after
    # this package is imported, and reading the metadata is most of that import's time.
    if name == "__version__":
        globals()[name] = value = _version()
        return value
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jax_dflash' has no attribute {name!r}")
    module = _EXPORTS[name]
    value = (
        importlib.import_module(f"jax_dflash.{name}")
        if module is None
        else getattr(importlib.import_module(module), name)
    )
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
