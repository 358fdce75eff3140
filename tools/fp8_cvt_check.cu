// The device's FP8 conversion (cvt.rn.satfinite, NaN mended) against the software rounding of
// numerics.h, over all 2^32 float32 bit patterns, for e4m3fn and e5m2. The kernels use the
// hardware path only because this finds no difference; it runs in tools/gpu_session.sh.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc tools/fp8_cvt_check.cu -o /tmp/fp8_cvt_check && /tmp/fp8_cvt_check
#include <cstdio>

#include "dflash/numerics.h"

__global__ void compare(unsigned long long* mismatches, unsigned* first) {
  uint64_t const stride = uint64_t(gridDim.x) * blockDim.x;
  unsigned long long local[2] = {0, 0};
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (uint64_t(1) << 32); i += stride) {
    float const f = __uint_as_float(uint32_t(i));
    uint16_t const e4 = dflash::float2_to_e4m3x2_bits(f, f);
    uint16_t const e5 = dflash::float2_to_e5m2x2_bits(f, f);
    uint8_t const s4 = dflash::float_to_e4m3_bits_software(f), s5 = dflash::float_to_e5m2_bits_software(f);
    if ((e4 & 0xff) != s4 || (e4 >> 8) != s4) {
      if (local[0]++ == 0) atomicCAS(first, 0xffffffffu, uint32_t(i));
    }
    if ((e5 & 0xff) != s5 || (e5 >> 8) != s5) {
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
    std::printf("fp8_cvt_check: CUDA error %s\n", cudaGetErrorString(status));
    return 2;
  }
  std::printf("fp8_cvt_check: all 2^32 float32 inputs: e4m3fn %llu mismatches (first input bits %#x), e5m2 %llu "
              "mismatches (first %#x)\n",
              mismatches[0], first[0], mismatches[1], first[1]);
  return mismatches[0] + mismatches[1] == 0 ? 0 : 1;
}
