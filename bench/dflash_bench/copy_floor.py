"""The floor: a copy moving the update's bytes (read + written), and the device's peak copy
bandwidth, on the GPU (torch, CUDA graph) and on the CPU (NumPy)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from dflash_bench.problem import Problem, rotated_sets
from dflash_bench.timing import Prepared, Settings, cuda_graph, host_loop
from dflash_bench.torch_side import import_torch

if TYPE_CHECKING:
    from dflash_bench.contenders import Contender


def copy_sets(problem: Problem, backend: str) -> tuple[int, int]:
    """Bytes per copy (half the update's bytes: read + written = the same total) and sets.

    Sources and destinations both rotate over the sets. The update writes rows it has not
    written recently (new positions), so the floor writes to buffers that are not in the cache
    either: a fixed destination stays in L2 at decode sizes and its writes never reach DRAM
    while the timing runs (BENCHMARKS.md, "How the benchmark times")."""
    size = max(problem.bytes["total"] // 2, 1)
    return size, rotated_sets(size, backend)


def _info(size: int, num_sets: int) -> dict:
    return {
        "check": {"ok": True, "criterion": "none (the floor)"},
        "bytes_copied": size,
        "copy_sets": num_sets,
    }


def prepare_copy_gpu(spec: Contender, problem: Problem, settings: Settings, ctx: dict) -> Prepared:
    torch = import_torch()
    size, num_sets = copy_sets(problem, "gpu")
    sources = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(num_sets)]
    dests = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(num_sets)]

    def enqueue(i: int) -> None:
        dests[i % num_sets].copy_(sources[i % num_sets])

    return cuda_graph(torch, enqueue, settings.chain, _info(size, num_sets))


def prepare_copy_cpu(spec: Contender, problem: Problem, settings: Settings, ctx: dict) -> Prepared:
    size, num_sets = copy_sets(problem, "cpu")
    sources = [np.ones(size, np.uint8) for _ in range(num_sets)]
    dests = [np.zeros(size, np.uint8) for _ in range(num_sets)]

    def copy(i: int) -> None:
        np.copyto(dests[i % num_sets], sources[i % num_sets])

    return host_loop(copy, settings.chain, _info(size, num_sets))


def peak_copy_bandwidth_gpu() -> dict:
    """Bytes read + written per second for 1 GiB device-to-device copies (torch)."""
    torch = import_torch()
    size = 1 << 30
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes_per_s": 2 * size * reps / seconds, "method": "torch copy_ of 1 GiB, x20"}


def peak_copy_bandwidth_cpu() -> dict:
    size = 128 << 20
    src, dst = np.ones(size, np.uint8), np.zeros(size, np.uint8)
    np.copyto(dst, src)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        samples.append(time.perf_counter() - t0)
    return {"bytes_per_s": 2 * size / min(samples), "method": "numpy copyto of 128 MiB, best of 5"}


def peak_copy_bandwidth(backend: str) -> dict:
    return peak_copy_bandwidth_gpu() if backend == "gpu" else peak_copy_bandwidth_cpu()
