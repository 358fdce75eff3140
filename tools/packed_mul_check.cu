// The fused k-norm's packed weight product (f16_pair_times / bf16_pair_times in numerics.h)
// against SPEC.md's arithmetic, the float32 product rounded to the delta dtype, over every pair
// of 16-bit inputs (2^32 pairs each for float16 and bfloat16; NaN results compared after the
// canonical NaN, as they are stored). It runs in tools/gpu_session.sh's parity stage.
//
//   nvcc -std=c++17 -O3 --fmad=false -arch=sm_90 -Icsrc tools/packed_mul_check.cu -o /tmp/packed_mul_check &&
//   /tmp/packed_mul_check
#include "dflash/numerics.h"
#include "exhaustive_check.cuh"

// Input bits: u (high half) and w (low half), also the weight word: both lanes of the packed
// multiply, (u, w) and (w, u). Bit 0: float16 differs, bit 1: bfloat16 differs.
struct PackedProduct {
  __device__ unsigned operator()(uint32_t bits) const {
    uint16_t const u = uint16_t(bits >> 16), w = uint16_t(bits);
    float const hu = dflash::float16_bits_to_float(u), hw = dflash::float16_bits_to_float(w);
    float2 const h = dflash::f16_pair_times(hu, hw, bits);
    uint16_t const h_want = dflash::float_to_float16_bits(dflash::mul_rn(hu, hw));
    float const bu = dflash::bfloat16_bits_to_float(u), bw = dflash::bfloat16_bits_to_float(w);
    float2 const b = dflash::bf16_pair_times(bu, bw, bits);
    uint16_t const b_want = dflash::float_to_bfloat16_bits(dflash::mul_rn(bu, bw));
    bool const f16_bad =
        dflash::float_to_float16_bits(h.x) != h_want || dflash::float_to_float16_bits(h.y) != h_want;
    bool const bf16_bad =
        dflash::float_to_bfloat16_bits(b.x) != b_want || dflash::float_to_bfloat16_bits(b.y) != b_want;
    return unsigned(f16_bad) | unsigned(bf16_bad) << 1;
  }
};

int main() {
  return exhaustive::check_all("packed_mul_check", "pairs of 16-bit inputs", "pair", "float16", "bfloat16",
                               PackedProduct{});
}
