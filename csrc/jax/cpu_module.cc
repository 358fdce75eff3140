// _dflash_cpu: the XLA FFI handlers of both contracts on CPU, and the same kernel for NumPy
// callers (the ONNX reference runtime uses it).
#include <cstring>

#include "array_operands.h"
#include "contract_bindings.h"
#include "dflash/kv_update_cpu.h"
#include "ffi_operands.h"

namespace dflash::jax {
namespace {

ffi::Error run_cpu(Contract contract, ffi::RemainingArgs args, ffi::RemainingRets rets,
                   ffi::Dictionary attrs) {
  KVUpdateParams p;
  InPlace pool, scales;
  if (ffi::Error e = decode_call(contract, args, rets, attrs, &p, &pool, &scales); e.failure()) return e;
  for (InPlace const* buffers : {&pool, &scales})
    if (!buffers->aliased())
      std::memcpy(buffers->result->untyped_data(), buffers->operand->untyped_data(),
                  buffers->operand->size_bytes());
  target_kv_cache_update_cpu(p);
  return ffi::Error::Success();
}

// The XLA FFI handler of form C on CPU.
template <Contract C> struct CpuHandler {
  static ffi::Error run(ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Dictionary attrs) {
    return run_cpu(C, args, rets, attrs);
  }
  static XLA_FFI_Error* call(XLA_FFI_CallFrame* call_frame) {
    XLA_FFI_DEFINE_HANDLER(handler, run, bind_update_call(ffi::Ffi::Bind()));
    return (*handler)(call_frame);
  }
};

}  // namespace

namespace {

void run_numpy(KVUpdateParams const& p) {
  nb::gil_scoped_release release;
  target_kv_cache_update_cpu(p);
}

// The keywords arrive as Python objects, so that a wrong one is reported by name (array_operands.h).
void update_slot_numpy(nb::handle k_delta, nb::handle v_delta, nb::handle pool, nb::handle rope_cos_sin,
                       nb::handle delta_start_positions, nb::handle delta_lengths, nb::handle k_scale,
                       nb::handle v_scale, nb::handle k_norm_weight, nb::handle pages_per_slot,
                       nb::handle v_norm, nb::handle norm_eps, nb::handle delta_dtype, nb::handle pool_dtype,
                       nb::kwargs const& unknown) {
  refuse_unknown_keywords(unknown, "target_kv_cache_update",
                          "k_scale, v_scale, k_norm_weight, pages_per_slot, v_norm, norm_eps, delta_dtype, "
                          "pool_dtype");
  UpdateAttrs const attrs = slot_attrs(pages_per_slot, v_norm, norm_eps);
  KeptArrays keep;
  run_numpy(params_from_arrays<nb::device::cpu>(
      attrs, {k_delta, v_delta, pool, rope_cos_sin, delta_start_positions, delta_lengths}, k_scale, v_scale,
      k_norm_weight, delta_dtype, pool_dtype, keep));
}

void update_paged_numpy(nb::handle k_delta, nb::handle v_delta, nb::handle pool, nb::handle rope_cos_sin,
                        nb::handle delta_positions, nb::handle delta_token_to_sequence,
                        nb::handle kv_page_table, nb::handle k_scale, nb::handle v_scale,
                        nb::handle k_norm_weight, nb::handle ring, nb::handle v_norm, nb::handle norm_eps,
                        nb::handle delta_dtype, nb::handle pool_dtype, nb::kwargs const& unknown) {
  refuse_unknown_keywords(unknown, "target_kv_cache_update_paged",
                          "k_scale, v_scale, k_norm_weight, ring, v_norm, norm_eps, delta_dtype, pool_dtype");
  RingArgument const ring_entries = ring_argument(ring);
  UpdateAttrs const attrs = paged_attrs(ring_entries, v_norm, norm_eps);
  KeptArrays keep;
  run_numpy(params_from_arrays<nb::device::cpu>(
      attrs, {k_delta, v_delta, pool, rope_cos_sin, delta_positions, delta_token_to_sequence, kv_page_table},
      k_scale, v_scale, k_norm_weight, delta_dtype, pool_dtype, keep));
}

// Any addressing form by its name (contract.h), its base operands as one sequence: a new form
// needs no entry of its own.
void update_numpy(std::string const& form, nb::handle operands, nb::handle k_scale, nb::handle v_scale,
                  nb::handle k_norm_weight, nb::handle pages_per_slot, nb::handle ring, nb::handle v_norm,
                  nb::handle norm_eps, nb::handle delta_dtype, nb::handle pool_dtype, nb::handle scale_pool,
                  nb::kwargs const& unknown) {
  refuse_unknown_keywords(
      unknown, "update",
      "k_scale, v_scale, k_norm_weight, pages_per_slot, ring, v_norm, norm_eps, delta_dtype, "
      "pool_dtype, scale_pool");
  RingArgument ring_entries;
  UpdateAttrs const attrs = form_attrs(form, pages_per_slot, ring, v_norm, norm_eps, ring_entries);
  KeptArrays keep;
  run_numpy(params_from_arrays<nb::device::cpu>(attrs, form_operands(form, operands), k_scale, v_scale,
                                                k_norm_weight, delta_dtype, pool_dtype, keep, scale_pool));
}

}  // namespace
}  // namespace dflash::jax

