// What is stored: RoPE, the fused norms' arithmetic, conversions to the pool dtypes with the
// canonical NaN, and FP8 rounding with saturation (docs/SPEC.md, "What is stored", "Fused norms",
// "FP8 pools"). Host and device share every function here, so the CPU kernel, the CUDA kernel and
// the NumPy reference (jax_dflash/reference.py) produce the same bits.
#pragma once

#include <cstdint>
#include <cstring>

#include "dflash/kv_update.h"

#include <cmath>

#include "dflash/float_bits.h"  // the host conversions (the device uses the intrinsics)

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

// Ada and Hopper convert to FP8 in hardware (cvt.rn.satfinite: round to nearest even, saturate
// to the largest finite value) with the same results as the software rounding below, NaN aside,
// which is mended to the canonical NaN; tools/fp8_cvt_check.cu compares the two over all 2^32
// float32 inputs. -DDFLASH_FP8_SOFTWARE=1 uses the software rounding on the device as well.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !DFLASH_FP8_SOFTWARE
#define DFLASH_FP8_HARDWARE 1
#else
#define DFLASH_FP8_HARDWARE 0
#endif

namespace dflash {

// ---- bits ---------------------------------------------------------------------------------------

DFLASH_HOST_DEVICE uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}
DFLASH_HOST_DEVICE float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}
DFLASH_HOST_DEVICE bool is_nan(float f) { return (bits_of(f) & 0x7fffffffu) > 0x7f800000u; }

// Canonical quiet NaNs: what every computed or converted NaN is stored as (x86 keeps payloads,
// CUDA makes its own; without this the runtimes would disagree on NaN inputs).
inline constexpr uint16_t kFloat16NaN = 0x7e00u;
inline constexpr uint16_t kBFloat16NaN = 0x7fc0u;
inline constexpr uint32_t kFloat32NaN = 0x7fc00000u;
inline constexpr uint8_t kFloat8NaN = 0x7fu;

// ---- float32 arithmetic, each operation rounded on its own ----------------------------------------
// Never fused into an FMA (the CPU code is built with -ffp-contract=off, the CUDA code with
// --fmad=false, and these say so explicitly on the device).

DFLASH_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
DFLASH_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
DFLASH_HOST_DEVICE float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
DFLASH_HOST_DEVICE float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
// a * b + c with one rounding: only where a proof needs the exact product (bracketed codes).
DFLASH_HOST_DEVICE float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// ---- RoPE ---------------------------------------------------------------------------------------

// Rotate-half RoPE for one channel j < R of a key:
//   j <  R/2: y[j] = x[j] * c - x[j + R/2] * s
//   j >= R/2: y[j] = x[j] * c + x[j - R/2] * s
// with c = cos_sin[.., j mod R/2] and s = cos_sin[.., R/2 + j mod R/2]; `partner` is the other
// channel of the pair.
DFLASH_HOST_DEVICE float rope_channel(float x, float partner, float c, float s, bool first_half) {
  float const rotated = mul_rn(partner, s);
  return add_rn(mul_rn(x, c), first_half ? -rotated : rotated);
}

// ---- 16/32-bit storage --------------------------------------------------------------------------

DFLASH_HOST_DEVICE float float16_bits_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  return float16_to_float(h);
#endif
}
DFLASH_HOST_DEVICE float bfloat16_bits_to_float(uint16_t h) { return float_of(uint32_t(h) << 16); }

DFLASH_HOST_DEVICE uint16_t float_to_float16_bits(float f) {
  if (is_nan(f)) return kFloat16NaN;
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  return float_to_float16(f);
#endif
}
DFLASH_HOST_DEVICE uint16_t float_to_bfloat16_bits(float f) {
  if (is_nan(f)) return kBFloat16NaN;
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  return float_to_bfloat16(f);
#endif
}
DFLASH_HOST_DEVICE uint32_t float_to_float32_bits(float f) { return is_nan(f) ? kFloat32NaN : bits_of(f); }

