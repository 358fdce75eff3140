"""Loads the compiled extensions and registers their XLA FFI targets, once per platform.

The CPU extension is always built; the CUDA one is imported only when a computation is
lowered for CUDA, so a CPU-only install (or a machine without a GPU) never touches it.
"""

from __future__ import annotations

import importlib
import os
import threading
from pathlib import Path

import jax

SLOT_FFI_TARGET = "dflash_target_kv_cache_update"
PAGED_FFI_TARGET = "dflash_target_kv_cache_update_paged"

_MODULES = {"cpu": ("jax_dflash._dflash_cpu", "cpu"), "cuda": ("jax_dflash._dflash_cuda", "CUDA")}
_registered: set[str] = set()
_lock = threading.Lock()


def extension(platform: str):
    """The nanobind module for ``platform`` ('cpu' or 'cuda'); ImportError if it was not built."""
    module, _ = _MODULES[platform]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        hint = (
            " (built only where a CUDA toolkit was found; see BUILD.md)"
            if platform == "cuda"
            else ""
        )
        raise ImportError(
            f"jax_dflash: the {platform} extension {module} is missing{hint}: {e}"
        ) from e


# "1" registers the CUDA targets with their record stage too, where the build has one. Off by
# default: with jaxlib 0.11.2 on an H200, XLA never called the record stage (not even with custom
# calls in its command buffers), so the stage has not run against a GPU (BENCHMARKS.md, "The FFI
# record stage"); XLA captures the execute stage on a stream instead.
RECORD_STAGE_SWITCH = "DFLASH_RECORD_STAGE"


def record_stage_registered() -> bool:
    """Whether the CUDA targets are (or will be, once lowered) registered with their record stage:
    the extension was built with one (``ffi_record_stage()``) and ``$DFLASH_RECORD_STAGE`` is
    ``"1"``. False where the CUDA extension is missing."""
    try:
        cuda = extension("cuda")
    except ImportError:
        return False
    return bool(cuda.ffi_record_stage()) and os.environ.get(RECORD_STAGE_SWITCH) == "1"


def ensure_registered(platform: str) -> None:
    with _lock:
        if platform in _registered:
            return
        _, ffi_platform = _MODULES[platform]
        module = extension(platform)
        if platform == "cuda":
            targets = module.registrations(record=record_stage_registered())
        else:
            targets = module.registrations()
        for name, handler in targets.items():
            if isinstance(handler, dict):  # {"execute": ..., "record": ...}
                # The trait the execute handler declares, given with the stages too.
                from jaxlib import xla_client

                traits = xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE
                jax.ffi.register_ffi_target(name, handler, platform=ffi_platform, traits=traits)
            else:
                jax.ffi.register_ffi_target(name, handler, platform=ffi_platform)
        _registered.add(platform)


def cuda_extension_available() -> bool:
    try:
        extension("cuda")
        return True
    except ImportError:
        return False


# ---- the TensorRT plugin library shipped inside the package ----------------------------------

PLUGIN_LIBRARY_NAME = "libdflash_trt_plugin.so"
_ENV_OVERRIDE = "DFLASH_TRT_PLUGIN_LIBRARY"


def _installed_file(name: str) -> Path | None:
    """``name`` in ``jax_dflash/lib`` of any location the package is imported from (an editable
    install puts compiled files in site-packages, next to the sources' redirect)."""
    import jax_dflash

    for root in getattr(jax_dflash, "__path__", []):
        candidate = Path(root) / "lib" / name
        if candidate.is_file():
            return candidate
    return None


def trt_plugin_library_path() -> str:
    """The absolute path of the TensorRT plugin library shipped inside this package.

    ``$DFLASH_TRT_PLUGIN_LIBRARY`` overrides it. Raises FileNotFoundError, saying why, when the
    plugin was not built (it needs a CUDA toolkit and TensorRT headers at build time).
    """
    override = os.environ.get(_ENV_OVERRIDE)
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"{_ENV_OVERRIDE}={override!r}: expected a file, found none")
        return str(Path(override).resolve())
    found = _installed_file(PLUGIN_LIBRARY_NAME)
    if found is None:
        raise FileNotFoundError(
            f"jax_dflash: {PLUGIN_LIBRARY_NAME} was not built: it needs a CUDA toolkit and the TensorRT "
            "headers (TENSORRT_ROOT, or `python tools/fetch_trt_headers.py`) at build time; see BUILD.md"
        )
    return str(found.resolve())
