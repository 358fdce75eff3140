// The core's contract for Python (part of _dflash_cpu): the checker and the descriptors.
//
// The JAX API (at trace time), the NumPy reference and the ONNX node builder call check_call
// with their operands' dtypes and dims, so that the rules and their messages are the core's
// (operands.cc) and nothing in Python decides what a valid call is.
#include "contract_bindings.h"

#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>
#include <vector>

#include "array_operands.h"
#include "dflash/contract.h"
#include "dflash/operands.h"

namespace dflash::jax {
namespace {

namespace nb = nanobind;

// NumPy's dtype names (str(np.dtype)); a name not listed is kOther.
DType dtype_from_numpy(std::string const& name) {
  static constexpr DType kNamed[] = {
      DType::kFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat8E4M3, DType::kFloat8E5M2,
      DType::kInt32,   DType::kInt64,    DType::kBool,    DType::kInt8,       DType::kUInt8,
      DType::kInt16,   DType::kUInt16,   DType::kUInt32,  DType::kUInt64,     DType::kFloat64,
  };
  for (DType d : kNamed)
    if (name == dtype_name(d)) return d;
  return DType::kOther;
}

// One operand as Python describes it: (dtype name, dims); a dim of None is not known yet.
TensorDesc describe(nb::handle operand, std::string const& name, bool* any_unknown) {
  nb::tuple const pair = nb::cast<nb::tuple>(operand);
  if (pair.size() != 2) throw nb::type_error((name + ": expected a (dtype, dims) pair").c_str());
  TensorDesc desc;
  desc.dtype = dtype_from_numpy(nb::cast<std::string>(nb::str(pair[0])));
  nb::sequence const dims = nb::cast<nb::sequence>(pair[1]);
  size_t const rank = nb::len(dims);
  if (rank > size_t(kMaxRank))
    throw nb::value_error((name + ": rank " + std::to_string(rank) + " is not supported (at most " +
                           std::to_string(kMaxRank) + ")")
                              .c_str());
  desc.rank = int32_t(rank);
  for (size_t i = 0; i < rank; ++i) {
    nb::handle const d = dims[i];
    if (d.is_none()) {
      desc.dims[i] = kUnknownDim;
      *any_unknown = true;
    } else {
      desc.dims[i] = nb::cast<int64_t>(d);
    }
  }
  return desc;
}

nb::dict params_dict(KVUpdateParams const& p) {
  nb::dict d;
  d["contract"] = addressing_form(p.contract).name;
  d["delta_dtype"] = dtype_name(p.delta_dtype);
  d["pool_dtype"] = dtype_name(p.pool_dtype);
  d["num_layers"] = p.num_layers;
  d["batch"] = p.batch;
  d["delta_len"] = p.delta_len;
  d["num_tokens"] = p.num_tokens;
  d["num_kv_heads"] = p.num_kv_heads;
  d["head_dim"] = p.head_dim;
  d["num_pages"] = p.num_pages;
  d["page_size"] = p.page_size;
  d["pages_per_slot"] = p.pages_per_slot;
  d["table_pages"] = p.table_pages;
  d["rotary_dim"] = p.rotary_dim;
  d["rope_batch"] = p.rope_batch;
  d["rope_seq_len"] = p.rope_seq_len;
  d["scale_heads"] = p.scale_heads;
  d["rope_per_layer"] = p.rope_per_layer;
  d["positions_per_layer"] = p.positions_per_layer;
  d["table_per_layer"] = p.table_per_layer;
  d["scale_per_layer"] = p.scale_per_layer;
  d["weight_per_layer"] = p.weight_per_layer;
  if (p.ring_layers != nullptr) {
    nb::list layers;
    for (int64_t l = 0; l < p.num_layers; ++l) layers.append(p.ring_layers[l] != 0);
    d["ring"] = nb::tuple(layers);
  } else {
    d["ring"] = p.ring;
  }
  d["k_norm"] = p.k_norm;
  d["v_norm"] = p.v_norm;
  d["norm_eps"] = p.norm_eps;
  return d;
}

nb::dict check_call(std::string const& form_name, nb::sequence operands, int64_t pages_per_slot,
                    nb::handle ring, bool k_norm, bool v_norm, double norm_eps, bool tensorrt,
                    bool scale_pool) {
  AddressingForm const* form = addressing_form(form_name.c_str());
  if (form == nullptr)
    throw nb::value_error(("form: expected 'slot' or 'paged', got '" + form_name + "'").c_str());
  if (std::string e = check_norm_eps(norm_eps); !e.empty()) throw nb::value_error(e.c_str());
  UpdateAttrs attrs;
  attrs.contract = form->contract;
  attrs.pages_per_slot = form->has_pages_per_slot ? pages_per_slot : 0;
  RingArgument const ring_entries = ring_argument(ring);  // a bool, or one per layer
  ring_entries.apply(attrs);
  attrs.k_norm = k_norm;
  attrs.v_norm = v_norm;
  attrs.norm_eps = float(norm_eps);
  attrs.tensorrt = tensorrt;
  attrs.scale_pool = scale_pool;
  size_t const count = nb::len(operands);
  // One more with scale_pool, so that the checker names a call that also gives static scales.
  size_t const most = size_t(kMaxBaseOperands + kMaxExtraOperands + (scale_pool ? 1 : 0));
  if (count > most)
    throw nb::type_error(
        ("expected at most " + std::to_string(most) + " operands, got " + std::to_string(count)).c_str());
  std::vector<TensorDesc> descs;
  bool any_unknown = false;
  for (size_t i = 0; i < count; ++i)
    descs.push_back(describe(operands[i], operand_name(attrs, int32_t(i), int32_t(count)), &any_unknown));
  KVUpdateParams p;
  bool type_error = false;
  std::string const e = params_from_operands(descs.data(), int32_t(count), attrs, &p, /*need_data=*/false,
                                             /*allow_unknown=*/any_unknown, &type_error);
  if (!e.empty()) {
    if (type_error) throw nb::type_error(e.c_str());
    throw nb::value_error(e.c_str());
  }
  nb::dict params = params_dict(p);
  params["layered"] = descs[kPoolOperand].rank == 6;  // the layer-batched form, even of one layer
  params["scale_pool"] = scale_pool;
  return params;
}

nb::dict forms_dict() {
  nb::dict forms;
  for (AddressingForm const& f : kAddressingForms) {
    static constexpr char const* kRoles[] = {"k_delta", "v_delta",    "pool",      "rope",
                                             "index",   "page_table", "slot_index"};
    nb::list names, dims, roles;
    for (int32_t i = 0; i < f.base_count; ++i) {
      names.append(f.base[i].name);
      dims.append(f.base[i].dims);
      roles.append(kRoles[int32_t(f.base[i].role)]);
    }
    nb::list attributes;
    if (f.has_pages_per_slot) attributes.append("pages_per_slot");
    if (f.has_ring) attributes.append("ring");
    nb::dict d;
    d["origin"] = f.origin;
    d["ffi_target"] = f.ffi_target;
    d["operands"] = nb::tuple(names);
    d["operand_dims"] = nb::tuple(dims);
    d["operand_roles"] = nb::tuple(roles);
    d["delta_rank"] = f.delta_rank;
    d["rope_rank"] = f.rope_rank;
    d["attributes"] = nb::tuple(attributes);
    d["cuda"] = f.cuda;
    forms[f.name] = d;
  }
  return forms;
}

nb::dict formats_dict() {
  nb::dict formats;
  for (PoolFormat const& f : kPoolFormats) {
    nb::dict d;
    d["scales"] = f.scales == ScaleGranularity::kNone     ? "none"
                  : f.scales == ScaleGranularity::kStatic ? "static"
                                                          : "dynamic";
    d["max_finite"] = f.max_finite;
    d["tensorrt"] = f.tensorrt;
    d["per_byte"] = f.per_byte;
    d["cuda"] = f.cuda;
    d["name"] = f.name;
    formats[dtype_name(f.element)] = d;
  }
  return formats;
}

}  // namespace

void bind_contract(nb::module_& m) {
  using namespace nb::literals;
  m.def("check_call", &check_call, "form"_a, "operands"_a, nb::kw_only(), "pages_per_slot"_a = 0,
        "ring"_a = false, "k_norm"_a = false, "v_norm"_a = false, "norm_eps"_a, "tensorrt"_a = false,
        "scale_pool"_a = false,
        "The contract's checker (docs/SPEC.md): the operands as (dtype name, dims) pairs in the FFI\n"
        "order, the attributes; returns the call's parameters, or raises TypeError (a dtype or the\n"
        "operand count) or ValueError (a shape or a value) naming the operand. A dim of None is not\n"
        "known yet: the rules between the known sizes are checked. With tensorrt, TensorRT's profile\n"
        "of the contract applies too (the plugin's and its ONNX node's rules). ring: a bool, or one\n"
        "bool per layer of the layer-batched form. scale_pool: the operand after the base ones is the\n"
        "per-token-head scale pool.");
  m.def("check_norm_eps", [](double eps) {
    if (std::string e = check_norm_eps(eps); !e.empty()) throw nb::value_error(e.c_str());
  });
  m.attr("ADDRESSING_FORMS") = forms_dict();
  m.attr("POOL_FORMATS") = formats_dict();
  m.attr("RESULT_NAME") = kResultName;
  m.attr("SCALE_NAMES") = nb::make_tuple(kScaleNames[0], kScaleNames[1]);
  m.attr("NORM_WEIGHT_NAME") = kNormWeightName;
  m.attr("SCALE_POOL_NAME") = kScalePoolName;
  m.attr("SCALE_RESULT_NAME") = kScaleResultName;
}

}  // namespace dflash::jax
