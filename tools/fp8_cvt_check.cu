// The device's FP8 conversion (cvt.rn.satfinite, NaN mended) against the software rounding of
// numerics.h, over all 2^32 float32 bit patterns, for e4m3fn and e5m2. The kernels use the
// hardware path only because this finds no difference; it runs in tools/gpu_session.sh.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc tools/fp8_cvt_check.cu -o /tmp/fp8_cvt_check && /tmp/fp8_cvt_check
#include "dflash/numerics.h"
#include "exhaustive_check.cuh"

// Every byte of `codes` (the first `bytes` of them) equal to `expected`.
__device__ bool all_bytes(uint32_t codes, int bytes, uint8_t expected) {
  for (int i = 0; i < bytes; ++i)
    if (((codes >> (8 * i)) & 0xffu) != expected) return false;
  return true;
}

// Bit 0: e4m3fn differs, bit 1: e5m2 differs: both lanes of the packed conversion, and all four
// bytes of the kernels' four-code word (two packed conversions, one NaN mend).
struct Fp8Conversion {
  __device__ unsigned operator()(uint32_t bits) const {
    float const f = __uint_as_float(bits);
    uint8_t const s4 = dflash::float_to_e4m3_bits_software(f), s5 = dflash::float_to_e5m2_bits_software(f);
    uint32_t const w4 = dflash::float4_to_e4m3x4_bits(f, f, f, f);
    uint32_t const w5 = dflash::float4_to_e5m2x4_bits(f, f, f, f);
    bool const ok4 = all_bytes(dflash::float2_to_e4m3x2_bits(f, f), 2, s4) && all_bytes(w4, 4, s4);
    bool const ok5 = all_bytes(dflash::float2_to_e5m2x2_bits(f, f), 2, s5) && all_bytes(w5, 4, s5);
    return unsigned(!ok4) | unsigned(!ok5) << 1;
  }
};

int main() {
  return exhaustive::check_all("fp8_cvt_check", "float32 inputs", "input", "e4m3fn", "e5m2", Fp8Conversion{});
}
