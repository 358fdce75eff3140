"""CUDA tensors for the contenders timed through torch (raw launchers, FlashInfer, copy)."""

from __future__ import annotations

import functools

import numpy as np

from dflash_bench.contracts import CONTRACTS, delta_shape
from dflash_bench.dtypes import BY_STORAGE, DTYPES
from dflash_bench.problem import POOL_FILL, Problem
from dflash_bench.timing import Skip


def import_torch():
    """torch with a CUDA device, its cache emptied of what the previous contender left."""
    try:
        import torch
    except ImportError as e:
        raise Skip(f"torch is not importable ({e})") from e
    if not torch.cuda.is_available():
        raise Skip("torch sees no CUDA device")
    torch.cuda.empty_cache()
    return torch


def torch_dtype(torch, dtype: str):
    return getattr(torch, DTYPES[dtype].torch_name)


# Formats narrower than 4 bytes cross from NumPy as integer bits of their width (torch reads no
# bfloat16 or FP8 NumPy arrays) and are viewed as their torch dtype on the device.
_NP_WORDS = {1: np.uint8, 2: np.int16}


def to_torch(torch, array: np.ndarray):
    """Host array -> CUDA tensor; FP8 stays uint8 bits (what the raw launcher takes, with
    pool_dtype naming the format)."""
    a = np.ascontiguousarray(array)
    spec = BY_STORAGE.get(a.dtype.name)
    if spec is None or a.dtype.itemsize not in _NP_WORDS:
        return torch.from_numpy(a).cuda()
    word = _NP_WORDS[a.dtype.itemsize]
    return torch.from_numpy(a.view(word)).cuda().view(getattr(torch, spec.torch_name))


def from_torch(tensor, dtype: np.dtype) -> np.ndarray:
    import torch

    t = tensor.detach().contiguous().cpu()
    if dtype.itemsize == 2:
        return t.view(torch.int16).numpy().view(dtype)
    if dtype.itemsize == 1:
        return t.view(torch.uint8).numpy().view(dtype)
    return t.numpy()


def page_indices(torch, pages: np.ndarray):
    return torch.from_numpy(pages.astype(np.int64)).cuda()


def torch_pool(torch, problem: Problem, contract: str):
    """The known pool (see problem.host_pool), built on the device: the fill's bits broadcast,
    the sample copied into its pages."""
    s = problem.shape
    fill = to_torch(torch, np.full(1, POOL_FILL, np.float32).astype(s.np_pool_dtype))
    pool = fill.expand(s.pool_shape).contiguous()
    k_pages, v_pages = (page_indices(torch, p) for p in problem.sample_pages(contract))
    layer = pool[0] if s.num_layers else pool
    sample = to_torch(torch, problem.sample_init)
    layer[0].index_copy_(0, k_pages, sample[0])
    layer[1].index_copy_(0, v_pages, sample[1])
    return pool


class TorchInputs:
    """One shape's operands as CUDA tensors, uploaded once and shared by the raw contenders;
    each contract's operands on first use."""

    def __init__(self, torch, problem: Problem):
        self.problem = problem
        self.up = functools.partial(to_torch, torch)
        self.ks = [self.up(k) for k in problem.k_sets]
        self.vs = [self.up(v) for v in problem.v_sets]
        self.scales = {k: self.up(v) for k, v in problem.scales().items()}
        self._operands = {}

    def operands(self, contract: str) -> tuple[list[dict], dict]:
        """(per-set operands with the set's k_delta and v_delta in the contract's layout,
        shared operands)."""
        if contract not in self._operands:
            c, p = CONTRACTS[contract], self.problem
            layout = delta_shape(c, p.shape)
            per_set = [
                {
                    "k_delta": k.view(layout),
                    "v_delta": v.view(layout),
                    **{name: self.up(a) for name, a in c.per_set(p, j).items()},
                }
                for j, (k, v) in enumerate(zip(self.ks, self.vs))
            ]
            shared = {name: self.up(a) for name, a in c.shared(p).items()}
            self._operands[contract] = (per_set, shared)
        return self._operands[contract]


def torch_inputs(torch, problem: Problem, ctx: dict) -> TorchInputs:
    """The shape's ``TorchInputs``, uploaded by the first contender of the shape that asks."""
    if "torch_inputs" not in ctx:
        ctx["torch_inputs"] = TorchInputs(torch, problem)
    return ctx["torch_inputs"]


def mismatches_in_slot_order(torch, pool, slot_pool, problem: Problem, contract: str) -> int:
    """Elements of the contract's pool, read in slot order (its page order, see
    contracts.Contract), whose bits differ from the slot op's pool. One plane of one layer is
    gathered at a time: with every contender's pool alive, a whole gathered copy of a
    multi-layer pool did not fit beside them."""
    pages = [page_indices(torch, p) for p in problem.page_order(contract)]
    layers = [(pool, slot_pool)]
    if problem.shape.lead:
        layers = [(pool[layer], slot_pool[layer]) for layer in range(pool.shape[0])]
    return sum(
        count_mismatches(torch, mine[plane].index_select(0, pages[plane]), theirs[plane])
        for mine, theirs in layers
        for plane in (0, 1)
    )


def count_mismatches(torch, a, b) -> int:
    """Elements whose bits differ, in chunks (a whole-pool mask summed in int64 is 8x the pool)."""
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    a, b = a.reshape(-1).view(word), b.reshape(-1).view(word)
    if torch.equal(a, b):
        return 0
    return sum(int(torch.count_nonzero(x != y)) for x, y in zip(a.split(1 << 28), b.split(1 << 28)))
