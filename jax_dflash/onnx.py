"""``jax_dflash.onnx``: the ONNX nodes of both contracts, the slot contract's and Edge-LLM 0.11's
paged node, under a short name. They live in :mod:`jax_dflash.interop.onnx`, beside the other
interop code; every name of that module reads through this one."""

from jax_dflash.interop import onnx as _interop_onnx


def __getattr__(name: str):
    return getattr(_interop_onnx, name)


def __dir__():
    return dir(_interop_onnx)
