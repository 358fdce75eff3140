"""The contract's constants, once for the whole package (docs/SPEC.md).

Defaults and names that the op, the interop layer, the command line and the benchmark share.
"""

from __future__ import annotations

# The fused norms' epsilon when the caller gives none (HF RMSNorm's default in Qwen3 drafts).
DEFAULT_NORM_EPS = 1e-6

# The TensorRT plugin's registry key (trt_plugin/DFlashTargetKVCacheUpdatePlugin.h).
PLUGIN_NAME = "DFlashTargetKVCacheUpdate"
PLUGIN_VERSION = "1"
