"""Loads the compiled extensions and registers their XLA FFI targets, once per platform.

The CPU extension is always built; the CUDA one is imported only when a computation is
lowered for CUDA, so a CPU-only install (or a machine without a GPU) never touches it.
"""

from __future__ import annotations

import importlib
import threading

import jax

FFI_TARGET = "dflash_target_kv_cache_update"

_MODULES = {"cpu": ("jax_dflash._dflash_cpu", "cpu"), "cuda": ("jax_dflash._dflash_cuda", "CUDA")}
_registered: set[str] = set()
_lock = threading.Lock()


def extension(platform: str):
    """The nanobind module for ``platform`` ('cpu' or 'cuda'); ImportError if it was not built."""
    module, _ = _MODULES[platform]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        hint = (" (built only where a CUDA toolkit was found; see BUILD.md)"
                if platform == "cuda" else "")
        raise ImportError(f"jax_dflash: the {platform} extension {module} is missing{hint}: {e}") from e


def ensure_registered(platform: str) -> None:
    with _lock:
        if platform in _registered:
            return
        _, ffi_platform = _MODULES[platform]
        for name, capsule in extension(platform).registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform=ffi_platform)
        _registered.add(platform)


def cuda_extension_available() -> bool:
    try:
        extension("cuda")
        return True
    except ImportError:
        return False
