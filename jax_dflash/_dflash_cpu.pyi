"""The CPU extension: the XLA FFI handlers of both contracts and the CPU kernel for NumPy callers."""

from collections.abc import Sequence
from typing import Any

import numpy as np

def registrations() -> dict[str, Any]:
    """FFI handler capsules by target name: dflash_target_kv_cache_update(_paged)."""

def target_kv_cache_update(
    k_delta: np.ndarray,
    v_delta: np.ndarray,
    pool: np.ndarray,
    rope_cos_sin: np.ndarray,
    delta_start_positions: np.ndarray,
    delta_lengths: np.ndarray,
    k_scale: np.ndarray | None = None,
    v_scale: np.ndarray | None = None,
    k_norm_weight: np.ndarray | None = None,
    *,
    pages_per_slot: int,
    v_norm: bool = False,
    norm_eps: float = 1e-6,
    delta_dtype: str | Any = "",
    pool_dtype: str | Any = "",
) -> None:
    """Updates ``pool`` in place: the slot contract of docs/SPEC.md.

    ``pool`` is a writable, C-contiguous array that the caller owns (a NumPy array, a CPU torch
    tensor, or an object exporting one through DLPack); a jax.Array (or a view, export or capsule
    of one), a read-only array and a bare DLPack capsule are refused. bfloat16 and FP8 arrays
    cross as ml_dtypes NumPy arrays, as DLPack bfloat/float8 tensors, or as uint16/uint8 (or int)
    views of their bits with ``delta_dtype`` / ``pool_dtype`` naming them (a name or a dtype).
    The keywords take Python or NumPy scalars (``pages_per_slot`` an int in [1, 2^63-1]). Raises
    TypeError or ValueError naming the argument, what was expected and what was given.
    """

def target_kv_cache_update_paged(
    k_delta: np.ndarray,
    v_delta: np.ndarray,
    pool: np.ndarray,
    rope_cos_sin: np.ndarray,
    delta_positions: np.ndarray,
    delta_token_to_sequence: np.ndarray,
    kv_page_table: np.ndarray,
    k_scale: np.ndarray | None = None,
    v_scale: np.ndarray | None = None,
    k_norm_weight: np.ndarray | None = None,
    *,
    ring: bool | Sequence[bool] = False,
    v_norm: bool = False,
    norm_eps: float = 1e-6,
    delta_dtype: str | Any = "",
    pool_dtype: str | Any = "",
) -> None:
    """Updates ``pool`` in place: the paged contract of docs/SPEC.md; the arrays and keywords as
    in target_kv_cache_update. ``ring``: a bool, or one bool per layer of a layer-batched pool."""

def update(
    form: str,
    operands: Sequence[np.ndarray],
    k_scale: np.ndarray | float | None = None,
    v_scale: np.ndarray | float | None = None,
    k_norm_weight: np.ndarray | None = None,
    *,
    pages_per_slot: int | None = None,
    ring: bool | Sequence[bool] | None = None,
    v_norm: bool = False,
    norm_eps: float = 1e-6,
    delta_dtype: str | Any = "",
    pool_dtype: str | Any = "",
    scale_pool: np.ndarray | None = None,
) -> None:
    """Updates ``operands[2]`` (the pool) in place for the addressing form named ``form``
    (``ADDRESSING_FORMS``), its base operands in order; each form takes its own keywords.
    ``scale_pool``: per-token-head scales (float32, the pool's dims without ``D``), updated in
    place too, in place of ``k_scale`` and ``v_scale``."""

def check_call(
    form: str,
    operands: Sequence[tuple[str, Sequence[int | None]]],
    *,
    pages_per_slot: int = 0,
    ring: bool | Sequence[bool] = False,
    k_norm: bool = False,
    v_norm: bool = False,
    norm_eps: float,
    tensorrt: bool = False,
    scale_pool: bool = False,
) -> dict[str, Any]:
    """The contract's checker: the call's parameters, or TypeError/ValueError naming the operand.
    ``scale_pool``: the operand after the base ones is the per-token-head scale pool."""

def check_norm_eps(eps: float) -> None: ...

ADDRESSING_FORMS: dict[str, dict[str, Any]]
POOL_FORMATS: dict[str, dict[str, Any]]
RESULT_NAME: str
SCALE_NAMES: tuple[str, str]
NORM_WEIGHT_NAME: str
SCALE_POOL_NAME: str
SCALE_RESULT_NAME: str
