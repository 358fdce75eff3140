// Times one build of the shipped kernel (make_variants.py compiles csrc/dflash with its tuning
// macros set by -D, then links this harness): both contracts, fp16 H=8 D=128 R=128 P=128, the
// benchmark's shapes, 20 launches per CUDA graph rotating among input sets (8, or 2 where 8
// would exceed 200 MB), median of 30 replays. One line per contract and shape.
#include "harness.h"

// The knobs this binary was built with (make_variants.py passes all three).
#define DFLASH_STR2(x) #x
#define DFLASH_STR(x) DFLASH_STR2(x)
#if defined(DFLASH_BLOCK_THREADS) && defined(DFLASH_STREAMING_STORES) && defined(DFLASH_MAX_VEC_BYTES)
#define KNOBS "DFLASH_BLOCK_THREADS=" DFLASH_STR(DFLASH_BLOCK_THREADS) " DFLASH_STREAMING_STORES=" \
  DFLASH_STR(DFLASH_STREAMING_STORES) " DFLASH_MAX_VEC_BYTES=" DFLASH_STR(DFLASH_MAX_VEC_BYTES)
#else
#define KNOBS "the shipped defaults"
#endif

using namespace harness;

int main() {
  std::printf("kernel built with %s\n", KNOBS);
  int const cases[][3] = {{1, 16, 1}, {8, 16, 1}, {64, 16, 1}, {1, 4096, 1}, {8, 2048, 1}, {64, 16, 5}};
  int const M = 64, cap = M * P, reps = 20;  // M pages per sequence, as in the main benchmark
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  std::mt19937 rng(1);
  for (auto const& c : cases) {
    int const B = c[0], L = c[1], layers = c[2], T = B * L, N = B * M;
    size_t const delta = size_t(layers) * T * H * D, pool = size_t(layers) * 2 * N * P * H * D;
    double const bytes = double(delta) * 2 * 2 * 2 + double(layers) * T * R * 4;
    int const sets = bytes * 8 < 200e6 ? 8 : 2;
    std::vector<__half*> ks(sets), vs(sets);
    std::vector<int*> starts(sets), positions(sets);
    std::vector<float*> paged_rope(sets);
    for (int i = 0; i < sets; ++i) {
      ks[i] = device_halves(delta, i);
      vs[i] = device_halves(delta, i + 99);
      std::vector<int> s(B), pos(T);
      for (int b = 0; b < B; ++b) s[b] = int(rng() % unsigned(cap - L + 1));
      for (int b = 0; b < B; ++b)
        for (int t = 0; t < L; ++t) pos[b * L + t] = s[b] + t;
      starts[i] = device_copy(s);
      positions[i] = device_copy(pos);
      CK(cudaMalloc(&paged_rope[i], size_t(T) * R * 4));
      CK(cudaMemset(paged_rope[i], 0, size_t(T) * R * 4));
    }
    std::vector<int> owner_host(T), length_host(B, L);
    for (int t = 0; t < T; ++t) owner_host[t] = t / L;
    int* owners = device_copy(owner_host);
    int* lengths = device_copy(length_host);
    int* table = device_copy(permuted_table(B, M, rng));
    __half* pool_mem;
    CK(cudaMalloc(&pool_mem, pool * 2));
    CK(cudaMemset(pool_mem, 0, pool * 2));
    float* rope;
    CK(cudaMalloc(&rope, size_t(cap) * R * 4));
    CK(cudaMemset(rope, 0, size_t(cap) * R * 4));
    CK(cudaDeviceSynchronize());
    float const slot_us = time_graph(st, [&](int i) {
      int j = i % sets;
      launch(slot_params(layers, B, L, M, ks[j], vs[j], pool_mem, rope, cap, starts[j], lengths), st);
    }, reps, false, 30, 1);
    float const paged_us = time_graph(st, [&](int i) {
      int j = i % sets;
      launch(paged_params(layers, T, B, M, N, ks[j], vs[j], pool_mem, paged_rope[j], positions[j], owners, table), st);
    }, reps, false, 30, 1);
    std::printf("slot  B=%3d L=%5d layers=%d  %8.2f us  (%.0f GB/s)\n", B, L, layers, slot_us, bytes / slot_us / 1e3);
    std::printf("paged B=%3d L=%5d layers=%d  %8.2f us  (%.0f GB/s)\n", B, L, layers, paged_us, bytes / paged_us / 1e3);
    for (int i = 0; i < sets; ++i) {
      CK(cudaFree(ks[i]));
      CK(cudaFree(vs[i]));
      CK(cudaFree(starts[i]));
      CK(cudaFree(positions[i]));
      CK(cudaFree(paged_rope[i]));
    }
    CK(cudaFree(owners));
    CK(cudaFree(lengths));
    CK(cudaFree(table));
    CK(cudaFree(pool_mem));
    CK(cudaFree(rope));
  }
  return 0;
}