NB_MODULE(_dflash_cpu, m) {
  namespace nb = nanobind;
  using namespace nb::literals;
  m.def("registrations", []() {
    nb::dict targets;
    for (auto const& [name, handler] : dflash::jax::form_targets<dflash::jax::CpuHandler>())
      targets[name] = nb::capsule(reinterpret_cast<void*>(handler));
    return targets;
  });
  dflash::jax::bind_contract(m);
  m.def("update", &dflash::jax::update_numpy, "form"_a, "operands"_a, "k_scale"_a = nb::none(),
        "v_scale"_a = nb::none(), "k_norm_weight"_a = nb::none(), nb::kw_only(),
        "pages_per_slot"_a = nb::none(), "ring"_a = nb::none(), "v_norm"_a = false, "norm_eps"_a = 1e-6f,
        "delta_dtype"_a = "", "pool_dtype"_a = "", "scale_pool"_a = nb::none(), "kwargs"_a,
        "Updates `pool` (operands[2]) in place with the CPU kernel, for the addressing form named `form`\n"
        "('slot', 'paged', ...: docs/SPEC.md), its base operands in order as one sequence; the\n"
        "keywords as in target_kv_cache_update(_paged), each form taking its own. `scale_pool`: the\n"
        "per-token-head scales (float32, the pool's dims without D), updated in place too, in place\n"
        "of k_scale and v_scale.");
  m.def("target_kv_cache_update", &dflash::jax::update_slot_numpy, "k_delta"_a, "v_delta"_a, "pool"_a,
        "rope_cos_sin"_a, "delta_start_positions"_a, "delta_lengths"_a, "k_scale"_a = nb::none(),
        "v_scale"_a = nb::none(), "k_norm_weight"_a = nb::none(), nb::kw_only(),
        "pages_per_slot"_a = nb::none(), "v_norm"_a = false, "norm_eps"_a = 1e-6f, "delta_dtype"_a = "",
        "pool_dtype"_a = "", "kwargs"_a,
        "Updates `pool` in place with the CPU kernel (slot contract, docs/SPEC.md). bfloat16 and FP8\n"
        "arrays: ml_dtypes NumPy arrays as they are, or uint16/uint8 views of their bits with\n"
        "delta_dtype/pool_dtype naming them. The pool must be a writable array the caller owns.");
  m.def("target_kv_cache_update_paged", &dflash::jax::update_paged_numpy, "k_delta"_a, "v_delta"_a, "pool"_a,
        "rope_cos_sin"_a, "delta_positions"_a, "delta_token_to_sequence"_a, "kv_page_table"_a,
        "k_scale"_a = nb::none(), "v_scale"_a = nb::none(), "k_norm_weight"_a = nb::none(), nb::kw_only(),
        "ring"_a = false, "v_norm"_a = false, "norm_eps"_a = 1e-6f, "delta_dtype"_a = "", "pool_dtype"_a = "",
        "kwargs"_a,
        "Updates `pool` in place with the CPU kernel (paged contract, docs/SPEC.md). bfloat16 and FP8\n"
        "arrays: ml_dtypes NumPy arrays as they are, or uint16/uint8 views of their bits with\n"
        "delta_dtype/pool_dtype naming them. The pool must be a writable array the caller owns.");
}
