#include "dflash/kv_update_cpu.h"

#include <cstdlib>
#include <cstring>
#include <vector>

#include "dflash/contract.h"
#include "dflash/float_bits.h"
#include "dflash/numerics.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DFLASH_X86 1
#endif

namespace dflash {
namespace {

// ---- RoPE on 16-bit storage, same dtype in and out, no norm: the common fast path ------------------
// A head's first R channels are widened to fp32, rotated, and narrowed once (round to nearest
// even). On x86 with AVX2 + F16C (chosen at run time, so the extension still loads elsewhere)
// this happens 8 channels at a time in registers.

#if DFLASH_X86
// 8 channels of 16-bit storage <-> 8 floats, rounding to nearest even (as the scalar code).
__attribute__((target("avx2,f16c"))) inline __m256 load8(uint16_t const* x, bool bf16) {
  __m128i const bits = _mm_loadu_si128(reinterpret_cast<__m128i const*>(x));
  if (!bf16) return _mm256_cvtph_ps(bits);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
__attribute__((target("avx2,f16c"))) inline void store8(uint16_t* y, __m256 v, bool bf16) {
  __m128i out;
  if (!bf16) {
    out = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
    // NaN lanes (a float16 NaN out of a float32 NaN) become the canonical float16 NaN
    // (numerics.h), as the scalar and CUDA code do: three instructions on the 16-bit lanes.
    __m128i const nan16 = _mm_cmpgt_epi16(_mm_and_si128(out, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x7c00));
    out = _mm_blendv_epi8(out, _mm_set1_epi16(short(kFloat16NaN)), nan16);
  } else {
    __m256i const u = _mm256_castps_si256(v);
    __m256i const lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i const rounded =
        _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    __m256i const magnitude = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    __m256i const is_nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
    __m256i const bits = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(kBFloat16NaN), is_nan);
    // Pack the eight 32-bit results (each < 2^16) into 16-bit lanes, in order.
    __m256i const packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
    out = _mm256_castsi256_si128(packed);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y), out);
}

// Rotate-half on 8 channel pairs in registers: rope_channel()'s operations and order, so its bits.
__attribute__((target("avx2,f16c"))) inline void rope8(__m256 x0, __m256 x1, float const* cos,
                                                       float const* sin, __m256* y0, __m256* y1) {
  __m256 const c = _mm256_loadu_ps(cos), s = _mm256_loadu_ps(sin);
  *y0 = _mm256_sub_ps(_mm256_mul_ps(x0, c), _mm256_mul_ps(x1, s));
  *y1 = _mm256_add_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x0, s));
}

// One head's rotate-half on 16-bit storage, 8 channels per step: widen, rotate and narrow in
// registers.
__attribute__((target("avx2,f16c"))) inline void rotate_half_16bit_avx2(uint16_t const* x,
                                                                        float const* cos_sin,
                                                                        int64_t rotary_dim, uint16_t* y,
                                                                        bool bf16) {
  int64_t const half = rotary_dim / 2;
  float const* cos = cos_sin;
  float const* sin = cos_sin + half;
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    __m256 y0, y1;
    rope8(load8(x + i, bf16), load8(x + i + half, bf16), cos + i, sin + i, &y0, &y1);
    store8(y + i, y0, bf16);
    store8(y + i + half, y1, bf16);
  }
  for (; i < half; ++i) {
    auto const load = [bf16](uint16_t v) {
      return bf16 ? bfloat16_bits_to_float(v) : float16_bits_to_float(v);
    };
    auto const store = [bf16](float v) {
      return bf16 ? float_to_bfloat16_bits(v) : float_to_float16_bits(v);
    };
    float const x0 = load(x[i]), x1 = load(x[i + half]);
    y[i] = store(rope_channel(x0, x1, cos[i], sin[i], /*first_half=*/true));
    y[i + half] = store(rope_channel(x1, x0, cos[i], sin[i], /*first_half=*/false));
  }
}

