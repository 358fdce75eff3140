// The fused k-norm's packed weight product (f16_pair_times / bf16_pair_times in numerics.h)
// against SPEC.md's arithmetic, the float32 product rounded to the delta dtype, over every pair
// of 16-bit inputs (2^32 pairs each for float16 and bfloat16; NaN results compared after the
// canonical NaN, as they are stored). It runs in tools/gpu_session.sh's parity stage.
//
//   nvcc -std=c++17 -O3 --fmad=false -arch=sm_90 -Icsrc tools/packed_mul_check.cu -o /tmp/packed_mul_check && /tmp/packed_mul_check
#include <cstdio>

#include "dflash/numerics.h"

__global__ void compare(unsigned long long* mismatches, unsigned* first) {
  uint64_t const stride = uint64_t(gridDim.x) * blockDim.x;
  unsigned long long local[2] = {0, 0};
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (uint64_t(1) << 32); i += stride) {
    uint16_t const u = uint16_t(i >> 16), w = uint16_t(i);
    // Both lanes of the packed multiply: (u, w) and (w, u).
    float const hu = dflash::float16_bits_to_float(u), hw = dflash::float16_bits_to_float(w);
    float2 const h = dflash::f16_pair_times(hu, hw, w, u);
    uint16_t const h_want = dflash::float_to_float16_bits(dflash::mul_rn(hu, hw));
    if (dflash::float_to_float16_bits(h.x) != h_want || dflash::float_to_float16_bits(h.y) != h_want) {
      if (local[0]++ == 0) atomicCAS(first, 0xffffffffu, uint32_t(i));
    }
    float const bu = dflash::bfloat16_bits_to_float(u), bw = dflash::bfloat16_bits_to_float(w);
    float2 const b = dflash::bf16_pair_times(bu, bw, w, u);
    uint16_t const b_want = dflash::float_to_bfloat16_bits(dflash::mul_rn(bu, bw));
    if (dflash::float_to_bfloat16_bits(b.x) != b_want || dflash::float_to_bfloat16_bits(b.y) != b_want) {
      if (local[1]++ == 0) atomicCAS(first + 1, 0xffffffffu, uint32_t(i));
    }
  }
  atomicAdd(mismatches, local[0]);
  atomicAdd(mismatches + 1, local[1]);
}

int main() {
  unsigned long long* mismatches;
  unsigned* first;
  cudaMallocManaged(&mismatches, 2 * sizeof(unsigned long long));
  cudaMallocManaged(&first, 2 * sizeof(unsigned));
  mismatches[0] = mismatches[1] = 0;
  first[0] = first[1] = 0xffffffffu;
  compare<<<132 * 8, 256>>>(mismatches, first);
  cudaError_t const status = cudaDeviceSynchronize();
  if (status != cudaSuccess) {
    std::printf("packed_mul_check: CUDA error %s\n", cudaGetErrorString(status));
    return 2;
  }
  std::printf("packed_mul_check: all 2^32 pairs of 16-bit inputs: float16 %llu mismatches (first pair bits %#x), "
              "bfloat16 %llu mismatches (first %#x)\n",
              mismatches[0], first[0], mismatches[1], first[1]);
  return mismatches[0] + mismatches[1] == 0 ? 0 : 1;
}