// The float32 value after a rounding to `dtype` (a delta dtype), with the canonical NaN: the
// fused norms' intermediate values live in the delta dtype.
DFLASH_HOST_DEVICE float round_to(DType dtype, float f) {
  switch (dtype) {
    case DType::kFloat16: return float16_bits_to_float(float_to_float16_bits(f));
    case DType::kBFloat16: return bfloat16_bits_to_float(float_to_bfloat16_bits(f));
    default: return float_of(float_to_float32_bits(f));
  }
}

#if defined(__CUDACC__)
// Two float32 values as one word of float16 codes (a in the low half) with the canonical NaN: one
// packed conversion, then one mend of both halves. With m a half's low 15 bits, m + 0x3ff reaches
// bit 15 exactly for NaN codes (m > 0x7c00, the infinity's code) and never carries into the
// other half. (The same for bfloat16 pools made the compiler schedule their fused-norm kernel
// slower; they keep the one-value conversion.)
__device__ __forceinline__ uint32_t float2_to_float16x2_bits(float a, float b) {
  __half2 const h = __floats2half2_rn(a, b);
  uint32_t w;
  memcpy(&w, &h, sizeof(w));
  uint32_t const nan = ((w & 0x7fff7fffu) + 0x03ff03ffu) & 0x80008000u;
  uint32_t const mask = (nan >> 15) * 0xffffu;
  return (w & ~mask) | (uint32_t(kFloat16NaN) * 0x00010001u & mask);
}

// The fused k-norm's weight step on two channels (SPEC.md "Fused norms" 4-5): (a, b) rounded to
// the 16-bit delta dtype, each times its weight, rounded again, widened. The float32 product of
// two 16-bit values is exact, so rounding it once is the correctly rounded 16-bit product: one
// packed multiply (mul.rn, never contracted) instead of two float32 products and a second
// conversion. `w_pair` holds the two weights as they lie in memory (a's in the low half): one word
// of the loaded weight row. tools/packed_mul_check.cu compares the two over every pair of 16-bit
// inputs.
// f16_pair_times_bits: the same two products as one word of float16 codes (a's in the low half),
// not widened, for a kernel that keeps the normed key packed until it is rotated.
__device__ __forceinline__ uint32_t f16_pair_times_bits(float a, float b, uint32_t w_pair) {
  __half2 w;
  memcpy(&w, &w_pair, sizeof(w));
  __half2 const product = __hmul2_rn(__float22half2_rn(make_float2(a, b)), w);
  uint32_t bits;
  memcpy(&bits, &product, sizeof(bits));
  return bits;
}
__device__ __forceinline__ float2 f16_pair_times(float a, float b, uint32_t w_pair) {
  uint32_t const bits = f16_pair_times_bits(a, b, w_pair);
  __half2 product;
  memcpy(&product, &bits, sizeof(product));
  return __half22float2(product);
}
__device__ __forceinline__ float2 bf16_pair_times(float a, float b, uint32_t w_pair) {
  __nv_bfloat162 w;
  memcpy(&w, &w_pair, sizeof(w));
  return __bfloat1622float2(__hmul2_rn(__float22bfloat162_rn(make_float2(a, b)), w));
}
#endif

// ---- FP8: round to nearest even, saturate to the largest finite value, NaN -> 0x7F ---------------

// MANT mantissa bits, exponent bias BIAS, MAX_CODE the largest finite magnitude's code; the
// constants of the rounding below (the CPU kernel's vector form uses the same).
template <int MANT, int BIAS, uint32_t MAX_CODE> struct Fp8Format {
  static constexpr int kMant = MANT;
  static constexpr int kBias = BIAS;
  static constexpr uint32_t kMaxCode = MAX_CODE;
  static constexpr uint32_t kMantMask = (1u << MANT) - 1u;
  static constexpr uint32_t kShift = 23 - MANT;
  // MAX_CODE's value and the smallest normal, as float32 bits.
  static constexpr uint32_t kMaxBits =
      (((MAX_CODE >> MANT) - BIAS + 127u) << 23) | ((MAX_CODE & kMantMask) << kShift);
  static constexpr uint32_t kMinNormalBits = uint32_t(1 - BIAS + 127) << 23;
  // Adding 2^(23 + 1 - BIAS - MANT) to a magnitude below the smallest normal rounds it (to nearest
  // even, by the float add) to a multiple of the subnormal step 2^(1 - BIAS - MANT).
  static constexpr uint32_t kSubnormalMagicBits = uint32_t(23 + 1 - BIAS - MANT + 127) << 23;
};
using E4M3Format = Fp8Format<3, 7, 0x7eu>;
using E5M2Format = Fp8Format<2, 15, 0x7bu>;

