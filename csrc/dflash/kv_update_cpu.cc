#include "dflash/kv_update_cpu.h"

#include <cstdlib>
#include <cstring>
#include <vector>

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
    auto const load = [bf16](uint16_t v) { return bf16 ? bfloat16_bits_to_float(v) : float16_bits_to_float(v); };
    auto const store = [bf16](float v) { return bf16 ? float_to_bfloat16_bits(v) : float_to_float16_bits(v); };
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

float load_delta(DType dtype, void const* row, int64_t j) {
  switch (dtype) {
    case DType::kFloat16: return float16_bits_to_float(static_cast<uint16_t const*>(row)[j]);
    case DType::kBFloat16: return bfloat16_bits_to_float(static_cast<uint16_t const*>(row)[j]);
    default: return static_cast<float const*>(row)[j];
  }
}

void store_pool(DType dtype, void* row, int64_t j, float y, float inv_scale) {
  switch (dtype) {
    case DType::kFloat16: static_cast<uint16_t*>(row)[j] = float_to_float16_bits(y); return;
    case DType::kBFloat16: static_cast<uint16_t*>(row)[j] = float_to_bfloat16_bits(y); return;
    case DType::kFloat32: static_cast<uint32_t*>(row)[j] = float_to_float32_bits(y); return;
    case DType::kFloat8E4M3: static_cast<uint8_t*>(row)[j] = float_to_e4m3_bits(mul_rn(y, inv_scale)); return;
    case DType::kFloat8E5M2: static_cast<uint8_t*>(row)[j] = float_to_e5m2_bits(mul_rn(y, inv_scale)); return;
    default: return;
  }
}

// One head of one token, src -> dst: widened to fp32, RMS-normed (when `norm`; times `weight`
// when given), rotated (when cos_sin is given), stored in the pool dtype. With `copy_unrotated`
// (same dtype, no norm) the channels past R are copied bit for bit instead.
struct HeadWriter {
  KVUpdateParams const& p;
  std::vector<float> x, y;

  explicit HeadWriter(KVUpdateParams const& params)
      : p(params), x(size_t(params.head_dim)), y(size_t(params.head_dim)) {}

  void write(void const* src, void* dst, bool norm, void const* weight, float const* cos_sin,
             float inv_scale, bool copy_unrotated) {
    int64_t const head_dim = p.head_dim, rotary_dim = cos_sin != nullptr ? p.rotary_dim : 0;
    for (int64_t j = 0; j < head_dim; ++j) x[size_t(j)] = load_delta(p.delta_dtype, src, j);
    if (norm) {
      float const* values = x.data();
      float const inv_rms =
          inverse_rms(sum_squares([values](int64_t j) { return values[j]; }, head_dim), head_dim, p.norm_eps);
      for (int64_t j = 0; j < head_dim; ++j) {
        float u = round_to(p.delta_dtype, mul_rn(x[size_t(j)], inv_rms));
        if (weight != nullptr) u = round_to(p.delta_dtype, mul_rn(u, load_delta(p.delta_dtype, weight, j)));
        x[size_t(j)] = u;
      }
    }
    int64_t const half = rotary_dim / 2;
    for (int64_t i = 0; i < half; ++i) {
      float const c = cos_sin[i], s = cos_sin[half + i];
      y[size_t(i)] = rope_channel(x[size_t(i)], x[size_t(i + half)], c, s, /*first_half=*/true);
      y[size_t(i + half)] = rope_channel(x[size_t(i + half)], x[size_t(i)], c, s, /*first_half=*/false);
    }
    for (int64_t j = rotary_dim; j < head_dim; ++j) y[size_t(j)] = x[size_t(j)];
    int64_t const elem = dtype_bytes(p.pool_dtype);
    for (int64_t j = 0; j < head_dim; ++j) {
      if (copy_unrotated && j >= rotary_dim)
        std::memcpy(static_cast<char*>(dst) + j * elem, static_cast<char const*>(src) + j * elem, size_t(elem));
      else
        store_pool(p.pool_dtype, dst, j, y[size_t(j)], inv_scale);
    }
  }
};

