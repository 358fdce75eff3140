// The CUDA launcher of the update, shared by the JAX FFI handler and the TensorRT plugin.
#pragma once

#include <cuda_runtime_api.h>

#include "dflash/kv_update.h"

namespace dflash {

// Enqueues the update on `stream`. p must have passed check_params(); all pointers are device
// pointers. Returns the launch status (cudaSuccess when nothing needed launching).
cudaError_t launch_target_kv_cache_update(KVUpdateParams const& p, cudaStream_t stream);

}  // namespace dflash