template <typename F> DFLASH_HOST_DEVICE uint8_t float_to_fp8_bits(float f) {
  uint32_t const u = bits_of(f);
  uint32_t const sign = (u >> 24) & 0x80u;
  uint32_t const a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return kFloat8NaN;
  // Anything at or above the largest finite value (infinity included) saturates; below it,
  // rounding cannot go past it.
  if (a >= F::kMaxBits) return uint8_t(sign | F::kMaxCode);
  if (a >= F::kMinNormalBits) {
    uint32_t const r = a + ((1u << (F::kShift - 1)) - 1u) + ((a >> F::kShift) & 1u);
    uint32_t const exponent = (r >> 23) - 127u + F::kBias;
    return uint8_t(sign | (exponent << F::kMant) | ((r >> F::kShift) & F::kMantMask));
  }
  float const rounded = add_rn(float_of(a), float_of(F::kSubnormalMagicBits));
  return uint8_t(sign | (bits_of(rounded) - F::kSubnormalMagicBits));
}
DFLASH_HOST_DEVICE uint8_t float_to_e4m3_bits_software(float f) { return float_to_fp8_bits<E4M3Format>(f); }
DFLASH_HOST_DEVICE uint8_t float_to_e5m2_bits_software(float f) { return float_to_fp8_bits<E5M2Format>(f); }

#if defined(__CUDACC__)
// Two conversions per instruction, NaN codes as the hardware gives them (in the low 16 bits).
__device__ __forceinline__ uint32_t float2_to_e4m3x2_raw(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}
__device__ __forceinline__ uint32_t float2_to_e5m2x2_raw(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E5M2);
}
// Four conversions into one word (a in the low byte), NaN codes as the hardware gives them: the
// two packed conversions merged in place, where float2_to_e4m3x2_raw's 16-bit results would each be
// widened by a mask and joined by a byte permute.
#define DFLASH_FP8X4_CVT(FORMAT)                        \
  "{\n .reg .b16 low, high;\n cvt.rn.satfinite." FORMAT \
  "x2.f32 low, %2, %1;\n"                               \
  " cvt.rn.satfinite." FORMAT "x2.f32 high, %4, %3;\n mov.b32 %0, {low, high};\n}"
