// The CUDA launcher of the update, shared by the JAX FFI handlers and the TensorRT plugin: picks
// the kernel instantiation (kv_update_kernel.cuh, one unit per pool dtype) for the contract and
// the delta/pool dtypes.
#include "dflash/kv_update_cuda.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "dflash/kv_update_kernel.cuh"

DFLASH_DECLARE_POOL(F16)
DFLASH_DECLARE_POOL(BF16)
DFLASH_DECLARE_POOL(F32)
DFLASH_DECLARE_POOL(E4M3)
DFLASH_DECLARE_POOL(E5M2)
DFLASH_DECLARE_POOL(I8)
DFLASH_DECLARE_POOL(I4)

namespace dflash {
namespace {

using namespace kernel;

// What the dispatch below does with the instantiation it picks: launch it on a stream, or plan
// its launches.
struct Enqueue {
  cudaStream_t stream;
  template <Contract C, typename Delta, typename Pool> cudaError_t run(KVUpdateParams const& p) const {
    return launch_widest<C, Delta, Pool>(p, stream);
  }
};
struct Plan {
  std::vector<KernelLaunch>* out;
  template <Contract C, typename Delta, typename Pool> cudaError_t run(KVUpdateParams const& p) const {
    return plan_widest<C, Delta, Pool>(p, out);
  }
};

template <Contract C, typename Pool, typename Op>
cudaError_t for_delta(KVUpdateParams const& p, Op const& op) {
  switch (p.delta_dtype) {
    case DType::kFloat16: return op.template run<C, F16, Pool>(p);
    case DType::kBFloat16: return op.template run<C, BF16, Pool>(p);
    case DType::kFloat32: return op.template run<C, F32, Pool>(p);
    default: return cudaErrorInvalidValue;
  }
}

template <Contract C, typename Op> cudaError_t for_pool(KVUpdateParams const& p, Op const& op) {
  switch (p.pool_dtype) {
    case DType::kFloat16: return for_delta<C, F16>(p, op);
    case DType::kBFloat16: return for_delta<C, BF16>(p, op);
    case DType::kFloat32: return for_delta<C, F32>(p, op);
    case DType::kFloat8E4M3: return for_delta<C, E4M3>(p, op);
    case DType::kFloat8E5M2: return for_delta<C, E5M2>(p, op);
    case DType::kInt8: return for_delta<C, I8>(p, op);
    case DType::kUInt8: return for_delta<C, I4>(p, op);  // int4
    default: return cudaErrorInvalidValue;
  }
}

template <typename Op> cudaError_t for_contract(KVUpdateParams const& p, Op const& op) {
  switch (p.contract) {
    case Contract::kSlot: return for_pool<Contract::kSlot>(p, op);
    case Contract::kPaged: return for_pool<Contract::kPaged>(p, op);
    case Contract::kSlotMapping: return for_pool<Contract::kSlotMapping>(p, op);
    default: return cudaErrorNotSupported;
  }
}

// DFLASH_PDL, read once: "1", "0", or anything else (unset included).
char const* pdl_switch() {
  static char const* const value = [] {
    char const* v = std::getenv("DFLASH_PDL");
    if (v != nullptr && std::strcmp(v, "1") == 0) return "1";
    if (v != nullptr && std::strcmp(v, "0") == 0) return "0";
    return "";
  }();
  return value;
}

// Launches on a stream: "1" turns programmatic dependent launch on; unset (or anything else)
// leaves it off. Off by default because on the H200 it made the update slower where it follows
// the GEMM that produces its deltas (the benchmark's raw GEMM chain: +0.57 us at B=1 L=16, +0.68
// at B=64 L=16), though faster back to back (-0.23 / -0.17 us): BENCHMARKS.md.
bool pdl_switch_on() { return std::strcmp(pdl_switch(), "1") == 0; }

// Whether every virtual architecture this unit (and so the kernel units, built with the same
// flags) was compiled for is 9.0 or more. A device of 9.0 or more that ran an image of an older one
// (its PTX compiled at load time) would run a kernel without griddepcontrol.wait, which a launch
// with the attribute must not.
constexpr bool images_wait_for_producer() {
#ifdef __CUDA_ARCH_LIST__
  for (int arch : {__CUDA_ARCH_LIST__})
    if (arch < 900) return false;
  return true;
#else
  return false;
#endif
}

// The compute capability test of pdl_enabled, cached per device: 0 not asked yet, 1 no, 2 yes.
// Devices past the table are asked at every launch (one attribute query).
constexpr int kCachedDevices = 64;
std::atomic<signed char> device_has_pdl[kCachedDevices];

bool device_supports_pdl(int device) {
  bool const cached = device >= 0 && device < kCachedDevices;
  if (cached) {
    if (signed char const known = device_has_pdl[device].load(std::memory_order_relaxed); known != 0)
      return known == 2;
  }
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    (void)cudaGetLastError();  // the plain launch reports any real problem with the device
    return false;
  }
  bool const yes = major >= 9;
  if (cached) device_has_pdl[device].store(yes ? 2 : 1, std::memory_order_relaxed);
  return yes;
}

}  // namespace

bool pdl_enabled() {
  if (!images_wait_for_producer() || !pdl_switch_on()) return false;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();  // no device: no launch either, and its own error says why
    return false;
  }
  return device_supports_pdl(device);
}

bool record_pdl_switch_on() { return std::strcmp(pdl_switch(), "0") != 0; }

cudaError_t launch_target_kv_cache_update(KVUpdateParams const& p, cudaStream_t stream) {
  // A form whose kernel path has not passed on the GPU is refused here, under every runtime.
  if (!addressing_form(p.contract).cuda) return cudaErrorNotSupported;
  if (p.num_layers * tokens_per_layer(p) == 0 || p.num_kv_heads * p.head_dim == 0) return cudaSuccess;
  return for_contract(p, Enqueue{stream});
}

cudaError_t plan_target_kv_cache_update(KVUpdateParams const& p, std::vector<KernelLaunch>* out) {
  if (!addressing_form(p.contract).cuda) return cudaErrorNotSupported;
  if (p.num_layers * tokens_per_layer(p) == 0 || p.num_kv_heads * p.head_dim == 0) return cudaSuccess;
  return for_contract(p, Plan{out});
}

}  // namespace dflash
