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

template <Contract C, typename Pool> cudaError_t for_delta(KVUpdateParams const& p, cudaStream_t stream) {
  switch (p.delta_dtype) {
    case DType::kFloat16: return launch_widest<C, F16, Pool>(p, stream);
    case DType::kBFloat16: return launch_widest<C, BF16, Pool>(p, stream);
    case DType::kFloat32: return launch_widest<C, F32, Pool>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <Contract C> cudaError_t for_pool(KVUpdateParams const& p, cudaStream_t stream) {
  switch (p.pool_dtype) {
    case DType::kFloat16: return for_delta<C, F16>(p, stream);
    case DType::kBFloat16: return for_delta<C, BF16>(p, stream);
    case DType::kFloat32: return for_delta<C, F32>(p, stream);
    case DType::kFloat8E4M3: return for_delta<C, E4M3>(p, stream);
    case DType::kFloat8E5M2: return for_delta<C, E5M2>(p, stream);
    case DType::kInt8: return for_delta<C, I8>(p, stream);
    case DType::kUInt8: return for_delta<C, I4>(p, stream);  // int4
    default: return cudaErrorInvalidValue;
  }
}

// DFLASH_PDL, read once: "1" turns programmatic dependent launch on; unset (or anything else)
// leaves it off. Off by default because on the H200 it made the update slower where it follows
// the GEMM that produces its deltas (the benchmark's raw GEMM chain: +0.57 us at B=1 L=16, +0.68
// at B=64 L=16), though faster back to back (-0.23 / -0.17 us): BENCHMARKS.md.
bool pdl_switch_on() {
  static bool const on = [] {
    char const* value = std::getenv("DFLASH_PDL");
    return value != nullptr && std::strcmp(value, "1") == 0;
  }();
  return on;
}

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

cudaError_t launch_target_kv_cache_update(KVUpdateParams const& p, cudaStream_t stream) {
  // A form whose kernel path has not passed on the GPU is refused here, under every runtime.
  if (!addressing_form(p.contract).cuda) return cudaErrorNotSupported;
  if (p.num_layers * tokens_per_layer(p) == 0 || p.num_kv_heads * p.head_dim == 0) return cudaSuccess;
  switch (p.contract) {
    case Contract::kSlot: return for_pool<Contract::kSlot>(p, stream);
    case Contract::kPaged: return for_pool<Contract::kPaged>(p, stream);
    case Contract::kSlotMapping: return for_pool<Contract::kSlotMapping>(p, stream);
    default: return cudaErrorNotSupported;
  }
}

}  // namespace dflash
