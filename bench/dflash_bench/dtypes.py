"""The element types of deltas and pools: one entry per format, read by every part that
allocates, views or compares arrays of it (a new pool format is one entry here)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class DtypeSpec:
    name: str  # the NumPy / ml_dtypes name, as the JSON and the launchers' dtype strings say
    ulp: float  # spacing of the format at 1: the peers' tolerance is two of them
    torch_name: str  # the torch dtype a CUDA tensor of it is (raw bits where torch has none)
    host_bits: str | None = None  # the view the NumPy entries take (formats NumPy lacks)
    quantized: bool = False  # a pool format that takes per-head scales (k_scale, v_scale)
    label: str = ""  # how a message names a quantized format
    # The per-head scales drawn for it: unit-normal keys and values then fit its range.
    scale_range: tuple[float, float] = (1 / 96, 1 / 48)

    @property
    def np(self) -> np.dtype:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, self.name, self.name))


DTYPES = {
    spec.name: spec
    for spec in (
        DtypeSpec("float16", 2.0**-10, "float16"),
        DtypeSpec("bfloat16", 2.0**-7, "bfloat16", host_bits="uint16"),
        DtypeSpec("float32", 2.0**-23, "float32"),
        DtypeSpec("float8_e4m3fn", 2.0**-3, "uint8", "uint8", quantized=True, label="FP8"),
        DtypeSpec("float8_e5m2", 2.0**-2, "uint8", "uint8", quantized=True, label="FP8"),
        DtypeSpec("int8", 1.0, "int8", quantized=True, label="int8", scale_range=(1 / 40, 1 / 30)),
    )
}


def bits(a: np.ndarray) -> np.ndarray:
    """The array's elements as unsigned integers of their width (compared bit for bit)."""
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def host_view(a: np.ndarray) -> np.ndarray:
    """What the NumPy entries take: formats NumPy lacks as the unsigned bits of their width."""
    spec = DTYPES.get(a.dtype.name)
    return a.view(spec.host_bits) if spec is not None and spec.host_bits else a
