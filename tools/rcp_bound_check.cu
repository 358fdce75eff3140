// The bound the divided stores' proof takes from the hardware (numerics.h, "divided stores
// without their division"): wherever divisor_of(s) lets the product stand in for the quotient,
// its reciprocal is within 2^-23 of 1 / s relatively; and it does so for every normal s below
// 2^125 (so the stores divide only where they must). Over all 2^32 float32 bit patterns of s; it
// runs in tools/gpu_session.sh.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc tools/rcp_bound_check.cu -o /tmp/rcp_bound_check &&
//   /tmp/rcp_bound_check
#include "dflash/numerics.h"
#include "exhaustive_check.cuh"

// Bit 0: a product admitted with a reciprocal off by more than 2^-23; bit 1: a normal s below
// 2^125 refused.
struct ReciprocalBound {
  __device__ unsigned operator()(uint32_t bits) const {
    float const s = __uint_as_float(bits);
    dflash::Divisor const d = dflash::divisor_of(s);
    unsigned failed = 0;
    if (d.by_product) {
      double const error = double(d.reciprocal) * double(s) - 1.0;  // exact in double
      if (!(fabs(error) <= 0x1p-23)) failed |= 1u;
    }
    uint32_t const magnitude = bits & 0x7fffffffu;
    if (magnitude >= 0x00800000u && magnitude < (uint32_t(125 + 127) << 23) && !d.by_product) failed |= 2u;
    return failed;
  }
};

int main() {
  return exhaustive::check_all("rcp_bound_check", "float32 scales", "scale", "bound", "coverage",
                               ReciprocalBound{});
}
