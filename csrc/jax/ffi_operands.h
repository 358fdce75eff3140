// XLA FFI buffers and attributes -> TensorDescs and UpdateAttrs -> KVUpdateParams (operands.h).
// Shapes were checked at trace time (jax_dflash/_shapes.py); they are checked again here, since a
// custom call can be reached by hand-written ffi_calls and HLO too: anything off is an error
// returned to XLA, never a crash or a write outside the result.
#pragma once

#include <array>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dflash/operands.h"
#include "xla/ffi/api/ffi.h"

namespace dflash::jax {

namespace ffi = ::xla::ffi;

inline char const* target_name(Contract contract) { return addressing_form(contract).ffi_target; }

inline ffi::Error invalid(Contract contract, std::string const& message) {
  return ffi::Error::InvalidArgument(std::string(target_name(contract)) + ": " + message);
}

inline DType from_ffi(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F16: return DType::kFloat16;
    case ffi::DataType::BF16: return DType::kBFloat16;
    case ffi::DataType::F32: return DType::kFloat32;
    case ffi::DataType::F8E4M3FN: return DType::kFloat8E4M3;
    case ffi::DataType::F8E5M2: return DType::kFloat8E5M2;
    case ffi::DataType::S32: return DType::kInt32;
    case ffi::DataType::S64: return DType::kInt64;
    case ffi::DataType::PRED: return DType::kBool;
    case ffi::DataType::S8: return DType::kInt8;
    case ffi::DataType::U8: return DType::kUInt8;
    case ffi::DataType::S16: return DType::kInt16;
    case ffi::DataType::U16: return DType::kUInt16;
    case ffi::DataType::U32: return DType::kUInt32;
    case ffi::DataType::U64: return DType::kUInt64;
    case ffi::DataType::F64: return DType::kFloat64;
    default: return DType::kOther;
  }
}

inline TensorDesc describe(ffi::AnyBuffer const& buffer) {
  TensorDesc desc;
  auto const dims = buffer.dimensions();
  desc.dtype = from_ffi(buffer.element_type());
  desc.rank = int32_t(dims.size());
  for (size_t i = 0; i < dims.size() && i < size_t(kMaxRank); ++i) desc.dims[i] = dims[i];
  desc.data = buffer.untyped_data();
  return desc;
}

// The attributes of SPEC.md's ABI: the form's own (pages_per_slot: int64 or int32, required;
// ring: bool, or in the layer-batched form an int8 array of one 0/1 entry per layer), then k_norm,
// v_norm (bool) and norm_eps (float32), which every form has. Anything else is an error. The
// per-layer entries stay in the call frame for the call.
inline ffi::Error read_attrs(Contract contract, ffi::Dictionary const& attrs, UpdateAttrs* out) {
  AddressingForm const& form = addressing_form(contract);
  out->contract = contract;
  bool pages_per_slot_seen = false;
  for (auto it = attrs.begin(); it != attrs.end(); ++it) {
    std::string_view const name = *it;
    auto wrong_type = [&](char const* wanted) {
      return invalid(contract, "attribute " + std::string(name) + ": expected " + wanted);
    };
    if (form.has_pages_per_slot && name == "pages_per_slot") {
      if (auto v = attrs.get<int64_t>(name); v.has_value()) {
        out->pages_per_slot = *v;
      } else if (auto v32 = attrs.get<int32_t>(name); v32.has_value()) {
        out->pages_per_slot = *v32;
      } else {
        return wrong_type("an int64 (or int32) scalar");
      }
      pages_per_slot_seen = true;
    } else if (form.has_ring && name == "ring") {
      if (auto v = attrs.get<bool>(name); v.has_value()) {
        out->ring = *v;
      } else if (auto entries = attrs.get<ffi::Span<int8_t const>>(name); entries.has_value()) {
        out->ring_layers = entries->begin();
        out->ring_layer_count = int64_t(entries->size());
      } else {
        return wrong_type("a bool, or an int8 array of one entry per layer");
      }
    } else if (name == "k_norm" || name == "v_norm") {
      auto v = attrs.get<bool>(name);
      if (!v.has_value()) return wrong_type("a bool");
      (name == "k_norm" ? out->k_norm : out->v_norm) = *v;
    } else if (name == "scale_pool") {
      auto v = attrs.get<bool>(name);
      if (!v.has_value()) return wrong_type("a bool");
      out->scale_pool = *v;
    } else if (name == "norm_eps") {
      auto v = attrs.get<float>(name);
      if (!v.has_value()) return wrong_type("a float32 scalar");
      out->norm_eps = *v;
    } else {
      return invalid(contract, "unknown attribute " + std::string(name) +
                                   " (known: " + (form.has_pages_per_slot ? "pages_per_slot, " : "") +
                                   (form.has_ring ? "ring, " : "") + "k_norm, v_norm, norm_eps, scale_pool)");
    }
  }
  if (form.has_pages_per_slot && !pages_per_slot_seen)
    return invalid(contract, "missing attribute pages_per_slot (an int64 > 0)");
  return ffi::Error::Success();
}

