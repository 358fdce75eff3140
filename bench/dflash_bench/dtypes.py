"""The element types of deltas and pools: one entry per format, read by every part that
allocates, views or compares arrays of it (a new pool format is one entry here).

A pool format is its stored elements and how they are scaled: ``int8`` (per-head scales,
``k_scale``/``v_scale``) and ``int8-dynamic`` (per-token-head scales in a scale pool, SPEC.md
"Dynamic scales") store the same int8 elements; ``int4`` packs two elements per byte of a uint8
pool, with per-token-head scales only (SPEC.md, "int4 pools")."""

from __future__ import annotations

import dataclasses

import numpy as np

SCALE_BYTES = 4  # a scale pool entry: float32


@dataclasses.dataclass(frozen=True)
class DtypeSpec:
    name: str  # the format's name in shape tables, messages and the JSON's pool_format
    ulp: float  # spacing of the format at 1: the peers' tolerance is two of them
    torch_name: str  # the torch dtype a CUDA tensor of it is (raw bits where torch has none)
    host_bits: str | None = None  # the view the NumPy entries take (formats NumPy lacks)
    # How the pool's elements are scaled: "none", "static" (per-head k_scale and v_scale) or
    # "dynamic" (per token and head: the scale pool, float32 [(layers,) 2, N, P, H]).
    scales: str = "none"
    label: str = ""  # how a message names a pool format with scales
    # The per-head scales drawn for a static format: unit-normal keys and values then fit its range.
    scale_range: tuple[float, float] = (1 / 96, 1 / 48)
    storage: str = ""  # the NumPy / ml_dtypes name of the stored elements (default: name)
    per_byte: int = 1  # elements per stored element (int4: two per byte)

    @property
    def storage_name(self) -> str:
        """What the arrays' dtype, the launchers' dtype strings and the JSON's pool_dtype say."""
        return self.storage or self.name

    @property
    def np(self) -> np.dtype:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, self.storage_name, self.storage_name))

    @property
    def quantized(self) -> bool:
        """Stored with per-head static scales (k_scale, v_scale)."""
        return self.scales == "static"

    @property
    def dynamic(self) -> bool:
        """Stored with per-token-head dynamic scales: the op takes and returns a scale pool."""
        return self.scales == "dynamic"


def _dynamic(static: DtypeSpec, label: str) -> DtypeSpec:
    """The format ``static`` stores, with per-token-head dynamic scales."""
    return dataclasses.replace(
        static,
        name=f"{static.name}-dynamic",
        storage=static.storage_name,
        scales="dynamic",
        label=label,
    )


_STATIC = (
    DtypeSpec("float16", 2.0**-10, "float16"),
    DtypeSpec("bfloat16", 2.0**-7, "bfloat16", host_bits="uint16"),
    DtypeSpec("float32", 2.0**-23, "float32"),
    DtypeSpec("float8_e4m3fn", 2.0**-3, "uint8", "uint8", scales="static", label="FP8"),
    DtypeSpec("float8_e5m2", 2.0**-2, "uint8", "uint8", scales="static", label="FP8"),
    DtypeSpec("int8", 1.0, "int8", scales="static", label="int8", scale_range=(1 / 40, 1 / 30)),
)
_E4M3, _E5M2, _INT8 = _STATIC[3:]

DTYPES = {
    spec.name: spec
    for spec in (
        *_STATIC,
        _dynamic(_E4M3, "FP8 (dynamic scales)"),
        _dynamic(_E5M2, "FP8 (dynamic scales)"),
        _dynamic(_INT8, "int8 (dynamic scales)"),
        DtypeSpec(
            "int4", 1.0, "uint8", storage="uint8", scales="dynamic", label="int4", per_byte=2
        ),
    )
}
# The spec of an array by its dtype's name: the first format that stores it (the static one
# where a format also comes with dynamic scales; uint8 is int4's bytes).
BY_STORAGE: dict[str, DtypeSpec] = {}
for _spec in DTYPES.values():
    BY_STORAGE.setdefault(_spec.storage_name, _spec)


def ulp(dtype: np.dtype) -> float:
    """The spacing at 1 of the format an array of ``dtype`` stores."""
    return BY_STORAGE[np.dtype(dtype).name].ulp


def bits(a: np.ndarray) -> np.ndarray:
    """The array's elements as unsigned integers of their width (compared bit for bit)."""
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def host_view(a: np.ndarray) -> np.ndarray:
    """What the NumPy entries take: formats NumPy lacks as the unsigned bits of their width."""
    spec = BY_STORAGE.get(a.dtype.name)
    return a.view(spec.host_bits) if spec is not None and spec.host_bits else a
