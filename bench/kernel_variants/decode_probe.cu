// Decode-size probe (issue 4): where the time of a small update goes, fp16 H=8 D=128 R=128 P=128,
// L=16, B in {1, 8, 64}, slot capacity 2048 (and 256). Times, per update, CUDA events over CUDA-graph
// replays of 64-launch chains (median of 25 x 10 replays):
//   - the shipped kernel (this file includes csrc/dflash/kv_update_cuda.cu), as direct graph nodes and
//     as child-graph nodes (how XLA's command buffers record an FFI call);
//   - an empty kernel (the launch floor of a dependent chain) and cudaMemcpyAsync of the K/V bytes;
//   - stripped variants of the kernel: start positions loaded or computed, cos/sin loaded or not,
//     with and without programmatic dependent launch (PDL);
//   - knob copies of the shipped kernel: positions through shared memory, PDL.
// Inputs rotate over enough sets to exceed 2x L2 unless told otherwise:
//   python3 bench/kernel_variants/make_probe.py /tmp/probe   # writes knob_kernel.inc, runs nvcc
//   /tmp/probe/decode_probe                 # everything, cold inputs
//   /tmp/probe/decode_probe POS_SETS KV_SETS  # shipped + knobs only; e.g. "2 0": positions L2-resident
//                                       # (2 sets), K/V rotated (0 = beyond 2x L2)
// tools/gpu_session.sh probe runs both. Results: BENCHMARKS.md, "Decode-size probe".
#include "../../csrc/dflash/kv_update_cuda.cu"
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <random>
#include <functional>
#include <string>
using namespace dflash;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s line %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

__global__ void fill(__half* p, size_t n, unsigned seed) { size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; if (i < n) p[i] = __float2half((float)((i * 2654435761u + seed) % 2001) / 1000.f - 1.f); }
__global__ void empty_kernel(int* p) { if (p && threadIdx.x == 1234567) p[0] = 1; }

// Variant: POS 1 = positions loaded (as shipped), 0 = start computed from b (no dependent load,
// the same rows every launch), 2 = start computed from b and the launch's index (no dependent
// load, new rows every launch, like loaded positions), 3 = computed, advancing by L every launch
// (as in a decode loop).
// ROPE 1 = cos/sin loaded, 0 = not loaded (c=1, s=0 from registers). PDL 1 = griddepcontrol.
// EARLY 1 = launch_dependents at the top (else at the end / implicit).
struct VP { __half const* k; __half const* v; __half* pool; float const* rope; int const* starts; int const* lens; int B, L, cap, S; unsigned seed; };
template <int POS, int ROPE, int PDL>
__global__ void __launch_bounds__(128) variant(VP p) {
  if (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (PDL) asm volatile("griddepcontrol.launch_dependents;");
  constexpr int H = 8, D = 128, HALF = 64, VEC = 8, HEAD_ITEMS = 8;
  unsigned token = blockIdx.x * blockDim.y + threadIdx.y;
  unsigned item = threadIdx.x;
  if (token >= unsigned(p.B * p.L) || item >= H * HEAD_ITEMS) return;
  unsigned b = token / p.L, t = token - b * p.L;
  unsigned h = item / HEAD_ITEMS, hi = item - h * HEAD_ITEMS;
  int channel = hi * VEC;
  size_t src = size_t(token) * H * D + h * D + channel;
  using P = Pack<__half, VEC>;
  int start, length;
  if (POS == 1) { start = __ldg(p.starts + b); length = __ldg(p.lens + b); }
  else if (POS == 2) { start = ((b * 37u + p.seed * 101u) * 2654435761u >> 8) % unsigned(p.cap - p.L); length = p.L; }  // computed, new per launch
  else if (POS == 3) { start = (b * 37u + p.seed * unsigned(p.L)) % unsigned(p.cap - p.L); length = p.L; }  // computed, advancing by L
  else { start = (b * 37) % (p.cap - p.L); length = p.L; }
  P k0 = *reinterpret_cast<P const*>(p.k + src), v0 = *reinterpret_cast<P const*>(p.v + src);
  P k1 = *reinterpret_cast<P const*>(p.k + src + HALF), v1 = *reinterpret_cast<P const*>(p.v + src + HALF);
  int pos = start + int(t);
  if (int(t) >= length || pos < 0 || pos >= p.cap) return;
  float c[VEC], s[VEC];
  if (ROPE) { load_cos_sin<VEC>(p.rope + size_t(pos) * 128 + channel, p.rope + size_t(pos) * 128 + channel + HALF, true, c, s); }
  else { for (int i = 0; i < VEC; ++i) c[i] = 1.f, s[i] = 0.f; }
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    float x0 = __half2float(k0.v[i]), x1 = __half2float(k1.v[i]);
    k0.v[i] = __float2half_rn(rope_channel(x0, x1, c[i], s[i], true));
    k1.v[i] = __float2half_rn(rope_channel(x1, x0, c[i], s[i], false));
  }
  size_t plane = size_t(p.B) * p.cap * H * D;
  size_t dst = (size_t(b) * p.cap + pos) * H * D + h * D + channel;
  store_streaming(p.pool + dst, k0); store_streaming(p.pool + plane + dst, v0);
  store_streaming(p.pool + dst + HALF, k1); store_streaming(p.pool + plane + dst + HALF, v1);
}

