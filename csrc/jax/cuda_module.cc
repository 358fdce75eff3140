// _dflash_cuda: the XLA FFI handlers of both contracts on CUDA. They translate the buffers into
// KVUpdateParams (operands.h) and call the launcher the TensorRT plugin calls too. Safe to capture
// into a CUDA graph (XLA command buffers): they only enqueue work on XLA's stream. Built against
// XLA FFI headers with the record API (DFLASH_FFI_RECORD, cmake/FfiRecordStage.cmake), each target
// also has a record stage, which hands XLA the kernel's launches (image, name, dimensions and
// by-value parameters) for its command buffer instead of a stream to capture. Also the raw
// launcher over DLPack arrays (jax, torch, cupy), for benchmarks and the TensorRT parity tests, and
// whether the launches use programmatic dependent launch (pdl_enabled, kv_update_cuda.h).
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <initializer_list>
#include <vector>

#include "array_operands.h"
#include "dflash/kv_update_cuda.h"
#include "ffi_operands.h"

#if DFLASH_FFI_RECORD
#include "jax/record_images.h"
#include "xla/ffi/api/record_api.h"
#endif

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

// What the record stage did in this process: launches created (kCreate) and updated (kUpdate),
// and calls handed back to XLA to capture on a stream; for the tests and the probe.
std::atomic<int64_t> record_created{0}, record_updated{0}, record_captured{0};
std::atomic<char const*> record_last_capture{""};  // why the latest capture was asked (a literal)

#if DFLASH_FFI_RECORD
using RecordContext = ffi::internal::RecordContextBase<ffi::internal::ErrorPolicy>;
using RecordExtension = ffi::internal::RecordExtensionBase<RecordContext>;

// Whether the current device runs the record images (CUBINs for sm_DFLASH_RECORD_ARCH: the same
// major compute capability, a minor at least as high).
bool device_runs_record_images() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major == DFLASH_RECORD_ARCH / 10 && minor >= DFLASH_RECORD_ARCH % 10;
}

// The record stage of form C: on kCreate, one launch command per launch of the plan
// (plan_target_kv_cache_update: the kernels, dimensions and constants the execute stage would
// launch), from the pool format's CUBIN, with programmatic dependent launch when
// record_pdl_switch_on() (no dependencies: XLA adds the edges to the commands around it); on
// kUpdate (XLA's buffers moved), the same launches with the new parameters. What it does not plan
// goes back to XLA as a request to capture the execute stage on a stream, at kCreate and again at
// kUpdate: a pool (or scale pool) XLA did not alias to the result (a copy first), per-token-head
// dynamic scales (their own kernel), a device that cannot run the images, a plan of more launches
// than XLA takes from one call, and anything the execute stage refuses (it says why).
ffi::Error record_cuda(Contract contract, RecordContext ctx, ffi::RemainingArgs args, ffi::RemainingRets rets,
                       ffi::Dictionary attrs) {
  bool const update = ctx.action() == ffi::RecordAction::kUpdate;
  // XLA's capture of the execute stage reports any error itself; `why` is kept for
  // record_stage_last_capture().
  auto capture = [&](char const* why) {
    record_last_capture.store(why, std::memory_order_relaxed);
    record_captured.fetch_add(1, std::memory_order_relaxed);
    return ctx.RequestStreamCapture();
  };
  if (!addressing_form(contract).cuda) return capture("no CUDA kernel for the form");
  KVUpdateParams p;
  InPlace pool, scales;
  if (ffi::Error e = decode_call(contract, args, rets, attrs, &p, &pool, &scales); e.failure()) return e;
  if (!cpu_only_format(p).empty()) return capture("a pool format without a CUDA kernel");
  if (!pool.aliased() || !scales.aliased()) return capture("a pool not aliased to its result");
  // The plan's kernel depends on the buffers' alignment up to 16 bytes (the vector width); XLA's
  // buffers are aligned beyond that, which keeps kUpdate's plan kCreate's.
  for (void const* ptr :
       std::initializer_list<void const*>{p.k_delta, p.v_delta, p.pool, p.rope_cos_sin, p.k_norm_weight})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return capture("a buffer aligned to less than 16 bytes");
  if (!device_runs_record_images()) return capture("a device that cannot run the record images");
  RecordImage const image = record_image(p.pool_dtype);
  if (image.size == 0) return capture("no record image for the pool format");
  std::vector<KernelLaunch> plan;
  if (cudaError_t const status = plan_target_kv_cache_update(p, &plan); status != cudaSuccess) {
    if (status == cudaErrorNotSupported) return capture("launches the plan does not cover");
    return cuda_error(contract, status);
  }
  ffi::BoundedCommandVector const commands = ctx.commands();
  if (plan.empty()) return capture("nothing to launch");
  if (!update && int64_t(plan.size()) > commands.capacity()) return capture("more launches than XLA takes");
  if (update && int64_t(plan.size()) != commands.size()) {
    if (commands.size() == 0) return capture("captured at kCreate");
    return ffi::Error::Internal(std::string(target_name(contract)) +
                                ": record stage: " + std::to_string(plan.size()) + " launches planned, " +
                                std::to_string(commands.size()) + " recorded at kCreate");
  }
  bool const pdl = record_pdl_switch_on();
  for (size_t i = 0; i < plan.size(); ++i) {
    KernelLaunch const& step = plan[i];
    std::array<ffi::KernelArg, 2> const kernel_args = {ffi::HostValue{&p, sizeof(p)},
                                                       ffi::HostValue{step.constants, step.constants_size}};
    if (update) {
      if (ffi::Error e = ctx.UpdateLaunch(commands[i], kernel_args); e.failure()) return e;
      record_updated.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    char const* name = nullptr;
    if (cudaError_t const status = cudaFuncGetName(&name, step.kernel); status != cudaSuccess) {
      (void)cudaGetLastError();
      return cuda_error(contract, status);
    }
    XLA_FFI_LaunchDims const dims = {{int32_t(step.grid.x), int32_t(step.grid.y), int32_t(step.grid.z)},
                                     {int32_t(step.block.x), int32_t(step.block.y), int32_t(step.block.z)},
                                     {0, 0, 0}};
    auto command = ctx.CreateLaunch(name, image.data, image.size, ffi::SourceFormat::kCubin, dims,
                                    /*shared_mem_bytes=*/0, pdl, kernel_args);
    if (command.has_error()) return command.error();
    record_created.fetch_add(1, std::memory_order_relaxed);
  }
  return ffi::Error::Success();
}
#endif

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
#if DFLASH_FFI_RECORD
  static ffi::Error record_launches(RecordContext ctx, ffi::RemainingArgs args, ffi::RemainingRets rets,
                                    ffi::Dictionary attrs) {
    return record_cuda(C, ctx, args, rets, attrs);
  }
  static XLA_FFI_Error* record(XLA_FFI_CallFrame* call_frame) {
    XLA_FFI_DEFINE_HANDLER(handler, record_launches,
                           bind_update_call(ffi::Ffi::BindRecord().Ctx<ffi::Extension<RecordExtension>>()),
                           {ffi::Traits::kCmdBufferCompatible});
    return (*handler)(call_frame);
  }
#endif
};

