"""The benchmarked updates: one ``BenchShape`` per case, a table per backend."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from dflash_bench.dtypes import DTYPES, DtypeSpec

# TensorRT Edge-LLM 0.11's kernel on this H200, fp16, H=8, D=128 (not runnable here: quoted).
EDGE_LLM_0_11_US = {
    "decode_b1": 2.64,
    "decode_b8": 3.17,
    "decode_b64": 8.38,
    "prefill_b1_l4096": 26.5,
    "prefill_b8_l2048": 103.4,
}


@dataclasses.dataclass(frozen=True)
class BenchShape:
    """One benchmarked update. fp16/bf16 deltas, H=8, D=128, R=128, P=128 unless stated.

    Every contract uses one pool of ``B * M`` pages: the slot op with ``pages_per_slot = M``,
    the paged op with ``M`` pages per sequence in its table."""

    name: str
    batch: int  # B
    delta_len: int  # L
    dtype: str = "float16"  # deltas
    # The pool's format, a key of dtypes.DTYPES (default: the delta dtype's): FP8 and int8 take
    # per-head scales, their "-dynamic" formats and int4 a scale pool (per token and head).
    pool_dtype: str | None = None
    num_layers: int | None = None  # layer-batched form when set
    num_kv_heads: int = 8  # H
    head_dim: int = 128  # D
    rotary_dim: int = 128  # R
    page_size: int = 128  # P
    min_capacity: int = 8192  # tokens per sequence at least (M = 64 pages of 128)
    unfused: bool = False  # also time the unfused pair and the norm alone
    gemm_chain: bool = False  # also time the update after the k/v GEMM (gemm_chain.py)

    @property
    def pages_per_slot(self) -> int:  # M
        # Room for start positions in [0, cap - L] with cap >= 2 L.
        return math.ceil(max(self.min_capacity, 2 * self.delta_len) / self.page_size)

    @property
    def slot_capacity(self) -> int:
        return self.pages_per_slot * self.page_size

    @property
    def num_pages(self) -> int:  # N
        return self.pages_per_slot * self.batch  # maxBatch = B

    @property
    def tokens(self) -> int:  # T
        return self.batch * self.delta_len

    @property
    def layers(self) -> int:
        return self.num_layers or 1

    @property
    def lead(self) -> tuple[int, ...]:
        return (self.num_layers,) if self.num_layers else ()

    @property
    def delta_shape(self) -> tuple[int, ...]:
        return (*self.lead, self.batch, self.delta_len, self.num_kv_heads, self.head_dim)

    @property
    def paged_delta_shape(self) -> tuple[int, ...]:
        return (*self.lead, self.tokens, self.num_kv_heads, self.head_dim)

    @property
    def scale_pool_shape(self) -> tuple[int, ...]:
        """The scale pool of a format with dynamic scales: the pool's dims without D."""
        return (*self.lead, 2, self.num_pages, self.page_size, self.num_kv_heads)

    @property
    def pool_shape(self) -> tuple[int, ...]:
        return (*self.scale_pool_shape, self.head_dim // self.pool_spec.per_byte)

    @property
    def pool_format(self) -> str:
        return self.pool_dtype or self.dtype

    @property
    def pool_dtype_name(self) -> str:
        """The dtype of the pool array (int4: uint8)."""
        return self.pool_spec.storage_name

    @property
    def pool_spec(self) -> DtypeSpec:
        return DTYPES[self.pool_format]

    @property
    def dynamic_scales(self) -> bool:
        """The pool comes with a scale pool (per-token-head dynamic scales)."""
        return self.pool_spec.dynamic

    @property
    def pool_is_delta_dtype(self) -> bool:
        """The pool stores the deltas' own format (what the jnp baseline and FlashInfer write)."""
        return self.pool_format == self.dtype

    @property
    def pool_label(self) -> str:
        return self.pool_spec.label or self.pool_format

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype].np

    @property
    def np_pool_dtype(self) -> np.dtype:
        return self.pool_spec.np

    def describe(self) -> str:
        layers = f"{self.num_layers} layers, " if self.num_layers else ""
        pool = f", {self.pool_dtype} pool" if self.pool_dtype else ""
        return f"{layers}B={self.batch} L={self.delta_len} {self.dtype}{pool}"