// One token's key row [H, D]: every head rotated, its channels past R copied. A whole row per
// call, so the per-call cost (this function cannot be inlined into code built without AVX2) is
// paid once per token, not once per head.
__attribute__((target("avx2,f16c"))) void write_rotated_key_16bit_avx2(KVUpdateParams const& p,
                                                                       uint16_t const* k,
                                                                       float const* cos_sin, uint16_t* dst) {
  bool const bf16 = p.delta_dtype == DType::kBFloat16;
  int64_t const pass = p.head_dim - p.rotary_dim;
  for (int64_t head = 0; head < p.num_kv_heads * p.head_dim; head += p.head_dim) {
    if (pass > 0) std::memcpy(dst + head + p.rotary_dim, k + head + p.rotary_dim, pass * 2);
    rotate_half_16bit_avx2(k + head, cos_sin, p.rotary_dim, dst + head, bf16);
  }
}

bool has_avx2_f16c() {
  static bool const yes = [] {
    // JAX_DFLASH_CPU_PORTABLE=1 forces the portable code (tests use it to cover that path).
    char const* portable = std::getenv("JAX_DFLASH_CPU_PORTABLE");
    if (portable != nullptr && portable[0] == '1') return false;
    __builtin_cpu_init();  // this library may be dlopen-ed before libgcc initialised the CPU model
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  }();
  return yes;
}

#endif

// ---- the general path: any dtype pair, norms, FP8 -----------------------------------------------
// A head row goes through float32 arrays in passes (widen, norm, RoPE, narrow), each a loop over
// the row with the dtype decided once per row. With AVX2 + F16C a pass's vector form does the
// row's whole 8-channel steps and returns how many channels it did; the scalar loop does the rest.
// NaN payloads inside the passes do not matter: every store writes the canonical NaN.

#if DFLASH_X86
__attribute__((target("avx2,f16c"))) int64_t widen_16bit_avx2(uint16_t const* src, float* x, int64_t n,
                                                              bool bf16) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(x + j, load8(src + j, bf16));
  return j;
}
__attribute__((target("avx2,f16c"))) int64_t narrow_16bit_avx2(float const* y, uint16_t* dst, int64_t n,
                                                               bool bf16) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) store8(dst + j, _mm256_loadu_ps(y + j), bf16);
  return j;
}
__attribute__((target("avx2,f16c"))) inline __m256i splat(uint32_t v) { return _mm256_set1_epi32(int(v)); }

// The FP8 codes (format F) of 8 quotients, in the low 8 bytes: float_to_fp8_bits (numerics.h) on 8
// lanes, the same integer steps and the same float add for subnormals, so the same bits.
template <typename F> __attribute__((target("avx2,f16c"))) inline __m128i fp8_codes8(__m256 q) {
  __m256 const magic = _mm256_castsi256_ps(splat(F::kSubnormalMagicBits));
  __m256i const u = _mm256_castps_si256(q);
  __m256i const sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), splat(0x80u));
  __m256i const a = _mm256_and_si256(u, splat(0x7fffffffu));  // >= 0: signed compares below are exact
  __m256i r = _mm256_add_epi32(a, splat((1u << (F::kShift - 1)) - 1u));
  r = _mm256_add_epi32(r, _mm256_and_si256(_mm256_srli_epi32(a, F::kShift), splat(1u)));
  // (exponent - 127 + bias) << MANT | mantissa in one subtraction: r >> kShift is the exponent
  // field above the rounded mantissa, and for a normal result that exponent is above 127 - bias.
  __m256i const normal =
      _mm256_sub_epi32(_mm256_srli_epi32(r, F::kShift), splat((127u - F::kBias) << F::kMant));
  __m256i const subnormal = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), magic)), splat(F::kSubnormalMagicBits));
  __m256i code = _mm256_blendv_epi8(subnormal, normal, _mm256_cmpgt_epi32(a, splat(F::kMinNormalBits - 1u)));
  code = _mm256_blendv_epi8(code, splat(F::kMaxCode), _mm256_cmpgt_epi32(a, splat(F::kMaxBits - 1u)));
  code = _mm256_or_si256(code, sign);
  code = _mm256_blendv_epi8(code, splat(kFloat8NaN), _mm256_cmpgt_epi32(a, splat(0x7f800000u)));
  __m128i const words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
  return _mm_packus_epi16(words, words);
}

