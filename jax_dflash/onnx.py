"""``jax_dflash.onnx``: the ONNX nodes of both contracts, the slot contract's and Edge-LLM 0.11's
paged node. The same module object as :mod:`jax_dflash.interop.onnx`, where it lives beside the
other interop code; this is its short name."""

import sys

from jax_dflash.interop import onnx as _onnx

sys.modules[__name__] = _onnx
