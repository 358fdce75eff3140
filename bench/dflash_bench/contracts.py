"""The addressing forms the op is benchmarked in: one ``Contract`` each, naming its entry in
every runtime and building its operands from a shape's ``Problem``.

All forms address the same rows of the same pool, so their results agree page for page once
each pool is read in its ``page_order``. Operands are keyword arguments under the names the
op, the raw launchers, the NumPy entries and the reference share; a new form is one subclass
of ``Contract`` registered in ``CONTRACTS`` (and its contenders in ``contenders.CONTENDERS``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from dflash_bench.problem import Problem
    from dflash_bench.shapes import BenchShape

PageOrder = tuple[np.ndarray, np.ndarray]


class Contract:
    """An addressing form. The op's entries are named alike in every runtime, a suffix apart:
    ``target_kv_cache_update{suffix}`` (jax_dflash, jax_dflash.reference, the CPU extension's
    NumPy entry) and ``launch{suffix}`` (the CUDA extension's raw launcher)."""

    name: str
    suffix: str
    token_major: bool  # deltas as [T, H, D] (else [B, L, H, D])
    by_form = False  # its raw entries are the extensions' by-name ones (launch_form / update)

    @property
    def jax_op(self) -> str:
        return f"target_kv_cache_update{self.suffix}"

    reference = cpu_entry = jax_op

    @property
    def cuda_launcher(self) -> str:
        return f"launch{self.suffix}"

    def cuda_entry(self, cuda) -> Callable:
        """The raw CUDA launcher, called with the operands by name."""
        return getattr(cuda, self.cuda_launcher)

    def cpu_call(self, cpu) -> Callable:
        """The NumPy entry, called as ``(k_delta, v_delta, pool, **operands)``."""
        return getattr(cpu, self.cpu_entry)

    def per_set(self, problem: Problem, j: int) -> dict:
        """The operands that rotate with input set j."""
        raise NotImplementedError

    def shared(self, problem: Problem) -> dict:
        """The operands every set shares."""
        raise NotImplementedError

    def statics(self, shape: BenchShape) -> dict:
        """Static keyword arguments."""
        return {}

    def page_order(self, problem: Problem) -> PageOrder:
        """(K pages, V pages in plane 1) of the whole pool in slot order."""
        raise NotImplementedError

    def sample_operands(self, problem: Problem, n: int) -> dict:
        """The operands of set 0 restricted to the first n sequences, writing into a pool of
        just their pages, numbered in page order (the reference's sample)."""
        raise NotImplementedError


class Slot(Contract):
    name, suffix, token_major = "slot", "", False

    def per_set(self, problem: Problem, j: int) -> dict:
        return {"delta_start_positions": problem.start_sets[j]}

    def shared(self, problem: Problem) -> dict:
        return {"rope_cos_sin": problem.rope, "delta_lengths": problem.lengths}

    def statics(self, shape: BenchShape) -> dict:
        return {"pages_per_slot": shape.pages_per_slot}

    def page_order(self, problem: Problem) -> PageOrder:
        pages = np.arange(problem.shape.num_pages, dtype=np.int32)
        return pages, pages

    def sample_operands(self, problem: Problem, n: int) -> dict:
        return {
            "rope_cos_sin": problem.rope,
            "delta_start_positions": problem.start_sets[0][:n],
            "delta_lengths": problem.lengths[:n],
        }


class Paged(Contract):
    name, suffix, token_major = "paged", "_paged", True

    def per_set(self, problem: Problem, j: int) -> dict:
        return {
            "rope_cos_sin": problem.paged_rope_sets[j],
            "delta_positions": problem.position_sets[j],
        }

    def shared(self, problem: Problem) -> dict:
        return {"delta_token_to_sequence": problem.owners, "kv_page_table": problem.table}

    def page_order(self, problem: Problem) -> PageOrder:
        table = problem.table
        return table[:, 0].reshape(-1), table[:, 1].reshape(-1) - problem.shape.num_pages

    def sample_operands(self, problem: Problem, n: int) -> dict:
        tokens, m = n * problem.shape.delta_len, problem.shape.pages_per_slot
        pages = np.arange(n * m, dtype=np.int32).reshape(n, m)
        return {
            "rope_cos_sin": problem.paged_rope_sets[0][:tokens],
            "delta_positions": problem.position_sets[0][:tokens],
            "delta_token_to_sequence": problem.owners[:tokens],
            "kv_page_table": np.stack([pages, pages + n * m], axis=1),  # the sample pages
        }


class SlotMapping(Contract):
    """vLLM's flat slots: ``slot = K page * P + position % P`` of the paged form's table, so
    token for token the same rows as the other forms (V in plane 1 of the same page). Its raw
    entries are the extensions' by-name ones (``launch_form`` / ``update``)."""

    name, suffix, token_major = "slot_mapping", "_slots", True
    by_form = True
    operands = ("k_delta", "v_delta", "pool", "rope_cos_sin", "slot_mapping")

    @staticmethod
    def slots(positions: np.ndarray, owners: np.ndarray, k_pages: np.ndarray, p: int) -> np.ndarray:
        return (k_pages[owners, positions // p].astype(np.int64) * p + positions % p).astype(
            np.int32
        )

    def per_set(self, problem: Problem, j: int) -> dict:
        positions, p = problem.position_sets[j], problem.shape.page_size
        return {
            "rope_cos_sin": problem.paged_rope_sets[j],
            "slot_mapping": self.slots(positions, problem.owners, problem.table[:, 0], p),
        }

    def shared(self, problem: Problem) -> dict:
        return {}

    def page_order(self, problem: Problem) -> PageOrder:
        k_pages = problem.table[:, 0].reshape(-1)
        return k_pages, k_pages

    def sample_operands(self, problem: Problem, n: int) -> dict:
        tokens, m = n * problem.shape.delta_len, problem.shape.pages_per_slot
        pages = np.arange(n * m, dtype=np.int32).reshape(n, m)  # the sample pages
        positions = problem.position_sets[0][:tokens]
        owners = problem.owners[:tokens]
        return {
            "rope_cos_sin": problem.paged_rope_sets[0][:tokens],
            "slot_mapping": self.slots(positions, owners, pages, problem.shape.page_size),
        }

    def cuda_entry(self, cuda) -> Callable:
        def launch(**kw):
            base = [kw.pop(name) for name in self.operands]
            cuda.launch_form(self.name, base, **kw)

        return launch

    def cpu_call(self, cpu) -> Callable:
        def update(k_delta, v_delta, pool, **kw):
            base = [k_delta, v_delta, pool, kw.pop("rope_cos_sin"), kw.pop("slot_mapping")]
            cpu.update(self.name, base, **kw)

        return update


CONTRACTS = {c.name: c for c in (Slot(), Paged(), SlotMapping())}


def delta_shape(contract: Contract, shape: BenchShape) -> tuple[int, ...]:
    return shape.paged_delta_shape if contract.token_major else shape.delta_shape