// The integer codes of 8 quotients (int8, or int4 with qmax 7), as int32 lanes: float_to_int8_bits
// and float_to_int4_bits on 8 lanes. NaN gives 0; the clamp comes before the rounding (to nearest
// even, explicitly: the same as nearbyint under the default rounding mode).
__attribute__((target("avx2,f16c"))) inline __m256i integer_codes8(__m256 q, float qmax) {
  __m256 const clamped = _mm256_min_ps(_mm256_max_ps(q, _mm256_set1_ps(-qmax)), _mm256_set1_ps(qmax));
  __m256 const ordered = _mm256_and_ps(clamped, _mm256_cmp_ps(q, q, _CMP_ORD_Q));  // NaN: +0
  return _mm256_cvttps_epi32(_mm256_round_ps(ordered, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// The 8 int8 codes of integer_codes8's lanes, in order, in the low 8 bytes (each within +-127:
// the saturating packs keep it).
__attribute__((target("avx2,f16c"))) inline __m128i int8_bytes8(__m256i codes) {
  __m128i const words = _mm_packs_epi32(_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1));
  return _mm_packs_epi16(words, words);
}
// The 4 int4 bytes of integer_codes8's lanes (element 2j in byte j's low nibble, 2j + 1 in its
// high one), in the low 4 bytes.
__attribute__((target("avx2,f16c"))) inline uint32_t int4_bytes8(__m256i codes) {
  __m128i const words = _mm_packs_epi32(_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1));
  // 32-bit lane j of `words`: code 2j in its low half, code 2j + 1 in its high half.
  __m128i const pairs = _mm_or_si128(_mm_and_si128(words, _mm_set1_epi32(0x0f)),
                                     _mm_and_si128(_mm_srli_epi32(words, 12), _mm_set1_epi32(0xf0)));
  __m128i const halves = _mm_packus_epi32(pairs, pairs);
  return uint32_t(_mm_cvtsi128_si32(_mm_packus_epi16(halves, halves)));
}

// out[0, n) <- y times inv_scale in the FP8 format F; returns the elements done (whole 8s).
template <typename F> __attribute__((target("avx2,f16c"))) int64_t narrow_fp8_avx2(float const* y,
                                                                                   uint8_t* out, int64_t n,
                                                                                   float inv_scale) {
  __m256 const inv = _mm256_set1_ps(inv_scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + j),
                     fp8_codes8<F>(_mm256_mul_ps(_mm256_loadu_ps(y + j), inv)));
  return j;
}

// A row's RowMax over its first whole 8s (returned: the elements covered), 8 lanes at a time: the
// maximum magnitude (exact in any order) and whether every element is finite.
__attribute__((target("avx2,f16c"))) int64_t row_max_avx2(float const* y, int64_t n, RowMax* r) {
  __m256 largest = _mm256_setzero_ps();
  __m256i nonfinite = _mm256_setzero_si256();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256i const magnitude =
        _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(y + j)), splat(0x7fffffffu));
    nonfinite = _mm256_or_si256(nonfinite, _mm256_cmpgt_epi32(magnitude, splat(0x7f7fffffu)));
    largest = _mm256_max_ps(largest, _mm256_castsi256_ps(magnitude));  // NaN lanes: the row is non-finite
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, largest);
  for (float const lane : lanes) r->max = lane > r->max ? lane : r->max;
  r->finite = r->finite && _mm256_testz_si256(nonfinite, nonfinite);
  return j;
}