__device__ __forceinline__ uint32_t float4_to_e4m3x4_raw(float a, float b, float c, float d) {
  uint32_t word;
  asm(DFLASH_FP8X4_CVT("e4m3") : "=r"(word) : "f"(a), "f"(b), "f"(c), "f"(d));
  return word;
}
__device__ __forceinline__ uint32_t float4_to_e5m2x4_raw(float a, float b, float c, float d) {
  uint32_t word;
  asm(DFLASH_FP8X4_CVT("e5m2") : "=r"(word) : "f"(a), "f"(b), "f"(c), "f"(d));
  return word;
}
#undef DFLASH_FP8X4_CVT
// Any NaN code (e4m3fn: 0x7F/0xFF; e5m2: 0x7D..0x7F, 0xFD..0xFF) becomes the canonical 0x7F, in
// each of the four bytes of a word at once: with m = a byte's low 7 bits, m + 1 (e4m3fn) or m + 3
// (e5m2) reaches bit 7 exactly for the NaN codes and never carries into the next byte (m <= 0x7F).
// An e4m3fn NaN's low 7 bits are already 0x7F, so only its sign bit is cleared.
__device__ __forceinline__ uint32_t mend_e4m3_nans(uint32_t codes) {
  uint32_t const nan_bits = ((codes & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u;
  return codes & ~nan_bits;
}
__device__ __forceinline__ uint32_t mend_e5m2_nans(uint32_t codes) {
  uint32_t const nan_bits = ((codes & 0x7f7f7f7fu) + 0x03030303u) & 0x80808080u;
  return (codes & ~nan_bits) | (nan_bits - (nan_bits >> 7));  // 0x80 - 0x01 = 0x7F per NaN byte
}
__device__ __forceinline__ uint16_t float2_to_e4m3x2_bits(float lo, float hi) {
  return uint16_t(mend_e4m3_nans(float2_to_e4m3x2_raw(lo, hi)));
}
__device__ __forceinline__ uint16_t float2_to_e5m2x2_bits(float lo, float hi) {
  return uint16_t(mend_e5m2_nans(float2_to_e5m2x2_raw(lo, hi)));
}
// Four conversions into one word (a in the low byte): two packed conversions, one NaN mend.
__device__ __forceinline__ uint32_t float4_to_e4m3x4_bits(float a, float b, float c, float d) {
  return mend_e4m3_nans(float2_to_e4m3x2_raw(a, b) | float2_to_e4m3x2_raw(c, d) << 16);
}
__device__ __forceinline__ uint32_t float4_to_e5m2x4_bits(float a, float b, float c, float d) {
  return mend_e5m2_nans(float2_to_e5m2x2_raw(a, b) | float2_to_e5m2x2_raw(c, d) << 16);
}
#endif

DFLASH_HOST_DEVICE uint8_t float_to_e4m3_bits(float f) {
#if DFLASH_FP8_HARDWARE
  return uint8_t(float2_to_e4m3x2_bits(f, 0.0f));
#else
  return float_to_e4m3_bits_software(f);
#endif
}
DFLASH_HOST_DEVICE uint8_t float_to_e5m2_bits(float f) {
#if DFLASH_FP8_HARDWARE
  return uint8_t(float2_to_e5m2x2_bits(f, 0.0f));
#else
  return float_to_e5m2_bits_software(f);
#endif
}

// ---- int8: round half to even, clamp to [-127, 127], NaN -> 0 ----------------------------------------

// q = y / scale, already divided: the stored two's-complement byte. Clamped before the conversion
// (which is then exact and defined); infinities clamp, NaN stores 0.
DFLASH_HOST_DEVICE uint8_t float_to_int8_bits(float q) {
  if (!(q == q)) return 0;
  float const clamped = q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q);
#if defined(__CUDA_ARCH__)
  return uint8_t(int8_t(__float2int_rn(clamped)));
#else
  return uint8_t(int8_t(std::nearbyint(clamped)));  // the default rounding mode: nearest even
#endif
}

// ---- int4: round half to even, clamp to [-7, 7], NaN -> 0, two per byte ------------------------------

// q = y / s, already divided: the 4-bit two's-complement code in the low nibble (as int8's
// conversion, clamped to the 15 levels of SPEC.md's "int4 pools").
DFLASH_HOST_DEVICE uint8_t float_to_int4_bits(float q) {
  if (!(q == q)) return 0;
  float const clamped = q < -7.0f ? -7.0f : (q > 7.0f ? 7.0f : q);
#if defined(__CUDA_ARCH__)
  return uint8_t(__float2int_rn(clamped)) & 0x0fu;
#else
  return uint8_t(int8_t(std::nearbyint(clamped))) & 0x0fu;  // the default rounding mode: nearest even
#endif
}

// The byte of two neighbouring elements along D: element 2j (q_even) in the low nibble, 2j + 1
// (q_odd) in the high one.
DFLASH_HOST_DEVICE uint8_t pack_int4(float q_even, float q_odd) {
  return uint8_t(float_to_int4_bits(q_even) | (float_to_int4_bits(q_odd) << 4));
}

// ---- per-token-head dynamic scales (SPEC.md, "Dynamic scales") --------------------------------------

// One row's magnitude a = max_j |y_j|, folded one element at a time; `finite` turns false at the
// first non-finite element (whose row then stores a NaN scale).
struct RowMax {
  float max = 0.0f;
  bool finite = true;
  DFLASH_HOST_DEVICE void add(float y) {
    uint32_t const magnitude = bits_of(y) & 0x7fffffffu;
    finite = finite && magnitude < 0x7f800000u;  // false for inf and NaN
    float const a = float_of(magnitude);
    max = a > max ? a : max;
  }
  // Two partial maxima (of disjoint channels) into one: max is exact, so any order gives its bits.
  DFLASH_HOST_DEVICE void merge(RowMax const& o) {
    finite = finite && o.finite;
    max = o.max > max ? o.max : max;
  }
};

// The stored scale of a row: a / qmax (float32 division), the canonical NaN for a non-finite row.
DFLASH_HOST_DEVICE float dynamic_scale(RowMax const& r, float qmax) {
  if (!r.finite) return float_of(kFloat32NaN);
  return div_rn(r.max, qmax);
}

// RN(a / divisor) for a divisor whose reciprocal RN(1 / divisor) is `reciprocal` (a constant: the
// scale pools' qmax): with q0 = RN(a r), RN(q0 + (a - q0 divisor) r) is the quotient (Markstein, as
// the exact quotients below) wherever nothing underflows, which holds for every float a in
// [2^-90, max] and each of the four formats' qmax (tools/scale_check.cu, over all of them). Other
// a (zero, tiny, non-finite, negative) by the division.
DFLASH_HOST_DEVICE float quotient_by_constant(float a, float divisor, float reciprocal) {
  if (!(a >= 0x1p-90f && a <= 0x1.fffffep127f)) return div_rn(a, divisor);
  float const q0 = mul_rn(a, reciprocal);
  return fma_rn(fma_rn(-q0, divisor, a), reciprocal, q0);
}

// The scales whose rows the CUDA group kernel stores from exact quotients (exact_quotient_words);
// a NaN scale is outside.
inline constexpr float kExactQuotientsFrom = 0x1p-80f, kExactQuotientsTo = 0x1p100f;

// RN(1 / s) for s in [kExactQuotientsFrom, kExactQuotientsTo]: on the device __frcp_rn's own path
// for such s (the hardware's approximation and one correction), without its test for the other s
// (tools/scale_check.cu compares the two over every s in the range).
DFLASH_HOST_DEVICE float reciprocal_in_range(float s) {
#if defined(__CUDA_ARCH__)
  float approximate;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(approximate) : "f"(s));
  return fma_rn(fma_rn(-approximate, s, 1.0f), approximate, approximate);
#else
  return 1.0f / s;
#endif
}

