// The kernels' two-code 16-bit stores (float2_to_float16x2_bits / float2_to_bfloat16x2_bits in
// numerics.h: one packed conversion, one NaN mend of both halves) against the one-value encoders,
// over all 2^32 float32 bit patterns in each half (the other half holds the pattern with its sign
// and lowest bit flipped, so that NaN and finite values meet in one word). It runs in
// tools/gpu_session.sh's parity stage.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc tools/half_pack_check.cu -o /tmp/half_pack_check && /tmp/half_pack_check
#include "dflash/numerics.h"
#include "exhaustive_check.cuh"

// Bit 0: float16 differs, bit 1: bfloat16 differs (either half, either order).
struct HalfPack {
  __device__ unsigned operator()(uint32_t bits) const {
    float const f = __uint_as_float(bits), g = __uint_as_float(bits ^ 0x80000001u);
    auto pair = [](uint16_t lo, uint16_t hi) { return uint32_t(lo) | uint32_t(hi) << 16; };
    uint16_t const hf = dflash::float_to_float16_bits(f), hg = dflash::float_to_float16_bits(g);
    uint16_t const bf = dflash::float_to_bfloat16_bits(f), bg = dflash::float_to_bfloat16_bits(g);
    bool const f16_bad = dflash::float2_to_float16x2_bits(f, g) != pair(hf, hg) ||
                         dflash::float2_to_float16x2_bits(g, f) != pair(hg, hf);
    bool const bf16_bad = dflash::float2_to_bfloat16x2_bits(f, g) != pair(bf, bg) ||
                          dflash::float2_to_bfloat16x2_bits(g, f) != pair(bg, bf);
    return unsigned(f16_bad) | unsigned(bf16_bad) << 1;
  }
};

int main() {
  return exhaustive::check_all("half_pack_check", "float32 inputs", "input", "float16", "bfloat16", HalfPack{});
}
