// The CUDA launcher of the update, shared by the JAX FFI handler and the TensorRT plugin.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

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
// capability, asked once per device, is 9.0 or more. The one place that decides it for launches
// on a stream.
bool pdl_enabled();

// Whether launches recorded into an XLA command buffer (the record stage of the JAX FFI handlers,
// whose kernel image is compiled for 9.0 or more) use PDL: DFLASH_PDL, read once per process, is
// not "0". On by default: in a command buffer the edge from the kernel before is XLA's to make.
bool record_pdl_switch_on();

// One launch of the update kernel as a plan: the kernel (its host stub: cudaFuncGetName names
// it), its grid and block, and its second by-value parameter (the launch's constants, as bytes);
// the first is the KVUpdateParams itself.
struct KernelLaunch {
  void const* kernel = nullptr;
  dim3 grid, block;
  alignas(8) unsigned char constants[256];
  size_t constants_size = 0;
};

// Appends to *out the launches launch_target_kv_cache_update would make for p, in order, without
// launching anything; none when nothing needs launching. p must have passed check_params().
// cudaErrorNotSupported for calls whose launches it does not plan (per-token-head dynamic scales,
// a form without a CUDA kernel).
cudaError_t plan_target_kv_cache_update(KVUpdateParams const& p, std::vector<KernelLaunch>* out);

}  // namespace dflash
