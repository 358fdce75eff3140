// Shared by kbench.cu and decode_probe.cu: operands of one update of either contract (fp16 H=8
// D=128 R=128 P=128), described as the runtimes describe them (TensorDesc -> params_from_operands,
// csrc/dflash/operands.h), launched through the shipped launcher, and CUDA-graph timing.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "dflash/kv_update_cuda.h"
#include "dflash/operands.h"

#define CK(x)                                                                       \
  do {                                                                              \
    cudaError_t e = (x);                                                            \
    if (e != cudaSuccess) {                                                         \
      std::printf("CUDA %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

namespace harness {

constexpr int H = 8, D = 128, R = 128, P = 128;

// The deltas: 2001 values on a grid in [-1, 1] (the default), or with KB_DATA=normal unit-normal
// values (Box-Muller of two hashes), as the main benchmark draws them (and rope rows of real
// angles, fill_rope, where the default leaves zeros: zero keys, whose scale-pool rows store zeros).
// The grid repeats values, so that some element of most rows is half its row's maximum: a
// quotient on a rounding boundary in a scale-pool row (127 y / a = 63.5), which the kernel stores
// by division; unit-normal rows have about a tenth as many.
inline bool normal_data() {
  static bool const normal = [] {
    char const* data = std::getenv("KB_DATA");
    return data != nullptr && std::string(data) == "normal";
  }();
  return normal;
}
__device__ unsigned hash32(size_t i, unsigned seed) {
  unsigned h = unsigned(i) * 2654435761u ^ (unsigned(i >> 32) + seed) * 2246822519u;
  h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
  return h;
}
__global__ void fill_half(__half* p, size_t n, unsigned seed, bool normal) {
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  if (!normal) {
    p[i] = __float2half(float((i * 2654435761u + seed) % 2001) / 1000.f - 1.f);
    return;
  }
  float const u1 = (float(hash32(i, seed) >> 8) + 0.5f) * 0x1p-24f;
  float const u2 = float(hash32(i, seed ^ 0x9e3779b9u) >> 8) * 0x1p-24f;
  p[i] = __float2half(sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
}

inline __half* device_halves(size_t n, unsigned seed) {
  __half* p;
  CK(cudaMalloc(&p, n * sizeof(__half)));
  fill_half<<<unsigned((n + 255) / 256), 256>>>(p, n, seed, normal_data());
  return p;
}

// `rows` rope rows of R floats (R / 2 cosines, then R / 2 sines) at positions 1, 2, ... with the
// usual frequencies (base 10000): KB_DATA=normal's rows; zeros otherwise.
__global__ void fill_rope_rows(float* rope, int rows) {
  int const row = blockIdx.x, i = threadIdx.x;  // R / 2 threads
  if (row >= rows || i >= R / 2) return;
  float const angle = float(row + 1) * exp2f(-float(2 * i) / float(R) * log2f(10000.0f));
  rope[size_t(row) * R + i] = cosf(angle);
  rope[size_t(row) * R + R / 2 + i] = sinf(angle);
}
inline void fill_rope(float* rope, int rows) {
  if (!normal_data()) {
    CK(cudaMemset(rope, 0, size_t(rows) * R * 4));
    return;
  }
  fill_rope_rows<<<unsigned(rows), R / 2>>>(rope, rows);
  CK(cudaGetLastError());
}

template <typename T> T* device_copy(std::vector<T> const& host) {
  T* p;
  CK(cudaMalloc(&p, host.size() * sizeof(T)));
  CK(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

// `sets` input sets of one decode-or-prefill shape, each used in turn by a timing chain: fp16 k/v
// deltas of `delta` elements (different values per set), random start positions of B sequences of
// L tokens in slots of `cap` tokens, and the same tokens' positions (token b * L + t of sequence
// b at start + t). Freed when it goes out of scope.
struct InputSets {
  std::vector<__half*> ks, vs;
  std::vector<int*> starts, positions;

  InputSets(int sets, size_t delta, int B, int L, int cap, std::mt19937& rng) {
    for (int i = 0; i < sets; ++i) {
      ks.push_back(device_halves(delta, i));
      vs.push_back(device_halves(delta, i + 99));
      std::vector<int> s(B), pos(size_t(B) * L);
      for (int b = 0; b < B; ++b) s[b] = int(rng() % unsigned(cap - L + 1));
      for (int b = 0; b < B; ++b)
        for (int t = 0; t < L; ++t) pos[size_t(b) * L + t] = s[b] + t;
      starts.push_back(device_copy(s));
      positions.push_back(device_copy(pos));
    }
  }
  ~InputSets() {
    for (auto* v : {&ks, &vs})
      for (__half* p : *v) CK(cudaFree(p));
    for (auto* v : {&starts, &positions})
      for (int* p : *v) CK(cudaFree(p));
  }
  InputSets(InputSets const&) = delete;
  InputSets& operator=(InputSets const&) = delete;
};

inline dflash::TensorDesc desc(dflash::DType dtype, std::initializer_list<int64_t> dims, void const* data) {
  dflash::TensorDesc d;
  d.dtype = dtype;
  d.rank = int32_t(dims.size());
  int i = 0;
  for (int64_t x : dims) d.dims[i++] = x;
  d.data = data;
  return d;
}

inline dflash::KVUpdateParams checked(std::vector<dflash::TensorDesc> const& operands,
                                      dflash::UpdateAttrs const& attrs) {
  dflash::KVUpdateParams p;
  std::string const error =
      dflash::params_from_operands(operands.data(), int32_t(operands.size()), attrs, &p, /*need_data=*/true);
  if (!error.empty()) {
    std::printf("invalid operands: %s\n", error.c_str());
    std::exit(1);
  }
  return p;
}

// Slot contract, layers = 1 or more: k/v [(layers,) B, L, H, D], pool [(layers,) 2, B * pps, P, H, D].
// The dtypes and extras of an update: fp16 deltas and pool by default; an FP8 or int8 pool takes
// per-head scales [H], or with scale_pool per-token-head scales (the pool's dims without D; the
// only kind an int4 pool, uint8 with D / 2 bytes a head row, takes); the fused k-norm a weight [D]
// in the delta dtype.
struct Flavor {
  dflash::DType delta = dflash::DType::kFloat16;
  dflash::DType pool = dflash::DType::kFloat16;
  float const* scales = nullptr;       // k_scale = v_scale = these [H] (FP8 and int8 pools)
  void const* k_norm_weight = nullptr;  // fused k-norm when set
  float* scale_pool = nullptr;          // per-token-head scales, in place of `scales`
};

// The last dim of a pool of this flavor: D, or D / 2 bytes for int4.
inline int64_t pool_last(Flavor const& f) { return f.pool == dflash::DType::kUInt8 ? D / 2 : D; }

inline void add_extras(std::vector<dflash::TensorDesc>& ops, dflash::UpdateAttrs& attrs, Flavor const& f) {
  using dflash::DType;
  if (f.scale_pool != nullptr) {
    dflash::TensorDesc scale_pool = ops[2];  // the pool's dims without D
    scale_pool.dtype = DType::kFloat32;
    scale_pool.rank -= 1;
    scale_pool.data = f.scale_pool;
    ops.push_back(scale_pool);
    attrs.scale_pool = true;
  } else if (f.pool == DType::kFloat8E4M3 || f.pool == DType::kFloat8E5M2 || f.pool == DType::kInt8) {
    ops.push_back(desc(DType::kFloat32, {H}, f.scales));
    ops.push_back(desc(DType::kFloat32, {H}, f.scales));
  }
  if (f.k_norm_weight != nullptr) {
    ops.push_back(desc(f.delta, {D}, f.k_norm_weight));
    attrs.k_norm = true;
  }
}

inline dflash::KVUpdateParams slot_params(int layers, int B, int L, int pps, void const* k, void const* v,
                                          void* pool, float const* rope, int rope_len, int const* starts,
                                          int const* lengths, Flavor const& f = {}) {
  using dflash::DType;
  int64_t const N = int64_t(B) * pps;
  std::vector<dflash::TensorDesc> ops;
  if (layers > 1) {
    ops = {desc(f.delta, {layers, B, L, H, D}, k), desc(f.delta, {layers, B, L, H, D}, v),
           desc(f.pool, {layers, 2, N, P, H, pool_last(f)}, pool)};
  } else {
    ops = {desc(f.delta, {B, L, H, D}, k), desc(f.delta, {B, L, H, D}, v),
           desc(f.pool, {2, N, P, H, pool_last(f)}, pool)};
  }
  ops.push_back(desc(DType::kFloat32, {1, rope_len, R}, rope));
  ops.push_back(desc(DType::kInt32, {B}, starts));
  ops.push_back(desc(DType::kInt32, {B}, lengths));
  dflash::UpdateAttrs attrs;
  attrs.contract = dflash::Contract::kSlot;
  attrs.pages_per_slot = pps;
  add_extras(ops, attrs, f);
  return checked(ops, attrs);
}

// Paged contract: k/v [(layers,) T, H, D], pool [(layers,) 2, N, P, H, D], rope [T, R], table [B, 2, M].
inline dflash::KVUpdateParams paged_params(int layers, int T, int B, int M, int N, void const* k,
                                           void const* v, void* pool, float const* rope, int const* positions,
                                           int const* owners, int const* table, Flavor const& f = {}) {
  using dflash::DType;
  std::vector<dflash::TensorDesc> ops;
  if (layers > 1) {
    ops = {desc(f.delta, {layers, T, H, D}, k), desc(f.delta, {layers, T, H, D}, v),
           desc(f.pool, {layers, 2, N, P, H, pool_last(f)}, pool)};
  } else {
    ops = {desc(f.delta, {T, H, D}, k), desc(f.delta, {T, H, D}, v),
           desc(f.pool, {2, N, P, H, pool_last(f)}, pool)};
  }
  ops.push_back(desc(DType::kFloat32, {T, R}, rope));
  ops.push_back(desc(DType::kInt32, {T}, positions));
  ops.push_back(desc(DType::kInt32, {T}, owners));
  ops.push_back(desc(DType::kInt32, {B, 2, M}, table));
  dflash::UpdateAttrs attrs;
  attrs.contract = dflash::Contract::kPaged;
  add_extras(ops, attrs, f);
  return checked(ops, attrs);
}

// A [B, 2, M] table: each sequence's K pages, and its V pages (offset by N), a random
// permutation of the pool's N = B * M pages.
inline std::vector<int> permuted_table(int B, int M, std::mt19937& rng) {
  int const N = B * M;
  std::vector<int> k(N), v(N), table(size_t(B) * 2 * M);
  for (int i = 0; i < N; ++i) k[i] = v[i] = i;
  std::shuffle(k.begin(), k.end(), rng);
  std::shuffle(v.begin(), v.end(), rng);
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < M; ++i) {
      table[(size_t(b) * 2 + 0) * M + i] = k[b * M + i];
      table[(size_t(b) * 2 + 1) * M + i] = N + v[b * M + i];
    }
  return table;
}

inline void launch(dflash::KVUpdateParams const& p, cudaStream_t stream) {
  CK(dflash::launch_target_kv_cache_update(p, stream));
}

// Median microseconds per enqueue(i) call: `chain` calls captured in one graph (as plain nodes, or
// each call its own child graph, as XLA's command buffers record an FFI call), `rounds` timed
// samples of `replays` replays each, after 3 warm-up replays.
inline float time_graph(cudaStream_t st, std::function<void(int)> const& enqueue, int chain,
                        bool child_nodes = false, int rounds = 25, int replays = 10) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  if (!child_nodes) {
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < chain; ++i) enqueue(i);
    CK(cudaStreamEndCapture(st, &g));
  } else {
    CK(cudaGraphCreate(&g, 0));
    cudaGraphNode_t prev = nullptr;
    for (int i = 0; i < chain; ++i) {
      cudaGraph_t sub;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      enqueue(i);
      CK(cudaStreamEndCapture(st, &sub));
      cudaGraphNode_t node;
      CK(cudaGraphAddChildGraphNode(&node, g, prev ? &prev : nullptr, prev ? 1 : 0, sub));
      prev = node;
      CK(cudaGraphDestroy(sub));
    }
  }
  CK(cudaGraphInstantiate(&ge, g, 0));
  for (int w = 0; w < 3; ++w) CK(cudaGraphLaunch(ge, st));
  CK(cudaStreamSynchronize(st));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ts;
  for (int it = 0; it < rounds; ++it) {
    CK(cudaEventRecord(a, st));
    for (int r = 0; r < replays; ++r) CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1000 / float(replays * chain));
  }
  std::sort(ts.begin(), ts.end());
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  return ts[ts.size() / 2];
}

}  // namespace harness