_FP8 = {"pool_dtype": "float8_e4m3fn"}
_INT8 = {"pool_dtype": "int8"}
# Per-token-head dynamic scales (a scale pool beside the pool), and int4 (dynamic only).
_FP8_DYNAMIC = {"pool_dtype": "float8_e4m3fn-dynamic"}
_INT8_DYNAMIC = {"pool_dtype": "int8-dynamic"}
_INT4 = {"pool_dtype": "int4"}

GPU_SHAPES = (
    BenchShape("decode_b1", 1, 16, gemm_chain=True),
    BenchShape("decode_b8", 8, 16, gemm_chain=True),
    BenchShape("decode_b64", 64, 16, unfused=True, gemm_chain=True),
    BenchShape("prefill_b1_l4096", 1, 4096),
    BenchShape("prefill_b8_l2048", 8, 2048, unfused=True),
    # 2048 tokens a sequence: every contender holds its own pool while they are timed together,
    # and seven pools of 8192 (10 GiB each) do not fit an 80 GB card. As many rows are written.
    BenchShape("decode_b64_5layers", 64, 16, num_layers=5, min_capacity=2048),
    BenchShape("decode_b64_bf16", 64, 16, dtype="bfloat16"),
    BenchShape("prefill_b8_l2048_bf16", 8, 2048, dtype="bfloat16"),
    BenchShape("decode_b64_fp8", 64, 16, **_FP8),
    BenchShape("prefill_b8_l2048_fp8", 8, 2048, **_FP8),
    BenchShape("decode_b64_int8", 64, 16, **_INT8),
    BenchShape("prefill_b8_l2048_int8", 8, 2048, **_INT8),
    BenchShape("decode_b64_int8_dynamic", 64, 16, **_INT8_DYNAMIC),
    BenchShape("prefill_b8_l2048_int8_dynamic", 8, 2048, **_INT8_DYNAMIC),
    BenchShape("decode_b64_fp8_dynamic", 64, 16, **_FP8_DYNAMIC),
    BenchShape("prefill_b8_l2048_fp8_dynamic", 8, 2048, **_FP8_DYNAMIC),
    BenchShape("decode_b64_int4", 64, 16, **_INT4),
    BenchShape("prefill_b8_l2048_int4", 8, 2048, **_INT4),
)

# The GPU set scaled down so that a 2-core machine finishes in a few minutes.
_SMALL = {"min_capacity": 512}
CPU_SHAPES = (
    BenchShape("decode_b1", 1, 16, **_SMALL),
    BenchShape("decode_b8", 8, 16, unfused=True, **_SMALL),
    BenchShape("prefill_b1_l512", 1, 512, **_SMALL),
    BenchShape("prefill_b4_l256", 4, 256, unfused=True, **_SMALL),
    BenchShape("decode_b8_5layers", 8, 16, num_layers=5, **_SMALL),
    BenchShape("decode_b8_bf16", 8, 16, dtype="bfloat16", **_SMALL),
    BenchShape("prefill_b4_l256_bf16", 4, 256, dtype="bfloat16", **_SMALL),
    BenchShape("decode_b8_fp8", 8, 16, **_FP8, **_SMALL),
    BenchShape("prefill_b4_l256_fp8", 4, 256, **_FP8, **_SMALL),
    BenchShape("decode_b8_int8", 8, 16, **_INT8, **_SMALL),
    BenchShape("decode_b8_int8_dynamic", 8, 16, **_INT8_DYNAMIC, **_SMALL),
    BenchShape("decode_b8_fp8_dynamic", 8, 16, **_FP8_DYNAMIC, **_SMALL),
    BenchShape("decode_b8_int4", 8, 16, **_INT4, **_SMALL),
)


def shapes_for(backend: str) -> list[BenchShape]:
    return list(GPU_SHAPES if backend == "gpu" else CPU_SHAPES)
