#include "dflash/kv_update_cpu.h"

#include <cstring>
#include <vector>

#include "dflash/float_bits.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DFLASH_X86 1
#endif

namespace dflash {
namespace {

// ---- bulk conversions between the storage types and fp32 --------------------------------------
// A row of D channels is widened to fp32, rotated, and narrowed once (round to nearest even).

#if DFLASH_X86
// F16C converts 8 halves per instruction and rounds exactly like the scalar code; it is chosen at
// run time, so the extension still loads on x86 CPUs without it.
__attribute__((target("avx,f16c"))) void float16_to_float_f16c(uint16_t const* x, float* y,
                                                                 int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(x + i))));
  for (; i < n; ++i) y[i] = float16_to_float(x[i]);
}
__attribute__((target("avx,f16c"))) void float_to_float16_f16c(float const* x, uint16_t* y,
                                                                 int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) y[i] = float_to_float16(x[i]);
}
bool has_f16c() {
  static bool const yes = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  return yes;
}
#endif

void widen(uint16_t const* x, float* y, int64_t n, DType dtype) {
  if (dtype == DType::kBFloat16) {
    for (int64_t i = 0; i < n; ++i) y[i] = bfloat16_to_float(x[i]);
    return;
  }
#if DFLASH_X86
  if (has_f16c()) return float16_to_float_f16c(x, y, n);
#endif
  for (int64_t i = 0; i < n; ++i) y[i] = float16_to_float(x[i]);
}

void narrow(float const* x, uint16_t* y, int64_t n, DType dtype) {
  if (dtype == DType::kBFloat16) {
    for (int64_t i = 0; i < n; ++i) y[i] = float_to_bfloat16(x[i]);
    return;
  }
#if DFLASH_X86
  if (has_f16c()) return float_to_float16_f16c(x, y, n);
#endif
  for (int64_t i = 0; i < n; ++i) y[i] = float_to_float16(x[i]);
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
  int64_t const head_dim = p.head_dim, rotary_dim = p.rotary_dim;
  int64_t const elem = dtype_bytes(p.dtype);
  std::memcpy(dst, k, token_stride(p) * elem);  // channels past R, and the layout
  scratch.resize(2 * rotary_dim);
  float* x = scratch.data();
  float* y = x + rotary_dim;
  for (int64_t h = 0; h < p.num_kv_heads; ++h) {
    int64_t const head = h * head_dim;
    if (p.dtype == DType::kFloat32) {
      rotate_half(static_cast<float const*>(k) + head, cos_sin, rotary_dim,
                  static_cast<float*>(dst) + head);
      continue;
    }
    widen(static_cast<uint16_t const*>(k) + head, x, rotary_dim, p.dtype);
    rotate_half(x, cos_sin, rotary_dim, y);
    narrow(y, static_cast<uint16_t*>(dst) + head, rotary_dim, p.dtype);
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
