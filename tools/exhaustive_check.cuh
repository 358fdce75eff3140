// The harness of the exhaustive device checks (fp8_cvt_check.cu, packed_mul_check.cu): every
// 32-bit input through a check that returns one bit per comparison that failed (two
// comparisons), counted, with the first failing input of each.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

namespace exhaustive {

struct Result {
  unsigned long long mismatches[2] = {0, 0};
  unsigned first[2] = {0xffffffffu, 0xffffffffu};  // input bits of the first mismatch
  bool ok() const { return mismatches[0] + mismatches[1] == 0; }
};

template <typename Check> __global__ void sweep(Check check, Result* result) {
  uint64_t const stride = uint64_t(gridDim.x) * blockDim.x;
  unsigned long long local[2] = {0, 0};
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < (uint64_t(1) << 32); i += stride) {
    unsigned const failed = check(uint32_t(i));
    for (int k = 0; k < 2; ++k)
      if ((failed >> k) & 1u && local[k]++ == 0) atomicCAS(&result->first[k], 0xffffffffu, uint32_t(i));
  }
  atomicAdd(&result->mismatches[0], local[0]);
  atomicAdd(&result->mismatches[1], local[1]);
}

// Runs `check` over all 2^32 inputs into `out`; false (with the error printed under `name`) when
// the device failed.
template <typename Check> bool run(char const* name, Check check, Result* out) {
  Result* result;
  if (cudaMallocManaged(&result, sizeof(Result)) != cudaSuccess) {
    std::printf("%s: cannot allocate managed memory\n", name);
    return false;
  }
  *result = Result{};
  sweep<<<132 * 8, 256>>>(check, result);
  cudaError_t const status = cudaDeviceSynchronize();
  if (status != cudaSuccess) {
    std::printf("%s: CUDA error %s\n", name, cudaGetErrorString(status));
    return false;
  }
  *out = *result;
  cudaFree(result);
  return true;
}

// A tool's whole run: `check` over all 2^32 inputs, then one line, e.g. "NAME: all 2^32 float32
// inputs: e4m3fn 0 mismatches (first input bits 0xffffffff), e5m2 0 mismatches (first
// 0xffffffff)". Exit status: 0 without mismatches, 1 with, 2 when the device failed.
template <typename Check> int check_all(char const* name, char const* inputs, char const* input,
                                        char const* label0, char const* label1, Check check) {
  Result r;
  if (!run(name, check, &r)) return 2;
  std::printf("%s: all 2^32 %s: %s %llu mismatches (first %s bits %#x), %s %llu mismatches (first %#x)\n",
              name, inputs, label0, r.mismatches[0], input, r.first[0], label1, r.mismatches[1], r.first[1]);
  return r.ok() ? 0 : 1;
}

}  // namespace exhaustive
