// The CUDA kernel of the update. One thread owns one vector of VEC channels of one head of one
// token for both K and V: it loads k, (for rotary channels) the partner vector of the rotate-half
// pair and the cos/sin entries, and v; it writes the K row and the V row of the pool.
#include "dflash/kv_update_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace dflash {
namespace {

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// VEC channels moved as one aligned load/store.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// Launch geometry: blockDim.x threads cover (part of) one token's H * D / VEC vectors,
// blockDim.y tokens share a block, grid.y splits very wide tokens.
struct Geometry {
  int64_t tokens;          // num_layers * B * L
  int32_t row_vectors;     // H * D / VEC
  int32_t head_vectors;    // D / VEC
};

template <typename T, int VEC>
__global__ void __launch_bounds__(256) target_kv_cache_update_kernel(KVUpdateParams p, Geometry g) {
  int64_t const token = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  int32_t const lane = int32_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (token >= g.tokens || lane >= g.row_vectors) return;

  int64_t const t = token % p.delta_len;
  int64_t const layer_b = token / p.delta_len;
  int64_t const b = layer_b % p.batch;
  int64_t const layer = layer_b / p.batch;

  int64_t const start = __ldg(p.delta_start_positions + position_index(p, layer, b));
  int64_t const length = __ldg(p.delta_lengths + position_index(p, layer, b));
  int64_t const pos = written_position(start, length, t, slot_capacity(p));
  if (pos < 0) return;

  int32_t const h = lane / g.head_vectors;
  int32_t const channel = (lane - h * g.head_vectors) * VEC;
  int64_t const src = delta_token_offset(p, layer, b, t) + int64_t(h) * p.head_dim + channel;
  int64_t const dst = layer * pool_layer_elems(p) + pool_token_offset(p, b, pos) +
                      int64_t(h) * p.head_dim + channel;

  using P = Pack<T, VEC>;
  T const* k_delta = static_cast<T const*>(p.k_delta);
  T const* v_delta = static_cast<T const*>(p.v_delta);
  T* pool = static_cast<T*>(p.pool);

  P const v = *reinterpret_cast<P const*>(v_delta + src);
  P k = *reinterpret_cast<P const*>(k_delta + src);
  if (channel < p.rotary_dim && pos < p.rope_seq_len) {
    int64_t const half = p.rotary_dim / 2;
    bool const first_half = channel < half;
    int64_t const partner_offset = first_half ? half : -half;
    int64_t const pair_index = first_half ? channel : channel - half;
    P const partner = *reinterpret_cast<P const*>(k_delta + src + partner_offset);
    float const* cos_sin = p.rope_cos_sin + rope_row_offset(p, layer, b, pos) + pair_index;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      float const c = __ldg(cos_sin + i);
      float const s = __ldg(cos_sin + half + i);
      k.v[i] = from_float<T>(
          rope_channel(to_float(k.v[i]), to_float(partner.v[i]), c, s, first_half));
    }
  }
  *reinterpret_cast<P*>(pool + dst) = k;
  *reinterpret_cast<P*>(pool + pool_plane_elems(p) + dst) = v;
}

bool aligned(void const* ptr, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

template <typename T, int VEC>
cudaError_t launch(KVUpdateParams const& p, cudaStream_t stream) {
  Geometry g;
  g.tokens = p.num_layers * p.batch * p.delta_len;
  g.head_vectors = int32_t(p.head_dim / VEC);
  g.row_vectors = int32_t(p.num_kv_heads * g.head_vectors);
  constexpr int kBlockThreads = 256;
  dim3 block, grid;
  if (g.row_vectors >= kBlockThreads) {
    block = dim3(kBlockThreads, 1);
    grid = dim3(unsigned(g.tokens), unsigned((g.row_vectors + kBlockThreads - 1) / kBlockThreads));
  } else {
    int const tokens_per_block = std::max(1, kBlockThreads / g.row_vectors);
    block = dim3(unsigned(g.row_vectors), unsigned(tokens_per_block));
    grid = dim3(unsigned((g.tokens + tokens_per_block - 1) / tokens_per_block), 1);
  }
  target_kv_cache_update_kernel<T, VEC><<<grid, block, 0, stream>>>(p, g);
  return cudaGetLastError();
}

// The widest vector (up to 16 bytes) that divides the head and the rotary half and that every
// tensor's alignment allows.
template <typename T>
cudaError_t launch_widest(KVUpdateParams const& p, cudaStream_t stream) {
  auto fits = [&](int vec) {
    int64_t const bytes = vec * int64_t(sizeof(T));
    return p.head_dim % vec == 0 && (p.rotary_dim / 2) % vec == 0 && aligned(p.k_delta, bytes) &&
           aligned(p.v_delta, bytes) && aligned(p.pool, bytes);
  };
  constexpr int kMaxVec = int(16 / sizeof(T));
  if (fits(kMaxVec)) return launch<T, kMaxVec>(p, stream);
  if (fits(kMaxVec / 2)) return launch<T, kMaxVec / 2>(p, stream);
  if (fits(kMaxVec / 4)) return launch<T, kMaxVec / 4>(p, stream);
  return launch<T, 1>(p, stream);
}

}  // namespace

cudaError_t launch_target_kv_cache_update(KVUpdateParams const& p, cudaStream_t stream) {
  if (p.num_layers * p.batch * p.delta_len == 0 || p.num_kv_heads * p.head_dim == 0)
    return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat16: return launch_widest<__half>(p, stream);
    case DType::kBFloat16: return launch_widest<__nv_bfloat16>(p, stream);
    case DType::kFloat32: return launch_widest<float>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace dflash
