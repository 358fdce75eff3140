// _dflash_cuda: the XLA FFI handler of the update on CUDA. It translates the buffers into
// KVUpdateParams and calls the launcher the TensorRT plugin calls too. Safe to capture into a
// CUDA graph (XLA command buffers): it only enqueues work on XLA's stream.
#include <cuda_runtime_api.h>

#include "dflash/kv_update_cuda.h"
#include "ffi_params.h"
#include "nanobind/nanobind.h"

namespace nb = nanobind;

namespace dflash::jax {
namespace {

ffi::Error cuda_error(cudaError_t status) {
  return ffi::Error::Internal(std::string("dflash_target_kv_cache_update: CUDA error: ") +
                              cudaGetErrorString(status));
}

ffi::Error target_kv_cache_update_cuda_impl(cudaStream_t stream, ffi::AnyBuffer k_delta,
                                            ffi::AnyBuffer v_delta, ffi::AnyBuffer past_key_value,
                                            ffi::Buffer<ffi::F32> rope_cos_sin,
                                            ffi::Buffer<ffi::S32> delta_start_positions,
                                            ffi::Buffer<ffi::S32> delta_lengths,
                                            ffi::Result<ffi::AnyBuffer> present_key_value,
                                            int64_t pages_per_slot) {
  KVUpdateParams p;
  if (ffi::Error e = params_from_buffers(k_delta, v_delta, past_key_value, rope_cos_sin,
                                         delta_start_positions, delta_lengths, pages_per_slot, &p);
      e.failure())
    return e;
  if (present_key_value->untyped_data() != past_key_value.untyped_data()) {
    cudaError_t const copied = cudaMemcpyAsync(
        present_key_value->untyped_data(), past_key_value.untyped_data(),
        past_key_value.size_bytes(), cudaMemcpyDeviceToDevice, stream);
    if (copied != cudaSuccess) return cuda_error(copied);
  }
  p.pool = present_key_value->untyped_data();
  if (cudaError_t const status = launch_target_kv_cache_update(p, stream); status != cudaSuccess)
    return cuda_error(status);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TargetKVCacheUpdateCuda, target_kv_cache_update_cuda_impl,
                              bind_update_operands(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

// The launcher over raw device pointers, for benchmarks and the TensorRT parity harness (callers
// bring their own allocations, e.g. torch or cupy). Raises on invalid parameters or launch errors.
void launch_raw(uintptr_t k_delta, uintptr_t v_delta, uintptr_t pool, uintptr_t rope_cos_sin,
                uintptr_t delta_start_positions, uintptr_t delta_lengths, int32_t dtype,
                int64_t num_layers, int64_t batch, int64_t delta_len, int64_t num_kv_heads,
                int64_t head_dim, int64_t num_pages, int64_t page_size, int64_t pages_per_slot,
                int64_t rotary_dim, int64_t rope_batch, int64_t rope_seq_len, bool rope_per_layer,
                bool positions_per_layer, uintptr_t stream) {
  KVUpdateParams p;
  p.k_delta = reinterpret_cast<void const*>(k_delta);
  p.v_delta = reinterpret_cast<void const*>(v_delta);
  p.pool = reinterpret_cast<void*>(pool);
  p.rope_cos_sin = reinterpret_cast<float const*>(rope_cos_sin);
  p.delta_start_positions = reinterpret_cast<int32_t const*>(delta_start_positions);
  p.delta_lengths = reinterpret_cast<int32_t const*>(delta_lengths);
  if (dtype < 0 || dtype > 2) throw nb::value_error("dtype code must be 0 (f16), 1 (bf16) or 2 (f32)");
  p.dtype = static_cast<DType>(dtype);
  p.num_layers = num_layers;
  p.batch = batch;
  p.delta_len = delta_len;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.num_pages = num_pages;
  p.page_size = page_size;
  p.pages_per_slot = pages_per_slot;
  p.rotary_dim = rotary_dim;
  p.rope_batch = rope_batch;
  p.rope_seq_len = rope_seq_len;
  p.rope_per_layer = rope_per_layer;
  p.positions_per_layer = positions_per_layer;
  if (std::string const error = check_params(p); !error.empty()) throw nb::value_error(error.c_str());
  cudaError_t const status = launch_target_kv_cache_update(p, reinterpret_cast<cudaStream_t>(stream));
  if (status != cudaSuccess) throw std::runtime_error(cudaGetErrorString(status));
}

}  // namespace dflash::jax

NB_MODULE(_dflash_cuda, m) {
  m.def("launch", &dflash::jax::launch_raw, nb::kw_only(), nb::arg("k_delta"), nb::arg("v_delta"),
        nb::arg("pool"), nb::arg("rope_cos_sin"), nb::arg("delta_start_positions"),
        nb::arg("delta_lengths"), nb::arg("dtype"), nb::arg("num_layers"), nb::arg("batch"),
        nb::arg("delta_len"), nb::arg("num_kv_heads"), nb::arg("head_dim"), nb::arg("num_pages"),
        nb::arg("page_size"), nb::arg("pages_per_slot"), nb::arg("rotary_dim"),
        nb::arg("rope_batch"), nb::arg("rope_seq_len"), nb::arg("rope_per_layer") = false,
        nb::arg("positions_per_layer") = false, nb::arg("stream") = 0,
        "Enqueues the update kernel over raw device pointers (the launcher the JAX handler and "
        "the TensorRT plugin call).");
  m.def("registrations", []() {
    nb::dict targets;
    targets["dflash_target_kv_cache_update"] =
        nb::capsule(reinterpret_cast<void*>(dflash::jax::TargetKVCacheUpdateCuda));
    return targets;
  });
}
