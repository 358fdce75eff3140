// The two shortcuts of the scale-pool group kernel's row scale, against what they stand for, over
// all 2^32 float32 bit patterns: quotient_by_constant(a, qmax, RN(1 / qmax)) against RN(a / qmax)
// for the four formats' qmax (127, 7, 448, 57344; every a, bits compared, NaNs as NaNs), and
// reciprocal_in_range(s) against __frcp_rn(s) for every s in [kExactQuotientsFrom,
// kExactQuotientsTo]. It runs in tools/gpu_session.sh.
//
//   nvcc -std=c++17 -O3 --fmad=false -arch=sm_90 -Icsrc tools/scale_check.cu -o /tmp/scale_check &&
//   /tmp/scale_check
#include "dflash/numerics.h"
#include "exhaustive_check.cuh"

// Bit 0: a quotient that differs from the division for some qmax; bit 1: a reciprocal that
// differs from __frcp_rn.
struct ScaleShortcuts {
  __device__ unsigned operator()(uint32_t bits) const {
    float const x = __uint_as_float(bits);
    unsigned failed = 0;
    constexpr float kQMax[4] = {127.0f, 7.0f, 448.0f, 57344.0f};
#pragma unroll
    for (float const qmax : kQMax) {
      float const got = dflash::quotient_by_constant(x, qmax, 1.0f / qmax);
      float const want = __fdiv_rn(x, qmax);
      bool const same = __float_as_uint(got) == __float_as_uint(want) || (isnan(got) && isnan(want));
      if (!same) failed |= 1u;
    }
    if (x >= dflash::kExactQuotientsFrom && x <= dflash::kExactQuotientsTo &&
        __float_as_uint(dflash::reciprocal_in_range(x)) != __float_as_uint(__frcp_rn(x)))
      failed |= 2u;
    return failed;
  }
};

int main() {
  return exhaustive::check_all("scale_check", "float32 inputs", "input", "quotient", "reciprocal",
                               ScaleShortcuts{});
}