// The quotient a row's element is stored as: y / s, rounded. A row whose scale is 0 (all zeros, or
// a maximum that underflows) stores zeros; a non-finite row stores NaN (int8's conversion makes it
// 0, FP8's the canonical NaN).
DFLASH_HOST_DEVICE float dynamic_quotient(float y, float s) {
  if (s == 0.0f) return 0.0f;
  return div_rn(y, s);  // s NaN: NaN
}

// ---- divided stores without their division (the CUDA kernels) ----------------------------------------
// int8 stores and every scale-pool store round q = RN(y / s), a float32 division, to the format's
// grid (SPEC.md). A correctly rounded division costs a dozen instructions per element, the
// conversion to an integer a quarter-rate one; at the pools' bandwidth that is most of the
// kernel's issue slots. So the stores take products with r, an approximate reciprocal of s, and
// prove, element by element, that the grid rounds them and q alike; where the proof fails they
// divide. r = rcp.approx(s) is within 2^-23 of 1 / s relatively wherever it is normal and finite
// (tools/rcp_bound_check.cu checks that over every float32 s), and q rounds y / s by at most
// 2^-24, so q is within y r (1 +- 0.75 * 2^-22) wherever it is normal. Two proofs:
// - the product's distance (DFLASH_BRACKETED_CODES=0): p = RN(y r) is within |p| 2^-21 of q, so
//   p rounds as q unless it lies that close to a boundary;
// - the bracket (DFLASH_BRACKETED_CODES=1): below = RN(r (1 - 2^-21)) and above = RN(r (1 + 2^-21))
//   are beyond r (1 -+ 2^-22), so y below and y above (exact, inside an FMA; or each rounded once
//   more by 2^-24 for FP8) bracket q. Rounding to the grid is monotonic, so where both ends round
//   to the same code, so does q: two products and one comparison a code. A subnormal q is within
//   2^-150 of the bracket, far from every boundary of these grids, and takes the ends' code.
// The stored bits are the division's: tests/test_int8_pool.py and tests/test_quotient_boundaries.py
// put quotients on and beside every boundary of each format, and tests/test_bracketed_codes.py
// checks the bracket's own code (host-compiled) against the division for every reciprocal the bound
// admits.
#ifndef DFLASH_BRACKETED_CODES
#define DFLASH_BRACKETED_CODES 1  // 0: the product's distance
#endif
struct Divisor {
  float scale = 1.0f;
  float reciprocal = 1.0f;  // within 2^-23 of 1 / scale (relatively) where by_product
  float below = 1.0f;       // the bracket's ends: RN(reciprocal (1 - 2^-21)), RN(reciprocal (1 + 2^-21))
  float above = 1.0f;
  bool by_product = false;  // the bound above holds: the proofs hold
};
// The bracket's ends from the reciprocal.
DFLASH_HOST_DEVICE void bracket_ends(Divisor& d) {
  d.below = mul_rn(d.reciprocal, 1.0f - 0x1p-21f);
  d.above = mul_rn(d.reciprocal, 1.0f + 0x1p-21f);
}
// A Divisor's proofs from its reciprocal: whether they hold (by_product), and the bracket's ends.
DFLASH_HOST_DEVICE void prove_reciprocal(Divisor& d) {
  // A subnormal s reads as zero (reciprocal infinite), one past 2^126 gives a zero reciprocal:
  // both are refused. The bracket's ends must be normal and finite too (every r of a normal s
  // below 2^125 has them).
  uint32_t const magnitude = bits_of(d.reciprocal) & 0x7fffffffu;
  d.by_product = magnitude >= 0x00800000u && magnitude < 0x7f800000u;
#if DFLASH_BRACKETED_CODES
  bracket_ends(d);
  d.by_product = d.by_product && (bits_of(d.below) & 0x7fffffffu) >= 0x00800000u &&
                 (bits_of(d.above) & 0x7fffffffu) < 0x7f800000u;
#endif
}
// The Divisor of s in [kExactQuotientsFrom, kExactQuotientsTo] with r = RN(1 / s): r is within
// 2^-24 of 1 / s and it and its bracket ends are normal and finite for every such s, so its proofs
// hold with no test.
DFLASH_HOST_DEVICE Divisor divisor_in_range(float s, float r) {
  Divisor d;
  d.scale = s;
  d.reciprocal = r;
  d.by_product = true;
  bracket_ends(d);
  return d;
}
// The Divisor of s with reciprocal r (tools/bracket_check.cc: every r the hardware may give).
DFLASH_HOST_DEVICE Divisor divisor_with(float s, float r) {
  Divisor d;
  d.scale = s;
  d.reciprocal = r;
  prove_reciprocal(d);
  return d;
}
#if defined(__CUDACC__)
// The Divisor of s with the hardware's reciprocal.
__device__ __forceinline__ Divisor divisor_of(float s) {
  Divisor d;
  d.scale = s;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(d.reciprocal) : "f"(s));
  prove_reciprocal(d);
  return d;
}
#endif

