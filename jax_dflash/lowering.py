"""The per-device lowering of the update primitives: one XLA FFI custom call per addressing form
(SPEC.md, "The XLA FFI custom calls"), named by the form's descriptor, whose result aliases the
pool operand."""

from __future__ import annotations

import jax
import numpy as np

from jax_dflash import _ext
from jax_dflash._shapes import FORMS

POOL_OPERAND = FORMS["slot"]["operands"].index("past_key_value")  # result 0 aliases it
SLOT_TARGET = FORMS["slot"]["ffi_target"]
PAGED_TARGET = FORMS["paged"]["ffi_target"]

# The handlers' attribute types (SPEC.md's ABI): a form's own attributes, then the norms'. A
# per-layer ring (a tuple) is an int8 array of 0/1 entries (XLA's FFI has no bool arrays).
ATTRIBUTE_TYPES = {
    "pages_per_slot": np.int64,
    "ring": np.bool_,
    "k_norm": np.bool_,
    "v_norm": np.bool_,
    "norm_eps": np.float32,
    "scale_pool": np.bool_,
}
_NORM_ATTRIBUTES = ("k_norm", "v_norm", "norm_eps")


def _attribute(name: str, value):
    if isinstance(value, tuple):  # one ring entry per layer
        return np.asarray(value, np.int8)
    return ATTRIBUTE_TYPES[name](value)


def lowering_for(form: str, *, scale_pool: bool = False):
    """The lowering rule factory of ``form``'s primitive: ``platform`` (cpu/cuda) -> rule. With
    ``scale_pool`` (the call with per-token-head dynamic scales), the scale pool (the operand
    after the base ones) is the second result, aliased too."""
    names = (
        *FORMS[form]["attributes"],
        *_NORM_ATTRIBUTES,
        *(("scale_pool",) if scale_pool else ()),
    )
    aliases = {POOL_OPERAND: 0}
    if scale_pool:
        aliases[len(FORMS[form]["operands"])] = 1

    def for_platform(platform: str):
        lower = jax.ffi.ffi_lowering(FORMS[form]["ffi_target"], operand_output_aliases=aliases)

        def rule(ctx, *operands, **params):
            if platform == "cuda" and not FORMS[form]["cuda"]:
                raise NotImplementedError(
                    f"the {form} form has no CUDA kernel yet (its CUDA path is off): it runs on CPU "
                    "(jax.devices('cpu'))"
                )
            _ext.ensure_registered(platform)
            # Typed NumPy scalars: the handlers bind int64, bool (i1) and float32 attributes.
            return lower(ctx, *operands, **{n: _attribute(n, params[n]) for n in names})

        return rule

    return for_platform
