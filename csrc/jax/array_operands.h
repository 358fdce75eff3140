// The raw (array) entries of both extension modules: NumPy / DLPack arrays -> TensorDescs ->
// KVUpdateParams (operands.h), for callers outside XLA (the ONNX reference runtime, benchmarks,
// the TensorRT parity harness). The pool is updated in place, so it must be a writable,
// C-contiguous array of the right device: a silent copy would lose the update.
#pragma once

#include <string>
#include <vector>

#include "dflash/operands.h"
#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "nanobind/stl/string.h"

namespace dflash::jax {

namespace nb = nanobind;

inline DType dtype_from_name(std::string const& name, char const* argument) {
  if (name == "float16") return DType::kFloat16;
  if (name == "bfloat16") return DType::kBFloat16;
  if (name == "float32") return DType::kFloat32;
  if (name == "float8_e4m3fn") return DType::kFloat8E4M3;
  if (name == "float8_e5m2") return DType::kFloat8E5M2;
  throw nb::value_error((std::string(argument) +
                         ": expected float16, bfloat16, float32, float8_e4m3fn or float8_e5m2, got '" + name +
                         "'")
                            .c_str());
}

// The dtype an array says it has; unsigned ints only carry bits (bfloat16/FP8 views).
inline DType dtype_of(nb::dlpack::dtype d) {
  auto const code = nb::dlpack::dtype_code(d.code);
  if (d.lanes != 1) return DType::kOther;
  if (code == nb::dlpack::dtype_code::Float && d.bits == 16) return DType::kFloat16;
  if (code == nb::dlpack::dtype_code::Float && d.bits == 32) return DType::kFloat32;
  if (code == nb::dlpack::dtype_code::Bfloat && d.bits == 16) return DType::kBFloat16;
  if (code == nb::dlpack::dtype_code::Int && d.bits == 32) return DType::kInt32;
  if (code == nb::dlpack::dtype_code::Int && d.bits == 64) return DType::kInt64;
  return DType::kOther;
}

inline std::string given_dtype(nb::dlpack::dtype d) {
  char const* kind = "type";
  switch (nb::dlpack::dtype_code(d.code)) {
    case nb::dlpack::dtype_code::Int: kind = "int"; break;
    case nb::dlpack::dtype_code::UInt: kind = "uint"; break;
    case nb::dlpack::dtype_code::Float: kind = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: kind = "bfloat"; break;
    default: break;
  }
  return kind + std::to_string(d.bits);
}

struct ArraySpec {
  char const* name;
  nb::handle object;  // None for an absent optional operand
  DType declared = DType::kOther;  // delta_dtype / pool_dtype given by name; kOther: the array's own
  bool writable = false;
  char const* dtype_keyword = nullptr;  // the keyword that names this operand's dtype, if any
};

// The arrays of one call, kept alive while their data is used: the pool writable, the rest may be
// read-only (np.asarray of a jax.Array is).
struct KeptArrays {
  std::vector<nb::ndarray<>> writable;
  std::vector<nb::ndarray<nb::ro>> read_only;
};

// One array operand: type, device, layout and dtype checked, each error naming the argument.
template <typename Device, typename Array>
TensorDesc describe_array(ArraySpec const& spec, std::vector<Array>& keep) {
  std::string const name = spec.name;
  // NumPy says whether an array is writable (cupy's flags do not carry the field).
  if (spec.writable && nb::hasattr(spec.object, "flags") &&
      nb::hasattr(spec.object.attr("flags"), "writeable") &&
      !nb::cast<bool>(spec.object.attr("flags").attr("writeable")))
    throw nb::value_error(
        (name + ": expected a writable array (it is updated in place), got a read-only one").c_str());
  // A jax.Array is immutable: writing into its buffer would change a value JAX still holds.
  if (spec.writable && nb::cast<std::string>(spec.object.type().attr("__module__")).rfind("jax", 0) == 0)
    throw nb::value_error((name +
                           ": expected a writable array (NumPy, torch, cupy), got a jax.Array, which is "
                           "immutable; use jax_dflash.target_kv_cache_update(_paged) for JAX arrays")
                              .c_str());
  Array array;
  if (!nb::try_cast(spec.object, array, /*convert=*/false))
    throw nb::type_error((name +
                          ": expected an array (NumPy, or a DLPack tensor of jax, torch or cupy), got " +
                          nb::cast<std::string>(nb::str(spec.object.type().attr("__name__"))))
                             .c_str());
  if (array.device_type() != Device::value)
    throw nb::value_error((name + ": expected an array on the " +
                           (Device::value == nb::device::cpu::value ? "CPU" : "CUDA device") +
                           ", got one on DLPack device type " + std::to_string(array.device_type()))
                              .c_str());
  int64_t expected_stride = 1;
  bool empty = false;
  for (size_t i = 0; i < array.ndim(); ++i) empty |= array.shape(i) == 0;
  for (size_t i = array.ndim(); !empty && i-- > 0;) {
    if (array.shape(i) > 1 && array.stride(i) != expected_stride)
      throw nb::value_error(
          (name + ": expected a C-contiguous array" +
           (spec.writable ? " (it is updated in place; a copy would lose the update)" : "") +
           ", got strides that are not row-major")
              .c_str());
    expected_stride *= int64_t(array.shape(i));
  }
  TensorDesc desc;
  DType const own = dtype_of(array.dtype());
  if (spec.declared != DType::kOther) {
    bool const same_width = int64_t(array.dtype().bits) == 8 * dtype_bytes(spec.declared);
    auto const code = nb::dlpack::dtype_code(array.dtype().code);
    bool const bits_view = code == nb::dlpack::dtype_code::UInt || code == nb::dlpack::dtype_code::Int;
    if (!same_width || !(own == spec.declared || bits_view))
      throw nb::type_error((name + ": expected " + dtype_name(spec.declared) + " elements (or a uint/int" +
                            std::to_string(8 * dtype_bytes(spec.declared)) + " view of their bits), got " +
                            given_dtype(array.dtype()))
                               .c_str());
    desc.dtype = spec.declared;
  } else {
    if (own == DType::kOther)
      throw nb::value_error(
          (name + ": expected a dtype the update takes, got " + given_dtype(array.dtype()) +
           (spec.dtype_keyword != nullptr
                ? std::string(" (bfloat16 and FP8 arrays cross as uint16/uint8 views named with ") +
                      spec.dtype_keyword + "=\"...\")"
                : std::string()))
              .c_str());
    desc.dtype = own;
  }
  desc.rank = int32_t(array.ndim());
  for (size_t i = 0; i < array.ndim() && i < size_t(kMaxRank); ++i) desc.dims[i] = int64_t(array.shape(i));
  desc.data = array.data();
  keep.push_back(array);
  return desc;
}

// The attributes of a raw call of each contract (k_norm follows from k_norm_weight).
inline UpdateAttrs slot_attrs(int64_t pages_per_slot, bool v_norm, float norm_eps) {
  UpdateAttrs attrs;
  attrs.contract = Contract::kSlot;
  attrs.pages_per_slot = pages_per_slot;
  attrs.v_norm = v_norm;
  attrs.norm_eps = norm_eps;
  return attrs;
}
inline UpdateAttrs paged_attrs(bool ring, bool v_norm, float norm_eps) {
  UpdateAttrs attrs;
  attrs.contract = Contract::kPaged;
  attrs.ring = ring;
  attrs.v_norm = v_norm;
  attrs.norm_eps = norm_eps;
  return attrs;
}

// The whole call: base operands (SPEC.md's order), then the present extras; raises on any
// invalid operand, attribute or parameter. delta_dtype names k, v and the weight; pool_dtype
// the pool ("" = the arrays' own dtypes).
template <typename Device>
KVUpdateParams params_from_arrays(UpdateAttrs attrs, std::vector<nb::handle> const& base, nb::handle k_scale,
                                  nb::handle v_scale, nb::handle k_norm_weight,
                                  std::string const& delta_dtype, std::string const& pool_dtype,
                                  KeptArrays& keep) {
  attrs.k_norm = !k_norm_weight.is_none();
  if (k_scale.is_none() != v_scale.is_none())
    throw nb::value_error(k_scale.is_none()
                              ? "k_scale: v_scale is given, so k_scale is expected too, got None"
                              : "v_scale: k_scale is given, so v_scale is expected too, got None");
  DType const delta = delta_dtype.empty() ? DType::kOther : dtype_from_name(delta_dtype, "delta_dtype");
  DType const pool = pool_dtype.empty() ? DType::kOther : dtype_from_name(pool_dtype, "pool_dtype");
  std::vector<ArraySpec> specs;
  for (size_t i = 0; i < base.size(); ++i) {
    char const* name = operand_name(attrs, int32_t(i), int32_t(base.size()));
    DType const declared = i < 2 ? delta : i == 2 ? pool : DType::kOther;
    char const* keyword = i < 2 ? "delta_dtype" : i == 2 ? "pool_dtype" : nullptr;
    specs.push_back({name, base[i], declared, /*writable=*/i == 2, keyword});
  }
  // Scales may be Python or NumPy scalars too (per-tensor scales), as in the JAX op.
  nb::object k_scale_array, v_scale_array;
  if (!k_scale.is_none()) {
    auto as_array = [](nb::handle scale) -> nb::object {
      nb::module_ const numpy = nb::module_::import_("numpy");
      bool const scalar = nb::isinstance<nb::float_>(scale) || nb::isinstance<nb::int_>(scale) ||
                          nb::isinstance(scale, numpy.attr("generic"));
      return scalar ? numpy.attr("asarray")(scale, "float32") : nb::borrow(scale);
    };
    k_scale_array = as_array(k_scale);
    v_scale_array = as_array(v_scale);
    specs.push_back({"k_scale", k_scale_array});
    specs.push_back({"v_scale", v_scale_array});
  }
  if (attrs.k_norm) specs.push_back({"k_norm_weight", k_norm_weight, delta, false, "delta_dtype"});
  std::vector<TensorDesc> operands;
  for (ArraySpec const& spec : specs)
    operands.push_back(spec.writable ? describe_array<Device>(spec, keep.writable)
                                     : describe_array<Device>(spec, keep.read_only));
  KVUpdateParams p;
  if (std::string e =
          params_from_operands(operands.data(), int32_t(operands.size()), attrs, &p, /*need_data=*/true);
      !e.empty())
    throw nb::value_error(e.c_str());
  return p;
}

}  // namespace dflash::jax
