// Decode-size probe: where the time of a small update goes, fp16 H=8 D=128 R=128 P=128, L=16,
// B in {1, 8, 64}, slot capacity 2048 (also 256 and 16384). Times, per update, CUDA events over
// CUDA-graph replays of 64-launch chains (median of 25 x 10 replays):
//   - the shipped kernel (csrc/dflash, compiled by make_probe.py with its -D knobs), slot contract
//     as plain graph nodes and as child-graph nodes (how XLA's command buffers record an FFI call),
//     with starts advancing by L every launch (a decode loop), and the paged contract over a
//     permuted page table;
//   - an empty kernel (the launch floor of a dependent chain) and cudaMemcpyAsync of the K/V bytes
//     into a fixed and into rotating destinations;
//   - stripped probe kernels (written here, not the shipped code): start positions loaded or
//     computed, cos/sin loaded or not, with and without programmatic dependent launch (PDL).
// Inputs rotate over enough sets to exceed 2x L2 unless told otherwise:
//   python3 bench/kernel_variants/make_probe.py /tmp/probe   # builds /tmp/probe/decode_probe
//   /tmp/probe/decode_probe                   # everything, cold inputs
//   /tmp/probe/decode_probe POS_SETS KV_SETS  # shipped kernel only; e.g. "2 0": positions
//                                             # L2-resident (2 sets), K/V rotated (0 = beyond 2x L2)
// tools/gpu_session.sh probe runs both. Results: BENCHMARKS.md, "Decode-size probe".
#include "harness.h"

using namespace harness;

__global__ void empty_kernel(int* p) {
  if (p && threadIdx.x == 1234567) p[0] = 1;
}

// Probe kernel: one thread per rotate-half pair of 8-channel vectors of one head of one token.
// POS 1 = start positions loaded, 0 = computed from b (no dependent load, the same rows every
// launch), 2 = computed from b and the launch index (no dependent load, new rows every launch),
// 3 = computed, advancing by L every launch. ROPE 1 = cos/sin rows loaded, 0 = c=1, s=0.
// PDL 1 = griddepcontrol (wait before the first load).
struct ProbeArgs {
  __half const* k;
  __half const* v;
  __half* pool;
  float const* rope;
  int const* starts;
  int B, L, cap;
  unsigned seed;
};

