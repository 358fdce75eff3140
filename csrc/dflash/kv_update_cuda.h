// The CUDA launcher of the update, shared by the JAX FFI handler and the TensorRT plugin.
#pragma once

#include <cuda_runtime_api.h>

#include "dflash/kv_update.h"

namespace dflash {

// Enqueues the update on `stream`. p must have passed check_params(); all pointers are device
// pointers. Returns the launch status (cudaSuccess when nothing needed launching).
cudaError_t launch_target_kv_cache_update(KVUpdateParams const& p, cudaStream_t stream);

// Whether the launches on the current device use programmatic dependent launch (PDL): the kernel
// may then start while the kernel before it on the stream finishes, and waits for that kernel's
// writes (griddepcontrol.wait) before its own first load or store. True when the environment
// variable DFLASH_PDL, read once per process, is not "0", every kernel image of this build was
// compiled for compute capability 9.0 or more (so has the wait), and the device's compute
// capability, asked once per device, is 9.0 or more. The one place that decides it.
bool pdl_enabled();

}  // namespace dflash
