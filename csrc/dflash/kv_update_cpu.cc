#include "dflash/kv_update_cpu.h"

#include <cstring>

#include "dflash/float_bits.h"

namespace dflash {
namespace {

// Storage type <-> fp32 for the three pool dtypes.
struct Float32Elem {
  using Bits = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
};
struct Float16Elem {
  using Bits = uint16_t;
  static float load(uint16_t v) { return float16_to_float(v); }
  static uint16_t store(float v) { return float_to_float16(v); }
};
struct BFloat16Elem {
  using Bits = uint16_t;
  static float load(uint16_t v) { return bfloat16_to_float(v); }
  static uint16_t store(float v) { return float_to_bfloat16(v); }
};

// y = RoPE(x) on the first R channels, y = x elsewhere (one head row of D channels).
template <typename Elem>
void rotate_key_row(typename Elem::Bits const* x, float const* cos_sin, int64_t rotary_dim,
                    int64_t head_dim, typename Elem::Bits* y) {
  int64_t const half = rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    float const x0 = Elem::load(x[i]);
    float const x1 = Elem::load(x[i + half]);
    float const c = cos_sin[i];
    float const s = cos_sin[half + i];
    y[i] = Elem::store(rope_channel(x0, x1, c, s, /*first_half=*/true));
    y[i + half] = Elem::store(rope_channel(x1, x0, c, s, /*first_half=*/false));
  }
  std::memcpy(y + rotary_dim, x + rotary_dim, sizeof(*x) * (head_dim - rotary_dim));
}

template <typename Elem>
void update(KVUpdateParams const& p) {
  using Bits = typename Elem::Bits;
  int64_t const capacity = slot_capacity(p);
  int64_t const row = token_stride(p);
  int64_t const row_bytes = row * int64_t(sizeof(Bits));
  for (int64_t layer = 0; layer < p.num_layers; ++layer) {
    Bits* const k_plane = static_cast<Bits*>(p.pool) + layer * pool_layer_elems(p);
    Bits* const v_plane = k_plane + pool_plane_elems(p);
    for (int64_t b = 0; b < p.batch; ++b) {
      int64_t const start = p.delta_start_positions[position_index(p, layer, b)];
      int64_t const length = p.delta_lengths[position_index(p, layer, b)];
      for (int64_t t = 0; t < p.delta_len; ++t) {
        int64_t const pos = written_position(start, length, t, capacity);
        if (pos < 0) continue;
        int64_t const src = delta_token_offset(p, layer, b, t);
        int64_t const dst = pool_token_offset(p, b, pos);
        Bits const* k = static_cast<Bits const*>(p.k_delta) + src;
        Bits const* v = static_cast<Bits const*>(p.v_delta) + src;
        if (pos < p.rope_seq_len && p.rotary_dim > 0) {
          float const* cos_sin = p.rope_cos_sin + rope_row_offset(p, layer, b, pos);
          for (int64_t h = 0; h < p.num_kv_heads; ++h) {
            int64_t const head = h * p.head_dim;
            rotate_key_row<Elem>(k + head, cos_sin, p.rotary_dim, p.head_dim,
                                 k_plane + dst + head);
          }
        } else {
          std::memcpy(k_plane + dst, k, row_bytes);  // past the rope table: pass-through
        }
        std::memcpy(v_plane + dst, v, row_bytes);
      }
    }
  }
}

}  // namespace

void target_kv_cache_update_cpu(KVUpdateParams const& p) {
  switch (p.dtype) {
    case DType::kFloat16: return update<Float16Elem>(p);
    case DType::kBFloat16: return update<BFloat16Elem>(p);
    case DType::kFloat32: return update<Float32Elem>(p);
  }
}

}  // namespace dflash
