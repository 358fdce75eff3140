// Times one build of the shipped kernel (make_variants.py compiles csrc/dflash with its tuning
// macros set by -D, then links this harness): both contracts at H=8 D=128 R=128 P=128, in fp16,
// with the fused k-norm, in bf16, into an e4m3 pool (per-head and per-token-head scales), into an int8
// pool (both) and into an int4 pool; the benchmark's shapes, 20 launches per CUDA graph rotating among input
// sets (8, or 2 where 8 would exceed 200 MB), median of 30 replays. One line per row and shape.
// KB_TABLE=identity gives each sequence its pages in order, KB_TABLE=grouped a random permutation of runs of
// 8 pages (2 MB of a float16 plane) with the pages of a run in order (default: a random permutation of the
// pool's pages, as in the main benchmark). KB_SETS=n rotates among n input sets at every shape.
// KB_DATA=normal draws unit-normal deltas, as the main benchmark does (harness.h).
// KB_ROPE=shared gives every input set of the paged rows the same token-aligned rope rows (as in L2 right
// after the gather that writes them), instead of rotating them with the deltas. KB_SHAPES and KB_REPLAYS (see
// main) select shapes and lengthen the samples; KB_STAMP prints the time each row ended. The copy rows (one
// layer) are floors of the paged rows' memory traffic, without RoPE or checks: the K and V deltas copied, 16
// bytes per thread, into the pool rows the page table gives them
// ("copy paged"; "+rope" also reads each token's rope row, "x2" moves two tokens per thread),
// into token-major rows at the start of each plane once the page ids have arrived ("copy wait"),
// or at once ("copy flat"). The "i8+s+rope" and "i4+s+rope" copy rows are the quantized pools' own
// bytes (deltas and rope rows read, one or half a byte an element and a scale a head written), each
// form's own: the slot contract's rows and its rope table's row at the position, or the paged
// contract's rows through the page table and its token-aligned rope rows. The chunk rows move the same
// traffic (+rope) with each block looping over a contiguous run of tokens, the next step's loads issued
// before this step's stores ("pipe").
#include "harness.h"

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>

using namespace harness;

