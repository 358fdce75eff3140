"""The per-device lowering of both primitives: one XLA FFI custom call (SPEC.md, "The XLA FFI
custom calls") whose result aliases the pool operand."""

from __future__ import annotations

import jax
import numpy as np

from jax_dflash import _ext
from jax_dflash._shapes import FORMS

POOL_OPERAND = FORMS["slot"]["operands"].index("past_key_value")  # result 0 aliases it
SLOT_TARGET = FORMS["slot"]["ffi_target"]
PAGED_TARGET = FORMS["paged"]["ffi_target"]


def _norm_attributes(k_norm, v_norm, norm_eps) -> dict:
    # Typed NumPy scalars: the handlers bind bool (i1) and float32 attributes.
    return dict(k_norm=np.bool_(k_norm), v_norm=np.bool_(v_norm), norm_eps=np.float32(norm_eps))


def slot_lowering(platform: str):
    """The lowering rule of ``dflash_target_kv_cache_update`` on ``platform`` (cpu/cuda)."""
    lower = jax.ffi.ffi_lowering(SLOT_TARGET, operand_output_aliases={POOL_OPERAND: 0})

    def rule(ctx, *operands, pages_per_slot, k_norm, v_norm, norm_eps):
        _ext.ensure_registered(platform)
        return lower(
            ctx,
            *operands,
            pages_per_slot=np.int64(pages_per_slot),
            **_norm_attributes(k_norm, v_norm, norm_eps),
        )

    return rule


def paged_lowering(platform: str):
    """The lowering rule of ``dflash_target_kv_cache_update_paged`` on ``platform``."""
    lower = jax.ffi.ffi_lowering(PAGED_TARGET, operand_output_aliases={POOL_OPERAND: 0})

    def rule(ctx, *operands, ring, k_norm, v_norm, norm_eps):
        _ext.ensure_registered(platform)
        return lower(
            ctx, *operands, ring=np.bool_(ring), **_norm_attributes(k_norm, v_norm, norm_eps)
        )

    return rule