// Adding 1.5 * 2^23 to a float below 2^22 in magnitude rounds it to an integer, half to even (the
// sum's ulp is 1); its low bits are then the integer's two's-complement code.
inline constexpr float kIntegerMagic = 0x1.8p23f;

// The code of an integer format of levels [-QMAX, QMAX] (QMAX <= 127) for y / s by the bracket:
// each end rounded to an integer by the magic add, inside its FMA. `divide` is set where the ends
// round apart (or are NaN). Clamped after the rounding (monotonic as well; an end at or past 2^22
// still rounds to a value past QMAX). BOUNDED: y is an element of the row whose own maximum
// magnitude a gave s = RN(a / QMAX) (a dynamic scale), so |q| <= QMAX (1 + 2^-23) < QMAX + 1/2 and
// the code needs no clamp.
template <int QMAX, bool BOUNDED = false>
DFLASH_HOST_DEVICE uint32_t bracketed_integer_code(float y, Divisor const& d, bool& divide) {
  float const low = fma_rn(y, d.below, kIntegerMagic);
  float const high = fma_rn(y, d.above, kIntegerMagic);
  divide |= !(low == high);
  float code = low;
  if constexpr (!BOUNDED) code = fminf(fmaxf(low, kIntegerMagic - float(QMAX)), kIntegerMagic + float(QMAX));
  return bits_of(code);
}
// The ends of an FP8 code's bracket: y below and y above, each rounded.
DFLASH_HOST_DEVICE void fp8_bracket(float y, Divisor const& d, float& low, float& high) {
  low = mul_rn(y, d.below);
  high = mul_rn(y, d.above);
}