// out <- the codes in FORMAT (int8, or a scale-pool format) of y_j / s: an int8 pool's static
// scale, or a row's dynamic one; returns the elements done (whole 8s).
template <DType FORMAT>
__attribute__((target("avx2,f16c"))) int64_t divided_codes_avx2(float const* y, uint8_t* out, int64_t n,
                                                                float scale) {
  __m256 const s = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 const q = _mm256_div_ps(_mm256_loadu_ps(y + j), s);
    auto* const bytes8 = reinterpret_cast<__m128i*>(out + j);
    if constexpr (FORMAT == DType::kFloat8E4M3) {
      _mm_storel_epi64(bytes8, fp8_codes8<E4M3Format>(q));
    } else if constexpr (FORMAT == DType::kFloat8E5M2) {
      _mm_storel_epi64(bytes8, fp8_codes8<E5M2Format>(q));
    } else if constexpr (FORMAT == DType::kInt8) {
      _mm_storel_epi64(bytes8, int8_bytes8(integer_codes8(q, 127.0f)));
    } else {  // int4: 4 bytes of 8 elements
      uint32_t const bytes = int4_bytes8(integer_codes8(q, 7.0f));
      std::memcpy(out + j / 2, &bytes, sizeof(bytes));
    }
  }
  return j;
}
__attribute__((target("avx2,f16c"))) int64_t divided_codes_avx2(DType dtype, float const* y, uint8_t* out,
                                                                int64_t n, float scale) {
  switch (dtype) {
    case DType::kFloat8E4M3: return divided_codes_avx2<DType::kFloat8E4M3>(y, out, n, scale);
    case DType::kFloat8E5M2: return divided_codes_avx2<DType::kFloat8E5M2>(y, out, n, scale);
    case DType::kInt8: return divided_codes_avx2<DType::kInt8>(y, out, n, scale);
    case DType::kUInt8: return divided_codes_avx2<DType::kUInt8>(y, out, n, scale);
    default: return 0;
  }
}

// v rounded to the 16-bit dtype and widened again, in registers (a NaN stays a NaN; its payload
// does not matter, as every store writes the canonical NaN).
__attribute__((target("avx2,f16c"))) inline __m256 round8(__m256 v, bool bf16) {
  if (!bf16) return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  __m256i const u = _mm256_castps_si256(v);
  __m256i const lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i const up = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  __m256 const rounded = _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(int(0xffff0000u))));
  return _mm256_blendv_ps(rounded, v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));  // NaN: kept
}

// The norm's scaling of a 16-bit row: x <- round(x * inv_rms), then, with a weight,
// x <- round(x * w) (SPEC.md "Fused norms"; numerics.h's operations on 8 lanes).
__attribute__((target("avx2,f16c"))) int64_t normalize_16bit_avx2(float* x, int64_t n, float inv_rms,
                                                                  float const* w, bool bf16) {
  __m256 const inv = _mm256_set1_ps(inv_rms);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 v = round8(_mm256_mul_ps(_mm256_loadu_ps(x + j), inv), bf16);
    if (w != nullptr) v = round8(_mm256_mul_ps(v, _mm256_loadu_ps(w + j)), bf16);
    _mm256_storeu_ps(x + j, v);
  }
  return j;
}

// y <- x rotated (rotate-half over the first 2 * half channels): the pairs i < the result.
__attribute__((target("avx2,f16c"))) int64_t rotate_half_avx2(float const* x, float const* cos_sin,
                                                              int64_t half, float* y) {
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    __m256 y0, y1;
    rope8(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i + half), cos_sin + i, cos_sin + half + i, &y0, &y1);
    _mm256_storeu_ps(y + i, y0);
    _mm256_storeu_ps(y + i + half, y1);
  }
  return i;
}

// sums[c] for the chunks c < 8 * groups of a row (numerics.h chunk_sums, 8 chunks at a time): the
// squares of 8 chunks are transposed so that lane c of vector j is channel j of chunk c, and each
// lane adds its chunk's squares left to right.
__attribute__((target("avx2,f16c"))) void chunk_sums_avx2(float const* x, int64_t groups, float* sums) {
  for (int64_t g = 0; g < groups; ++g) {
    float const* const base = x + g * 8 * kNormChunk;
    __m256 r[8];
    for (int c = 0; c < 8; ++c) {
      __m256 const v = _mm256_loadu_ps(base + c * kNormChunk);
      r[c] = _mm256_mul_ps(v, v);
    }
    __m256 const t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 const t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 const t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 const t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 const u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 const u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 const u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 const u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    __m256 const column[8] = {
        _mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
        _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
        _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
        _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31),
    };
    __m256 sum = column[0];
    for (int j = 1; j < kNormChunk; ++j) sum = _mm256_add_ps(sum, column[j]);
    _mm256_storeu_ps(sums + g * 8, sum);
  }
}
#endif