#if DFLASH_FFI_RECORD
// The record handler of each target, by name, in form_targets' order.
template <template <Contract> class Handler, size_t... I>
constexpr std::array<TargetHandler, sizeof...(I)> record_handlers(std::index_sequence<I...>) {
  return {{&Handler<kAddressingForms[I].contract>::record...}};
}
#endif

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
                 nb::handle scale_pool, nb::kwargs const& unknown) {
  refuse_unknown_keywords(
      unknown, "launch_form",
      "k_scale, v_scale, k_norm_weight, pages_per_slot, ring, v_norm, norm_eps, delta_dtype, "
      "pool_dtype, stream, scale_pool");
  RingArgument ring_entries;
  UpdateAttrs const attrs = form_attrs(form, pages_per_slot, ring, v_norm, norm_eps, ring_entries);
  uintptr_t const cuda_stream = stream_argument(stream);
  KeptArrays keep;
  enqueue(params_from_arrays<nb::device::cuda>(attrs, form_operands(form, operands), k_scale, v_scale,
                                               k_norm_weight, delta_dtype, pool_dtype, keep, scale_pool),
          cuda_stream);
}

}  // namespace
}  // namespace dflash::jax

NB_MODULE(_dflash_cuda, m) {
  namespace nb = nanobind;
  using namespace nb::literals;
  m.def(
      "registrations",
      [](bool record) {
        nb::dict targets;
        auto const forms = dflash::jax::form_targets<dflash::jax::CudaHandler>();
#if DFLASH_FFI_RECORD
        auto const recorders = dflash::jax::record_handlers<dflash::jax::CudaHandler>(
            std::make_index_sequence<std::size(dflash::kAddressingForms)>{});
#endif
        for (size_t i = 0; i < forms.size(); ++i) {
          auto const& [name, handler] = forms[i];
          nb::capsule execute(reinterpret_cast<void*>(handler));
#if DFLASH_FFI_RECORD
          if (record) {
            nb::dict stages;
            stages["execute"] = execute;
            stages["record"] = nb::capsule(reinterpret_cast<void*>(recorders[i]));
            targets[name] = stages;
            continue;
          }
#endif
          targets[name] = execute;
        }
        return targets;
      },
      "record"_a = true);
  m.def(
      "ffi_record_stage",
      []() {
#if DFLASH_FFI_RECORD
        return true;
#else
        return false;
#endif
      },
      "Whether this build's FFI targets have a record stage (built against XLA FFI headers with the\n"
      "record API: jaxlib 0.11 or later).");
  m.def(
      "record_stage_counts",
      []() {
        nb::dict counts;
        counts["created"] = dflash::jax::record_created.load();
        counts["updated"] = dflash::jax::record_updated.load();
        counts["captured"] = dflash::jax::record_captured.load();
        return counts;
      },
      "What the record stage did in this process: launch commands created and updated, and calls\n"
      "handed back to XLA to capture on a stream (all 0 without a record stage).");
  m.def(
      "record_stage_last_capture", []() { return std::string(dflash::jax::record_last_capture.load()); },
      "Why the record stage last handed a call back to XLA to capture on a stream ('' if never).");
  m.def("record_pdl_enabled", &dflash::record_pdl_switch_on,
        "Whether the record stage asks XLA for programmatic dependent launch: the environment variable\n"
        "DFLASH_PDL (read once per process) is not '0'.");
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
        "delta_dtype"_a = "", "pool_dtype"_a = "", "stream"_a = 0, "scale_pool"_a = nb::none(), "kwargs"_a,
        "Enqueues the update of the addressing form named `form` ('slot', 'paged', ...: docs/SPEC.md),\n"
        "its base operands in order as one sequence, on `stream`; the keywords as in launch(_paged).\n"
        "`scale_pool`: the per-token-head scales (float32, the pool's dims without D), updated in\n"
        "place too, in place of k_scale and v_scale.");
}
