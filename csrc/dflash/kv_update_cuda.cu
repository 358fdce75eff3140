// The CUDA kernel of the update. One thread owns one work item of one head of one token, for K
// and V alike: a rotate-half pair of VEC-channel vectors (channels c and c + R/2, so each key
// element is read once and each cos/sin entry once per head), or one pass-through vector past R.
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

// The machine word of a Pack, for the cache-hinted load/store intrinsics.
template <int BYTES> struct Word;
template <> struct Word<16> { using type = uint4; };
template <> struct Word<8> { using type = uint2; };
template <> struct Word<4> { using type = unsigned int; };
template <> struct Word<2> { using type = unsigned short; };

// Streaming store: the pool rows are not read again by this kernel.
template <typename P>
__device__ __forceinline__ void store_streaming(void* ptr, P const& pack) {
  using W = typename Word<sizeof(P)>::type;
  __stcs(static_cast<W*>(ptr), *reinterpret_cast<W const*>(&pack));
}

// Launch geometry. A head row of D channels is cut into work items of VEC channels: the first
// R / (2 VEC) items each own a rotate-half pair (channels c and c + R/2), the rest own one
// pass-through vector. A block is (items of one head, heads, tokens of one sequence):
// threadIdx.x walks a head's items, threadIdx.y heads, threadIdx.z tokens. grid.y is the slot and
// grid.z the layer, so no thread divides to find its token: at decode sizes the index math before
// the first load is a visible part of the kernel's time (BENCHMARKS.md, kernel notes).
struct Geometry {
  uint32_t head_items;      // R / (2 VEC) + (D - R) / VEC
  uint32_t pair_items;      // R / (2 VEC)
  uint32_t item_chunks;     // blocks along one head's items (1 unless a head is very wide)
  uint32_t head_groups;     // blocks along (heads x item chunks) per token chunk
  uint32_t slot_base;       // first slot of this launch (grids are at most 65535 slots tall)
  uint32_t layer_base;      // first layer of this launch (and 65535 layers deep)
  bool rope_float4;         // cos/sin rows can be read 16 bytes at a time
};

template <int VEC>
__device__ __forceinline__ void load_cos_sin(float const* cos, float const* sin, bool float4_ok,
                                             float (&c)[VEC], float (&s)[VEC]) {
  if constexpr (VEC % 4 == 0) {
    if (float4_ok) {
#pragma unroll
      for (int i = 0; i < VEC; i += 4) {
        float4 const c4 = __ldg(reinterpret_cast<float4 const*>(cos + i));
        float4 const s4 = __ldg(reinterpret_cast<float4 const*>(sin + i));
        c[i] = c4.x, c[i + 1] = c4.y, c[i + 2] = c4.z, c[i + 3] = c4.w;
        s[i] = s4.x, s[i + 1] = s4.y, s[i + 2] = s4.z, s[i + 3] = s4.w;
      }
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) c[i] = __ldg(cos + i), s[i] = __ldg(sin + i);
}

template <typename T, int VEC>
__global__ void __launch_bounds__(128) target_kv_cache_update_kernel(KVUpdateParams p, Geometry g) {
  uint32_t const b = g.slot_base + blockIdx.y;
  uint32_t const layer = g.layer_base + blockIdx.z;
  // The positions first: every store waits for them, so their load leaves before anything else.
  int64_t const start = __ldg(p.delta_start_positions + position_index(p, layer, b));
  int64_t const length = __ldg(p.delta_lengths + position_index(p, layer, b));

  uint32_t token_chunk = blockIdx.x, group = 0;
  if (g.head_groups != 1) {  // uniform per block; 1 for every head width up to 128 items
    token_chunk = blockIdx.x / g.head_groups;
    group = blockIdx.x - token_chunk * g.head_groups;
  }
  uint32_t const t = token_chunk * blockDim.z + threadIdx.z;
  uint32_t h = group * blockDim.y + threadIdx.y, head_item = threadIdx.x;
  if (g.item_chunks != 1) {  // one head per block row, its items over item_chunks blocks
    h = group / g.item_chunks;
    head_item += (group - h * g.item_chunks) * blockDim.x;
  }
  if (t >= uint32_t(p.delta_len) || h >= uint32_t(p.num_kv_heads) || head_item >= g.head_items)
    return;
  bool const pair = head_item < g.pair_items;
  int64_t const half = p.rotary_dim / 2;
  // Channel of this item's (first) vector; a pair's second vector sits at channel + R/2.
  int64_t const channel = pair ? int64_t(head_item) * VEC
                               : p.rotary_dim + int64_t(head_item - g.pair_items) * VEC;
  int64_t const head_offset = int64_t(h) * p.head_dim + channel;
  int64_t const src = delta_token_offset(p, layer, b, t) + head_offset;

  using P = Pack<T, VEC>;
  T const* k_delta = static_cast<T const*>(p.k_delta);
  T const* v_delta = static_cast<T const*>(p.v_delta);

  // Every load that does not depend on the positions is issued before waiting for them: the
  // delta rows are always in bounds, whatever the positions say. Plain (cached) loads: at decode
  // the deltas were just written by the projection and are likely still in L2; evict-first loads
  // measured slower there (BENCHMARKS.md, kernel notes).
  P k0 = *reinterpret_cast<P const*>(k_delta + src);
  P const v0 = *reinterpret_cast<P const*>(v_delta + src);
  P k1, v1;
  if (pair) {
    k1 = *reinterpret_cast<P const*>(k_delta + src + half);
    v1 = *reinterpret_cast<P const*>(v_delta + src + half);
  }

  int64_t const pos = written_position(start, length, t, slot_capacity(p));
  if (pos < 0) return;

  if (pair && pos < p.rope_seq_len) {
    float const* cos = p.rope_cos_sin + rope_row_offset(p, layer, b, pos) + channel;
    float c[VEC], s[VEC];
    load_cos_sin<VEC>(cos, cos + half, g.rope_float4, c, s);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      float const x0 = to_float(k0.v[i]), x1 = to_float(k1.v[i]);
      k0.v[i] = from_float<T>(rope_channel(x0, x1, c[i], s[i], /*first_half=*/true));
      k1.v[i] = from_float<T>(rope_channel(x1, x0, c[i], s[i], /*first_half=*/false));
    }
  }
  T* k_plane = static_cast<T*>(p.pool) + int64_t(layer) * pool_layer_elems(p);
  T* v_plane = k_plane + pool_plane_elems(p);
  int64_t const dst = pool_token_offset(p, b, pos) + head_offset;
  store_streaming(k_plane + dst, k0);
  store_streaming(v_plane + dst, v0);
  if (pair) {
    store_streaming(k_plane + dst + half, k1);
    store_streaming(v_plane + dst + half, v1);
  }
}