// "  at HH:MM:SS.mmm" (UTC, as nvidia-smi's timestamps) when KB_STAMP is set, else "".
std::string stamp() {
  if (!std::getenv("KB_STAMP")) return "";
  auto const now = std::chrono::system_clock::now();
  std::time_t const secs = std::chrono::system_clock::to_time_t(now);
  int const ms =
      int(std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
  char buf[32];
  std::strftime(buf, sizeof buf, "%H:%M:%S", std::gmtime(&secs));
  return std::string("  at ") + buf + "." + std::to_string(1000 + ms).substr(1);
}

// The copy rows' kernel: blocks of H * D / 8 threads (times blockDim.y token groups, "b8": 8 of
// them, consecutive tokens), each moving 8 channels of K and V of TOKENS consecutive tokens (every
// load issued before any store). kFlat: token t's rows at t of each
// plane; kPaged: where the paged contract writes them; kWait: at t, but only once the page ids
// have arrived (the paged rows' dependent loads without their scattered destinations).
enum CopyKind { kFlat, kPaged, kWait, kSlot };
template <int TOKENS> __global__ void copy_rows(__half const* k, __half const* v, float const* rope,
                                                __half* pool, int const* positions, int const* owners,
                                                int const* table, int M, int N, CopyKind kind) {
  int const e = threadIdx.x * 8;
  size_t const row_elems = size_t(H) * D;
  uint4 kv[TOKENS], vv[TOKENS];
  size_t k_row[TOKENS], v_row[TOKENS];
#pragma unroll
  for (int i = 0; i < TOKENS; ++i) {
    int const t = (blockIdx.x * blockDim.y + threadIdx.y) * TOKENS + i;
    kv[i] = __ldg(reinterpret_cast<uint4 const*>(k + size_t(t) * row_elems + e));
    vv[i] = __ldg(reinterpret_cast<uint4 const*>(v + size_t(t) * row_elems + e));
    k_row[i] = t, v_row[i] = size_t(N) * P + t;
    if (rope != nullptr)  // the token's rope row, 4 bytes per thread, into the stored bits
      kv[i].x ^= __float_as_uint(__ldg(rope + size_t(t) * R + threadIdx.x % R));
    if (kind != kFlat) {
      int const b = __ldg(owners + t), pos = __ldg(positions + t);
      int const* entry = table + (size_t(b) * 2) * M + pos / P;
      int const k_page = __ldg(entry), v_page = __ldg(entry + M);
      if (kind == kPaged) {
        k_row[i] = size_t(k_page) * P + pos % P, v_row[i] = size_t(v_page) * P + pos % P;
      } else {  // never true, but the stores wait for the ids
        k_row[i] += k_page == -7, v_row[i] += v_page == -7;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < TOKENS; ++i) {
    __stcs(reinterpret_cast<uint4*>(pool + k_row[i] * row_elems + e), kv[i]);
    __stcs(reinterpret_cast<uint4*>(pool + v_row[i] * row_elems + e), vv[i]);
  }
}

// The copy rows of a quantized pool's own bytes (the op's traffic without its arithmetic): each
// thread reads 8 channels of K and V (16 bytes each) and 4 bytes of a rope row (kSlot: the rope
// table's at the position, shared by the sequences; kPaged: the token's own),
// and writes OUT bytes of each plane (8: int8 or FP8, 4: int4) and, from each head's first thread,
// the head's scale in each plane (4 bytes), where the slot contract writes them (kSlot: row
// b * M * P + position of the token's sequence b, a sequence a slot of M pages) or the paged one
// does (kPaged); both move with the input set's positions, as the ops' rows do. The pool's rows are
// H * D * OUT / 16 bytes; the scale pool's H floats.
template <int OUT> __global__ void copy_format_rows(__half const* k, __half const* v, float const* rope,
                                                    uint8_t* pool, float* scale_pool, int const* positions,
                                                    int const* owners, int const* table, int M, int N,
                                                    CopyKind kind) {
  int const t = blockIdx.x;
  size_t const row_elems = size_t(H) * D, e = size_t(threadIdx.x) * 8;
  uint4 kv = __ldg(reinterpret_cast<uint4 const*>(k + size_t(t) * row_elems + e));
  uint4 const vv = __ldg(reinterpret_cast<uint4 const*>(v + size_t(t) * row_elems + e));
  int const b = __ldg(owners + t), pos = __ldg(positions + t);
  kv.x ^= __float_as_uint(__ldg(rope + size_t(kind == kSlot ? pos : t) * R + threadIdx.x % R));
  size_t k_row = size_t(b) * M * P + pos, v_row = size_t(N) * P + k_row;
  if (kind == kPaged) {
    int const* entry = table + (size_t(b) * 2) * M + pos / P;
    k_row = size_t(__ldg(entry)) * P + pos % P, v_row = size_t(__ldg(entry + M)) * P + pos % P;
  }
  size_t const row_bytes = row_elems * OUT / 16;
  uint8_t* const k_out = pool + k_row * row_bytes + threadIdx.x * OUT;
  uint8_t* const v_out = pool + v_row * row_bytes + threadIdx.x * OUT;
  if constexpr (OUT == 8) {
    __stcs(reinterpret_cast<uint2*>(k_out), make_uint2(kv.x ^ kv.y, kv.z ^ kv.w));
    __stcs(reinterpret_cast<uint2*>(v_out), make_uint2(vv.x ^ vv.y, vv.z ^ vv.w));
  } else {
    __stcs(reinterpret_cast<unsigned*>(k_out), kv.x ^ kv.y ^ kv.z ^ kv.w);
    __stcs(reinterpret_cast<unsigned*>(v_out), vv.x ^ vv.y ^ vv.z ^ vv.w);
  }
  if (threadIdx.x % (D / 8) == 0) {
    size_t const h = threadIdx.x / (D / 8);
    __stcs(scale_pool + k_row * H + h, __uint_as_float(kv.w));
    __stcs(scale_pool + v_row * H + h, __uint_as_float(vv.w));
  }
}

// The chunked copy rows: the paged copy (+rope) with each block moving a contiguous run of
// `chunk` tokens, blockDim.y tokens a step, so that a multiprocessor writes few pages at a time.
// PIPE: the next step's page ids, deltas and rope row are loaded before this step's stores.
template <bool PIPE> __global__ void copy_chunks(__half const* k, __half const* v, float const* rope,
                                                 __half* pool, int const* positions, int const* owners,
                                                 int const* table, int M, int N, int T, int chunk) {
  int const e = threadIdx.x * 8;
  size_t const row_elems = size_t(H) * D;
  int const end = min(T, int(blockIdx.x + 1) * chunk);
  int t = blockIdx.x * chunk + threadIdx.y;
  if (t >= end) return;
  struct Step {
    uint4 k, v;
    size_t k_row, v_row;
  };
  auto load = [&](int t) {
    Step s;
    s.k = __ldg(reinterpret_cast<uint4 const*>(k + size_t(t) * row_elems + e));
    s.v = __ldg(reinterpret_cast<uint4 const*>(v + size_t(t) * row_elems + e));
    s.k.x ^= __float_as_uint(__ldg(rope + size_t(t) * R + threadIdx.x % R));
    int const b = __ldg(owners + t), pos = __ldg(positions + t);
    int const* entry = table + (size_t(b) * 2) * M + pos / P;
    s.k_row = size_t(__ldg(entry)) * P + pos % P, s.v_row = size_t(__ldg(entry + M)) * P + pos % P;
    return s;
  };
  Step cur = load(t);
  for (;;) {
    int const next = t + blockDim.y;
    bool const more = next < end;
    Step ahead;
    if (PIPE && more) ahead = load(next);
    __stcs(reinterpret_cast<uint4*>(pool + cur.k_row * row_elems + e), cur.k);
    __stcs(reinterpret_cast<uint4*>(pool + cur.v_row * row_elems + e), cur.v);
    if (!more) break;
    cur = PIPE ? ahead : load(next);
    t = next;
  }
}

int main(int, char** argv) {
  // The variant, and so its knobs: make_variants.py names each binary kb_<variant>.
  std::printf("%s\n", argv[0]);
  // KB_SHAPES=BxL[xlayers],... runs those shapes (any B, L up to the M pages' tokens), else these.
  std::vector<std::array<int, 3>> cases = {{1, 16, 1},   {8, 16, 1},   {64, 16, 1},
                                           {1, 4096, 1}, {8, 2048, 1}, {64, 16, 5}};
  int const M = 64, cap = M * P, reps = 20;  // M pages per sequence, as in the main benchmark
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  std::mt19937 rng(1);
  float* scales = device_copy(std::vector<float>(H, 1.0f));
  // 1.0 in fp16 bits; the bf16 rows read the same bits as 2^-7 (timing does not depend on values).
  uint16_t* weight = device_copy(std::vector<uint16_t>(D, 0x3C00));
  // KB_REPLAYS=n times n graph replays per sample (the sustained runs: long enough for the GPU's
  // power limit to act, read with nvidia-smi).
  if (char const* shapes_env = std::getenv("KB_SHAPES")) {
    cases.clear();
    std::string const list = shapes_env;
    for (size_t at = 0; at < list.size();) {
      size_t const end = std::min(list.find(',', at), list.size());
      std::array<int, 3> c{0, 0, 1};
      if (std::sscanf(list.substr(at, end - at).c_str(), "%dx%dx%d", &c[0], &c[1], &c[2]) < 2 || c[0] < 1 ||
          c[1] < 1 || c[1] > M * P || c[2] < 1) {
        std::fprintf(stderr, "KB_SHAPES: expected BxL[xlayers],... with L <= %d, got %s\n", M * P,
                     shapes_env);
        return 2;
      }
      cases.push_back(c);
      at = end + 1;
    }
  }
  char const* replays_env = std::getenv("KB_REPLAYS");
  int const replays = replays_env ? std::max(1, std::atoi(replays_env)) : 1;
  for (auto const& c : cases) {
    int const B = c[0], L = c[1], layers = c[2], T = B * L, N = B * M;
    size_t const delta = size_t(layers) * T * H * D, pool = size_t(layers) * 2 * N * P * H * D;
    double const bytes = double(delta) * 2 * 2 * 2 + double(layers) * T * R * 4;
    char const* sets_env = std::getenv("KB_SETS");  // more sets: less of them left in L2
    int const sets = sets_env ? std::atoi(sets_env) : bytes * 8 < 200e6 ? 8 : 2;
    InputSets const in(sets, delta, B, L, cap, rng);
    auto const &ks = in.ks, &vs = in.vs;
    auto const &starts = in.starts, &positions = in.positions;
    std::vector<float*> paged_rope(sets);
    for (int i = 0; i < sets; ++i) {
      CK(cudaMalloc(&paged_rope[i], size_t(T) * R * 4));
      fill_rope(paged_rope[i], T);
    }
    std::vector<int> owner_host(T), length_host(B, L);
    for (int t = 0; t < T; ++t) owner_host[t] = t / L;
    int* owners = device_copy(owner_host);
    int* lengths = device_copy(length_host);
    std::vector<int> table_host = permuted_table(B, M, rng);
    char const* table_kind = std::getenv("KB_TABLE");
    std::string const kind = table_kind ? table_kind : "";
    if (kind == "identity" || kind == "grouped") {
      // Runs of 8 pages, in order (identity) or shuffled per plane (grouped); N is a multiple of 8.
      int const run = 8, runs = N / run;
      std::vector<int> k_runs(runs), v_runs(runs);
      for (int i = 0; i < runs; ++i) k_runs[i] = v_runs[i] = i;
      if (kind == "grouped")
        std::shuffle(k_runs.begin(), k_runs.end(), rng), std::shuffle(v_runs.begin(), v_runs.end(), rng);
      for (int b = 0; b < B; ++b)
        for (int i = 0; i < M; ++i) {
          int const page = b * M + i;
          table_host[(size_t(b) * 2 + 0) * M + i] = k_runs[page / run] * run + page % run;
          table_host[(size_t(b) * 2 + 1) * M + i] = N + v_runs[page / run] * run + page % run;
        }
    }
    int* table = device_copy(table_host);
    __half* pool_mem;
    CK(cudaMalloc(&pool_mem, pool * 2));
    CK(cudaMemset(pool_mem, 0, pool * 2));
    float* scale_pool;  // per-token-head scales of the scale-pool rows: the pool without D
    CK(cudaMalloc(&scale_pool, pool / D * 4));
    CK(cudaMemset(scale_pool, 0, pool / D * 4));
    float* rope;
    CK(cudaMalloc(&rope, size_t(cap) * R * 4));
    fill_rope(rope, cap);
    CK(cudaDeviceSynchronize());
    // The rows: fp16 both contracts, the fused k-norm in both, bf16 deltas and pool, and an e4m3
    // pool (per-head scales) in both, the paged one with the k-norm too (from fp16 and from bf16
    // deltas, the main job's); int8 with per-head scales; the scale pools (int8, e4m3, int4),
    // each paged with the k-norm too (int8 from bf16 deltas as well).
    struct Row {
      char const* name;
      bool paged;
      Flavor flavor;
    };
    using dflash::DType;
    Flavor const bf16{DType::kBFloat16, DType::kBFloat16};
    Flavor const e4m3{DType::kFloat16, DType::kFloat8E4M3, scales};
    Flavor const int8{DType::kFloat16, DType::kInt8, scales};
    Flavor const int8_dynamic{DType::kFloat16, DType::kInt8, nullptr, nullptr, scale_pool};
    Flavor const e4m3_dynamic{DType::kFloat16, DType::kFloat8E4M3, nullptr, nullptr, scale_pool};
    Flavor const int4{DType::kFloat16, DType::kUInt8, nullptr, nullptr, scale_pool};
    Flavor const int8_dynamic_knorm{DType::kFloat16, DType::kInt8, nullptr, weight, scale_pool};
    Flavor const bf16_int8_dynamic_knorm{DType::kBFloat16, DType::kInt8, nullptr, weight, scale_pool};
    Flavor const e4m3_dynamic_knorm{DType::kFloat16, DType::kFloat8E4M3, nullptr, weight, scale_pool};
    Flavor const int4_knorm{DType::kFloat16, DType::kUInt8, nullptr, weight, scale_pool};
    Row const rows[] = {
        {"slot ", false, {}},
        {"paged", true, {}},
        {"paged knorm", true, {DType::kFloat16, DType::kFloat16, nullptr, weight}},
        {"slot  knorm", false, {DType::kFloat16, DType::kFloat16, nullptr, weight}},
        {"slot  bf16", false, bf16},
        {"paged bf16", true, bf16},
        {"paged bf16 knorm", true, {DType::kBFloat16, DType::kBFloat16, nullptr, weight}},
        {"slot  e4m3", false, e4m3},
        {"paged e4m3", true, e4m3},
        {"paged e4m3 knorm", true, {DType::kFloat16, DType::kFloat8E4M3, scales, weight}},
        {"paged bf16>e4m3 knorm", true, {DType::kBFloat16, DType::kFloat8E4M3, scales, weight}},
        {"slot  int8", false, int8},
        {"paged int8", true, int8},
        {"slot  int8 dynamic", false, int8_dynamic},
        {"paged int8 dynamic", true, int8_dynamic},
        {"paged int8 dynamic knorm", true, int8_dynamic_knorm},
        {"paged bf16>int8 dynamic knorm", true, bf16_int8_dynamic_knorm},
        {"slot  e4m3 dynamic", false, e4m3_dynamic},
        {"paged e4m3 dynamic knorm", true, e4m3_dynamic_knorm},
        {"slot  int4", false, int4},
        {"paged int4 knorm", true, int4_knorm},
    };
    char const* rope_kind = std::getenv("KB_ROPE");
    bool const shared_rope = rope_kind && std::string(rope_kind) == "shared";
    for (Row const& r : rows) {
      // Bytes moved: K and V deltas read, their pool elements and (scale pool) scales written.
      double const pool_elem = r.flavor.pool == DType::kUInt8                                         ? 0.5
                               : r.flavor.pool == DType::kFloat8E4M3 || r.flavor.pool == DType::kInt8 ? 1.0
                                                                                                      : 2.0;
      double const scales_written = r.flavor.scale_pool ? double(delta) / D * 2 * 4 : 0.0;
      double const row_bytes =
          double(delta) * 2 * (2 + pool_elem) + scales_written + double(layers) * T * R * 4;
      auto const enqueue = [&](int i) {
        int j = i % sets;
        if (r.paged)
          launch(paged_params(layers, T, B, M, N, ks[j], vs[j], pool_mem, paged_rope[shared_rope ? 0 : j],
                              positions[j], owners, table, r.flavor),
                 st);
        else
          launch(
              slot_params(layers, B, L, M, ks[j], vs[j], pool_mem, rope, cap, starts[j], lengths, r.flavor),
              st);
      };
      // One launch outside the graph first: the launcher's one-time queries (the scale-pool
      // kernel's resident blocks) happen before the capture.
      enqueue(0);
      CK(cudaStreamSynchronize(st));
      float const us = time_graph(st, enqueue, reps, false, 30, replays);
      std::printf("%-21s B=%3d L=%5d layers=%d  %8.2f us  (%.0f GB/s)%s\n", r.name, B, L, layers, us,
                  row_bytes / us / 1e3, stamp().c_str());
    }
    struct CopyRow {
      char const* name;
      CopyKind kind;
      int tokens;
      bool rope;
      int groups = 1;  // token groups per block
    };
    CopyRow const copies[] = {
        {"copy paged", kPaged, 1, false},        {"copy paged x2", kPaged, 2, false},
        {"copy paged+rope", kPaged, 1, true},    {"copy paged+rope x2", kPaged, 2, true},
        {"copy paged+rope x4", kPaged, 4, true}, {"copy wait", kWait, 1, false},
        {"copy flat", kFlat, 1, false},          {"copy paged b8", kPaged, 1, false, 8},
        {"copy flat b8", kFlat, 1, false, 8}};
    for (CopyRow const& c : copies) {
      if (layers != 1 || T % (c.tokens * c.groups) != 0) continue;
      float const us = time_graph(
          st,
          [&](int i) {
            int j = i % sets;
            auto* kernel = c.tokens == 1 ? copy_rows<1> : c.tokens == 2 ? copy_rows<2> : copy_rows<4>;
            float const* rope_rows = c.rope ? paged_rope[shared_rope ? 0 : j] : nullptr;
            kernel<<<T / (c.tokens * c.groups), dim3(H * D / 8, c.groups), 0, st>>>(
                ks[j], vs[j], rope_rows, pool_mem, positions[j], owners, table, M, N, c.kind);
          },
          reps, false, 30, replays);
      double const copied = double(delta) * 2 * 2 * 2 + (c.rope ? double(T) * R * 4 : 0.0);
      std::printf("%-21s B=%3d L=%5d layers=%d  %8.2f us  (%.0f GB/s)%s\n", c.name, B, L, layers, us,
                  copied / us / 1e3, stamp().c_str());
    }
    // The quantized pools' own bytes with their scales, into the slot contract's rows and through
    // the page table.
    struct FormatCopyRow {
      char const* name;
      CopyKind kind;
      int out;  // bytes written a plane for 8 channels
    };
    FormatCopyRow const format_copies[] = {{"copy slot i8+s+rope", kSlot, 8},
                                           {"copy paged i8+s+rope", kPaged, 8},
                                           {"copy slot i4+s+rope", kSlot, 4},
                                           {"copy paged i4+s+rope", kPaged, 4}};
    for (FormatCopyRow const& c : format_copies) {
      if (layers != 1) continue;
      float const us = time_graph(
          st,
          [&](int i) {
            int j = i % sets;
            auto* kernel = c.out == 8 ? copy_format_rows<8> : copy_format_rows<4>;
            float const* rope_rows = c.kind == kSlot ? rope : paged_rope[shared_rope ? 0 : j];
            kernel<<<T, H * D / 8, 0, st>>>(ks[j], vs[j], rope_rows, reinterpret_cast<uint8_t*>(pool_mem),
                                            scale_pool, positions[j], owners, table, M, N, c.kind);
          },
          reps, false, 30, replays);
      double const copied = double(delta) * 2 * 2 + double(delta) * 2 * c.out / 8 +
                            double(delta) / D * 2 * 4 + double(T) * R * 4;
      std::printf("%-21s B=%3d L=%5d layers=%d  %8.2f us  (%.0f GB/s)%s\n", c.name, B, L, layers, us,
                  copied / us / 1e3, stamp().c_str());
    }
    // Chunked rows: groups of tokens per block, blocks per multiprocessor (132 multiprocessors).
    struct ChunkRow {
      char const* name;
      bool pipe;
      int groups, per_sm;
    };
    ChunkRow const chunks[] = {
        {"chunk+rope g8 2/sm", false, 8, 2},      {"chunk+rope g8 2/sm pipe", true, 8, 2},
        {"chunk+rope g4 4/sm pipe", true, 4, 4},  {"chunk+rope g2 8/sm pipe", true, 2, 8},
        {"chunk+rope g8 4/sm pipe", true, 8, 4},  {"chunk+rope g4 16/sm pipe", true, 4, 16},
        {"chunk+rope g1 16/sm pipe", true, 1, 16}};
    for (ChunkRow const& c : chunks) {
      if (layers != 1) continue;
      int const blocks = 132 * c.per_sm, chunk = (T + blocks - 1) / blocks;
      float const us = time_graph(
          st,
          [&](int i) {
            int j = i % sets;
            auto* kernel = c.pipe ? copy_chunks<true> : copy_chunks<false>;
            kernel<<<(T + chunk - 1) / chunk, dim3(H * D / 8, c.groups), 0, st>>>(
                ks[j], vs[j], paged_rope[shared_rope ? 0 : j], pool_mem, positions[j], owners, table, M, N, T,
                chunk);
          },
          reps, false, 30, replays);
      double const copied = double(delta) * 2 * 2 * 2 + double(T) * R * 4;
      std::printf("%-24s B=%3d L=%5d layers=%d  %8.2f us  (%.0f GB/s)%s\n", c.name, B, L, layers, us,
                  copied / us / 1e3, stamp().c_str());
    }
    for (float* r : paged_rope) CK(cudaFree(r));
    CK(cudaFree(owners));
    CK(cudaFree(lengths));
    CK(cudaFree(table));
    CK(cudaFree(pool_mem));
    CK(cudaFree(scale_pool));
    CK(cudaFree(rope));
  }
  return 0;
}