__device__ __forceinline__ void load8(__half const* p, float (&x)[8]) {
  uint4 const raw = __ldg(reinterpret_cast<uint4 const*>(p));
  __half2 const* h = reinterpret_cast<__half2 const*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 const f = __half22float2(h[i]);
    x[2 * i] = f.x, x[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void store8(__half* p, float const (&x)[8]) {
  uint4 raw;
  __half2* h = reinterpret_cast<__half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(x[2 * i], x[2 * i + 1]);
  __stcs(reinterpret_cast<uint4*>(p), raw);
}

template <int POS, int ROPE, int PDL> __global__ void __launch_bounds__(128) probe_kernel(ProbeArgs a) {
  if (PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (PDL) asm volatile("griddepcontrol.launch_dependents;");
  constexpr int HALF = R / 2, VEC = 8, PAIRS = HALF / VEC;
  unsigned const token = blockIdx.x * blockDim.y + threadIdx.y;
  unsigned const item = threadIdx.x;  // H * PAIRS items per token
  if (token >= unsigned(a.B * a.L) || item >= unsigned(H * PAIRS)) return;
  unsigned const b = token / a.L, t = token - b * a.L;
  unsigned const h = item / PAIRS, channel = (item - h * PAIRS) * VEC;
  size_t const src = size_t(token) * H * D + h * D + channel;
  int start;
  if (POS == 1)
    start = __ldg(a.starts + b);
  else if (POS == 2)
    start = int(((b * 37u + a.seed * 101u) * 2654435761u >> 8) % unsigned(a.cap - a.L));
  else if (POS == 3)
    start = int((b * 37u + a.seed * unsigned(a.L)) % unsigned(a.cap - a.L));
  else
    start = int((b * 37) % (a.cap - a.L));
  float k0[8], k1[8], v0[8], v1[8];
  load8(a.k + src, k0), load8(a.k + src + HALF, k1);
  load8(a.v + src, v0), load8(a.v + src + HALF, v1);
  int const pos = start + int(t);
  if (pos < 0 || pos >= a.cap) return;
  float c[8], s[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) c[i] = 1.f, s[i] = 0.f;
  if (ROPE) {
    float4 const* row = reinterpret_cast<float4 const*>(a.rope + size_t(pos) * R + channel);
    float4 const* row_sin = reinterpret_cast<float4 const*>(a.rope + size_t(pos) * R + HALF + channel);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float4 const x = __ldg(row + i), y = __ldg(row_sin + i);
      c[4 * i] = x.x, c[4 * i + 1] = x.y, c[4 * i + 2] = x.z, c[4 * i + 3] = x.w;
      s[4 * i] = y.x, s[4 * i + 1] = y.y, s[4 * i + 2] = y.z, s[4 * i + 3] = y.w;
    }
  }
  float y0[8], y1[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    y0[i] = __fsub_rn(__fmul_rn(k0[i], c[i]), __fmul_rn(k1[i], s[i]));
    y1[i] = __fadd_rn(__fmul_rn(k1[i], c[i]), __fmul_rn(k0[i], s[i]));
  }
  size_t const plane = size_t(a.B) * a.cap * H * D;
  size_t const dst = (size_t(b) * a.cap + pos) * H * D + h * D + channel;
  store8(a.pool + dst, y0), store8(a.pool + plane + dst, v0);
  store8(a.pool + dst + HALF, y1), store8(a.pool + plane + dst + HALF, v1);
}

int main(int argc, char** argv) {
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  int const L = 16, chain = 64;
  int const pos_sets_arg = argc > 2 ? std::atoi(argv[1]) : 0;
  int const kv_sets_arg = argc > 2 ? std::atoi(argv[2]) : 0;  // 0 = rotate beyond 2x L2
  bool const only_shipped = argc > 2;
  for (int cap : {2048, 256, 16384}) {
    if (only_shipped && cap != 2048) continue;
    for (int B : {1, 8, 64}) {
      int const pps = cap / P, N = B * pps, T = B * L;
      size_t const delta = size_t(T) * H * D, pool_elems = size_t(2) * N * P * H * D;
      double const kv_bytes = double(delta) * 2 * 2;
      int const sets = kv_sets_arg ? kv_sets_arg : std::min(32, std::max(2, int(120e6 / kv_bytes + 1)));
      int const pos_sets = pos_sets_arg ? pos_sets_arg : sets;
      std::mt19937 rng(1);
      InputSets const in(sets, delta, B, L, cap, rng);
      auto const &ks = in.ks, &vs = in.vs;
      auto const &starts = in.starts, &positions = in.positions;
      // Start positions of a decode loop: every slot's start advances by L each launch.
      std::vector<int*> advancing(chain);
      std::vector<int> base(B);
      for (int b = 0; b < B; ++b) base[b] = int(rng() % unsigned(cap - L + 1));
      for (int i = 0; i < chain; ++i) {
        std::vector<int> s(B);
        for (int b = 0; b < B; ++b) s[b] = (base[b] + L * i) % (cap - L + 1);
        advancing[i] = device_copy(s);
      }
      std::vector<int> owner_host(T), length_host(B, L);
      for (int t = 0; t < T; ++t) owner_host[t] = t / L;
      int* owners = device_copy(owner_host);
      int* lengths = device_copy(length_host);
      int* table = device_copy(permuted_table(B, pps, rng));
      __half* pool;
      CK(cudaMalloc(&pool, pool_elems * 2));
      CK(cudaMemset(pool, 0, pool_elems * 2));
      // Slot rows [cap, R]; its first T rows double as the paged token rows [T, R].
      size_t const rope_rows = size_t(std::max(cap, T));
      float* rope;
      CK(cudaMalloc(&rope, rope_rows * R * 4));
      CK(cudaMemset(rope, 0, rope_rows * R * 4));
      void* copy_dst;
      CK(cudaMalloc(&copy_dst, size_t(kv_bytes)));
      int* dummy;
      CK(cudaMalloc(&dummy, 4));
      CK(cudaDeviceSynchronize());
      auto slot = [&](int i, int const* s) {
        int const j = i % sets;
        launch(slot_params(1, B, L, pps, ks[j], vs[j], pool, rope, cap, s, lengths), st);
      };
      auto shipped = [&](int i) { slot(i, starts[i % pos_sets]); };
      std::printf("\n== B=%d L=%d cap=%d sets=%d position sets=%d (kv %.2f MB)\n", B, L, cap, sets, pos_sets,
                  kv_bytes / 1e6);
      std::printf("shipped slot kernel, direct nodes     %7.3f us\n", time_graph(st, shipped, chain));
      std::printf("shipped slot kernel, advancing starts %7.3f us\n",
                  time_graph(st, [&](int i) { slot(i, advancing[i]); }, chain));
      std::printf("shipped paged kernel, direct nodes    %7.3f us\n",
                  time_graph(
                      st,
                      [&](int i) {
                        int const j = i % sets;
                        launch(paged_params(1, T, B, pps, N, ks[j], vs[j], pool, rope,
                                            positions[i % pos_sets], owners, table),
                               st);
                      },
                      chain));
      if (!only_shipped) {
        std::printf("shipped slot kernel, child-graph nodes %6.3f us\n",
                    time_graph(st, shipped, chain, true));
        std::printf("empty kernel, direct                  %7.3f us\n",
                    time_graph(st, [&](int) { empty_kernel<<<1, 32, 0, st>>>(dummy); }, chain));
        std::printf("empty kernel, child-graph             %7.3f us\n",
                    time_graph(st, [&](int) { empty_kernel<<<1, 32, 0, st>>>(dummy); }, chain, true));
        std::printf(
            "memcpy kv bytes, fixed dst            %7.3f us\n",
            time_graph(
                st,
                [&](int i) {
                  int const j = i % sets;
                  CK(cudaMemcpyAsync(copy_dst, ks[j], size_t(kv_bytes) / 2, cudaMemcpyDeviceToDevice, st));
                  CK(cudaMemcpyAsync(static_cast<char*>(copy_dst) + size_t(kv_bytes) / 2, vs[j],
                                     size_t(kv_bytes) / 2, cudaMemcpyDeviceToDevice, st));
                },
                chain));
        size_t const span = pool_elems * 2 - size_t(kv_bytes);  // a new place of the pool each time
        std::printf("memcpy kv bytes, rotating dst         %7.3f us\n",
                    time_graph(
                        st,
                        [&](int i) {
                          int const j = i % sets;
                          char* d =
                              reinterpret_cast<char*>(pool) + (size_t(i) * 7919 * 4096) % span / 256 * 256;
                          CK(cudaMemcpyAsync(d, ks[j], size_t(kv_bytes) / 2, cudaMemcpyDeviceToDevice, st));
                          CK(cudaMemcpyAsync(d + size_t(kv_bytes) / 2, vs[j], size_t(kv_bytes) / 2,
                                             cudaMemcpyDeviceToDevice, st));
                        },
                        chain));
        for (int tpb : {1, 2}) {
          auto probe = [&](auto kernel, bool pdl) {
            return time_graph(
                st,
                [&](int i) {
                  int const j = i % sets;
                  ProbeArgs a{ks[j], vs[j], pool, rope, starts[j], B, L, cap, unsigned(i)};
                  cudaLaunchConfig_t cfg = {};
                  cfg.gridDim = dim3(unsigned((T + tpb - 1) / tpb));
                  cfg.blockDim = dim3(64, unsigned(tpb));
                  cfg.stream = st;
                  cudaLaunchAttribute attr[1];
                  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                  attr[0].val.programmaticStreamSerializationAllowed = 1;
                  cfg.attrs = attr;
                  cfg.numAttrs = pdl ? 1 : 0;
                  CK(cudaLaunchKernelEx(&cfg, kernel, a));
                },
                chain);
          };
          std::printf("tpb=%d probe pos+rope                 %7.3f us\n", tpb,
                      probe(probe_kernel<1, 1, 0>, false));
          std::printf("tpb=%d probe pos, no rope             %7.3f us\n", tpb,
                      probe(probe_kernel<1, 0, 0>, false));
          std::printf("tpb=%d probe no pos, rope             %7.3f us\n", tpb,
                      probe(probe_kernel<0, 1, 0>, false));
          std::printf("tpb=%d probe new pos, rope            %7.3f us\n", tpb,
                      probe(probe_kernel<2, 1, 0>, false));
          std::printf("tpb=%d probe new pos, no rope         %7.3f us\n", tpb,
                      probe(probe_kernel<2, 0, 0>, false));
          std::printf("tpb=%d probe advancing pos, rope      %7.3f us\n", tpb,
                      probe(probe_kernel<3, 1, 0>, false));
          std::printf("tpb=%d probe no pos, no rope          %7.3f us\n", tpb,
                      probe(probe_kernel<0, 0, 0>, false));
          std::printf("tpb=%d probe pos+rope, PDL            %7.3f us\n", tpb,
                      probe(probe_kernel<1, 1, 1>, true));
          std::printf("tpb=%d probe no pos no rope, PDL      %7.3f us\n", tpb,
                      probe(probe_kernel<0, 0, 1>, true));
        }
      }
      for (int* x : advancing) CK(cudaFree(x));
      CK(cudaFree(owners));
      CK(cudaFree(lengths));
      CK(cudaFree(table));
      CK(cudaFree(pool));
      CK(cudaFree(rope));
      CK(cudaFree(copy_dst));
      CK(cudaFree(dummy));
    }
  }
  return 0;
}
