// The DFlash target KV-cache update: parameters, layout math, RoPE step and guards.
//
// This header is the one place that says where token t of sequence b lands in the paged pool
// and what is written there (docs/SPEC.md, mirrored in jax_dflash/reference.py). The CPU
// implementation, the CUDA kernel, the XLA FFI handlers and the TensorRT plugin all include it.
#pragma once

#include <cstdint>
#include <string>

#if defined(__CUDACC__)
#define DFLASH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define DFLASH_HOST_DEVICE inline
#endif

namespace dflash {

enum class DType : int32_t { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

inline int64_t dtype_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

inline char const* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
  }
  return "unknown";
}

// Everything one launch needs. Shapes (without the optional leading layer axis):
//   k_delta, v_delta        [B, L, H, D]            dtype
//   pool                    [2, numPages, P, H, D]  dtype, updated in place
//   rope_cos_sin            [Rb, S, R]              fp32 (Rb is 1 or B)
//   delta_start_positions   [B]                     int32
//   delta_lengths           [B]                     int32
// With num_layers > 1, k/v/pool carry a leading layer axis; rope and positions carry one only
// when rope_per_layer / positions_per_layer say so (otherwise they are shared by every layer).
struct KVUpdateParams {
  void const* k_delta = nullptr;
  void const* v_delta = nullptr;
  void* pool = nullptr;
  float const* rope_cos_sin = nullptr;
  int32_t const* delta_start_positions = nullptr;
  int32_t const* delta_lengths = nullptr;

  DType dtype = DType::kFloat16;
  int64_t num_layers = 1;
  int64_t batch = 0;          // B
  int64_t delta_len = 0;      // L
  int64_t num_kv_heads = 0;   // H
  int64_t head_dim = 0;       // D
  int64_t num_pages = 0;      // pool dim 1
  int64_t page_size = 0;      // P, tokens per page
  int64_t pages_per_slot = 0;
  int64_t rotary_dim = 0;     // R
  int64_t rope_batch = 1;     // Rb
  int64_t rope_seq_len = 0;   // S
  bool rope_per_layer = false;
  bool positions_per_layer = false;
};

DFLASH_HOST_DEVICE int64_t max_batch(KVUpdateParams const& p) {
  return p.num_pages / p.pages_per_slot;
}
DFLASH_HOST_DEVICE int64_t slot_capacity(KVUpdateParams const& p) {
  return p.pages_per_slot * p.page_size;
}

// ---- layout math: slot -> page -> row --------------------------------------------------------

// Elements between consecutive tokens (rows) of one pool plane, and of one delta.
DFLASH_HOST_DEVICE int64_t token_stride(KVUpdateParams const& p) {
  return p.num_kv_heads * p.head_dim;
}
// Elements in one plane (K or V) of one layer's pool.
DFLASH_HOST_DEVICE int64_t pool_plane_elems(KVUpdateParams const& p) {
  return p.num_pages * p.page_size * token_stride(p);
}
DFLASH_HOST_DEVICE int64_t pool_layer_elems(KVUpdateParams const& p) {
  return 2 * pool_plane_elems(p);
}
DFLASH_HOST_DEVICE int64_t delta_layer_elems(KVUpdateParams const& p) {
  return p.batch * p.delta_len * token_stride(p);
}

// Offset (elements) of pool[0, page, row, 0, 0] within one layer's pool, for the token at
// position `pos` of slot `slot`: page = slot * pages_per_slot + pos / P, row = pos % P. Slot b
// owns pages [b * pages_per_slot, (b + 1) * pages_per_slot), so page * P + row is simply
// slot * cap + pos (the pool is [2, maxBatch, cap, H, D] in memory): no division on the hot path.
// Only valid when written_position() said yes.
DFLASH_HOST_DEVICE int64_t pool_token_offset(KVUpdateParams const& p, int64_t slot, int64_t pos) {
  return (slot * slot_capacity(p) + pos) * token_stride(p);
}

// Offset (elements) of k_delta[layer, b, t, 0, 0].
DFLASH_HOST_DEVICE int64_t delta_token_offset(KVUpdateParams const& p, int64_t layer, int64_t b,
                                              int64_t t) {
  return ((layer * p.batch + b) * p.delta_len + t) * token_stride(p);
}

// Index into delta_start_positions / delta_lengths.
DFLASH_HOST_DEVICE int64_t position_index(KVUpdateParams const& p, int64_t layer, int64_t b) {
  return (p.positions_per_layer ? layer * p.batch : 0) + b;
}