// An updated operand and the result aliasing it: the pool, or the scale pool.
struct InPlace {
  std::optional<ffi::AnyBuffer> operand, result;
  // The result starts as the operand; should XLA ever hand over two buffers (of the operand's
  // checked dims and dtype), the caller copies the operand into the result first.
  bool aliased() const { return !operand || result->untyped_data() == operand->untyped_data(); }
};

// Decodes one call: every operand and result (all bound as remaining arguments/results, so that a
// wrong count is this target's own error naming what is expected) and the attributes. On success
// *p describes the update with p->pool (and p->scale_pool, with the scale_pool attribute) pointing
// at the results.
inline ffi::Error decode_call(Contract contract, ffi::RemainingArgs const& args,
                              ffi::RemainingRets const& rets, ffi::Dictionary const& attrs, KVUpdateParams* p,
                              InPlace* pool, InPlace* scales) {
  UpdateAttrs a;
  if (ffi::Error e = read_attrs(contract, attrs, &a); e.failure()) return e;
  int32_t const base = base_operand_count(contract);
  if (args.size() < size_t(base) || args.size() > size_t(base + kMaxExtraOperands + (a.scale_pool ? 1 : 0)))
    return invalid(contract,
                   "expected " + std::to_string(base) + " operands (" +
                       base_operand_list(addressing_form(contract)) +
                       "), then k_scale and v_scale for a pool format with scales, then k_norm_weight "
                       "with k_norm; got " +
                       std::to_string(args.size()) + " operands");
  size_t const results = a.scale_pool ? 2 : 1;
  if (rets.size() != results)
    return invalid(contract, a.scale_pool ? "expected 2 results with scale_pool (present_key_value and "
                                            "present_scale_pool, updated in place), got " +
                                                std::to_string(rets.size()) + " results"
                                          : "expected 1 result (present_key_value, the pool updated in "
                                            "place), got " +
                                                std::to_string(rets.size()) + " results");
  // The count is checked above; one more than the extras' most lets the checker name a call with
  // both static scales and scale_pool.
  std::array<TensorDesc, kMaxBaseOperands + kMaxExtraOperands + 1> operands;
  for (size_t i = 0; i < args.size(); ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (!buffer.has_value()) return invalid(contract, "operand " + std::to_string(i) + " is not an array");
    if (i == size_t(kPoolOperand)) pool->operand.emplace(*buffer);
    if (a.scale_pool && i == size_t(base)) scales->operand.emplace(*buffer);
    operands[i] = describe(*buffer);
  }
  auto out = rets.get<ffi::AnyBuffer>(0);
  if (!out.has_value()) return invalid(contract, "present_key_value: the result is not an array");
  pool->result.emplace(**out);
  if (std::string e = check_result(describe(*pool->result), operands[kPoolOperand]); !e.empty())
    return invalid(contract, e);
  if (std::string e = params_from_operands(operands.data(), int32_t(args.size()), a, p, /*need_data=*/true);
      !e.empty())
    return invalid(contract, e);
  p->pool = pool->result->untyped_data();
  if (a.scale_pool) {
    auto scale_out = rets.get<ffi::AnyBuffer>(1);
    if (!scale_out.has_value())
      return invalid(contract, std::string(kScaleResultName) + ": the result is not an array");
    scales->result.emplace(**scale_out);
    if (std::string e = check_scale_result(describe(*scales->result), operands[base]); !e.empty())
      return invalid(contract, e);
    p->scale_pool = static_cast<float*>(scales->result->untyped_data());
  }
  return ffi::Error::Success();
}

// The binding of every target, after the platform context (if any): SPEC.md's operands in order
// then the extras, the results (the pool's, then the scale pool's with scale_pool), the attributes
// as a dictionary.
template <typename Binding> auto bind_update_call(Binding binding) {
  return std::move(binding).RemainingArgs().RemainingRets().template Attrs<ffi::Dictionary>();
}

// One FFI target per addressing form of contract.h: {target name, handler}, where
// Handler<C>::call is the form's handler on one platform. A new form is a row of the table.
using TargetHandler = XLA_FFI_Error* (*)(XLA_FFI_CallFrame*);
template <template <Contract> class Handler, size_t... I>
constexpr std::array<std::pair<char const*, TargetHandler>, sizeof...(I)> form_targets(
    std::index_sequence<I...>) {
  return {{{kAddressingForms[I].ffi_target, &Handler<kAddressingForms[I].contract>::call}...}};
}
template <template <Contract> class Handler> constexpr auto form_targets() {
  return form_targets<Handler>(std::make_index_sequence<std::size(kAddressingForms)>{});
}

}  // namespace dflash::jax