// AVX2 + F16C: rows go 8 channels at a time.
bool vector_rows() {
#if DFLASH_X86
  return has_avx2_f16c();
#else
  return false;
#endif
}

// x[0, n) <- the delta row `src`, widened.
void widen_row(DType dtype, void const* src, float* x, int64_t n) {
  bool const bf16 = dtype == DType::kBFloat16;
  if (dtype == DType::kFloat32) {
    std::memcpy(x, src, size_t(n) * sizeof(float));
    return;
  }
  auto const* bits = static_cast<uint16_t const*>(src);
  int64_t j = 0;
#if DFLASH_X86
  if (vector_rows()) j = widen_16bit_avx2(bits, x, n, bf16);
#endif
  for (; j < n; ++j) x[j] = bf16 ? bfloat16_bits_to_float(bits[j]) : float16_bits_to_float(bits[j]);
}

// out[begin, end) <- y times inv_scale in the FP8 format F.
template <typename F>
void narrow_fp8(float const* y, uint8_t* out, int64_t begin, int64_t end, float inv_scale) {
  int64_t j = begin;
#if DFLASH_X86
  if (vector_rows()) j += narrow_fp8_avx2<F>(y + begin, out + begin, end - begin, inv_scale);
#endif
  for (; j < end; ++j) out[j] = float_to_fp8_bits<F>(mul_rn(y[j], inv_scale));
}

// dst[begin, end) <- y stored in the pool dtype (FP8: y times inv_scale, saturated; int8: y divided
// by it, which for a dividing format is the scale itself: see conversion_scale).
void narrow_row(DType dtype, float const* y, void* dst, int64_t begin, int64_t end, float inv_scale) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16: {
      bool const bf16 = dtype == DType::kBFloat16;
      uint16_t* const out = static_cast<uint16_t*>(dst);
      int64_t j = begin;
#if DFLASH_X86
      if (vector_rows()) j += narrow_16bit_avx2(y + begin, out + begin, end - begin, bf16);
#endif
      for (; j < end; ++j) out[j] = bf16 ? float_to_bfloat16_bits(y[j]) : float_to_float16_bits(y[j]);
      return;
    }
    case DType::kFloat32: {
      uint32_t* const out = static_cast<uint32_t*>(dst);
      for (int64_t j = begin; j < end; ++j) out[j] = float_to_float32_bits(y[j]);
      return;
    }
    case DType::kFloat8E4M3:
      return narrow_fp8<E4M3Format>(y, static_cast<uint8_t*>(dst), begin, end, inv_scale);
    case DType::kFloat8E5M2:
      return narrow_fp8<E5M2Format>(y, static_cast<uint8_t*>(dst), begin, end, inv_scale);
    case DType::kInt8: {
      uint8_t* const out = static_cast<uint8_t*>(dst);
      int64_t j = begin;
#if DFLASH_X86
      if (vector_rows())
        j += divided_codes_avx2<DType::kInt8>(y + begin, out + begin, end - begin, inv_scale);
#endif
      for (; j < end; ++j) out[j] = float_to_int8_bits(div_rn(y[j], inv_scale));
      return;
    }
    default: return;
  }
}

// dst[0, n) <- y quantized with the row's dynamic scale, which is stored at *scale (SPEC.md,
// "Dynamic scales": s = max_j |y_j| / qmax, the elements y / s in the pool's conversion).
void store_dynamic(DType dtype, float const* y, void* dst, int64_t n, float* scale) {
  RowMax r;
  int64_t first = 0;
#if DFLASH_X86
  if (vector_rows()) first = row_max_avx2(y, n, &r);
#endif
  for (int64_t j = first; j < n; ++j) r.add(y[j]);
  float const s = dynamic_scale(r, pool_format(dtype)->max_finite);
  *scale = s;
  uint8_t* const out = static_cast<uint8_t*>(dst);
  int64_t j = 0;
#if DFLASH_X86
  if (vector_rows() && s != 0.0f) j = divided_codes_avx2(dtype, y, out, n, s);  // s == 0: the zeros below
#endif
  switch (dtype) {
    case DType::kFloat8E4M3:
      for (; j < n; ++j) out[j] = float_to_fp8_bits<E4M3Format>(dynamic_quotient(y[j], s));
      return;
    case DType::kFloat8E5M2:
      for (; j < n; ++j) out[j] = float_to_fp8_bits<E5M2Format>(dynamic_quotient(y[j], s));
      return;
    case DType::kInt8:
      for (; j < n; ++j) out[j] = float_to_int8_bits(dynamic_quotient(y[j], s));
      return;
    case DType::kUInt8:  // int4: n is even (the checker's rule), byte j holds elements 2j, 2j + 1
      for (; j + 1 < n; j += 2)
        out[j / 2] = pack_int4(dynamic_quotient(y[j], s), dynamic_quotient(y[j + 1], s));
      return;
    default: return;
  }
}