#if defined(__CUDACC__)
// The code of an integer format of levels [-QMAX, QMAX] (QMAX <= 127) for y / s, from the product:
// clamped, then rounded half to even by the magic add, whose low bits are then the
// two's-complement code. `divide` is set where the product may round otherwise than the
// quotient: within 2^-13 of some k + 1/2 with |k| < QMAX (for |p| < 128, |p - q| < 2^-14; past
// QMAX both saturate), or a NaN product. BOUNDED: as for bracketed_integer_code, |p| <= QMAX
// (1 + 2^-21) < QMAX + 1/2: the product rounds to at most QMAX without the clamp.
template <int QMAX, bool BOUNDED = false>
__device__ __forceinline__ uint32_t integer_code(float y, Divisor const& d, bool& divide) {
  if constexpr (DFLASH_BRACKETED_CODES) return bracketed_integer_code<QMAX, BOUNDED>(y, d, divide);
  float const p = mul_rn(y, d.reciprocal);
  float clamped = p;  // a NaN product stays NaN (max.NaN / min.NaN), so that it divides
  if constexpr (!BOUNDED) {
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(clamped) : "f"(p), "f"(-float(QMAX)));
    asm("min.NaN.f32 %0, %0, %1;" : "+f"(clamped) : "f"(float(QMAX)));
  }
  float const shifted = add_rn(clamped, kIntegerMagic);
  float const from_integer = fabsf(add_rn(clamped, -add_rn(shifted, -kIntegerMagic)));
  divide |= !(from_integer < 0.5f - 0x1p-13f);  // bitwise: no branch per element
  return bits_of(shifted);
}
#endif

// ---- fused norms --------------------------------------------------------------------------------

inline constexpr int64_t kNormChunk = 8;  // channels summed left to right before the tree

// Sum of x(j)^2 for j in [8c, min(8c + 8, D)): the chunk's squares, left to right. `x` is any
// callable giving channel j's float32 value (an array, or a decoding load from memory).
template <typename Values>
DFLASH_HOST_DEVICE float chunk_sum_squares(Values const& x, int64_t chunk, int64_t head_dim) {
  int64_t const begin = chunk * kNormChunk;
  int64_t const end = begin + kNormChunk < head_dim ? begin + kNormChunk : head_dim;
  float const first = x(begin);
  float s = mul_rn(first, first);
  for (int64_t j = begin + 1; j < end; ++j) {
    float const v = x(j);
    s = add_rn(s, mul_rn(v, v));
  }
  return s;
}

// The number of chunk sums the tree works on: ceil(D / 8) rounded up to a power of two.
DFLASH_HOST_DEVICE int64_t norm_tree_leaves(int64_t head_dim) {
  int64_t const chunks = (head_dim + kNormChunk - 1) / kNormChunk;
  int64_t leaves = 1;
  while (leaves < chunks) leaves *= 2;
  return leaves;
}

