"""The CUDA extension: the XLA FFI handlers of both contracts and the raw launcher over DLPack
arrays (jax, torch, cupy), the one the TensorRT plugin calls too."""

from collections.abc import Sequence
from typing import Any

def registrations() -> dict[str, Any]:
    """FFI handler capsules by target name: dflash_target_kv_cache_update(_paged)."""

def pdl_enabled() -> bool:
    """Whether the launches on the current CUDA device use programmatic dependent launch (the
    kernel starts while the kernel before it on the stream finishes, and waits for that kernel's
    writes before its own first memory access): the environment variable ``DFLASH_PDL``, read once
    per process, is not ``"0"``, this build's kernels were compiled for compute capability 9.0 or
    more, and so is the device. False where no CUDA device is visible."""

def launch(
    k_delta: Any,
    v_delta: Any,
    pool: Any,
    rope_cos_sin: Any,
    delta_start_positions: Any,
    delta_lengths: Any,
    k_scale: Any | None = None,
    v_scale: Any | None = None,
    k_norm_weight: Any | None = None,
    *,
    pages_per_slot: int,
    v_norm: bool = False,
    norm_eps: float = 1e-6,
    delta_dtype: str | Any = "",
    pool_dtype: str | Any = "",
    stream: int = 0,
) -> None:
    """Enqueues the slot-contract update on ``stream`` (a cudaStream_t as an int); ``pool`` is
    updated in place: a writable, C-contiguous CUDA array that the caller owns (a torch or cupy
    tensor, or an object exporting one through DLPack); a jax.Array (or an export or capsule of
    one), a read-only export and a bare DLPack capsule are refused. FP8 pools cross as float8
    tensors or as uint8 views with ``pool_dtype`` naming them. Errors name the argument, what was
    expected and what was given."""

def launch_paged(
    k_delta: Any,
    v_delta: Any,
    pool: Any,
    rope_cos_sin: Any,
    delta_positions: Any,
    delta_token_to_sequence: Any,
    kv_page_table: Any,
    k_scale: Any | None = None,
    v_scale: Any | None = None,
    k_norm_weight: Any | None = None,
    *,
    ring: bool | Sequence[bool] = False,
    v_norm: bool = False,
    norm_eps: float = 1e-6,
    delta_dtype: str | Any = "",
    pool_dtype: str | Any = "",
    stream: int = 0,
) -> None:
    """Enqueues the paged-contract update on ``stream``; ``pool`` is updated in place, the
    arrays and keywords as in launch."""

def launch_form(
    form: str,
    operands: Sequence[Any],
    k_scale: Any = None,
    v_scale: Any = None,
    k_norm_weight: Any = None,
    *,
    pages_per_slot: int | None = None,
    ring: bool | Sequence[bool] | None = None,
    v_norm: bool = False,
    norm_eps: float = 1e-6,
    delta_dtype: str | Any = "",
    pool_dtype: str | Any = "",
    stream: int = 0,
) -> None:
    """Enqueues the update of the addressing form named ``form`` on ``stream``, its base operands
    in order; each form takes its own keywords."""