bool aligned(void const* ptr, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

int multiprocessor_count() {
  static int const count = [] {
    int device = 0, sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
      sms = 132;
    return sms;
  }();
  return count;
}

template <typename T, int VEC>
cudaError_t launch(KVUpdateParams const& p, cudaStream_t stream) {
  constexpr int64_t kBlockThreads = 128;  // ties 256 at decode sizes, best at the bandwidth-bound ones (BENCHMARKS.md)
  constexpr int64_t kMaxGridYZ = 65535;
  int64_t const head_items = p.rotary_dim / (2 * VEC) + (p.head_dim - p.rotary_dim) / VEC;
  Geometry g;
  g.head_items = uint32_t(head_items);
  g.pair_items = uint32_t(p.rotary_dim / (2 * VEC));
  g.rope_float4 = p.rotary_dim % 4 == 0 && aligned(p.rope_cos_sin, 16);
  int64_t const items_x = std::min(head_items, kBlockThreads);
  int64_t const item_chunks = (head_items + items_x - 1) / items_x;
  int64_t const heads_y = item_chunks == 1 ? std::min(p.num_kv_heads, kBlockThreads / items_x) : 1;
  int64_t const head_groups = (p.num_kv_heads + heads_y - 1) / heads_y * item_chunks;
  // Several tokens per block when a token has few items, but small updates (decode) spread over
  // every multiprocessor: there, latency, not bandwidth, sets the time.
  int64_t const max_tokens = std::max<int64_t>(1, kBlockThreads / (items_x * heads_y));
  int64_t const blocks_wanted = 2 * int64_t(multiprocessor_count());
  int64_t const token_blocks = p.num_layers * p.batch * p.delta_len * head_groups;
  int64_t const spread = (token_blocks + blocks_wanted - 1) / blocks_wanted;
  int64_t const tokens_z = std::max<int64_t>(1, std::min({max_tokens, spread, p.delta_len}));
  int64_t const grid_x = (p.delta_len + tokens_z - 1) / tokens_z * head_groups;
  if (grid_x >= (int64_t(1) << 31) || p.batch >= (int64_t(1) << 31) ||
      p.num_layers >= (int64_t(1) << 31))
    return cudaErrorInvalidConfiguration;  // 32-bit index math in the kernel
  g.item_chunks = uint32_t(item_chunks);
  g.head_groups = uint32_t(head_groups);
  dim3 const block{unsigned(items_x), unsigned(heads_y), unsigned(tokens_z)};
  // Slots and layers beyond a grid's 65535 go to further launches.
  for (int64_t layer = 0; layer < p.num_layers; layer += kMaxGridYZ) {
    for (int64_t slot = 0; slot < p.batch; slot += kMaxGridYZ) {
      g.slot_base = uint32_t(slot);
      g.layer_base = uint32_t(layer);
      dim3 const grid{unsigned(grid_x), unsigned(std::min(kMaxGridYZ, p.batch - slot)),
                      unsigned(std::min(kMaxGridYZ, p.num_layers - layer))};
      target_kv_cache_update_kernel<T, VEC><<<grid, block, 0, stream>>>(p, g);
      if (cudaError_t const status = cudaGetLastError(); status != cudaSuccess) return status;
    }
  }
  return cudaSuccess;
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