// The sum of squares of x(0 .. D) in SPEC.md's order: chunk sums s[c] (zero past the last chunk),
// then halving, s[c] += s[c + h] for h = leaves/2 .. 1. That tree is evaluated here leaf by leaf in
// bit-reversed order with a binary-counter stack (no array of chunk sums): the same additions on
// the same operands, for any D, with log2(leaves) + 1 floats of state. (The CUDA kernel's fast path
// gets the same tree from a warp butterfly.)
template <typename Values> DFLASH_HOST_DEVICE float sum_squares(Values const& x, int64_t head_dim) {
  int64_t const chunks = (head_dim + kNormChunk - 1) / kNormChunk;
  int64_t const leaves = norm_tree_leaves(head_dim);
  int levels = 0;
  while ((int64_t(1) << levels) < leaves) ++levels;
  float stack[64];
  int top = 0;
  for (int64_t k = 0; k < leaves; ++k) {
    int64_t chunk = 0;  // k bit-reversed over `levels` bits
    for (int i = 0; i < levels; ++i) chunk |= ((k >> i) & 1) << (levels - 1 - i);
    stack[top++] = chunk < chunks ? chunk_sum_squares(x, chunk, head_dim) : 0.0f;
    for (int64_t m = k + 1; (m & 1) == 0; m >>= 1) {
      float const right = stack[--top];
      float const left = stack[--top];
      stack[top++] = add_rn(left, right);
    }
  }
  return stack[0];
}

// The same sum of x[0 .. D) evaluated as SPEC.md writes it, over an array `sums` of
// norm_tree_leaves(D) floats (the CPU kernel's form; the same additions on the same operands as
// sum_squares()). Step 1, chunk_sums: sums[c] for the chunks c >= `first`, each chunk's squares
// left to right (the chunks advance together, channel by channel, so that the additions of
// different chunks are independent), zero past the last chunk. Step 2, halving_sum: the halving
// passes; the result is sums[0].
DFLASH_HOST_DEVICE void chunk_sums(float const* x, int64_t head_dim, int64_t first, float* sums) {
  int64_t const full = head_dim / kNormChunk;  // chunks of all 8 channels
  int64_t const chunks = (head_dim + kNormChunk - 1) / kNormChunk;
  for (int64_t c = first; c < full; ++c) sums[c] = mul_rn(x[c * kNormChunk], x[c * kNormChunk]);
  for (int64_t j = 1; j < kNormChunk; ++j)
    for (int64_t c = first; c < full; ++c)
      sums[c] = add_rn(sums[c], mul_rn(x[c * kNormChunk + j], x[c * kNormChunk + j]));
  if (chunks > full && full >= first) {  // the last, shorter chunk
    sums[full] = chunk_sum_squares([x](int64_t j) { return x[j]; }, full, head_dim);
  }
  for (int64_t c = chunks > first ? chunks : first; c < norm_tree_leaves(head_dim); ++c) sums[c] = 0.0f;
}
DFLASH_HOST_DEVICE float halving_sum(float* sums, int64_t leaves) {
  for (int64_t h = leaves / 2; h >= 1; h /= 2)
    for (int64_t c = 0; c < h; ++c) sums[c] = add_rn(sums[c], sums[c + h]);
  return sums[0];
}
DFLASH_HOST_DEVICE float sum_squares_array(float const* x, int64_t head_dim, float* sums) {
  chunk_sums(x, head_dim, 0, sums);
  return halving_sum(sums, norm_tree_leaves(head_dim));
}

// 1 / sqrt(sum / D + eps), each operation rounded. For D a power of two, sum / D is computed as
// sum * (1 / D): both round the same exact value, so the bits are the same, and the multiply is
// far shorter on the GPU's critical path (inverse_rms_scaled takes 1 / D precomputed).
DFLASH_HOST_DEVICE float inverse_rms_scaled(float sum, float inv_head_dim, float eps) {
  return div_rn(1.0f, sqrt_rn(add_rn(mul_rn(sum, inv_head_dim), eps)));
}
DFLASH_HOST_DEVICE float inverse_rms(float sum, int64_t head_dim, float eps) {
  if ((head_dim & (head_dim - 1)) == 0) return inverse_rms_scaled(sum, 1.0f / float(head_dim), eps);
  return div_rn(1.0f, sqrt_rn(add_rn(div_rn(sum, float(head_dim)), eps)));
}

}  // namespace dflash