// knob_kernel<T, VEC, SMEM_POS, PDL, PF, VFIRST>: the shipped kernel with knobs, generated from
// csrc/dflash/kv_update_cuda.cu by make_probe.py (no second copy of the kernel in the tree).
#include "knob_kernel.inc"
static cudaStream_t st;
static float time_graph(std::function<void(int)> enqueue, int chain, bool child_nodes) {
  cudaGraph_t g; cudaGraphExec_t ge;
  if (!child_nodes) {
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < chain; ++i) enqueue(i);
    CK(cudaStreamEndCapture(st, &g));
  } else {  // XLA's way: each call traced into its own graph, added as a child-graph node
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
      cudaGraphDestroy(sub);
    }
  }
  CK(cudaGraphInstantiate(&ge, g, 0));
  for (int w = 0; w < 3; ++w) CK(cudaGraphLaunch(ge, st));
  CK(cudaStreamSynchronize(st));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  std::vector<float> ts;
  for (int it = 0; it < 25; ++it) {
    cudaEventRecord(a, st);
    for (int r = 0; r < 10; ++r) CK(cudaGraphLaunch(ge, st));
    cudaEventRecord(b, st); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms * 1000 / (10 * chain));
  }
  std::sort(ts.begin(), ts.end());
  cudaGraphExecDestroy(ge); cudaGraphDestroy(g); cudaEventDestroy(a); cudaEventDestroy(b);
  return ts[ts.size() / 2];
}

