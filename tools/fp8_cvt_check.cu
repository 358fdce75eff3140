// The device's FP8 conversion (cvt.rn.satfinite, NaN mended) against the software rounding of
// numerics.h, over all 2^32 float32 bit patterns, for e4m3fn and e5m2. The kernels use the
// hardware path only because this finds no difference; it runs in tools/gpu_session.sh.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc tools/fp8_cvt_check.cu -o /tmp/fp8_cvt_check && /tmp/fp8_cvt_check
#include "dflash/numerics.h"
#include "exhaustive_check.cuh"

// Bit 0: e4m3fn differs, bit 1: e5m2 differs (both lanes of the packed conversion).
struct Fp8Conversion {
  __device__ unsigned operator()(uint32_t bits) const {
    float const f = __uint_as_float(bits);
    uint16_t const e4 = dflash::float2_to_e4m3x2_bits(f, f);
    uint16_t const e5 = dflash::float2_to_e5m2x2_bits(f, f);
    uint8_t const s4 = dflash::float_to_e4m3_bits_software(f), s5 = dflash::float_to_e5m2_bits_software(f);
    return unsigned((e4 & 0xff) != s4 || (e4 >> 8) != s4) | unsigned((e5 & 0xff) != s5 || (e5 >> 8) != s5) << 1;
  }
};

int main() {
  exhaustive::Result r;
  if (!exhaustive::run("fp8_cvt_check", Fp8Conversion{}, &r)) return 2;
  std::printf("fp8_cvt_check: all 2^32 float32 inputs: e4m3fn %llu mismatches (first input bits %#x), e5m2 %llu "
              "mismatches (first %#x)\n",
              r.mismatches[0], r.first[0], r.mismatches[1], r.first[1]);
  return r.ok() ? 0 : 1;
}
