#include "dflash/kv_update_cpu.h"

#include <cstdlib>
#include <cstring>
#include <vector>

#include "dflash/float_bits.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DFLASH_X86 1
#endif

namespace dflash {
namespace {

// ---- RoPE on 16-bit storage ---------------------------------------------------------------------
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
  } else {
    __m256i const u = _mm256_castps_si256(v);
    __m256i const lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i const rounded =
        _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    __m256i const magnitude = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    __m256i const is_nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
    __m256i const quiet_nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256i const bits = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
    // Pack the eight 32-bit results (each < 2^16) into 16-bit lanes, in order.
    __m256i const packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
    out = _mm256_castsi256_si128(packed);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y), out);
}

// One head's rotate-half on 16-bit storage, 8 channels per step: widen, rotate and narrow in
// registers. Same operations and order as rope_channel(), so the same bits.
__attribute__((target("avx2,f16c"))) inline void rotate_half_16bit_avx2(uint16_t const* x,
                                                                          float const* cos_sin,
                                                                          int64_t rotary_dim,
                                                                          uint16_t* y, bool bf16) {
  int64_t const half = rotary_dim / 2;
  float const* cos = cos_sin;
  float const* sin = cos_sin + half;
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    __m256 const x0 = load8(x + i, bf16);
    __m256 const x1 = load8(x + i + half, bf16);
    __m256 const c = _mm256_loadu_ps(cos + i);
    __m256 const s = _mm256_loadu_ps(sin + i);
    store8(y + i, _mm256_sub_ps(_mm256_mul_ps(x0, c), _mm256_mul_ps(x1, s)), bf16);
    store8(y + i + half, _mm256_add_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x0, s)), bf16);
  }
  for (; i < half; ++i) {
    auto const load = [bf16](uint16_t v) { return bf16 ? bfloat16_to_float(v) : float16_to_float(v); };
    auto const store = [bf16](float v) { return bf16 ? float_to_bfloat16(v) : float_to_float16(v); };
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
                                                                         float const* cos_sin,
                                                                         uint16_t* dst) {
  bool const bf16 = p.dtype == DType::kBFloat16;
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

// Portable fallbacks (no AVX2/F16C, or not x86).
void widen(uint16_t const* x, float* y, int64_t n, DType dtype) {
  for (int64_t i = 0; i < n; ++i)
    y[i] = dtype == DType::kBFloat16 ? bfloat16_to_float(x[i]) : float16_to_float(x[i]);
}

void narrow(float const* x, uint16_t* y, int64_t n, DType dtype) {
  for (int64_t i = 0; i < n; ++i)
    y[i] = dtype == DType::kBFloat16 ? float_to_bfloat16(x[i]) : float_to_float16(x[i]);
}

// Rotate-half RoPE of one head's first R channels, in fp32 (x and y may not alias).
void rotate_half(float const* x, float const* cos_sin, int64_t rotary_dim, float* y) {
  int64_t const half = rotary_dim / 2;
  float const* cos = cos_sin;
  float const* sin = cos_sin + half;
  for (int64_t i = 0; i < half; ++i)
    y[i] = rope_channel(x[i], x[i + half], cos[i], sin[i], /*first_half=*/true);
  for (int64_t i = 0; i < half; ++i)
    y[i + half] = rope_channel(x[i + half], x[i], cos[i], sin[i], /*first_half=*/false);
}

// Writes one token's rotated key row [H, D] into dst (pass-through past R).
void write_rotated_key(KVUpdateParams const& p, void const* k, float const* cos_sin, void* dst,
                       std::vector<float>& scratch) {
#if DFLASH_X86
  if (p.dtype != DType::kFloat32 && has_avx2_f16c()) {
    write_rotated_key_16bit_avx2(p, static_cast<uint16_t const*>(k), cos_sin,
                                 static_cast<uint16_t*>(dst));
    return;
  }
#endif
  int64_t const head_dim = p.head_dim, rotary_dim = p.rotary_dim;
  int64_t const elem = dtype_bytes(p.dtype);
  scratch.resize(2 * rotary_dim);
  float* x = scratch.data();
  float* y = x + rotary_dim;
  for (int64_t h = 0; h < p.num_kv_heads; ++h) {
    int64_t const head = h * head_dim;
    std::memcpy(static_cast<char*>(dst) + (head + rotary_dim) * elem,
                static_cast<char const*>(k) + (head + rotary_dim) * elem,
                (head_dim - rotary_dim) * elem);
    if (p.dtype == DType::kFloat32) {
      rotate_half(static_cast<float const*>(k) + head, cos_sin, rotary_dim,
                  static_cast<float*>(dst) + head);
      continue;
    }
    uint16_t const* x_bits = static_cast<uint16_t const*>(k) + head;
    uint16_t* y_bits = static_cast<uint16_t*>(dst) + head;
    widen(x_bits, x, rotary_dim, p.dtype);
    rotate_half(x, cos_sin, rotary_dim, y);
    narrow(y, y_bits, rotary_dim, p.dtype);
  }
}

}  // namespace

void target_kv_cache_update_cpu(KVUpdateParams const& p) {
  int64_t const capacity = slot_capacity(p);
  int64_t const elem = dtype_bytes(p.dtype);
  int64_t const row_bytes = token_stride(p) * elem;
  std::vector<float> scratch;
  for (int64_t layer = 0; layer < p.num_layers; ++layer) {
    char* const k_plane = static_cast<char*>(p.pool) + layer * pool_layer_elems(p) * elem;
    char* const v_plane = k_plane + pool_plane_elems(p) * elem;
    for (int64_t b = 0; b < p.batch; ++b) {
      int64_t const start = p.delta_start_positions[position_index(p, layer, b)];
      int64_t const length = p.delta_lengths[position_index(p, layer, b)];
      for (int64_t t = 0; t < p.delta_len; ++t) {
        int64_t const pos = written_position(start, length, t, capacity);
        if (pos < 0) continue;
        int64_t const src = delta_token_offset(p, layer, b, t) * elem;
        int64_t const dst = pool_token_offset(p, b, pos) * elem;
        void const* k = static_cast<char const*>(p.k_delta) + src;
        if (pos < p.rope_seq_len && p.rotary_dim > 0) {
          write_rotated_key(p, k, p.rope_cos_sin + rope_row_offset(p, layer, b, pos),
                            k_plane + dst, scratch);
        } else {
          std::memcpy(k_plane + dst, k, row_bytes);  // past the rope table: pass-through
        }
        std::memcpy(v_plane + dst, static_cast<char const*>(p.v_delta) + src, row_bytes);
      }
    }
  }
}

}  // namespace dflash
