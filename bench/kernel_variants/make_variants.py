"""Builds the kernel-variant timing binaries of BENCHMARKS.md's kernel notes.

Copies csrc/dflash/kv_update_cuda.cu with three compile-time knobs (pool stores streaming or
plain, threads per block, vector bytes), then compiles kbench.cu (a CUDA-graph timing harness,
fp16 H=8 D=128 R=128 P=128) once per combination: kb_cs{0,1}_b{128,256,512}_v{8,16}.
Run each binary on the GPU machine; it prints one line per shape. Needs nvcc (sm_90).

    python bench/kernel_variants/make_variants.py OUTDIR
"""

import itertools
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def variant_source() -> str:
    s = (ROOT / "csrc/dflash/kv_update_cuda.cu").read_text()
    knobs = "#ifndef KV_BLOCK\n#define KV_BLOCK 128\n#endif\n#ifndef KV_VEC_BYTES\n#define KV_VEC_BYTES 16\n#endif\n#ifndef KV_STORE_CS\n#define KV_STORE_CS 1\n#endif\n"
    replacements = [
        ('#include "dflash/kv_update_cuda.h"', '#include "dflash/kv_update_cuda.h"\n' + knobs),
        ("__launch_bounds__(128)", "__launch_bounds__(KV_BLOCK)"),
        ("constexpr int64_t kBlockThreads = 128;", "constexpr int64_t kBlockThreads = KV_BLOCK;"),
        ("constexpr int kMaxVec = int(16 / sizeof(T));", "constexpr int kMaxVec = int(KV_VEC_BYTES / sizeof(T));"),
        ("  using W = typename Word<sizeof(P)>::type;\n  __stcs(",
         "  using W = typename Word<sizeof(P)>::type;\n"
         "  if (!KV_STORE_CS) { *static_cast<W*>(ptr) = *reinterpret_cast<W const*>(&pack); return; }\n"
         "  __stcs("),
    ]
    for old, new in replacements:
        if old not in s:
            raise SystemExit(f"kv_update_cuda.cu changed: cannot find {old!r}")
        s = s.replace(old, new, 1)
    # Only the fp16 launcher is timed: drop the dtype switch (it would instantiate every dtype).
    cut = s.index("}  // namespace\n\ncudaError_t launch_target_kv_cache_update")
    return s[:cut] + "}  // namespace\n}  // namespace dflash\n"


def main() -> int:
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "kernel_variants_build").resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "kvar.cu").write_text(variant_source())
    jobs = []
    for cs, block, vec in itertools.product((1, 0), (128, 256, 512), (16, 8)):
        cmd = ["nvcc", "-std=c++17", "-O3", "--fmad=false", "-arch=sm_90", f"-I{ROOT / 'csrc'}",
               f"-I{out}", f"-DKV_STORE_CS={cs}", f"-DKV_BLOCK={block}", f"-DKV_VEC_BYTES={vec}",
               str(HERE / "kbench.cu"), "-o", str(out / f"kb_cs{cs}_b{block}_v{vec}")]
        jobs.append(subprocess.Popen(cmd))
    return max(job.wait() for job in jobs)


if __name__ == "__main__":
    sys.exit(main())
