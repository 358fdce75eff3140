// The kernels' two-code float16 stores (float2_to_float16x2_bits in numerics.h: one packed
// conversion, one NaN mend of both halves) against the one-value encoder, over all 2^32 float32
// bit patterns in each half (the other half holds the pattern with its sign and lowest bit
// flipped, so that NaN and finite values meet in one word). It runs in tools/gpu_session.sh's
// parity stage.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc tools/half_pack_check.cu -o /tmp/half_pack_check &&
//   /tmp/half_pack_check
#include "dflash/numerics.h"
#include "exhaustive_check.cuh"

// Bit 0: the pattern in the low half differs, bit 1: in the high half.
struct HalfPack {
  __device__ unsigned operator()(uint32_t bits) const {
    float const f = __uint_as_float(bits), g = __uint_as_float(bits ^ 0x80000001u);
    auto pair = [](uint16_t lo, uint16_t hi) { return uint32_t(lo) | uint32_t(hi) << 16; };
    uint16_t const hf = dflash::float_to_float16_bits(f), hg = dflash::float_to_float16_bits(g);
    bool const low_bad = dflash::float2_to_float16x2_bits(f, g) != pair(hf, hg);
    bool const high_bad = dflash::float2_to_float16x2_bits(g, f) != pair(hg, hf);
    return unsigned(low_bad) | unsigned(high_bad) << 1;
  }
};

int main() {
  return exhaustive::check_all("half_pack_check", "float32 inputs", "input", "float16 low half",
                               "float16 high half", HalfPack{});
}
