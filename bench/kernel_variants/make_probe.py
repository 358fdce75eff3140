"""Builds the decode-size probe (decode_probe.cu) into OUTDIR.

The probe's knob kernel is the shipped kernel of csrc/dflash/kv_update_cuda.cu, copied at build
time with two compile-time knobs added: SMEM_POS (one thread loads the slot's start and length
into shared memory) and PDL (griddepcontrol.wait before the first load, then launch_dependents).

    python3 bench/kernel_variants/make_probe.py /tmp/probe && /tmp/probe/decode_probe
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNEL = ROOT / "csrc" / "dflash" / "kv_update_cuda.cu"


def edit(text: str, old: str, new: str) -> str:
    if old not in text:
        raise SystemExit(f"make_probe: the shipped kernel changed; cannot find:\n{old}")
    return text.replace(old, new)


def knob_kernel(source: str) -> str:
    head = "template <typename T, int VEC>\n__global__ void __launch_bounds__(128) target_kv_cache_update_kernel"
    start, end = source.index(head), source.index("bool aligned(void const* ptr")
    k = source[start:end]
    k = edit(k, "template <typename T, int VEC>\n__global__",
             "template <typename T, int VEC, int SMEM_POS, int PDL, int PF = 0, int VFIRST = 0, int RH = 0>\n"
             "__global__")
    k = edit(k, "target_kv_cache_update_kernel(", "knob_kernel(")
    k = edit(k, """  int64_t const start = __ldg(p.delta_start_positions + position_index(p, layer, b));
  int64_t const length = __ldg(p.delta_lengths + position_index(p, layer, b));""", """  if (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (PDL) asm volatile("griddepcontrol.launch_dependents;");
  __shared__ int slot_positions[2];
  int64_t start = 0, length = 0;
  if (SMEM_POS) {
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
      slot_positions[0] = __ldg(p.delta_start_positions + position_index(p, layer, b));
      slot_positions[1] = __ldg(p.delta_lengths + position_index(p, layer, b));
    }
  } else {
    start = __ldg(p.delta_start_positions + position_index(p, layer, b));
    length = __ldg(p.delta_lengths + position_index(p, layer, b));
  }""")
    k = edit(k, """  if (t >= uint32_t(p.delta_len) || h >= uint32_t(p.num_kv_heads) || head_item >= g.head_items)
    return;""", """  bool const live = t < uint32_t(p.delta_len) && h < uint32_t(p.num_kv_heads) &&
                    head_item < g.head_items;
  if (!SMEM_POS && !live) return;""")
    k = edit(k, "  int64_t const pos = written_position(", """  if (SMEM_POS) {
    __syncthreads();
    if (!live) return;
    start = slot_positions[0], length = slot_positions[1];
  }
  int64_t const pos = written_position(""")
    # PF 1: once the position is known, one thread per token prefetches the token's K and V
    # destination lines to L2 (warming the address translation of the pool pages while the
    # cos/sin rows load); PF 2: every thread prefetches its K destination. VFIRST: the V rows
    # (no RoPE) are stored before the cos/sin load instead of after it.
    k = edit(k, "  if (pair && pos < p.rope_seq_len) {", """  T* const kp = static_cast<T*>(p.pool) + int64_t(layer) * pool_layer_elems(p);
  int64_t const kdst = pool_token_offset(p, b, pos) + head_offset;
  if ((PF == 1 && threadIdx.x == 0 && threadIdx.y == 0) || PF == 2)
    asm volatile("prefetch.global.L2 [%0];" :: "l"(kp + kdst));
  if (PF == 1 && threadIdx.x == 0 && threadIdx.y == 0)
    asm volatile("prefetch.global.L2 [%0];" :: "l"(kp + pool_plane_elems(p) + kdst));
  if (VFIRST) {
    store_streaming(kp + pool_plane_elems(p) + kdst, v0);
    if (pair) store_streaming(kp + pool_plane_elems(p) + kdst + half, v1);
  }
  if (pair && pos < p.rope_seq_len) {""")
    k = edit(k, "  store_streaming(v_plane + dst, v0);", "  if (!VFIRST) store_streaming(v_plane + dst, v0);")
    k = edit(k, "    store_streaming(v_plane + dst + half, v1);",
             "    if (!VFIRST) store_streaming(v_plane + dst + half, v1);")
    # RH: cos/sin rows loaded with an L2 evict-last policy (the table stays in L2 while the
    # streamed deltas pass through).
    k = edit(k, "    load_cos_sin<VEC>(cos, cos + half, g.rope_float4, c, s);",
             "    if (RH) load_cos_sin_evict_last<VEC>(cos, cos + half, c, s);\n"
             "    else load_cos_sin<VEC>(cos, cos + half, g.rope_float4, c, s);")
    helper = """template <int VEC>
__device__ __forceinline__ void load_cos_sin_evict_last(float const* cos, float const* sin,
                                                        float (&c)[VEC], float (&s)[VEC]) {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
#pragma unroll
  for (int i = 0; i < VEC; i += 4) {
    asm volatile("ld.global.nc.L2::cache_hint.v4.f32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=f"(c[i]), "=f"(c[i + 1]), "=f"(c[i + 2]), "=f"(c[i + 3]) : "l"(cos + i), "l"(policy));
    asm volatile("ld.global.nc.L2::cache_hint.v4.f32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=f"(s[i]), "=f"(s[i + 1]), "=f"(s[i + 2]), "=f"(s[i + 3]) : "l"(sin + i), "l"(policy));
  }
}
"""
    return "namespace dflash {\nnamespace {\n" + helper + k + "}  // namespace\n}  // namespace dflash\n"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "knob_kernel.inc").write_text(knob_kernel(KERNEL.read_text()))
    cmd = ["nvcc", "-O3", "-std=c++17", "-arch=sm_90", f"-I{ROOT / 'csrc'}", f"-I{out}",
           "-o", str(out / "decode_probe"), str(Path(__file__).with_name("decode_probe.cu"))]
    print(" ".join(cmd), flush=True)
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
