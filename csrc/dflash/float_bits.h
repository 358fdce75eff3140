// Host-side conversions between fp32 and the 16-bit storage types, rounding to nearest even,
// so that the CPU kernel rounds exactly as CUDA's __float2half_rn / __float2bfloat16_rn and
// NumPy's astype do.
#pragma once

#include <cstdint>
#include <cstring>

namespace dflash {

inline uint32_t float_as_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float bits_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float bfloat16_to_float(uint16_t h) { return bits_as_float(uint32_t(h) << 16); }

inline uint16_t float_to_bfloat16(float f) {
  uint32_t u = float_as_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float float16_to_float(uint16_t h) {
  uint32_t const sign = uint32_t(h & 0x8000u) << 16;
  uint32_t const exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_as_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return bits_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_as_float(sign);
  // Subnormal half: normalise.
  int32_t e = -1;
  do {
    ++e;
    mantissa <<= 1;
  } while ((mantissa & 0x400u) == 0);
  return bits_as_float(sign | uint32_t(112 - e) << 23 | ((mantissa & 0x3ffu) << 13));
}

inline uint16_t float_to_float16(float f) {
  uint32_t const u = float_as_bits(f);
  uint16_t const sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t const abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // NaN
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to infinity (or is inf)
  if (abs >= 0x38800000u) {  // normal half
    uint32_t const rounded = abs + 0xfffu + ((abs >> 13) & 1u);
    return uint16_t(sign | ((rounded - 0x38000000u) >> 13));
  }
  if (abs < 0x33000000u) return sign;  // below half the smallest subnormal: +-0
  // Subnormal half: shift the full mantissa into place with round-to-nearest-even.
  uint32_t const exponent = abs >> 23;
  uint32_t const mantissa = (abs & 0x7fffffu) | 0x800000u;
  uint32_t const shift = 126u - exponent;  // 14..24
  uint32_t const half_mantissa = mantissa >> shift;
  uint32_t const remainder = mantissa & ((1u << shift) - 1u);
  uint32_t const halfway = 1u << (shift - 1u);
  uint32_t result = half_mantissa;
  if (remainder > halfway || (remainder == halfway && (half_mantissa & 1u))) ++result;
  return uint16_t(sign | result);
}

}  // namespace dflash
