"""The CPU extension: the XLA FFI handlers of both contracts and the CPU kernel for NumPy callers."""

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
    delta_dtype: str = "",
    pool_dtype: str = "",
) -> None:
    """Updates ``pool`` (writable, C-contiguous) in place: the slot contract of docs/SPEC.md.

    bfloat16 and FP8 arrays cross as uint16/uint8 (or int) views with ``delta_dtype`` /
    ``pool_dtype`` naming them. Raises ValueError naming the argument on any invalid operand.
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
    ring: bool = False,
    v_norm: bool = False,
    norm_eps: float = 1e-6,
    delta_dtype: str = "",
    pool_dtype: str = "",
) -> None:
    """Updates ``pool`` (writable, C-contiguous) in place: the paged contract of docs/SPEC.md."""
