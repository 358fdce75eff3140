// --gpu [--dump DIR]: enqueue on device buffers for every addressing form (every pool dtype, kFP8
// and kINT8 pools with per-tensor and per-head scales, kINT8, kFP8 and int4 pools with a scale
// pool, k_norm / v_norm, hostile positions, owners, tables and slots),
// with guard bands around the pool, into a separate output and in place. The inputs and the
// pool the plugin produced are dumped as .npy under DIR/<case>/, indexed in the report's "dumps",
// for tests/test_trt_plugin.py to compare with the JAX op and the NumPy reference bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>

#include "cases.h"
#include "sequence.h"

namespace harness {

namespace {

uint64_t gRandomState = 0;
uint64_t nextRandom() {  // splitmix64
  uint64_t z = (gRandomState += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
float uniform(float lo, float hi) { return lo + (hi - lo) * float(nextRandom() >> 40) / float(1ull << 24); }
int64_t below(int64_t n) { return n <= 0 ? 0 : int64_t(nextRandom() % uint64_t(n)); }

std::vector<char> randomValues(int64_t count, DataType type, float lo, float hi) {
  std::vector<char> bytes(size_t(count * elementBytes(type)));
  for (int64_t i = 0; i < count; ++i) {
    if (type == DataType::kFP8) {
      uint8_t b;
      do b = uint8_t(nextRandom());
      while ((b & 0x7F) == 0x7F);  // any finite e4m3 byte
      bytes[size_t(i)] = char(b);
      continue;
    }
    if (type == DataType::kINT8 || type == DataType::kUINT8) {  // any int8, any two int4 nibbles
      bytes[size_t(i)] = char(uint8_t(nextRandom()));
      continue;
    }
    float const x = uniform(lo, hi);
    if (type == DataType::kFLOAT) {
      std::memcpy(bytes.data() + 4 * i, &x, 4);
    } else if (type == DataType::kHALF) {
      __half_raw const raw = __half(__float2half_rn(x));
      std::memcpy(bytes.data() + 2 * i, &raw.x, 2);
    } else {
      __nv_bfloat16_raw const raw = __nv_bfloat16(__float2bfloat16_rn(x));
      std::memcpy(bytes.data() + 2 * i, &raw.x, 2);
    }
  }
  return bytes;
}

template <typename T> std::vector<char> bytesOf(std::vector<T> const& values) {
  return std::vector<char>(reinterpret_cast<char const*>(values.data()),
                           reinterpret_cast<char const*>(values.data() + values.size()));
}

bool writeNpy(std::string const& path, char const* descr, Dims const& dims, void const* data, size_t bytes) {
  std::string shape = "(";
  for (int32_t i = 0; i < dims.nbDims; ++i)
    shape += std::to_string(dims.d[i]) + (dims.nbDims == 1 ? ",)" : i + 1 < dims.nbDims ? ", " : ")");
  if (dims.nbDims == 0) shape += ")";
  std::string header =
      std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  size_t const total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) return false;
  unsigned char const preamble[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  uint16_t const length = uint16_t(header.size());
  bool ok = std::fwrite(preamble, 1, 8, file) == 8 && std::fwrite(&length, 2, 1, file) == 1 &&
            std::fwrite(header.data(), 1, header.size(), file) == header.size() &&
            (bytes == 0 || std::fwrite(data, 1, bytes, file) == bytes);
  return std::fclose(file) == 0 && ok;
}

// NumPy has no bfloat16 or float8: those are stored as their bits (the dump index names the dtype).
char const* npyDescr(DataType type) {
  switch (type) {
    case DataType::kHALF: return "<f2";
    case DataType::kBF16: return "<u2";
    case DataType::kFP8:
    case DataType::kUINT8: return "|u1";
    case DataType::kINT8: return "|i1";
    case DataType::kINT32: return "<i4";
    case DataType::kINT64: return "<i8";
    default: return "<f4";
  }
}

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) {
    if (cudaMalloc(&ptr, bytes ? bytes : 1) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(DeviceBuffer const&) = delete;
  DeviceBuffer& operator=(DeviceBuffer const&) = delete;
};

bool cudaOk(cudaError_t status, std::string const& what) {
  return status == cudaSuccess || check(false, what, cudaGetErrorString(status));
}

// Slot starts and lengths with every guard in play: ordinary, crossing the slot's end, negative,
// near INT32_MAX and INT32_MIN, lengths beyond L, zero and negative.
void slotPositions(Case const& c, std::vector<int32_t>& starts, std::vector<int32_t>& lengths) {
  int64_t const cap = c.pagesPerSlot * kP;
  for (int64_t b = 0; b < c.B; ++b) {
    int32_t start = 0, length = int32_t(c.L);
    switch (b % 7) {
      case 0: start = int32_t(below(std::max<int64_t>(1, cap - c.L + 1))); break;
      case 1: start = int32_t(cap - c.L / 2 - 1); break;  // crosses the slot's end: the tail is dropped
      case 2:
        start = -3;
        length = int32_t(c.L + 5);
        break;
      case 3: start = std::numeric_limits<int32_t>::max() - 2; break;
      case 4:
        start = int32_t(below(cap));
        length = int32_t(c.L / 2);
        break;
      case 5:
        start = std::numeric_limits<int32_t>::min();
        length = -1;
        break;
      case 6:
        start = 0;
        length = 0;
        break;
    }
    starts.push_back(start);
    lengths.push_back(length);
  }
  if (c.B > 0 && c.B <= 2) {  // small batches: keep one ordinary sequence
    starts[0] = int32_t(std::max<int64_t>(0, cap - c.L) / 2);
    lengths[0] = int32_t(c.L);
  }
}

// Paged positions, owners and table: distinct K and V pages per (sequence, page index), a few
// invalid ids (K outside [0, N), V outside [N, 2N)), owners that are padding or out of range,
// negative positions, positions past M pages (dropped, or wrapped with ring), tokens shuffled
// across owners. No two written tokens address the same pool row.
void pagedAddressing(Case const& c, std::vector<int32_t>& positions, std::vector<int32_t>& owners,
                     std::vector<int32_t>& table) {
  int64_t const window = c.M * kP;
  std::vector<int32_t> kPages(size_t(c.N)), vPages(size_t(c.N));
  std::iota(kPages.begin(), kPages.end(), 0);
  std::iota(vPages.begin(), vPages.end(), int32_t(c.N));
  for (int64_t i = c.N - 1; i > 0; --i) {
    std::swap(kPages[size_t(i)], kPages[size_t(below(i + 1))]);
    std::swap(vPages[size_t(i)], vPages[size_t(below(i + 1))]);
  }
  table.assign(size_t(c.B * 2 * c.M), 0);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t i = 0; i < c.M; ++i) {
      table[size_t((b * 2 + 0) * c.M + i)] = kPages[size_t(b * c.M + i)];
      table[size_t((b * 2 + 1) * c.M + i)] = vPages[size_t(b * c.M + i)];
    }
  if (c.B >= 2 && c.M >= 2) {  // invalid ids: those pages are never written
    table[size_t((1 * 2 + 0) * c.M + 0)] = int32_t(c.N);      // K id past N
    table[size_t((1 * 2 + 1) * c.M + 1)] = int32_t(c.N - 1);  // V id below N
    table[size_t((0 * 2 + 0) * c.M + c.M - 1)] = -1;
  }
  std::vector<std::vector<bool>> used(size_t(c.B), std::vector<bool>(size_t(window), false));
  for (int64_t t = 0; t < c.T; ++t) {
    int32_t owner = int32_t(below(c.B)), position = 0;
    switch (t % 9) {
      case 5:
        owner = -1;
        position = int32_t(below(window));
        break;  // padding
      case 6:
        owner = t % 2 ? int32_t(c.B) : std::numeric_limits<int32_t>::max();
        position = int32_t(below(window));
        break;
      case 7: position = t % 2 ? -1 - int32_t(below(1000)) : std::numeric_limits<int32_t>::min(); break;
      case 8:
        if (c.ring) {  // a far position, in the window's ring: wraps onto a fresh row
          owner = std::numeric_limits<int32_t>::min();
          position = std::numeric_limits<int32_t>::max();
        } else {  // past M pages: dropped
          position = t % 2 ? int32_t(window + below(1000)) : std::numeric_limits<int32_t>::max();
        }
        break;
      default: {
        int64_t r = below(window);
        for (int64_t tries = 0; used[size_t(owner)][size_t(r)] && tries < window; ++tries)
          r = (r + 1) % window;
        if (used[size_t(owner)][size_t(r)]) {
          owner = -1;
        } else {
          used[size_t(owner)][size_t(r)] = true;
        }
        position = int32_t(r + (c.ring ? below(3) * window : 0));
      }
    }
    positions.push_back(position);
    owners.push_back(owner);
  }
}

// Flat slots (page * P + row): distinct rows of the pool in a random order, and every guard in
// play: negative (-1 and the most negative), exactly N * P, past 2^31 and, for int64 slots, a
// valid slot plus 2^32 (lands nowhere: narrowed to 32 bits it would hit that slot). No two written
// tokens share a slot (which of two tokens a repeated slot keeps is one of them, not a bit pattern).
template <typename Index> std::vector<Index> slotMapping(Case const& c) {
  int64_t const rows = c.N * kP;
  std::vector<int64_t> unused(static_cast<size_t>(rows));
  std::iota(unused.begin(), unused.end(), int64_t(0));
  for (int64_t i = rows - 1; i > 0; --i) std::swap(unused[size_t(i)], unused[size_t(below(i + 1))]);
  std::vector<Index> slots;
  size_t next = 0;
  for (int64_t t = 0; t < c.T; ++t) {
    int64_t slot = unused[next % unused.size()];
    switch (t % 8) {
      case 3: slot = t % 2 ? -1 : int64_t(std::numeric_limits<Index>::min()); break;
      case 5: slot = rows; break;
      case 6:
        slot = sizeof(Index) == 8 ? int64_t(std::numeric_limits<int32_t>::max()) + 1 + below(1000)
                                  : std::numeric_limits<int32_t>::max();
        break;
      case 7:
        if (sizeof(Index) == 8) {
          slot += int64_t(1) << 32;
          break;
        }
        [[fallthrough]];
      default: ++next;
    }
    slots.push_back(Index(slot));
  }
  return slots;
}

// The host inputs of a case, in input order.
std::vector<std::vector<char>> hostInputs(Case const& c) {
  std::vector<Tensor> const in = inputs(c);
  std::vector<std::vector<char>> host;
  host.push_back(randomValues(volume(in[0].dims), c.delta, -2.f, 2.f));
  host.push_back(randomValues(volume(in[1].dims), c.delta, -2.f, 2.f));
  host.push_back(randomValues(volume(in[2].dims), c.pool, -4.f, 4.f));
  host.push_back(randomValues(volume(in[3].dims), DataType::kFLOAT, -1.f, 1.f));
  if (c.contract == Contract::kSlot) {
    std::vector<int32_t> starts, lengths;
    slotPositions(c, starts, lengths);
    host.push_back(bytesOf(starts));
    host.push_back(bytesOf(lengths));
  } else if (c.contract == Contract::kSlotMapping) {
    host.push_back(c.slotIndex == DataType::kINT64 ? bytesOf(slotMapping<int64_t>(c))
                                                   : bytesOf(slotMapping<int32_t>(c)));
  } else {
    std::vector<int32_t> positions, owners, table;
    pagedAddressing(c, positions, owners, table);
    host.push_back(bytesOf(positions));
    host.push_back(bytesOf(owners));
    host.push_back(bytesOf(table));
  }
  if (c.staticScales()) {
    // Small scales: some products saturate at 448 (kFP8) or 127 (kINT8).
    host.push_back(randomValues(c.scaleHeads, DataType::kFLOAT, 0.004f, 0.05f));
    host.push_back(randomValues(c.scaleHeads, DataType::kFLOAT, 0.004f, 0.05f));
  }
  // The scales of the rows already stored: each written row's is replaced by the call.
  if (c.scalePool)
    host.push_back(randomValues(volume(in[size_t(scalePoolIndex(c))].dims), DataType::kFLOAT, 0.01f, 1.f));
  if (c.kNorm) host.push_back(randomValues(c.D, c.delta, 0.5f, 1.5f));
  return host;
}

void gpuCase(Case const& c, std::string const& dumpDir, IPluginResourceContext* context) {
  std::string const t = tag(c);
  Played played = playContract(c, c, c, context);
  if (played.rt == nullptr) return;
  gRandomState = std::hash<std::string>{}(c.name);
  std::vector<Tensor> const in = inputs(c);
  RuntimeDescs d = runtimeDescs(c);
  std::vector<std::vector<char>> const host = hostInputs(c);
  int32_t const nb = int32_t(in.size());

  // The pool sits between two guard bands; nothing may be written there.
  constexpr size_t kGuard = 4096;
  size_t const poolBytes = host[dtrt::kPAST_KEY_VALUE].size();
  std::vector<std::unique_ptr<DeviceBuffer>> device;
  for (int32_t i = 0; i < nb; ++i)
    device.push_back(
        std::make_unique<DeviceBuffer>(i == dtrt::kPAST_KEY_VALUE ? poolBytes + 2 * kGuard : host[i].size()));
  DeviceBuffer separateOutput(poolBytes);
  int32_t const sp = scalePoolIndex(c);
  size_t const scaleBytes = sp >= 0 ? host[size_t(sp)].size() : 0;
  DeviceBuffer separateScales(scaleBytes);
  for (auto const& buffer : device)
    if (buffer->ptr == nullptr) return void(check(false, "cudaMalloc" + t));
  if (separateOutput.ptr == nullptr || separateScales.ptr == nullptr)
    return void(check(false, "cudaMalloc" + t));
  char* pool = static_cast<char*>(device[dtrt::kPAST_KEY_VALUE]->ptr) + kGuard;
  std::vector<char> const guardPattern(poolBytes + 2 * kGuard, char(0xA5));
  bool uploaded = cudaOk(cudaMemcpy(device[dtrt::kPAST_KEY_VALUE]->ptr, guardPattern.data(),
                                    guardPattern.size(), cudaMemcpyHostToDevice),
                         "guard bands" + t);
  std::vector<void const*> pointers(static_cast<size_t>(nb), nullptr);
  for (int32_t i = 0; i < nb; ++i) {
    void* target = i == dtrt::kPAST_KEY_VALUE ? pool : device[i]->ptr;
    pointers[size_t(i)] = target;
    uploaded = uploaded && cudaOk(cudaMemcpy(target, host[i].data(), host[i].size(), cudaMemcpyHostToDevice),
                                  "upload " + in[i].name + t);
  }
  cudaStream_t stream = nullptr;
  if (!uploaded || !cudaOk(cudaStreamCreate(&stream), "cudaStreamCreate" + t)) return;

  // Not aliased first (the outputs start as copies of the pool and the scale pool), then aliased
  // (in place).
  void* separate[2] = {separateOutput.ptr, separateScales.ptr};
  logger().clear();
  check(played.rt->enqueue(d.in.data(), d.out(), pointers.data(), separate, nullptr, stream) == 0,
        "enqueue into a separate output" + t, logger().all());
  void* aliased[2] = {pool, sp >= 0 ? device[size_t(sp)]->ptr : nullptr};
  check(played.rt->enqueue(d.in.data(), d.out(), pointers.data(), aliased, nullptr, stream) == 0,
        "enqueue in place (output aliases the pool)" + t, logger().all());
  cudaOk(cudaStreamSynchronize(stream), "cudaStreamSynchronize" + t);

  std::vector<char> withGuards(poolBytes + 2 * kGuard), unaliased(poolBytes);
  cudaOk(cudaMemcpy(withGuards.data(), device[dtrt::kPAST_KEY_VALUE]->ptr, withGuards.size(),
                    cudaMemcpyDeviceToHost),
         "download pool" + t);
  cudaOk(cudaMemcpy(unaliased.data(), separateOutput.ptr, poolBytes, cudaMemcpyDeviceToHost),
         "download output" + t);
  bool const guardsIntact =
      std::memcmp(withGuards.data(), guardPattern.data(), kGuard) == 0 &&
      std::memcmp(withGuards.data() + kGuard + poolBytes, guardPattern.data(), kGuard) == 0;
  check(guardsIntact, "no write outside the pool" + t);
  check(std::memcmp(withGuards.data() + kGuard, unaliased.data(), poolBytes) == 0,
        "aliased and separate outputs are identical" + t);
  check(std::memcmp(withGuards.data() + kGuard, host[dtrt::kPAST_KEY_VALUE].data(), poolBytes) != 0,
        "the pool was updated" + t);
  std::vector<char> scales(scaleBytes), unaliasedScales(scaleBytes);
  if (sp >= 0) {
    cudaOk(cudaMemcpy(scales.data(), device[size_t(sp)]->ptr, scaleBytes, cudaMemcpyDeviceToHost),
           "download scale pool" + t);
    cudaOk(cudaMemcpy(unaliasedScales.data(), separateScales.ptr, scaleBytes, cudaMemcpyDeviceToHost),
           "download scale output" + t);
    check(scales == unaliasedScales, "aliased and separate scale pools are identical" + t);
    check(scales != host[size_t(sp)], "the scale pool was updated" + t);
  }

  // A rejected enqueue on real buffers leaves the pool untouched.
  std::vector<char> const before(withGuards);
  RuntimeDescs bad = d;
  std::string expected;
  if (c.contract == Contract::kSlot) {
    int64_t const slots = c.N / c.pagesPerSlot;
    for (int32_t i : {0, 1}) bad.in[size_t(i)].dims.d[0] = slots + 1;
    bad.in[dtrt::kDELTA_START_POSITIONS].dims.d[0] = bad.in[dtrt::kDELTA_LENGTHS].dims.d[0] = slots + 1;
    expected = "batch B must be <=";
  } else if (c.contract == Contract::kSlotMapping) {
    dflash::AddressingForm const& form = dflash::addressing_form(c.contract);
    for (int32_t i = 0; i < form.base_count; ++i)
      if (form.base[i].role == dflash::OperandRole::kSlotIndex) {
        bad.in[size_t(i)].dims.d[0] = c.T + 1;  // one slot per token
        expected = form.base[i].name;
      }
  } else {
    bad.in[dtrt::kKV_PAGE_TABLE].dims.d[2] = c.N + 1;
    expected = "kv_page_table";
  }
  logger().clear();
  bool const rejected =
      played.rt->enqueue(bad.in.data(), bad.out(), pointers.data(), aliased, nullptr, stream) != 0;
  cudaStreamSynchronize(stream);
  cudaOk(cudaMemcpy(withGuards.data(), device[dtrt::kPAST_KEY_VALUE]->ptr, withGuards.size(),
                    cudaMemcpyDeviceToHost),
         "download pool" + t);
  check(rejected && logger().sawError(expected) && withGuards == before,
        "a rejected enqueue on device buffers leaves the pool as it was" + t, logger().all());
  cudaStreamDestroy(stream);

  if (dumpDir.empty()) return;
  std::string const dir = dumpDir + "/" + c.name;
  mkdir(dir.c_str(), 0755);
  bool ok = true;
  std::vector<std::string> names;
  for (int32_t i = 0; i < nb; ++i) {
    ok = ok && writeNpy(dir + "/" + in[i].name + ".npy", npyDescr(in[i].type), in[i].dims, host[i].data(),
                        host[i].size());
    names.push_back(jsonString(in[i].name));
  }
  ok = ok && writeNpy(dir + "/present_key_value.npy", npyDescr(c.pool), output(c).dims,
                      withGuards.data() + kGuard, poolBytes);
  if (sp >= 0)
    ok = ok && writeNpy(dir + "/present_scale_pool.npy", npyDescr(DataType::kFLOAT), scaleOutput(c).dims,
                        scales.data(), scaleBytes);
  JsonObject entry;
  entry.add("name", c.name)
      .add("dir", dir)
      .add("contract", dflash::addressing_form(c.contract).name)
      .add("delta_dtype", dtypeName(c.delta))
      .add("pool_dtype", dtypeName(c.pool))
      .add("dtype", dtypeName(c.pool))
      .add("ring", c.ring)
      .add("k_norm", c.kNorm)
      .add("v_norm", c.vNorm)
      .add("norm_eps", double(c.eps))
      .addRaw("inputs", jsonArray(names))
      .add("output", "present_key_value");
  if (c.contract == Contract::kSlot) entry.add("pages_per_slot", c.pagesPerSlot);
  if (c.contract == Contract::kSlotMapping) entry.add("slot_dtype", dtypeName(c.slotIndex));
  if (c.staticScales()) entry.add("scale_heads", c.scaleHeads);
  if (c.scalePool) entry.add("scale_output", "present_scale_pool");
  // The pool's format by name (int4's bytes are uint8).
  entry.add("pool_format", c.int4() ? std::string("int4") : dtypeName(c.pool));
  FILE* meta = std::fopen((dir + "/meta.json").c_str(), "w");
  ok = ok && meta != nullptr;
  if (meta != nullptr) {
    std::fprintf(meta, "%s\n", entry.str().c_str());
    ok = std::fclose(meta) == 0 && ok;
  }
  if (check(ok, "dumped inputs and output to " + dir)) addDump(entry);
}

// The quantized formats of one form: kINT8 with static scales (per head, per tensor), kINT8 and
// kFP8 with a scale pool, and int4 (kUINT8 [.., D / 2], a scale pool only) where contract.h's row
// says a CUDA kernel stores it. `make(shape, delta, pool)` builds a case of the form; shapes 0 and
// 1 must have an even D.
template <typename Make, typename Shape>
void quantizedCases(std::vector<Case>& cases, Make make, Shape const* shapes) {
  Case c = make(shapes[0], DataType::kHALF, DataType::kINT8);
  c.name += "_per_head_scales", c.scaleHeads = c.H;
  cases.push_back(c);
  c = make(shapes[1], DataType::kBF16, DataType::kINT8);
  c.name += "_per_tensor_scales_k_norm", c.scaleHeads = 1, c.kNorm = true;
  cases.push_back(c);
  c = make(shapes[0], DataType::kBF16, DataType::kINT8);
  c.name += "_scale_pool", c.scalePool = true;
  cases.push_back(c);
  c = make(shapes[1], DataType::kFLOAT, DataType::kFP8);
  c.name += "_scale_pool_k_norm_v_norm", c.scalePool = true, c.kNorm = c.vNorm = true, c.eps = 1e-5f;
  cases.push_back(c);
  if (dflash::pool_format(dflash::DType::kUInt8)->cuda) {
    c = make(shapes[0], DataType::kHALF, DataType::kUINT8);
    c.name += "_int4_scale_pool", c.scalePool = true;
    cases.push_back(c);
  }
}

std::vector<Case> slotGpuCases() {
  struct Shape {
    char const* name;
    int64_t B, L, H, D, N, pagesPerSlot, Rb, S, R;
  };
  // Decode-like; partial rotary with per-sequence tables and S < cap; odd sizes (vector width 1);
  // a long delta crossing pages; no RoPE at all.
  Shape const shapes[] = {
      {"decode", 4, 16, 8, 128, 8, 2, 1, 256, 128}, {"partial_rotary", 3, 40, 2, 64, 4, 1, 3, 100, 32},
      {"odd_sizes", 7, 9, 3, 6, 14, 2, 1, 200, 2},  {"long_delta", 2, 300, 1, 32, 9, 3, 2, 384, 16},
      {"no_rope", 2, 5, 2, 16, 2, 1, 1, 0, 0},
  };
  auto make = [](Shape const& s, DataType delta, DataType pool) {
    Case c;
    c.contract = Contract::kSlot;
    c.name = std::string("slot_") + s.name + "_" + dtypeName(delta) +
             (pool == delta ? "" : "_into_" + dtypeName(pool));
    c.delta = delta, c.pool = pool;
    c.B = s.B, c.L = s.L, c.H = s.H, c.D = s.D, c.N = s.N, c.pagesPerSlot = s.pagesPerSlot, c.Rb = s.Rb,
    c.S = s.S, c.R = s.R;
    return c;
  };
  std::vector<Case> cases;
  for (DataType type : {DataType::kHALF, DataType::kBF16, DataType::kFLOAT})
    for (Shape const& s : shapes) cases.push_back(make(s, type, type));
  Case c = make(shapes[0], DataType::kHALF, DataType::kFP8);
  c.name += "_per_tensor_scales", c.scaleHeads = 1;
  cases.push_back(c);
  c = make(shapes[1], DataType::kBF16, DataType::kFP8);
  c.name += "_per_head_scales", c.scaleHeads = c.H;
  cases.push_back(c);
  c = make(shapes[0], DataType::kFLOAT, DataType::kFP8);
  c.name += "_per_head_scales_k_norm_v_norm", c.scaleHeads = c.H, c.kNorm = c.vNorm = true, c.eps = 1e-5f;
  cases.push_back(c);
  c = make(shapes[0], DataType::kHALF, DataType::kHALF);
  c.name += "_k_norm", c.kNorm = true;
  cases.push_back(c);
  c = make(shapes[2], DataType::kBF16, DataType::kBF16);
  c.name += "_v_norm", c.vNorm = true;
  cases.push_back(c);
  c = make(shapes[1], DataType::kBF16, DataType::kFLOAT);
  c.name += "_k_norm", c.kNorm = true;
  cases.push_back(c);
  quantizedCases(cases, make, shapes);
  return cases;
}

std::vector<Case> pagedGpuCases() {
  struct Shape {
    char const* name;
    int64_t T, H, D, N, B, M, R;
  };
  Shape const shapes[] = {
      {"tokens", 64, 4, 128, 32, 5, 4, 128},
      {"odd_sizes", 37, 3, 6, 20, 4, 3, 2},
      {"partial_rotary", 50, 2, 64, 12, 3, 2, 32},
  };
  auto make = [](Shape const& s, DataType delta, DataType pool) {
    Case c;
    c.contract = Contract::kPaged;
    c.name = std::string("paged_") + s.name + "_" + dtypeName(delta) +
             (pool == delta ? "" : "_into_" + dtypeName(pool));
    c.delta = delta, c.pool = pool;
    c.T = s.T, c.H = s.H, c.D = s.D, c.N = s.N, c.B = s.B, c.M = s.M, c.R = s.R;
    return c;
  };
  std::vector<Case> cases;
  for (DataType type : {DataType::kHALF, DataType::kBF16, DataType::kFLOAT})
    for (Shape const& s : shapes) cases.push_back(make(s, type, type));
  Case c = make(shapes[0], DataType::kHALF, DataType::kHALF);
  c.name += "_ring", c.ring = true;
  cases.push_back(c);
  c = make(shapes[0], DataType::kHALF, DataType::kFP8);
  c.name += "_per_tensor_scales", c.scaleHeads = 1;
  cases.push_back(c);
  c = make(shapes[2], DataType::kBF16, DataType::kFP8);
  c.name += "_per_head_scales_ring", c.scaleHeads = c.H, c.ring = true;
  cases.push_back(c);
  c = make(shapes[0], DataType::kFLOAT, DataType::kFP8);
  c.name += "_per_head_scales_k_norm_v_norm", c.scaleHeads = c.H, c.kNorm = c.vNorm = true, c.eps = 1e-5f;
  cases.push_back(c);
  c = make(shapes[0], DataType::kBF16, DataType::kBF16);
  c.name += "_k_norm", c.kNorm = true;
  cases.push_back(c);
  c = make(shapes[1], DataType::kHALF, DataType::kFLOAT);
  c.name += "_v_norm", c.vNorm = true;
  cases.push_back(c);
  Case ring = make(shapes[2], DataType::kHALF, DataType::kINT8);
  ring.name += "_scale_pool_ring", ring.scalePool = true, ring.ring = true;
  cases.push_back(ring);
  quantizedCases(cases, make, shapes);
  return cases;
}

std::vector<Case> slotMappingGpuCases() {
  struct Shape {
    char const* name;
    int64_t T, H, D, N, R;
  };
  Shape const shapes[] = {
      {"tokens", 64, 4, 128, 4, 128},
      {"odd_sizes", 37, 3, 6, 3, 2},
      {"partial_rotary", 50, 2, 64, 2, 32},
  };
  auto make = [](Shape const& s, DataType delta, DataType pool) {
    Case c;
    c.contract = Contract::kSlotMapping;
    c.name = std::string("slot_mapping_") + s.name + "_" + dtypeName(delta) +
             (pool == delta ? "" : "_into_" + dtypeName(pool));
    c.delta = delta, c.pool = pool;
    c.T = s.T, c.H = s.H, c.D = s.D, c.N = s.N, c.R = s.R;
    return c;
  };
  std::vector<Case> cases;
  for (DataType type : {DataType::kHALF, DataType::kBF16, DataType::kFLOAT})
    for (Shape const& s : shapes) cases.push_back(make(s, type, type));
  Case c = make(shapes[0], DataType::kHALF, DataType::kHALF);
  c.name += "_int32_slots", c.slotIndex = DataType::kINT32;
  cases.push_back(c);
  c = make(shapes[0], DataType::kHALF, DataType::kFP8);
  c.name += "_per_tensor_scales", c.scaleHeads = 1;
  cases.push_back(c);
  c = make(shapes[2], DataType::kBF16, DataType::kFP8);
  c.name += "_per_head_scales", c.scaleHeads = c.H;
  cases.push_back(c);
  c = make(shapes[0], DataType::kFLOAT, DataType::kFP8);
  c.name += "_per_head_scales_k_norm_v_norm", c.scaleHeads = c.H, c.kNorm = c.vNorm = true, c.eps = 1e-5f;
  cases.push_back(c);
  c = make(shapes[1], DataType::kHALF, DataType::kFLOAT);
  c.name += "_v_norm", c.vNorm = true;
  cases.push_back(c);
  c = make(shapes[0], DataType::kBF16, DataType::kBF16);
  c.name += "_k_norm", c.kNorm = true;
  cases.push_back(c);
  quantizedCases(cases, make, shapes);
  return cases;
}

}  // namespace

void gpuCases(std::string const& dumpDir, IPluginResourceContext* context) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    Group group(kGpuSlotGroup);
    check(false, "--gpu: a CUDA device is present");
    return;
  }
  if (!dumpDir.empty()) mkdir(dumpDir.c_str(), 0755);
  {
    Group group(kGpuSlotGroup);
    requireGroup(kGpuSlotGroup);
    for (Case const& c : slotGpuCases()) gpuCase(c, dumpDir, context);
  }
  {
    Group group(kGpuPagedGroup);
    requireGroup(kGpuPagedGroup);
    for (Case const& c : pagedGpuCases()) gpuCase(c, dumpDir, context);
  }
  {
    Group group(kGpuSlotMappingGroup);
    requireGroup(kGpuSlotMappingGroup);
    for (Case const& c : slotMappingGpuCases()) gpuCase(c, dumpDir, context);
  }
  if (!dflash::pool_format(dflash::DType::kUInt8)->cuda) {
    // No int4 dumps: contract.h's row says no CUDA kernel stores int4 yet, and the plugin says so.
    Group group(kGpuSlotGroup);
    std::printf("NOTE int4 GPU cases left out: contract.h's int4 row has cuda = false (no CUDA kernel)\n");
    Case c = slotGpuCases().front();
    c.name = "slot_int4_without_a_cuda_kernel", c.pool = DataType::kUINT8, c.scalePool = true;
    Played played = playContract(c, c, c, context);
    if (played.rt != nullptr) enqueueEmpty(played.rt, c);
  }
}

}  // namespace harness
