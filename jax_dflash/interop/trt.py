"""The TensorRT side: where the plugin library is, and building an engine that uses it.

The plugin library (``libdflash_trt_plugin.so``, built where a CUDA toolkit and TensorRT headers
are found; see BUILD.md) implements ``DFlashTargetKVCacheUpdate`` version ``"1"`` (both
contracts, told apart by their inputs) as an ``IPluginV3`` on the same CUDA kernel as the JAX
ops. It links no TensorRT library: load it into TensorRT with ``IPluginRegistry::loadLibrary``
(Python: ``registry.load_library(path)``), with ``trtexec --dynamicPlugins=PATH``, or register
it under a namespace with its C function ``initDFlashPlugin(logger, namespace)``.

Only :func:`build_engine` needs the ``tensorrt`` package; the rest is plain Python.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

from jax_dflash._ext import trt_plugin_library_path

__all__ = ["build_engine", "load_plugin", "trt_plugin_library_path"]

_loaded_lock = threading.Lock()
_registry_handles: dict[int, object] = {}  # id(registry) -> handle from load_library
_namespaces_registered: set[str] = set()


def _import_tensorrt():
    try:
        import tensorrt
    except ImportError as e:
        raise ImportError(
            "jax_dflash.interop.trt.build_engine needs the 'tensorrt' Python package (TensorRT >= 10.3, "
            f"with its builder): {e}"
        ) from e
    return tensorrt


def load_plugin(registry=None, plugin_namespace: str = "") -> None:
    """Makes the plugin's creator known to TensorRT's plugin registry, once per process.

    With ``plugin_namespace == ""`` the library is loaded through ``registry.load_library``
    (the loadLibrary / --dynamicPlugins path, default namespace). Otherwise its C function
    ``initDFlashPlugin`` registers a creator under that namespace in the process's registry.
    """
    # A registry given (the lean runtime's, say) needs nothing of the tensorrt package.
    if registry is None:
        registry = _import_tensorrt().get_plugin_registry()
    path = trt_plugin_library_path()
    with _loaded_lock:
        if plugin_namespace == "":
            if id(registry) in _registry_handles:
                return
            handle = registry.load_library(path)
            if not handle:
                raise RuntimeError(f"TensorRT's plugin registry did not load {path}")
            _registry_handles[id(registry)] = handle
            return
        if plugin_namespace in _namespaces_registered:
            return
        library = ctypes.CDLL(path)
        library.initDFlashPlugin.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        library.initDFlashPlugin.restype = ctypes.c_bool
        if not library.initDFlashPlugin(None, plugin_namespace.encode()):
            raise RuntimeError(
                f"initDFlashPlugin could not register the plugin in namespace {plugin_namespace!r} "
                "(see TensorRT's log / stderr)"
            )
        _namespaces_registered.add(plugin_namespace)


def _aliased_io_preview_feature(trt):
    for name in ("ALIASED_PLUGIN_IO_10_03",):
        feature = getattr(trt.PreviewFeature, name, None)
        if feature is not None:
            return feature
    raise RuntimeError(
        "this TensorRT has no PreviewFeature.ALIASED_PLUGIN_IO_10_03 (needed for the plugin's output "
        f"to alias past_key_value); TensorRT {getattr(trt, '__version__', '?')}"
    )


def _onnx_bytes(onnx_path_or_model) -> bytes:
    if isinstance(onnx_path_or_model, (bytes, bytearray)):
        return bytes(onnx_path_or_model)
    if isinstance(onnx_path_or_model, (str, os.PathLike)):
        return Path(onnx_path_or_model).read_bytes()
    if hasattr(onnx_path_or_model, "SerializeToString"):
        return onnx_path_or_model.SerializeToString()
    raise TypeError(
        "onnx_path_or_model: expected a path, serialized bytes or an onnx.ModelProto, got "
        f"{type(onnx_path_or_model).__name__}"
    )


def build_engine(
    onnx_path_or_model,
    *,
    input_shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] | None = None,
    plugin_namespace: str = "",
    strongly_typed: bool = True,
    workspace_bytes: int | None = None,
    logger=None,
) -> bytes:
    """Builds a serialized TensorRT engine from an ONNX graph that uses the plugin.

    ``onnx_path_or_model``: a path, serialized bytes or an ``onnx.ModelProto`` (for example
    :func:`jax_dflash.interop.onnx.make_update_model` or ``make_paged_update_model``, or an export
    of :mod:`jax_dflash.interop.export`). ``input_shapes`` maps each input with dynamic
    dimensions to its ``(min, opt, max)`` shapes (one optimization profile). The plugin library is
    loaded into the registry first, and the aliased-plugin-I/O preview feature is enabled so that
    ``present_key_value`` is ``past_key_value`` updated in place. Strongly typed by default, so the
    graph's fp16/bf16/fp32 types are kept. Returns the engine's bytes.
    """
    trt = _import_tensorrt()
    logger = logger if logger is not None else trt.Logger(trt.Logger.WARNING)
    load_plugin(plugin_namespace=plugin_namespace)

    builder = trt.Builder(logger)
    flags = 0
    if strongly_typed:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(_onnx_bytes(onnx_path_or_model)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT's ONNX parser rejected the graph: {errors}")

    config = builder.create_builder_config()
    config.set_preview_feature(_aliased_io_preview_feature(trt), True)
    if workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))

    input_shapes = dict(input_shapes or {})
    dynamic = []
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        if any(d < 0 for d in tensor.shape) and tensor.name not in input_shapes:
            dynamic.append(f"{tensor.name} {tuple(tensor.shape)}")
    if dynamic:
        raise ValueError(
            "input_shapes: expected (min, opt, max) shapes for every input with dynamic dimensions, "
            f"missing for {dynamic}"
        )
    if input_shapes:
        profile = builder.create_optimization_profile()
        for name, bounds in input_shapes.items():
            if len(bounds) != 3:
                raise ValueError(
                    f"input_shapes[{name!r}]: expected (min, opt, max), got {bounds!r}"
                )
            profile.set_shape(name, *[tuple(int(d) for d in shape) for shape in bounds])
        config.add_optimization_profile(profile)

    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise RuntimeError("TensorRT could not build the engine (see the logger's messages)")
    return bytes(engine)