// One head of one token, src -> dst: widened to fp32, RMS-normed (when `norm`; times the k-norm
// weight when given), rotated (when cos_sin is given), stored in the pool dtype. With
// `copy_unrotated` (same dtype, no norm) the channels past R are copied bit for bit instead. With
// `scale` (a scale pool's entry) the row is stored with its dynamic scale, written there.
struct HeadWriter {
  KVUpdateParams const& p;
  std::vector<float> x, y, w, sums;
  void const* w_row = nullptr;  // the delta-dtype weight row `w` holds, widened

  explicit HeadWriter(KVUpdateParams const& params)
      : p(params),
        x(size_t(params.head_dim)),
        y(size_t(params.head_dim)),
        w(size_t(params.head_dim)),
        sums(size_t(norm_tree_leaves(params.head_dim))) {}

  // xs <- round(xs * inv_rms), then round(xs * ws) with a weight, in the delta dtype.
  void normalize(float* xs, float inv_rms, float const* ws) {
    int64_t const n = p.head_dim;
    int64_t j = 0;
#if DFLASH_X86
    if (vector_rows() && p.delta_dtype != DType::kFloat32)
      j = normalize_16bit_avx2(xs, n, inv_rms, ws, p.delta_dtype == DType::kBFloat16);
#endif
    for (; j < n; ++j) {
      xs[j] = round_to(p.delta_dtype, mul_rn(xs[j], inv_rms));
      if (ws != nullptr) xs[j] = round_to(p.delta_dtype, mul_rn(xs[j], ws[j]));
    }
  }

  // x[0, D)'s sum of squares in SPEC.md's order.
  float sum_of_squares(float const* xs) {
    int64_t first = 0;
#if DFLASH_X86
    if (vector_rows()) {
      int64_t const groups = p.head_dim / (8 * kNormChunk);
      chunk_sums_avx2(xs, groups, sums.data());
      first = groups * 8;
    }
#endif
    chunk_sums(xs, p.head_dim, first, sums.data());
    return halving_sum(sums.data(), norm_tree_leaves(p.head_dim));
  }

  void write(void const* src, void* dst, bool norm, void const* weight, float const* cos_sin, float inv_scale,
             bool copy_unrotated, float* scale = nullptr) {
    int64_t const head_dim = p.head_dim, rotary_dim = cos_sin != nullptr ? p.rotary_dim : 0;
    float* const xs = x.data();
    float* const ys = y.data();
    widen_row(p.delta_dtype, src, xs, head_dim);
    if (norm) {
      float const inv_rms = inverse_rms(sum_of_squares(xs), head_dim, p.norm_eps);
      float const* ws = nullptr;
      if (weight != nullptr) {
        if (weight != w_row) widen_row(p.delta_dtype, weight, w.data(), head_dim), w_row = weight;
        ws = w.data();
      }
      normalize(xs, inv_rms, ws);
    }
    int64_t const half = rotary_dim / 2;
    int64_t i = 0;
#if DFLASH_X86
    if (vector_rows()) i = rotate_half_avx2(xs, cos_sin, half, ys);
#endif
    for (; i < half; ++i) {
      float const c = cos_sin[i], s = cos_sin[half + i];
      ys[i] = rope_channel(xs[i], xs[i + half], c, s, /*first_half=*/true);
      ys[i + half] = rope_channel(xs[i + half], xs[i], c, s, /*first_half=*/false);
    }
    if (scale != nullptr) {  // a scaled pool: never a copy (its dtype is no delta dtype)
      for (int64_t j = rotary_dim; j < head_dim; ++j) ys[j] = xs[j];
      store_dynamic(p.pool_dtype, ys, dst, head_dim, scale);
    } else if (copy_unrotated) {
      narrow_row(p.pool_dtype, ys, dst, 0, rotary_dim, inv_scale);
      int64_t const elem = dtype_bytes(p.pool_dtype);
      std::memcpy(static_cast<char*>(dst) + rotary_dim * elem,
                  static_cast<char const*>(src) + rotary_dim * elem, size_t((head_dim - rotary_dim) * elem));
    } else {
      for (int64_t j = rotary_dim; j < head_dim; ++j) ys[j] = xs[j];
      narrow_row(p.pool_dtype, ys, dst, 0, head_dim, inv_scale);
    }
  }
};

