// _dflash_cuda: the XLA FFI handlers of both contracts on CUDA. They translate the buffers into
// KVUpdateParams (operands.h) and call the launcher the TensorRT plugin calls too. Safe to capture
// into a CUDA graph (XLA command buffers): they only enqueue work on XLA's stream. Also the raw
// launcher over DLPack arrays (jax, torch, cupy), for benchmarks and the TensorRT parity tests, and
// whether the launches use programmatic dependent launch (pdl_enabled, kv_update_cuda.h).
#include <cuda_runtime_api.h>

#include "array_operands.h"
#include "dflash/kv_update_cuda.h"
#include "ffi_operands.h"

namespace dflash::jax {
namespace {

ffi::Error cuda_error(Contract contract, cudaError_t status) {
  return ffi::Error::Internal(std::string(target_name(contract)) +
                              ": CUDA error: " + cudaGetErrorString(status));
}

// Why the CUDA kernel does not store the pool's format (contract.h's row says which do); empty
// when it does.
std::string cpu_only_format(KVUpdateParams const& p) {
  PoolFormat const* format = pool_format(p.pool_dtype);
  if (format == nullptr || format->cuda) return {};
  return std::string("past_key_value: ") + format->name + " pools (" + dtype_name(p.pool_dtype) +
         ") are written on the CPU only so far (no CUDA kernel stores them); run this call on "
         "jax.devices('cpu')";
}

ffi::Error run_cuda(Contract contract, cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                    ffi::Dictionary attrs) {
  if (!addressing_form(contract).cuda)
    return ffi::Error(ffi::ErrorCode::kUnimplemented, std::string(target_name(contract)) + ": the " +
                                                          addressing_form(contract).name +
                                                          " form has no CUDA kernel yet (CPU only)");
  KVUpdateParams p;
  InPlace pool, scales;
  if (ffi::Error e = decode_call(contract, args, rets, attrs, &p, &pool, &scales); e.failure()) return e;
  if (std::string const refused = cpu_only_format(p); !refused.empty())
    return ffi::Error(ffi::ErrorCode::kUnimplemented, std::string(target_name(contract)) + ": " + refused);
  for (InPlace const* buffers : {&pool, &scales}) {
    if (buffers->aliased()) continue;
    cudaError_t const copied =
        cudaMemcpyAsync(buffers->result->untyped_data(), buffers->operand->untyped_data(),
                        buffers->operand->size_bytes(), cudaMemcpyDeviceToDevice, stream);
    if (copied != cudaSuccess) return cuda_error(contract, copied);
  }
  if (cudaError_t const status = launch_target_kv_cache_update(p, stream); status != cudaSuccess)
    return cuda_error(contract, status);
  return ffi::Error::Success();
}

// The XLA FFI handler of form C on CUDA; it only enqueues, so XLA may record it in a command buffer.
template <Contract C> struct CudaHandler {
  static ffi::Error run(cudaStream_t stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                        ffi::Dictionary attrs) {
    return run_cuda(C, stream, args, rets, attrs);
  }
  static XLA_FFI_Error* call(XLA_FFI_CallFrame* call_frame) {
    XLA_FFI_DEFINE_HANDLER(handler, run,
                           bind_update_call(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                           {ffi::Traits::kCmdBufferCompatible});
    return (*handler)(call_frame);
  }
};

}  // namespace

namespace {

void enqueue(KVUpdateParams const& p, uintptr_t stream) {
  if (std::string const refused = cpu_only_format(p); !refused.empty()) throw nb::type_error(refused.c_str());
  if (!addressing_form(p.contract).cuda)
    throw nb::type_error((std::string("form: the ") + addressing_form(p.contract).name +
                          " form has no CUDA kernel yet (CPU only)")
                             .c_str());
  cudaError_t const status = launch_target_kv_cache_update(p, reinterpret_cast<cudaStream_t>(stream));
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("CUDA error: ") + cudaGetErrorString(status));
}

// The keywords arrive as Python objects, so that a wrong one is reported by name (array_operands.h).
void launch_slot(nb::handle k_delta, nb::handle v_delta, nb::handle pool, nb::handle rope_cos_sin,
                 nb::handle delta_start_positions, nb::handle delta_lengths, nb::handle k_scale,
                 nb::handle v_scale, nb::handle k_norm_weight, nb::handle pages_per_slot, nb::handle v_norm,
                 nb::handle norm_eps, nb::handle delta_dtype, nb::handle pool_dtype, nb::handle stream,
                 nb::kwargs const& unknown) {
  refuse_unknown_keywords(unknown, "launch",
                          "k_scale, v_scale, k_norm_weight, pages_per_slot, v_norm, norm_eps, delta_dtype, "
                          "pool_dtype, stream");
  UpdateAttrs const attrs = slot_attrs(pages_per_slot, v_norm, norm_eps);
  uintptr_t const cuda_stream = stream_argument(stream);
  KeptArrays keep;
  enqueue(params_from_arrays<nb::device::cuda>(
              attrs, {k_delta, v_delta, pool, rope_cos_sin, delta_start_positions, delta_lengths}, k_scale,
              v_scale, k_norm_weight, delta_dtype, pool_dtype, keep),
          cuda_stream);
}

void launch_paged(nb::handle k_delta, nb::handle v_delta, nb::handle pool, nb::handle rope_cos_sin,
                  nb::handle delta_positions, nb::handle delta_token_to_sequence, nb::handle kv_page_table,
                  nb::handle k_scale, nb::handle v_scale, nb::handle k_norm_weight, nb::handle ring,
                  nb::handle v_norm, nb::handle norm_eps, nb::handle delta_dtype, nb::handle pool_dtype,
                  nb::handle stream, nb::kwargs const& unknown) {
  refuse_unknown_keywords(unknown, "launch_paged",
                          "k_scale, v_scale, k_norm_weight, ring, v_norm, norm_eps, delta_dtype, pool_dtype, "
                          "stream");
  RingArgument const ring_entries = ring_argument(ring);
  UpdateAttrs const attrs = paged_attrs(ring_entries, v_norm, norm_eps);
  uintptr_t const cuda_stream = stream_argument(stream);
  KeptArrays keep;
  enqueue(params_from_arrays<nb::device::cuda>(
              attrs,
              {k_delta, v_delta, pool, rope_cos_sin, delta_positions, delta_token_to_sequence, kv_page_table},
              k_scale, v_scale, k_norm_weight, delta_dtype, pool_dtype, keep),
          cuda_stream);
}

// Any addressing form by its name (contract.h), its base operands as one sequence.
void launch_form(std::string const& form, nb::handle operands, nb::handle k_scale, nb::handle v_scale,
                 nb::handle k_norm_weight, nb::handle pages_per_slot, nb::handle ring, nb::handle v_norm,
                 nb::handle norm_eps, nb::handle delta_dtype, nb::handle pool_dtype, nb::handle stream,
                 nb::kwargs const& unknown) {
  refuse_unknown_keywords(
      unknown, "launch_form",
      "k_scale, v_scale, k_norm_weight, pages_per_slot, ring, v_norm, norm_eps, delta_dtype, "
      "pool_dtype, stream");
  RingArgument ring_entries;
  UpdateAttrs const attrs = form_attrs(form, pages_per_slot, ring, v_norm, norm_eps, ring_entries);
  uintptr_t const cuda_stream = stream_argument(stream);
  KeptArrays keep;
  enqueue(params_from_arrays<nb::device::cuda>(attrs, form_operands(form, operands), k_scale, v_scale,
                                               k_norm_weight, delta_dtype, pool_dtype, keep),
          cuda_stream);
}

}  // namespace
}  // namespace dflash::jax