int main(int argc, char** argv) {
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  int H = 8, D = 128, R = 128, P = 128, chain = 64;
  bool ncu = argc > 1 && std::string(argv[1]) == "ncu";
  int pos_sets_arg = argc > 2 ? atoi(argv[1]) : 0, kv_sets_arg = argc > 2 ? atoi(argv[2]) : 0;  // 0 = rotate beyond 2x L2
  bool only_shipped = argc > 2;
  std::vector<int> Bs = ncu ? std::vector<int>{64} : std::vector<int>{1, 8, 64};
  for (int capi = 0; capi < (ncu ? 1 : 3); ++capi)
  for (int B : Bs) {
    int L = 16, cap = capi == 0 ? 2048 : capi == 1 ? 256 : 16384, pps = cap / P;
    size_t delta = size_t(B) * L * H * D, pool_elems = size_t(2) * B * cap * H * D;
    double kv_bytes = double(delta) * 2 * 2;
    int sets = kv_sets_arg ? kv_sets_arg : std::min(32, std::max(2, int(120e6 / kv_bytes + 1)));
    int pos_sets = pos_sets_arg ? pos_sets_arg : sets;
    if (only_shipped && capi != 0) continue;
    std::vector<__half*> ks(sets), vs(sets); std::vector<int*> ss(sets);
    std::mt19937 rng(1);
    for (int i = 0; i < sets; ++i) {
      CK(cudaMalloc(&ks[i], delta * 2)); CK(cudaMalloc(&vs[i], delta * 2));
      fill<<<(delta + 255) / 256, 256>>>(ks[i], delta, i); fill<<<(delta + 255) / 256, 256>>>(vs[i], delta, i + 99);
      std::vector<int> hs(B); for (int b = 0; b < B; ++b) hs[b] = rng() % (cap - L + 1);
      CK(cudaMalloc(&ss[i], B * 4)); CK(cudaMemcpy(ss[i], hs.data(), B * 4, cudaMemcpyHostToDevice));
    }
    __half* pool; CK(cudaMalloc(&pool, pool_elems * 2)); CK(cudaMemset(pool, 0, pool_elems * 2));
    float* rope; CK(cudaMalloc(&rope, size_t(cap) * R * 4)); CK(cudaMemset(rope, 0, size_t(cap) * R * 4));
    std::vector<int> hl(B, L); int* lens; CK(cudaMalloc(&lens, B * 4)); CK(cudaMemcpy(lens, hl.data(), B * 4, cudaMemcpyHostToDevice));
    void* cdst; CK(cudaMalloc(&cdst, size_t(kv_bytes)));
    int* dummy; CK(cudaMalloc(&dummy, 4));
    // Start positions of a decode loop: every slot's start advances by L each launch.
    std::vector<int*> sa(chain);
    std::vector<int> base(B); for (int b = 0; b < B; ++b) base[b] = rng() % (cap - L + 1);
    for (int i = 0; i < chain; ++i) {
      std::vector<int> hs(B); for (int b = 0; b < B; ++b) hs[b] = (base[b] + L * i) % (cap - L + 1);
      CK(cudaMalloc(&sa[i], B * 4)); CK(cudaMemcpy(sa[i], hs.data(), B * 4, cudaMemcpyHostToDevice));
    }
    CK(cudaDeviceSynchronize());
    KVUpdateParams p; p.dtype = DType::kFloat16; p.num_layers = 1; p.batch = B; p.delta_len = L; p.num_kv_heads = H; p.head_dim = D;
    p.num_pages = int64_t(B) * pps; p.page_size = P; p.pages_per_slot = pps; p.rotary_dim = R; p.rope_batch = 1; p.rope_seq_len = cap;
    p.rope_cos_sin = rope; p.delta_lengths = lens; p.pool = pool;
    auto shipped = [&](int i) { int j = i % sets; KVUpdateParams q = p; q.k_delta = ks[j]; q.v_delta = vs[j]; q.delta_start_positions = ss[i % pos_sets]; CK(launch_widest<__half>(q, st)); };
    if (ncu) { for (int i = 0; i < 40; ++i) shipped(i); CK(cudaStreamSynchronize(st)); printf("ncu mode done\n"); return 0; }
    printf("\n== B=%d L=%d cap=%d sets=%d (kv %.2f MB, total bytes %.2f MB)\n", B, L, cap, sets, kv_bytes / 1e6, (2 * kv_bytes + B * L * 512.0) / 1e6);
    printf("shipped kernel, direct nodes      %7.3f us\n", time_graph(shipped, chain, false));
    printf("shipped kernel, advancing starts  %7.3f us\n", time_graph([&](int i) { int j = i % sets; KVUpdateParams q = p; q.k_delta = ks[j]; q.v_delta = vs[j]; q.delta_start_positions = sa[i]; CK(launch_widest<__half>(q, st)); }, chain, false));
    {
      auto knob = [&](auto kern, bool pdl) {
        return time_graph([&](int i) {
          int j = i % sets; KVUpdateParams q = p; q.k_delta = ks[j]; q.v_delta = vs[j]; q.delta_start_positions = ss[i % pos_sets];
          Geometry g{}; g.head_items = 8; g.pair_items = 8; g.item_chunks = 1; g.head_groups = 1; g.rope_float4 = true;
          int tz = B * L * 1 >= 264 * 2 ? 2 : 1;
          cudaLaunchConfig_t cfg = {}; cfg.gridDim = dim3((L + tz - 1) / tz, B, 1); cfg.blockDim = dim3(8, 8, tz); cfg.stream = st;
          cudaLaunchAttribute attr[1]; attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; attr[0].val.programmaticStreamSerializationAllowed = 1;
          cfg.attrs = attr; cfg.numAttrs = pdl ? 1 : 0;
          CK(cudaLaunchKernelEx(&cfg, kern, q, g));
        }, chain, false);
      };
      printf("knob copy of shipped                %7.3f us\n", knob(knob_kernel<__half, 8, 0, 0>, false));
      printf("knob positions via smem             %7.3f us\n", knob(knob_kernel<__half, 8, 1, 0>, false));
      printf("knob PDL                            %7.3f us\n", knob(knob_kernel<__half, 8, 0, 1>, true));
      printf("knob smem + PDL                     %7.3f us\n", knob(knob_kernel<__half, 8, 1, 1>, true));
      printf("knob V stored first                 %7.3f us\n", knob(knob_kernel<__half, 8, 0, 0, 0, 1>, false));
      printf("knob prefetch dst (1/token)         %7.3f us\n", knob(knob_kernel<__half, 8, 0, 0, 1, 0>, false));
      printf("knob prefetch dst (1/token), V first %6.3f us\n", knob(knob_kernel<__half, 8, 0, 0, 1, 1>, false));
      printf("knob prefetch K (all), V first      %7.3f us\n", knob(knob_kernel<__half, 8, 0, 0, 2, 1>, false));
      printf("knob smem + prefetch + V first      %7.3f us\n", knob(knob_kernel<__half, 8, 1, 0, 1, 1>, false));
      printf("knob cos/sin L2 evict-last          %7.3f us\n", knob(knob_kernel<__half, 8, 0, 0, 0, 0, 1>, false));
      printf("knob evict-last + PDL               %7.3f us\n", knob(knob_kernel<__half, 8, 0, 1, 0, 0, 1>, true));
    }
    if (only_shipped) { printf("kv sets %d, position sets %d\n", sets, pos_sets); goto cleanup; }
    printf("shipped kernel, child-graph nodes %7.3f us\n", time_graph(shipped, chain, true));
    printf("empty kernel, direct              %7.3f us\n", time_graph([&](int) { empty_kernel<<<1, 32, 0, st>>>(dummy); }, chain, false));
    printf("empty kernel, child-graph         %7.3f us\n", time_graph([&](int) { empty_kernel<<<1, 32, 0, st>>>(dummy); }, chain, true));
    printf("memcpy kv bytes, fixed dst        %7.3f us\n", time_graph([&](int i) { int j = i % sets; CK(cudaMemcpyAsync(cdst, ks[j], size_t(kv_bytes) / 2, cudaMemcpyDeviceToDevice, st)); CK(cudaMemcpyAsync((char*)cdst + size_t(kv_bytes) / 2, vs[j], size_t(kv_bytes) / 2, cudaMemcpyDeviceToDevice, st)); }, chain, false));
    {  // the same copy into a new place of the pool each time (fresh rows, as the update writes)
      size_t const pool_bytes = pool_elems * 2, span = pool_bytes - size_t(kv_bytes);
      printf("memcpy kv bytes, rotating dst     %7.3f us\n", time_graph([&](int i) { int j = i % sets; char* d = (char*)pool + (size_t(i) * 7919 * 4096) % span / 256 * 256; CK(cudaMemcpyAsync(d, ks[j], size_t(kv_bytes) / 2, cudaMemcpyDeviceToDevice, st)); CK(cudaMemcpyAsync(d + size_t(kv_bytes) / 2, vs[j], size_t(kv_bytes) / 2, cudaMemcpyDeviceToDevice, st)); }, chain, false));
    }
    for (int tpb : {1, 2}) {
      auto run_variant = [&](auto kern, bool pdl) {
        return time_graph([&](int i) {
          int j = i % sets; VP v{ks[j], vs[j], pool, rope, ss[j], lens, B, L, cap, cap, unsigned(i)};
          cudaLaunchConfig_t cfg = {}; cfg.gridDim = dim3((B * L + tpb - 1) / tpb); cfg.blockDim = dim3(64, tpb); cfg.stream = st;
          cudaLaunchAttribute attr[1]; attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization; attr[0].val.programmaticStreamSerializationAllowed = 1;
          cfg.attrs = attr; cfg.numAttrs = pdl ? 1 : 0;
          CK(cudaLaunchKernelEx(&cfg, kern, v));
        }, chain, false);
      };
      printf("tpb=%d variant pos+rope            %7.3f us\n", tpb, run_variant(variant<1, 1, 0>, false));
      printf("tpb=%d variant pos, no rope        %7.3f us\n", tpb, run_variant(variant<1, 0, 0>, false));
      printf("tpb=%d variant no pos, rope        %7.3f us\n", tpb, run_variant(variant<0, 1, 0>, false));
      printf("tpb=%d variant new pos, rope       %7.3f us\n", tpb, run_variant(variant<2, 1, 0>, false));
      printf("tpb=%d variant new pos, no rope    %7.3f us\n", tpb, run_variant(variant<2, 0, 0>, false));
      printf("tpb=%d variant advancing pos, rope %7.3f us\n", tpb, run_variant(variant<3, 1, 0>, false));
      printf("tpb=%d variant no pos, no rope     %7.3f us\n", tpb, run_variant(variant<0, 0, 0>, false));
      printf("tpb=%d variant pos+rope, PDL       %7.3f us\n", tpb, run_variant(variant<1, 1, 1>, true));
      printf("tpb=%d variant no pos no rope, PDL %7.3f us\n", tpb, run_variant(variant<0, 0, 1>, true));
    }
    cleanup:
    for (int i = 0; i < sets; ++i) { cudaFree(ks[i]); cudaFree(vs[i]); cudaFree(ss[i]); }
    for (int* x : sa) cudaFree(x);
    cudaFree(pool); cudaFree(rope); cudaFree(lens); cudaFree(cdst); cudaFree(dummy);
  }
  return 0;
}