// What a scaled store is given: the scale's reciprocal, or the scale itself for a format that
// divides by it (contract.h's Conversion).
float conversion_scale(float const* scales, KVUpdateParams const& p, int64_t layer, int64_t h) {
  if (scales == nullptr) return 1.0f;
  float const scale = scales[scale_index(p, layer, h)];
  return divides_by_scale(p.pool_dtype) ? scale : div_rn(1.0f, scale);
}

// The scale pool's entry of head h of pool row `row` (kv_update.h's address); null without one.
float* row_scale(KVUpdateParams const& p, int64_t layer, int64_t row, int64_t h) {
  if (p.scale_pool == nullptr) return nullptr;
  return p.scale_pool + scale_pool_index(p, layer, row, h);
}

// Writes one token: its key (rotated with cos_sin unless that is null) and value rows.
void write_token(KVUpdateParams const& p, HeadWriter& heads, int64_t layer, int64_t delta_offset,
                 PoolRows rows, float const* cos_sin) {
  int64_t const delta_elem = dtype_bytes(p.delta_dtype), pool_elem = dtype_bytes(p.pool_dtype);
  int64_t const stride = token_stride(p);
  char* const pool = static_cast<char*>(p.pool);
  char* const k_dst = pool + pool_byte_offset(p, layer, rows.k_row, 0);
  char* const v_dst = pool + pool_byte_offset(p, layer, rows.v_row, 0);
  char const* const k_src = static_cast<char const*>(p.k_delta) + delta_offset * delta_elem;
  char const* const v_src = static_cast<char const*>(p.v_delta) + delta_offset * delta_elem;
  bool const same = p.delta_dtype == p.pool_dtype;
  bool const rotate = cos_sin != nullptr && p.rotary_dim > 0;
  int64_t const head_bytes = p.head_dim * delta_elem;
  void const* weight =
      p.k_norm ? static_cast<char const*>(p.k_norm_weight) + weight_offset(p, layer) * delta_elem : nullptr;

  if (same && !p.k_norm && !rotate) {
    std::memcpy(k_dst, k_src, size_t(stride * pool_elem));
#if DFLASH_X86
  } else if (same && !p.k_norm && delta_elem == 2 && has_avx2_f16c()) {
    write_rotated_key_16bit_avx2(p, reinterpret_cast<uint16_t const*>(k_src), cos_sin,
                                 reinterpret_cast<uint16_t*>(k_dst));
#endif
  } else {
    for (int64_t h = 0; h < p.num_kv_heads; ++h)
      heads.write(k_src + h * head_bytes, pool + pool_byte_offset(p, layer, rows.k_row, h), p.k_norm, weight,
                  rotate ? cos_sin : nullptr, conversion_scale(p.k_scale, p, layer, h), same && !p.k_norm,
                  row_scale(p, layer, rows.k_row, h));
  }
  if (same && !p.v_norm) {
    std::memcpy(v_dst, v_src, size_t(stride * pool_elem));
  } else {
    for (int64_t h = 0; h < p.num_kv_heads; ++h)
      heads.write(v_src + h * head_bytes, pool + pool_byte_offset(p, layer, rows.v_row, h), p.v_norm, nullptr,
                  nullptr, conversion_scale(p.v_scale, p, layer, h), false,
                  row_scale(p, layer, rows.v_row, h));
  }
}