// ---- guards -----------------------------------------------------------------------------------

// The position token t of a sequence lands at, or -1 when nothing is written for it: padding
// (t >= length, negative lengths included), dropped (pos >= slot capacity) or a negative position.
// Arithmetic is 64-bit so that no int32 start can wrap around into the slot.
DFLASH_HOST_DEVICE int64_t written_position(int64_t start, int64_t length, int64_t t,
                                            int64_t capacity) {
  if (t >= length) return -1;
  int64_t const pos = start + t;
  if (pos < 0 || pos >= capacity) return -1;
  return pos;
}

// ---- RoPE -------------------------------------------------------------------------------------

// Offset (floats) of cos_sin[layer?, rb, pos, 0]. rb is 0 when the table is shared by the batch.
DFLASH_HOST_DEVICE int64_t rope_row_offset(KVUpdateParams const& p, int64_t layer, int64_t b,
                                           int64_t pos) {
  int64_t const rb = p.rope_batch == 1 ? 0 : b;
  int64_t const rl = p.rope_per_layer ? layer : 0;
  return ((rl * p.rope_batch + rb) * p.rope_seq_len + pos) * p.rotary_dim;
}

// Products and sums rounded separately (never fused into an FMA), so that the CPU, the GPU and
// the NumPy reference produce the same bits.
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

// Rotate-half RoPE for one channel j < R of a key:
//   j <  R/2: y[j] = x[j] * c - x[j + R/2] * s
//   j >= R/2: y[j] = x[j] * c + x[j - R/2] * s
// with c = cos_sin[.., j mod R/2] and s = cos_sin[.., R/2 + j mod R/2]; `partner` is the other
// channel of the pair.
DFLASH_HOST_DEVICE float rope_channel(float x, float partner, float c, float s, bool first_half) {
  float const rotated = mul_rn(partner, s);
  return add_rn(mul_rn(x, c), first_half ? -rotated : rotated);
}

// ---- validation (shared by both runtimes) -----------------------------------------------------

// Empty when the parameters describe a valid update, else what was expected and what was given.
inline std::string check_params(KVUpdateParams const& p) {
  auto str = [](int64_t v) { return std::to_string(v); };
  if (p.num_layers < 1) return "num_layers must be >= 1, got " + str(p.num_layers);
  if (p.batch < 0 || p.delta_len < 0 || p.num_kv_heads < 0 || p.head_dim < 0)
    return "k_delta dimensions must be non-negative";
  if (p.page_size <= 0) return "past_key_value page size (dim 2) must be > 0, got " + str(p.page_size);
  if (p.pages_per_slot <= 0) return "pages_per_slot must be > 0, got " + str(p.pages_per_slot);
  if (p.num_pages % p.pages_per_slot != 0)
    return "past_key_value numPages (dim 1) must be divisible by pages_per_slot=" +
           str(p.pages_per_slot) + ", got numPages=" + str(p.num_pages);
  if (p.batch > max_batch(p))
    return "k_delta batch B must be <= the pool's slots numPages/pages_per_slot=" +
           str(max_batch(p)) + ", got B=" + str(p.batch);
  if (p.rotary_dim < 0 || p.rotary_dim % 2 != 0 || p.rotary_dim > p.head_dim)
    return "rope_cos_sin rotary dim R must be even and <= head dim D=" + str(p.head_dim) +
           ", got R=" + str(p.rotary_dim);
  if (p.rope_batch != 1 && p.rope_batch != p.batch)
    return "rope_cos_sin batch must be 1 or B=" + str(p.batch) + ", got " + str(p.rope_batch);
  if (p.rope_seq_len < 0 || p.rope_seq_len > slot_capacity(p))
    return "rope_cos_sin length S must be <= slot capacity pages_per_slot*P=" +
           str(slot_capacity(p)) + ", got S=" + str(p.rope_seq_len);
  bool const any_work = p.batch * p.delta_len * p.num_kv_heads * p.head_dim > 0;
  if (any_work && (p.k_delta == nullptr || p.v_delta == nullptr || p.pool == nullptr ||
                   p.delta_start_positions == nullptr || p.delta_lengths == nullptr))
    return "null tensor pointer";
  if (any_work && p.rotary_dim > 0 && p.rope_seq_len > 0 && p.rope_cos_sin == nullptr)
    return "null rope_cos_sin pointer";
  return {};
}

}  // namespace dflash