NB_MODULE(_dflash_cuda, m) {
  namespace nb = nanobind;
  using namespace nb::literals;
  m.def("registrations", []() {
    nb::dict targets;
    for (auto const& [name, handler] : dflash::jax::form_targets<dflash::jax::CudaHandler>())
      targets[name] = nb::capsule(reinterpret_cast<void*>(handler));
    return targets;
  });
  m.def("pdl_enabled", &dflash::pdl_enabled,
        "Whether the launches on the current CUDA device use programmatic dependent launch: the\n"
        "environment variable DFLASH_PDL (read once per process) is not '0', this build's kernels\n"
        "were compiled for compute capability 9.0 or more, and so is the device. False where no CUDA\n"
        "device is visible.");
  m.def("launch", &dflash::jax::launch_slot, "k_delta"_a, "v_delta"_a, "pool"_a, "rope_cos_sin"_a,
        "delta_start_positions"_a, "delta_lengths"_a, "k_scale"_a = nb::none(), "v_scale"_a = nb::none(),
        "k_norm_weight"_a = nb::none(), nb::kw_only(), "pages_per_slot"_a = nb::none(), "v_norm"_a = false,
        "norm_eps"_a = 1e-6f, "delta_dtype"_a = "", "pool_dtype"_a = "", "stream"_a = 0, "kwargs"_a,
        "Enqueues the slot-contract update on `stream` over CUDA arrays (DLPack: jax, torch, cupy); the\n"
        "pool, a writable array the caller owns (torch, cupy), is updated in place. FP8 pools as\n"
        "float8 tensors or as uint8 views with pool_dtype naming them.");
  m.def("launch_paged", &dflash::jax::launch_paged, "k_delta"_a, "v_delta"_a, "pool"_a, "rope_cos_sin"_a,
        "delta_positions"_a, "delta_token_to_sequence"_a, "kv_page_table"_a, "k_scale"_a = nb::none(),
        "v_scale"_a = nb::none(), "k_norm_weight"_a = nb::none(), nb::kw_only(), "ring"_a = false,
        "v_norm"_a = false, "norm_eps"_a = 1e-6f, "delta_dtype"_a = "", "pool_dtype"_a = "", "stream"_a = 0,
        "kwargs"_a,
        "Enqueues the paged-contract update on `stream` over CUDA arrays (DLPack: jax, torch, cupy); the\n"
        "pool, a writable array the caller owns (torch, cupy), is updated in place. FP8 pools as\n"
        "float8 tensors or as uint8 views with pool_dtype naming them.");
  m.def("launch_form", &dflash::jax::launch_form, "form"_a, "operands"_a, "k_scale"_a = nb::none(),
        "v_scale"_a = nb::none(), "k_norm_weight"_a = nb::none(), nb::kw_only(),
        "pages_per_slot"_a = nb::none(), "ring"_a = nb::none(), "v_norm"_a = false, "norm_eps"_a = 1e-6f,
        "delta_dtype"_a = "", "pool_dtype"_a = "", "stream"_a = 0, "kwargs"_a,
        "Enqueues the update of the addressing form named `form` ('slot', 'paged', ...: docs/SPEC.md),\n"
        "its base operands in order as one sequence, on `stream`; the keywords as in launch(_paged).");
}