// XLA's CPU runtime runs with flush-to-zero and denormals-are-zero set in MXCSR; the contract
// keeps subnormals, so the kernel runs with both cleared and restores the caller's state.
class IeeeSubnormals {
 public:
#if DFLASH_X86
  // MXCSR is written only when a flush bit is set (a write is slow; outside XLA neither is).
  IeeeSubnormals() : saved_(_mm_getcsr()) {
    if (saved_ & kFlushBits) _mm_setcsr(saved_ & ~kFlushBits);
  }
  ~IeeeSubnormals() {
    if (saved_ & kFlushBits) _mm_setcsr(saved_);
  }

 private:
  static constexpr unsigned kFlushBits = 0x8040u;  // FTZ (bit 15) | DAZ (bit 6)
  unsigned saved_;
#elif defined(__aarch64__)
  IeeeSubnormals() {
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved_));
    uint64_t const cleared = saved_ & ~(uint64_t(1) << 24);  // FZ
    __asm__ __volatile__("msr fpcr, %0" : : "r"(cleared));
  }
  ~IeeeSubnormals() { __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_)); }

 private:
  uint64_t saved_;
#endif
};

void update_slot(KVUpdateParams const& p, HeadWriter& heads, int64_t layer) {
  int64_t const capacity = slot_capacity(p);
  for (int64_t b = 0; b < p.batch; ++b) {
    int64_t const start = p.delta_start_positions[position_index(p, layer, b)];
    int64_t const length = p.delta_lengths[position_index(p, layer, b)];
    for (int64_t t = 0; t < p.delta_len; ++t) {
      int64_t const pos = written_position(start, length, t, capacity);
      if (pos < 0) continue;
      float const* cos_sin = pos < p.rope_seq_len && p.rotary_dim > 0
                                 ? p.rope_cos_sin + rope_row_offset(p, layer, b, pos)
                                 : nullptr;
      write_token(p, heads, layer, delta_token_offset(p, layer, b, t), slot_rows(p, b, pos), cos_sin);
    }
  }
}

void update_paged(KVUpdateParams const& p, HeadWriter& heads, int64_t layer) {
  PagedAddressing const addressing = paged_addressing(p, layer);  // bit 0 is this layer's ring
  bool const ring = layer_ring(addressing, 0);
  int32_t const* const table = p.page_table + layer * addressing.table_layer;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    int32_t const owner = p.token_to_sequence[position_index(p, layer, t)];
    int32_t const pos = p.delta_positions[position_index(p, layer, t)];
    uint32_t row;
    int64_t const entry = page_table_entry(addressing, ring, owner, pos, &row);
    if (entry < 0) continue;
    PoolRows const rows = paged_rows(addressing, table[entry], table[entry + p.table_pages], row);
    if (rows.k_row < 0) continue;
    float const* cos_sin = p.rotary_dim > 0 ? p.rope_cos_sin + rope_row_offset(p, layer, 0, t) : nullptr;
    write_token(p, heads, layer, delta_token_offset(p, layer, 0, t), rows, cos_sin);
  }
}

// Tokens in order, so that of two tokens with one slot the later one's rows are stored.
void update_mapped(KVUpdateParams const& p, HeadWriter& heads, int64_t layer) {
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    PoolRows const rows = mapped_rows(p, mapped_slot(p, position_index(p, layer, t)));
    if (rows.k_row < 0) continue;
    float const* cos_sin = p.rotary_dim > 0 ? p.rope_cos_sin + rope_row_offset(p, layer, 0, t) : nullptr;
    write_token(p, heads, layer, delta_token_offset(p, layer, 0, t), rows, cos_sin);
  }
}

}  // namespace

void target_kv_cache_update_cpu(KVUpdateParams const& p) {
  if (p.num_kv_heads * p.head_dim == 0) return;
  IeeeSubnormals const keep_subnormals;
  HeadWriter heads(p);
  for (int64_t layer = 0; layer < p.num_layers; ++layer) {
    switch (p.contract) {
      case Contract::kSlot: update_slot(p, heads, layer); break;
      case Contract::kPaged: update_paged(p, heads, layer); break;
      case Contract::kSlotMapping: update_mapped(p, heads, layer); break;
    }
  }
}

}  // namespace dflash
