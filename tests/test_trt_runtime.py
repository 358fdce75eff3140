"""The plugin library inside a real TensorRT runtime's plugin registry.

Where TensorRT's Python bindings import (the lean runtime, PyPI ``tensorrt-lean-cu13-bindings`` +
``tensorrt-lean-cu13-libs`` 11.4, or a full ``tensorrt``): the registry loads the library with
``load_library`` (TensorRT calls its ``getCreators``), finds the creator by name, version and
namespace, and creates plugins from fields for the build and the runtime phase (Edge-LLM 0.11's
field-less node included) and refuses bad fields. The registry path needs no GPU. Runs in a
subprocess, so that TensorRT's teardown at exit cannot take pytest down with it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from jax_dflash.interop import trt

BINDINGS = ("tensorrt_lean", "tensorrt_lean_bindings", "tensorrt")

SCRIPT = r"""
import ctypes, gc, importlib, json, sys
import numpy as np

module_name, library_path = sys.argv[1], sys.argv[2]
trt = importlib.import_module(module_name)
facts = {"module": module_name, "version": trt.__version__}

registry = trt.get_plugin_registry()
handle = registry.load_library(library_path)
facts["loaded"] = handle is not None
creator = registry.get_creator("DFlashTargetKVCacheUpdate", "1", "")
facts["creator_type"] = type(creator).__name__ if creator is not None else None
if creator is not None:
    facts["field_names"] = [(f.name, int(f.type)) for f in creator.field_names]
    facts["creator_namespace"] = creator.plugin_namespace

    def fields(value):
        return trt.PluginFieldCollection([trt.PluginField(
            "pages_per_slot", np.array([value], np.int32), trt.PluginFieldType.INT32)])

    plugin = creator.create_plugin("dflash", fields(2), trt.TensorRTPhase.RUNTIME)
    facts["runtime_plugin"] = plugin is not None
    if plugin is not None:
        core = plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
        facts["core"] = [core.plugin_name, core.plugin_version, core.plugin_namespace]
        facts["has_runtime_capability"] = (
            plugin.get_capability_interface(trt.PluginCapabilityType.RUNTIME) is not None)
        facts["has_build_capability"] = (
            plugin.get_capability_interface(trt.PluginCapabilityType.BUILD) is not None)
        clone = plugin.clone()
        facts["clone"] = clone is not None
        del core, clone
    build_plugin = creator.create_plugin("dflash", fields(4), trt.TensorRTPhase.BUILD)
    facts["build_plugin"] = build_plugin is not None
    # Edge-LLM 0.11's paged node has no fields: a drop-in for both phases.
    fieldless = creator.create_plugin("dflash", trt.PluginFieldCollection([]), trt.TensorRTPhase.RUNTIME)
    facts["runtime_plugin_without_field"] = fieldless is not None
    bad = creator.create_plugin("dflash", fields(0), trt.TensorRTPhase.BUILD)
    facts["plugin_with_zero_field"] = bad is not None
    twice = creator.create_plugin("dflash", trt.PluginFieldCollection([
        trt.PluginField("pages_per_slot", np.array([2], np.int32), trt.PluginFieldType.INT32),
        trt.PluginField("pages_per_slot", np.array([2], np.int32), trt.PluginFieldType.INT32)]),
        trt.TensorRTPhase.BUILD)
    facts["plugin_with_duplicate_field"] = twice is not None
    normed = creator.create_plugin("dflash", trt.PluginFieldCollection([
        trt.PluginField("k_norm", np.array([1], np.int32), trt.PluginFieldType.INT32),
        trt.PluginField("norm_eps", np.array([1e-5], np.float32), trt.PluginFieldType.FLOAT32)]),
        trt.TensorRTPhase.RUNTIME)
    facts["plugin_with_norm_fields"] = normed is not None
    del plugin, build_plugin, fieldless, bad, twice, normed

# The namespace route: refused (not a crash) when TensorRT's major differs from the headers'.
library = ctypes.CDLL(library_path)
library.initDFlashPlugin.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
library.initDFlashPlugin.restype = ctypes.c_bool
library.getDFlashPluginTensorRTVersion.restype = ctypes.c_int32
facts["header_version"] = library.getDFlashPluginTensorRTVersion()
facts["init_namespace"] = bool(library.initDFlashPlugin(None, b"dflash_test_ns"))
if facts["init_namespace"]:
    ns_creator = registry.get_creator("DFlashTargetKVCacheUpdate", "1", "dflash_test_ns")
    facts["namespace_creator"] = ns_creator is not None
    del ns_creator
del creator, registry
gc.collect()
print("FACTS " + json.dumps(facts))
"""


def _bindings():
    for name in BINDINGS:
        try:
            if importlib.util.find_spec(name) is not None:
                return name
        except (ImportError, ValueError):
            continue
    return None


def test_plugin_in_a_real_tensorrt_registry():
    module = _bindings()
    if module is None:
        pytest.skip(
            "no TensorRT Python bindings (tensorrt_lean / tensorrt) importable here; "
            "see BUILD.md for installing the tensorrt-lean-cu13 wheels"
        )
    try:
        library = trt.trt_plugin_library_path()
    except FileNotFoundError as e:
        pytest.skip(f"the TensorRT plugin was not built here: {e}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, module, library],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("FACTS ")]
    assert result.returncode == 0 and lines, (
        f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    )
    facts = json.loads(lines[-1][len("FACTS ") :])
    print(f"TensorRT runtime facts: {facts}")

    assert facts["creator_type"] == "IPluginCreatorV3One", facts
    int32, float32, char = 5, 1, 6  # PluginFieldType.INT32, FLOAT32, CHAR
    assert facts["field_names"] == [
        ["pages_per_slot", int32],
        ["ring", int32],
        ["k_norm", int32],
        ["v_norm", int32],
        ["norm_eps", float32],
        ["form", char],
        ["scale_pool", int32],
    ], facts
    assert facts["creator_namespace"] == ""
    # (plugin.clone() from Python is only recorded: the bindings return None for C++ plugins.)
    assert facts["runtime_plugin"] and facts["build_plugin"], facts
    assert facts["core"] == ["DFlashTargetKVCacheUpdate", "1", ""], facts
    assert facts["has_runtime_capability"] and facts["has_build_capability"], facts
    assert facts["runtime_plugin_without_field"] and facts["plugin_with_norm_fields"], facts
    # Refused with a logged message, not a crash.
    assert not facts["plugin_with_zero_field"], facts
    assert not facts["plugin_with_duplicate_field"], facts
    log = result.stderr + result.stdout
    assert "field 'pages_per_slot': expected an int32 > 0" in log, log[-3000:]
    assert "field 'pages_per_slot': given twice" in log, log[-3000:]
    same_major = int(facts["version"].split(".")[0]) == facts["header_version"] // 10000
    assert facts["init_namespace"] == same_major, facts
    if same_major:
        assert facts["namespace_creator"], facts
