// The CUDA launcher of the update, shared by the JAX FFI handlers and the TensorRT plugin: picks
// the kernel instantiation (kv_update_kernel.cuh, one unit per pool dtype) for the contract and
// the delta/pool dtypes.
#include "dflash/kv_update_cuda.h"
#include "dflash/kv_update_kernel.cuh"

DFLASH_DECLARE_POOL(F16)
DFLASH_DECLARE_POOL(BF16)
DFLASH_DECLARE_POOL(F32)
DFLASH_DECLARE_POOL(E4M3)
DFLASH_DECLARE_POOL(E5M2)
DFLASH_DECLARE_POOL(I8)

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
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

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