float inverse_scale(float const* scales, KVUpdateParams const& p, int64_t layer, int64_t h) {
  return scales == nullptr ? 1.0f : div_rn(1.0f, scales[scale_index(p, layer, h)]);
}

// Writes one token: its key (rotated with cos_sin unless that is null) and value rows.
void write_token(KVUpdateParams const& p, HeadWriter& heads, int64_t layer, int64_t delta_offset,
                 PoolRows rows, float const* cos_sin) {
  int64_t const delta_elem = dtype_bytes(p.delta_dtype), pool_elem = dtype_bytes(p.pool_dtype);
  int64_t const stride = token_stride(p);
  char* const layer_pool = static_cast<char*>(p.pool) + layer * pool_layer_elems(p) * pool_elem;
  char* const k_dst = layer_pool + rows.k_row * stride * pool_elem;
  char* const v_dst = layer_pool + rows.v_row * stride * pool_elem;
  char const* const k_src = static_cast<char const*>(p.k_delta) + delta_offset * delta_elem;
  char const* const v_src = static_cast<char const*>(p.v_delta) + delta_offset * delta_elem;
  bool const same = p.delta_dtype == p.pool_dtype;
  bool const rotate = cos_sin != nullptr && p.rotary_dim > 0;
  int64_t const head_bytes = p.head_dim * delta_elem;
  void const* weight = p.k_norm ? static_cast<char const*>(p.k_norm_weight) + weight_offset(p, layer) * delta_elem
                                : nullptr;

  if (same && !p.k_norm && !rotate) {
    std::memcpy(k_dst, k_src, size_t(stride * pool_elem));
#if DFLASH_X86
  } else if (same && !p.k_norm && delta_elem == 2 && has_avx2_f16c()) {
    write_rotated_key_16bit_avx2(p, reinterpret_cast<uint16_t const*>(k_src), cos_sin,
                                 reinterpret_cast<uint16_t*>(k_dst));
#endif
  } else {
    for (int64_t h = 0; h < p.num_kv_heads; ++h)
      heads.write(k_src + h * head_bytes, k_dst + h * p.head_dim * pool_elem, p.k_norm, weight,
                  rotate ? cos_sin : nullptr, inverse_scale(p.k_scale, p, layer, h), same && !p.k_norm);
  }
  if (same && !p.v_norm) {
    std::memcpy(v_dst, v_src, size_t(stride * pool_elem));
  } else {
    for (int64_t h = 0; h < p.num_kv_heads; ++h)
      heads.write(v_src + h * head_bytes, v_dst + h * p.head_dim * pool_elem, p.v_norm, nullptr, nullptr,
                  inverse_scale(p.v_scale, p, layer, h), false);
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
      float const* cos_sin =
          pos < p.rope_seq_len && p.rotary_dim > 0 ? p.rope_cos_sin + rope_row_offset(p, layer, b, pos) : nullptr;
      write_token(p, heads, layer, delta_token_offset(p, layer, b, t), slot_rows(p, b, pos), cos_sin);
    }
  }
}

void update_paged(KVUpdateParams const& p, HeadWriter& heads, int64_t layer) {
  int32_t const page_shift = page_shift_of(p.page_size);
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    int64_t const owner = p.token_to_sequence[position_index(p, layer, t)];
    int64_t const pos = p.delta_positions[position_index(p, layer, t)];
    if (pos < 0) continue;
    int64_t page, row;
    page_and_row(p, pos, page_shift, &page, &row);
    int64_t const entry = page_table_index(p, layer, owner, pos, page);
    if (entry < 0) continue;
    PoolRows const rows = paged_rows(p, p.page_table[entry], p.page_table[entry + p.table_pages], row);
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
    if (p.contract == Contract::kSlot)
      update_slot(p, heads, layer);
    else
      update_paged(p, heads, layer);
  }
}

}  // namespace dflash
