"""Runs an exported graph on CPU with ONNX's reference evaluator and this project's CPU kernel.

``onnx.reference.ReferenceEvaluator`` runs the standard ONNX nodes in NumPy; the
``DFlashTargetKVCacheUpdate`` node (domain ``trt.plugins``) is run by :class:`DFlashTargetKVCacheUpdate`
below, whose ``_run`` calls the kernel of the JAX CPU custom call itself
(``jax_dflash._dflash_cpu.target_kv_cache_update``, ``dflash::target_kv_cache_update_cpu``), so
an ONNX run and a JAX run of the same graph use one kernel.

ONNX values are immutable, so the node writes into a copy of the pool and returns it; in
TensorRT the output aliases the pool input instead (``getAliasedInput(0) == 2``).
"""

from __future__ import annotations

import numpy as np

from jax_dflash import _ext
from jax_dflash.interop import onnx as dflash_onnx
from jax_dflash._shapes import check_update

try:
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "jax_dflash.onnx_reference needs the 'onnx' package: pip install jax-dflash[onnx]"
    ) from e


def run_update_kernel(k_delta, v_delta, past_key_value, rope_cos_sin, delta_start_positions,
                      delta_lengths, *, pages_per_slot: int) -> np.ndarray:
    """The CPU kernel on NumPy arrays: returns an updated copy of ``past_key_value``.

    Shapes and dtypes as :func:`jax_dflash.target_kv_cache_update` (unbatched form); checked by
    the same code as the JAX primitive, so errors read the same.
    """
    args = [np.ascontiguousarray(a) for a in (k_delta, v_delta, past_key_value, rope_cos_sin,
                                              delta_start_positions, delta_lengths)]
    shape = check_update(*args, pages_per_slot)
    k, v, pool, rope, starts, lengths = args
    present = pool.copy()
    if shape.dtype.itemsize == 2:  # float16 / bfloat16 cross nanobind as their bits
        k, v, target = k.view(np.uint16), v.view(np.uint16), present.view(np.uint16)
    else:
        target = present
    _ext.extension("cpu").target_kv_cache_update(
        k, v, target, rope, starts, lengths, shape.pages_per_slot, shape.dtype.name
    )
    return present


class DFlashTargetKVCacheUpdate(OpRun):
    """The reference runtime's implementation of the TensorRT plugin node (see jax_dflash.interop.onnx)."""

    op_domain = dflash_onnx.PLUGIN_DOMAIN

    def _run(self, k_delta, v_delta, past_key_value, rope_cos_sin, delta_start_positions,
             delta_lengths, pages_per_slot=None, plugin_version=None, plugin_namespace=None):
        if pages_per_slot is None:
            raise ValueError(
                f"{dflash_onnx.PLUGIN_NAME} node {self.onnx_node.name!r}: expected the attribute "
                "pages_per_slot (an int > 0), got none"
            )
        version = plugin_version.decode() if isinstance(plugin_version, bytes) else plugin_version
        if version not in (None, dflash_onnx.PLUGIN_VERSION):
            raise ValueError(
                f"{dflash_onnx.PLUGIN_NAME} node {self.onnx_node.name!r}: expected "
                f"plugin_version {dflash_onnx.PLUGIN_VERSION!r}, got {version!r}"
            )
        present = run_update_kernel(
            k_delta, v_delta, past_key_value, rope_cos_sin, delta_start_positions,
            delta_lengths, pages_per_slot=int(pages_per_slot),
        )
        return (present,)


def reference_evaluator(model, **kwargs) -> ReferenceEvaluator:
    """A ``ReferenceEvaluator`` for ``model`` that knows the ``DFlashTargetKVCacheUpdate`` node."""
    new_ops = [DFlashTargetKVCacheUpdate, *kwargs.pop("new_ops", ())]
    return ReferenceEvaluator(model, new_ops=new_ops, **kwargs)
