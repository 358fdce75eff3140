"""The CUDA extension: the XLA FFI handlers of both contracts and the raw launcher over DLPack
arrays (jax, torch, cupy), the one the TensorRT plugin calls too."""

from collections.abc import Sequence
from typing import Any

def registrations(record: bool = True) -> dict[str, Any]:
    """FFI handlers by target name (dflash_target_kv_cache_update, _paged, ...): a capsule of the
    execute stage, or, where this build has a record stage (``ffi_record_stage()``) and ``record``
    is true, a dict of capsules by stage name (``{"execute": ..., "record": ...}``) for
    ``jax.ffi.register_ffi_target``."""

def ffi_record_stage() -> bool:
    """Whether this build's FFI targets have a record stage: it was built against XLA FFI headers
    with the record API (``xla/ffi/api/record_api.h``, jaxlib 0.11 or later) and for a CUDA
    architecture of 9.0 or more. The record stage hands XLA the kernel's launches for its command
    buffers (with programmatic dependent launch unless ``DFLASH_PDL=0``); calls it does not cover
    fall back to XLA capturing the execute stage on a stream."""

def record_stage_counts() -> dict[str, int]:
    """What the record stage did in this process: ``created`` and ``updated`` launch commands, and
    ``captured``, the calls handed back to XLA to capture the execute stage on a stream (all 0
    without a record stage, or before XLA records a command buffer)."""

def record_stage_last_capture() -> str:
    """Why the record stage last handed a call back to XLA to capture on a stream (for example
    ``"launches the plan does not cover"``); ``""`` if it never did in this process."""

def record_pdl_enabled() -> bool:
    """Whether the record stage asks XLA for programmatic dependent launch: the environment
    variable ``DFLASH_PDL``, read once per process, is not ``"0"`` (on by default)."""

def pdl_enabled() -> bool:
    """Whether the launches on a stream (the execute stage, the raw launchers, the TensorRT
    plugin) on the current CUDA device use programmatic dependent launch (the kernel starts while
    the kernel before it on the stream finishes, and waits for that kernel's writes before its own
    first memory access): the environment variable ``DFLASH_PDL``, read once per process, is
    ``"1"``, this build's kernels were compiled for compute capability 9.0 or more, and so is the
    device. False where no CUDA device is visible."""

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
    scale_pool: Any = None,
) -> None:
    """Enqueues the update of the addressing form named ``form`` on ``stream``, its base operands
    in order; each form takes its own keywords. ``scale_pool``: per-token-head scales (float32,
    the pool's dims without ``D``), updated in place too, in place of ``k_scale`` and
    ``v_scale``."""
