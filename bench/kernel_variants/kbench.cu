// Times kernel variants (compile-time knobs in kvar.cu, made by make_variants.py) with CUDA graphs:
// 20 launches per graph rotating among input sets, median of 30 replays, fp16 H=8 D=128 R=128 P=128.
#include "kvar.cu"
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cuda_fp16.h>
using namespace dflash;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s line %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)
__global__ void fill(__half* p, size_t n, unsigned seed) { size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; if (i < n) p[i] = __float2half((float)((i * 2654435761u + seed) % 2001) / 1000.f - 1.f); }
static void fillh(__half* p, size_t n, unsigned s) { fill<<<(n + 255) / 256, 256>>>(p, n, s); }
int main() {
  int H = 8, D = 128, R = 128, P = 128;
  int cases[][3] = {{1, 16, 1}, {8, 16, 1}, {64, 16, 1}, {1, 4096, 1}, {8, 2048, 1}, {64, 16, 5}};
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  for (auto& c : cases) {
    int B = c[0], L = c[1], layers = c[2];
    int pps = (L + 64 + P - 1) / P + 1, cap = pps * P;
    size_t delta = (size_t)layers * B * L * H * D, pool = (size_t)layers * 2 * B * pps * P * H * D;
    double bytes = (double)delta * 2 * 2 * 2 + (double)layers * B * L * R * 4;
    int sets = bytes * 8 < 200e6 ? 8 : 2;
    std::vector<__half*> ks(sets), vs(sets), pools(sets);
    for (int i = 0; i < sets; ++i) { CK(cudaMalloc(&ks[i], delta * 2)); CK(cudaMalloc(&vs[i], delta * 2)); CK(cudaMalloc(&pools[i], pool * 2)); fillh(ks[i], delta, i); fillh(vs[i], delta, i + 99); }
    float* rope; CK(cudaMalloc(&rope, (size_t)cap * R * 4)); CK(cudaMemset(rope, 0, (size_t)cap * R * 4));
    std::vector<int> hs(B), hl(B, L); for (int b = 0; b < B; ++b) hs[b] = (b * 37) % (cap - L);
    int *ds, *dl; CK(cudaMalloc(&ds, B * 4)); CK(cudaMalloc(&dl, B * 4)); CK(cudaMemcpy(ds, hs.data(), B * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(dl, hl.data(), B * 4, cudaMemcpyHostToDevice));
    KVUpdateParams p; p.dtype = DType::kFloat16; p.num_layers = layers; p.batch = B; p.delta_len = L; p.num_kv_heads = H; p.head_dim = D;
    p.num_pages = (int64_t)B * pps; p.page_size = P; p.pages_per_slot = pps; p.rotary_dim = R; p.rope_batch = 1; p.rope_seq_len = cap;
    p.rope_cos_sin = rope; p.delta_start_positions = ds; p.delta_lengths = dl;
    CK(cudaDeviceSynchronize());
    cudaGraph_t g; cudaGraphExec_t ge; int reps = 20;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int r = 0; r < reps; ++r) { int j = r % sets; p.k_delta = ks[j]; p.v_delta = vs[j]; p.pool = pools[j]; CK(launch_widest<__half>(p, st)); }
    CK(cudaStreamEndCapture(st, &g)); CK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    for (int w = 0; w < 3; ++w) CK(cudaGraphLaunch(ge, st));
    std::vector<float> ts;
    for (int it = 0; it < 30; ++it) { cudaEventRecord(a, st); CK(cudaGraphLaunch(ge, st)); cudaEventRecord(b, st); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms * 1000 / reps); }
    std::sort(ts.begin(), ts.end());
    printf("B=%3d L=%5d layers=%d  %8.2f us  (%.0f GB/s)\n", B, L, layers, ts[ts.size() / 2], bytes / ts[ts.size() / 2] / 1e3);
    for (int i = 0; i < sets; ++i) { cudaFree(ks[i]); cudaFree(vs[i]); cudaFree(pools[i]); }
    cudaFree(rope); cudaFree(ds); cudaFree(dl); cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
  }
}
