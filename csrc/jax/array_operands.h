// The raw (array) entries of both extension modules: NumPy / DLPack arrays -> TensorDescs ->
// KVUpdateParams (operands.h), for callers outside XLA (the ONNX reference runtime, benchmarks,
// the TensorRT parity harness). The pool is updated in place, so it must be a writable,
// C-contiguous array of the right device that the caller owns: a silent copy would lose the
// update, and writing into memory that JAX holds as an immutable array (however it is handed
// over: the jax.Array, its DLPack capsule, a NumPy view of it) would change a value behind JAX's
// back. Every error names the argument, what was expected and what was given.
#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dflash/operands.h"
#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "nanobind/stl/string.h"

namespace dflash::jax {

namespace nb = nanobind;

// ---- what was given, for the messages ----------------------------------------------------------

inline std::string type_of(nb::handle object) {
  return nb::cast<std::string>(nb::str(object.type().attr("__name__")));
}

// The type and a short repr of a scalar argument, e.g. "float 2.5".
inline std::string given_value(nb::handle object) {
  std::string text = nb::cast<std::string>(nb::repr(object));
  if (text.size() > 48) text = text.substr(0, 45) + "...";
  return type_of(object) + " " + text;
}

inline nb::module_ numpy() { return nb::module_::import_("numpy"); }

// Python's and NumPy's bools: ints to Python, never an int or a float argument here.
inline bool is_bool(nb::handle object) {
  return PyBool_Check(object.ptr()) || nb::isinstance(object, numpy().attr("bool_"));
}

// ---- keyword arguments: type and range checked here, not by nanobind's signature dump --------

// A Python or NumPy int in [minimum, 2^63-1]; `range` says so in the message.
inline int64_t int_argument(nb::handle value, char const* name, int64_t minimum, char const* range) {
  std::string const expected = std::string(name) + ": expected an int in " + range + ", got ";
  PyObject* index = is_bool(value) ? nullptr : PyNumber_Index(value.ptr());
  if (index == nullptr) {
    PyErr_Clear();
    throw nb::type_error((expected + given_value(value)).c_str());
  }
  nb::object const as_int = nb::steal(index);
  int overflow = 0;
  long long const v = PyLong_AsLongLongAndOverflow(index, &overflow);
  if (overflow != 0 || v < minimum)
    throw nb::value_error((expected + nb::cast<std::string>(nb::str(as_int))).c_str());
  return int64_t(v);
}

// A cudaStream_t given as a Python or NumPy int.
inline uintptr_t stream_argument(nb::handle value) {
  std::string const expected = "stream: expected an int in [0, 2^64-1] (a cudaStream_t), got ";
  PyObject* index = is_bool(value) ? nullptr : PyNumber_Index(value.ptr());
  if (index == nullptr) {
    PyErr_Clear();
    throw nb::type_error((expected + given_value(value)).c_str());
  }
  nb::object const as_int = nb::steal(index);
  unsigned long long const v = PyLong_AsUnsignedLongLong(index);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    throw nb::value_error((expected + nb::cast<std::string>(nb::str(as_int))).c_str());
  }
  return uintptr_t(v);
}

inline bool bool_argument(nb::handle value, char const* name) {
  if (!is_bool(value))
    throw nb::type_error((std::string(name) + ": expected a bool, got " + given_value(value)).c_str());
  return PyObject_IsTrue(value.ptr()) == 1;
}

// ring: a bool (every layer), or a sequence of bools, one per layer of the layer-batched form (a
// NumPy bool array too). Holds the per-layer entries that UpdateAttrs points to, for the call.
struct RingArgument {
  bool ring = false;
  bool per_layer = false;
  std::vector<int8_t> layers;

  void apply(UpdateAttrs& attrs) const {
    attrs.ring = ring;
    attrs.ring_layers = per_layer ? layers.data() : nullptr;
    attrs.ring_layer_count = per_layer ? int64_t(layers.size()) : -1;
  }
};
inline RingArgument ring_argument(nb::handle value) {
  RingArgument out;
  if (is_bool(value)) {
    out.ring = PyObject_IsTrue(value.ptr()) == 1;
    return out;
  }
  if (!nb::isinstance<nb::sequence>(value) || PyUnicode_Check(value.ptr()) || PyBytes_Check(value.ptr()))
    throw nb::type_error(
        ("ring: expected a bool, or a sequence of bools (one per layer), got " + given_value(value)).c_str());
  nb::sequence const entries = nb::borrow<nb::sequence>(value);
  out.per_layer = true;
  for (size_t l = 0; l < nb::len(entries); ++l) {
    nb::object const entry = entries[l];
    if (!is_bool(entry))
      throw nb::type_error(
          ("ring: expected a bool per layer, got " + given_value(entry) + " for layer " + std::to_string(l))
              .c_str());
    out.layers.push_back(int8_t(PyObject_IsTrue(entry.ptr()) == 1));
  }
  return out;
}

// A Python or NumPy float or int (not a bool); its value is the core's to judge.
inline float float_argument(nb::handle value, char const* name) {
  nb::module_ const np = numpy();
  bool const number = PyFloat_Check(value.ptr()) || PyLong_Check(value.ptr()) ||
                      nb::isinstance(value, np.attr("floating")) || nb::isinstance(value, np.attr("integer"));
  if (is_bool(value) || !number)
    throw nb::type_error((std::string(name) + ": expected a float, got " + given_value(value)).c_str());
  double const v = PyFloat_AsDouble(value.ptr());
  if (PyErr_Occurred()) {
    PyErr_Clear();
    throw nb::value_error((std::string(name) + ": expected a float, got " + given_value(value)).c_str());
  }
  return float(v);
}

// delta_dtype / pool_dtype: a name, a NumPy dtype or scalar type (ml_dtypes' too), or ""/None for
// the arrays' own dtypes.
inline std::string dtype_argument(nb::handle value, char const* name) {
  if (value.is_none()) return {};
  if (PyUnicode_Check(value.ptr())) return nb::cast<std::string>(value);
  try {
    return nb::cast<std::string>(numpy().attr("dtype")(value).attr("name"));
  } catch (nb::python_error const&) {
    throw nb::type_error(
        (std::string(name) + ": expected a dtype name (" + pool_dtype_list() + "), got " + given_value(value))
            .c_str());
  }
}

// A delta or pool dtype named by delta_dtype / pool_dtype: any the contract has (contract.h).
inline DType dtype_from_name(std::string const& name, char const* argument) {
  for (PoolFormat const& f : kPoolFormats)
    if (name == dtype_name(f.element)) return f.element;
  throw nb::value_error(
      (std::string(argument) + ": expected " + pool_dtype_list() + ", got '" + name + "'").c_str());
}

// ---- array dtypes ------------------------------------------------------------------------------

// DLPack's type codes, by number: older nanobind releases do not name the FP8 ones.
enum DLPackCode : uint8_t {
  kDLInt = 0,
  kDLUInt = 1,
  kDLFloat = 2,
  kDLOpaqueHandle = 3,
  kDLBfloat = 4,
  kDLComplex = 5,
  kDLBool = 6,
  kDLFloat8E4M3FN = 10,
  kDLFloat8E5M2 = 12,
};

// The dtype an array says it has, for every element type the core names (so that a new pool
// format needs no change here). uint8 is int4's bytes (as in the JAX op); other unsigned ints
// only carry bits (bfloat16/FP8 views, which name their dtype with delta_dtype/pool_dtype).
inline DType dtype_of(nb::dlpack::dtype d) {
  if (d.lanes != 1) return DType::kOther;
  if (d.code == kDLFloat && d.bits == 16) return DType::kFloat16;
  if (d.code == kDLFloat && d.bits == 32) return DType::kFloat32;
  if (d.code == kDLFloat && d.bits == 64) return DType::kFloat64;
  if (d.code == kDLBfloat && d.bits == 16) return DType::kBFloat16;
  if (d.code == kDLFloat8E4M3FN && d.bits == 8) return DType::kFloat8E4M3;
  if (d.code == kDLFloat8E5M2 && d.bits == 8) return DType::kFloat8E5M2;
  if (d.code == kDLInt && d.bits == 8) return DType::kInt8;
  if (d.code == kDLUInt && d.bits == 8) return DType::kUInt8;
  if (d.code == kDLInt && d.bits == 16) return DType::kInt16;
  if (d.code == kDLInt && d.bits == 32) return DType::kInt32;
  if (d.code == kDLInt && d.bits == 64) return DType::kInt64;
  if (d.code == kDLBool) return DType::kBool;
  return DType::kOther;
}

inline std::string given_dtype(nb::dlpack::dtype d) {
  static char const* const fp_names[] = {"float8_e3m4",     "float8_e4m3",     "float8_e4m3b11fnuz",
                                         "float8_e4m3fn",   "float8_e4m3fnuz", "float8_e5m2",
                                         "float8_e5m2fnuz", "float8_e8m0fnu",  "float6_e2m3fn",
                                         "float6_e3m2fn",   "float4_e2m1fn"};
  std::string name;
  switch (d.code) {
    case kDLInt: name = "int" + std::to_string(d.bits); break;
    case kDLUInt: name = "uint" + std::to_string(d.bits); break;
    case kDLFloat: name = "float" + std::to_string(d.bits); break;
    case kDLBfloat: name = "bfloat" + std::to_string(d.bits); break;
    case kDLComplex: name = "complex" + std::to_string(d.bits); break;
    case kDLBool: name = "bool"; break;
    case kDLOpaqueHandle: name = "an opaque handle"; break;
    default:
      name = d.code >= 7 && d.code <= 17
                 ? fp_names[d.code - 7]
                 : "DLPack type code " + std::to_string(d.code) + " of " + std::to_string(d.bits) + " bits";
  }
  if (d.lanes != 1) name += " x" + std::to_string(d.lanes) + " lanes";
  return name;
}

// ---- who owns an array's memory ----------------------------------------------------------------

// DLPack's managed tensors (dlpack.h before 1.0, and 1.x): read for the read-only flag and for
// the library that made the tensor (the one holding its deleter).
struct ManagedTensorLegacy {
  nb::dlpack::dltensor tensor;
  void* manager_ctx;
  void (*deleter)(void*);
};
struct ManagedTensorVersioned {
  uint32_t major, minor;
  void* manager_ctx;
  void (*deleter)(void*);
  uint64_t flags;
  nb::dlpack::dltensor tensor;
};
inline constexpr uint64_t kDLPackReadOnly = 1;  // DLPACK_FLAG_BITMASK_READ_ONLY

struct CapsuleFacts {
  bool read_only = false;
  std::string producer;  // the file of the library that made it; "" when unknown
};

inline std::string library_of(void* address) {
  Dl_info info;
  if (address == nullptr || dladdr(address, &info) == 0 || info.dli_fname == nullptr) return {};
  return info.dli_fname;
}

// A DLPack capsule that still owns its tensor: fresh from __dlpack__() ("dltensor"), or the base
// NumPy keeps for an array it made from one ("numpy_dltensor"); "_versioned" for DLPack 1.x. A
// consumed one ("used_dltensor") may point at freed memory and is not read.
inline CapsuleFacts capsule_facts(nb::handle capsule) {
  CapsuleFacts facts;
  char const* name = PyCapsule_GetName(capsule.ptr());
  if (name == nullptr) {
    PyErr_Clear();
    return facts;
  }
  std::string const n = name;
  bool const versioned = n == "dltensor_versioned" || n == "numpy_dltensor_versioned";
  if (!versioned && n != "dltensor" && n != "numpy_dltensor") return facts;
  void* const pointer = PyCapsule_GetPointer(capsule.ptr(), name);
  if (pointer == nullptr) {
    PyErr_Clear();
    return facts;
  }
  void (*deleter)(void*) = nullptr;
  if (versioned) {
    auto const* t = static_cast<ManagedTensorVersioned const*>(pointer);
    facts.read_only = (t->flags & kDLPackReadOnly) != 0;
    deleter = t->deleter;
  } else {
    deleter = static_cast<ManagedTensorLegacy const*>(pointer)->deleter;
  }
  facts.producer = library_of(reinterpret_cast<void*>(deleter));
  return facts;
}

// jaxlib's libraries, where jax.Array's DLPack export lives, and JAX's PJRT plugin packages.
inline bool is_jax_library(std::string const& path) {
  for (size_t start = 0; start < path.size();) {
    size_t end = path.find('/', start);
    if (end == std::string::npos) end = path.size();
    std::string const part = path.substr(start, end - start);
    if (part == "jaxlib" || part == "jax_plugins" || part.rfind("jax_cuda", 0) == 0 ||
        part.rfind("jax_rocm", 0) == 0 || part.rfind("libjax", 0) == 0)
      return true;
    start = end + 1;
  }
  return false;
}

inline bool is_jax_array(nb::handle object) {
  return nb::cast<std::string>(object.type().attr("__module__")).rfind("jax", 0) == 0;
}

[[noreturn]] inline void refuse_jax_memory(std::string const& name, char const* given) {
  throw nb::value_error(
      (name + ": expected a writable array that the caller owns (NumPy, torch, cupy), got " + given +
       ", which JAX holds as immutable; use jax_dflash.target_kv_cache_update(_paged) "
       "for JAX arrays")
          .c_str());
}

[[noreturn]] inline void refuse_read_only(std::string const& name, std::string const& why) {
  throw nb::value_error(
      (name + ": expected a writable array (it is updated in place), got a read-only one" + why).c_str());
}

inline void check_capsule(std::string const& name, CapsuleFacts const& facts, char const* jax_given,
                          char const* read_only_why) {
  if (is_jax_library(facts.producer)) refuse_jax_memory(name, jax_given);
  if (facts.read_only) refuse_read_only(name, read_only_why);
}

// The object to import as the pool, after checking that it may be written: not a bare capsule
// (it says neither who owns the memory nor, before DLPack 1.0, whether it may be written), not
// JAX's memory (the object, what a NumPy array or memoryview views, or its DLPack export's
// producer), not read-only (NumPy's flag, DLPack's flag). The DLPack export nanobind would make
// is made here instead, so that it can be read first; nanobind then imports that capsule.
inline nb::object pool_source(std::string const& name, nb::handle object) {
  if (PyCapsule_CheckExact(object.ptr()))
    throw nb::type_error(
        (name +
         ": expected the writable array that holds the pool (NumPy, torch, cupy), got a DLPack capsule, "
         "which says neither who owns its memory nor whether it may be written (jax.Array.__dlpack__() "
         "returns one for an immutable array); pass the array itself")
            .c_str());
  nb::module_ const np = numpy();
  if (nb::isinstance(object, np.attr("ndarray")) && !nb::cast<bool>(object.attr("flags").attr("writeable")))
    refuse_read_only(name, "");
  nb::object current = nb::borrow(object);
  for (int depth = 0; depth < 64; ++depth) {
    if (is_jax_array(current)) refuse_jax_memory(name, depth == 0 ? "a jax.Array" : "a view of a jax.Array");
    if (depth > 0 && PyCapsule_CheckExact(current.ptr())) {
      check_capsule(name, capsule_facts(current), "a view of a jax.Array (through DLPack)",
                    " (it views a DLPack tensor marked read-only)");
      break;
    }
    nb::object next;
    if (PyMemoryView_Check(current.ptr()))
      next = current.attr("obj");
    else if (nb::isinstance(current, np.attr("ndarray")))
      next = current.attr("base");
    if (!next.is_valid() || next.is_none()) break;
    current = next;
  }
  if (!nb::hasattr(object, "__dlpack__")) return nb::borrow(object);
  nb::object capsule;
  try {
    try {
      capsule = object.attr("__dlpack__")(nb::arg("max_version") = nb::make_tuple(1, 1));
    } catch (nb::python_error& e) {
      if (!e.matches(PyExc_TypeError)) throw;  // a producer before DLPack 1.0 takes no max_version
      capsule = object.attr("__dlpack__")();
    }
  } catch (nb::python_error& e) {
    throw nb::value_error((name + ": expected an array that exports itself through DLPack, got a " +
                           type_of(object) + " whose __dlpack__() raised " + type_of(e.value()) + ": " +
                           nb::cast<std::string>(nb::str(e.value())))
                              .c_str());
  }
  if (!PyCapsule_CheckExact(capsule.ptr()))
    throw nb::type_error((name + ": expected __dlpack__() to return a DLPack capsule, got a " +
                          type_of(capsule) + " from a " + type_of(object))
                             .c_str());
  check_capsule(name, capsule_facts(capsule), "an array that exports a jax.Array's memory",
                " (its DLPack export is marked read-only)");
  return capsule;
}

// ---- one array operand -------------------------------------------------------------------------

struct ArraySpec {
  char const* name;
  nb::handle object;  // None for an absent optional operand
  DType declared = DType::kOther;  // delta_dtype / pool_dtype given by name; kOther: the array's own
  bool writable = false;
  char const* dtype_keyword = nullptr;  // the keyword that names this operand's dtype, if any
  char const* expected = "";            // the dtypes it takes, for messages
};

// The arrays of one call, kept alive while their data is used: the pool writable, the rest may be
// read-only (np.asarray of a jax.Array is).
struct KeptArrays {
  std::vector<nb::ndarray<>> writable;
  std::vector<nb::ndarray<nb::ro>> read_only;
};

// A NumPy array of a dtype DLPack cannot carry (ml_dtypes' bfloat16 and FP8, void dtypes):
// replaced by a view of its bits (the same memory), its dtype returned; kOther for other arrays.
inline DType view_ml_dtypes_array(ArraySpec const& spec, nb::object& source) {
  nb::module_ const np = numpy();
  if (!nb::isinstance(source, np.attr("ndarray"))) return DType::kOther;
  nb::object const dtype = source.attr("dtype");
  // User-defined dtypes (ml_dtypes' are) have type numbers from NPY_USERDEF = 256 on.
  if (nb::cast<int>(dtype.attr("num")) < 256 && nb::cast<std::string>(dtype.attr("kind")) != "V")
    return DType::kOther;
  std::string const dtype_text = nb::cast<std::string>(nb::str(dtype));
  DType d = DType::kOther;
  if (dtype_text == "bfloat16") d = DType::kBFloat16;
  if (dtype_text == "float8_e4m3fn") d = DType::kFloat8E4M3;
  if (dtype_text == "float8_e5m2") d = DType::kFloat8E5M2;
  if (d == DType::kOther)
    throw nb::value_error(
        (std::string(spec.name) + ": expected dtype " + spec.expected + ", got " + dtype_text).c_str());
  source = source.attr("view")(dtype_bytes(d) == 2 ? "uint16" : "uint8");
  return d;
}

// One array operand: type, owner, device, layout and dtype checked, each error naming the argument.
template <typename Device, typename Array>
TensorDesc describe_array(ArraySpec const& spec, std::vector<Array>& keep) {
  std::string const name = spec.name;
  nb::object source = nb::borrow(spec.object);
  DType const viewed = view_ml_dtypes_array(spec, source);
  if (spec.writable) source = pool_source(name, source);
  Array array;
  if (!nb::try_cast(source, array, /*convert=*/false)) {
    nb::ndarray<nb::ro> read_only;
    if (spec.writable && nb::try_cast(source, read_only, /*convert=*/false)) refuse_read_only(name, "");
    throw nb::type_error((name + ": expected " + (spec.writable ? "a writable" : "an") +
                          " array (NumPy, or a DLPack tensor of jax, torch or cupy), got " +
                          type_of(spec.object))
                             .c_str());
  }
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
  DType const own = viewed != DType::kOther ? viewed : dtype_of(array.dtype());
  std::string const given = viewed != DType::kOther ? dtype_name(viewed) : given_dtype(array.dtype());
  if (spec.declared != DType::kOther) {
    bool const same_width = int64_t(array.dtype().bits) == 8 * dtype_bytes(spec.declared);
    bool const bits_view =
        viewed == DType::kOther && (array.dtype().code == kDLUInt || array.dtype().code == kDLInt);
    if (!same_width || !(own == spec.declared || bits_view))
      throw nb::type_error((name + ": expected " + dtype_name(spec.declared) + " elements (or a uint/int" +
                            std::to_string(8 * dtype_bytes(spec.declared)) + " view of their bits), got " +
                            given)
                               .c_str());
    desc.dtype = spec.declared;
  } else {
    if (own == DType::kOther)
      throw nb::value_error(
          (name + ": expected dtype " + spec.expected + ", got " + given +
           (spec.dtype_keyword != nullptr
                ? std::string(" (bfloat16 and FP8 arrays may also cross as uint16/uint8 views of their bits "
                              "named with ") +
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

// A keyword the entry does not take: named with the ones it does (rather than nanobind's dump of
// the signature).
inline void refuse_unknown_keywords(nb::kwargs const& unknown, char const* entry, char const* keywords) {
  for (auto [key, value] : unknown)
    throw nb::type_error((nb::cast<std::string>(nb::str(key)) + ": expected a keyword of " + entry + " (" +
                          keywords + "), got " + nb::cast<std::string>(nb::str(key)) + "=" +
                          given_value(value))
                             .c_str());
}

// ---- the whole call ----------------------------------------------------------------------------

// The attributes of a raw call of each contract (k_norm follows from k_norm_weight).
inline UpdateAttrs slot_attrs(nb::handle pages_per_slot, nb::handle v_norm, nb::handle norm_eps) {
  UpdateAttrs attrs;
  attrs.contract = Contract::kSlot;
  attrs.pages_per_slot = int_argument(pages_per_slot, "pages_per_slot", 1, "[1, 2^63-1]");
  attrs.v_norm = bool_argument(v_norm, "v_norm");
  attrs.norm_eps = float_argument(norm_eps, "norm_eps");
  return attrs;
}
inline UpdateAttrs paged_attrs(RingArgument const& ring, nb::handle v_norm, nb::handle norm_eps) {
  UpdateAttrs attrs;
  attrs.contract = Contract::kPaged;
  ring.apply(attrs);
  attrs.v_norm = bool_argument(v_norm, "v_norm");
  attrs.norm_eps = float_argument(norm_eps, "norm_eps");
  return attrs;
}

// The attributes of a call of the form named `form_name` (contract.h): its own (pages_per_slot,
// ring, whose entries `ring_entries` holds), each refused where the form has none, then the norms'.
inline UpdateAttrs form_attrs(std::string const& form_name, nb::handle pages_per_slot, nb::handle ring,
                              nb::handle v_norm, nb::handle norm_eps, RingArgument& ring_entries) {
  AddressingForm const* form = addressing_form(form_name.c_str());
  if (form == nullptr) {
    std::string known;
    for (AddressingForm const& f : kAddressingForms)
      known += std::string(known.empty() ? "'" : ", '") + f.name + "'";
    throw nb::value_error(("form: expected one of " + known + ", got '" + form_name + "'").c_str());
  }
  if (!form->has_pages_per_slot && !pages_per_slot.is_none())
    throw nb::value_error((std::string("pages_per_slot: the ") + form->name + " form takes none, got " +
                           given_value(pages_per_slot))
                              .c_str());
  if (!ring.is_none()) ring_entries = ring_argument(ring);
  if (!form->has_ring && (ring_entries.ring || ring_entries.per_layer))
    throw nb::value_error(
        (std::string("ring: the ") + form->name + " form takes none, got " + given_value(ring)).c_str());
  UpdateAttrs attrs = form->has_pages_per_slot ? slot_attrs(pages_per_slot, v_norm, norm_eps)
                                               : paged_attrs(ring_entries, v_norm, norm_eps);
  attrs.contract = form->contract;
  return attrs;
}

// The base operands of a call of `form`, from a Python sequence: exactly the form's count.
inline std::vector<nb::handle> form_operands(std::string const& form_name, nb::handle operands) {
  AddressingForm const& form = *addressing_form(form_name.c_str());  // form_attrs checked the name
  if (!nb::isinstance<nb::sequence>(operands) || nb::isinstance<nb::str>(operands))
    throw nb::type_error(("operands: expected a sequence of arrays, got " + given_value(operands)).c_str());
  nb::sequence const sequence = nb::borrow<nb::sequence>(operands);
  if (nb::len(sequence) != size_t(form.base_count))
    throw nb::value_error(("operands: expected " + std::to_string(form.base_count) + " arrays (" +
                           base_operand_list(form) + "), got " + std::to_string(nb::len(sequence)))
                              .c_str());
  std::vector<nb::handle> base;
  for (size_t i = 0; i < nb::len(sequence); ++i) base.push_back(sequence[i]);
  return base;
}

// A per-tensor scale may be a Python float or int (float32, as in the JAX op) or a NumPy scalar
// (an array of its own dtype); a bool is neither.
inline nb::object scale_array(nb::handle scale, char const* name) {
  if (is_bool(scale))
    throw nb::type_error((std::string(name) +
                          ": expected a float32 scale (a float, or a float32 array), got " +
                          given_value(scale))
                             .c_str());
  nb::module_ const np = numpy();
  if (PyFloat_Check(scale.ptr()) || PyLong_Check(scale.ptr())) return np.attr("asarray")(scale, "float32");
  if (nb::isinstance(scale, np.attr("generic"))) return np.attr("asarray")(scale);
  return nb::borrow(scale);
}

// The whole call: base operands (SPEC.md's order), then the present extras; raises on any
// invalid operand, attribute or parameter. delta_dtype names k, v and the weight; pool_dtype
// the pool ("" or None = the arrays' own dtypes). A scale pool (per-token-head scales, updated in
// place like the pool) takes the place of k_scale and v_scale.
template <typename Device>
KVUpdateParams params_from_arrays(UpdateAttrs attrs, std::vector<nb::handle> const& base, nb::handle k_scale,
                                  nb::handle v_scale, nb::handle k_norm_weight, nb::handle delta_dtype,
                                  nb::handle pool_dtype, KeptArrays& keep,
                                  nb::handle scale_pool = nb::none()) {
  attrs.k_norm = !k_norm_weight.is_none();
  attrs.scale_pool = !scale_pool.is_none();
  if (attrs.scale_pool && !(k_scale.is_none() && v_scale.is_none()))
    throw nb::value_error((std::string(kScalePoolName) +
                           ": per-token-head scales take the place of k_scale and v_scale; expected "
                           "k_scale=None and v_scale=None with a scale pool, got " +
                           (k_scale.is_none() ? "v_scale" : "k_scale") + "=" +
                           given_value(k_scale.is_none() ? v_scale : k_scale))
                              .c_str());
  if (k_scale.is_none() != v_scale.is_none())
    throw nb::value_error(k_scale.is_none()
                              ? "k_scale: v_scale is given, so k_scale is expected too, got None"
                              : "v_scale: k_scale is given, so v_scale is expected too, got None");
  std::string const delta_name = dtype_argument(delta_dtype, "delta_dtype");
  std::string const pool_name = dtype_argument(pool_dtype, "pool_dtype");
  DType const delta = delta_name.empty() ? DType::kOther : dtype_from_name(delta_name, "delta_dtype");
  DType const pool = pool_name.empty() ? DType::kOther : dtype_from_name(pool_name, "pool_dtype");
  char const* const delta_dtypes = "float16, bfloat16 or float32";
  static std::string const pool_dtypes = pool_dtype_list();
  std::vector<ArraySpec> specs;
  for (size_t i = 0; i < base.size(); ++i) {
    char const* name = operand_name(attrs, int32_t(i), int32_t(base.size()));
    DType const declared = i < 2 ? delta : i == 2 ? pool : DType::kOther;
    char const* keyword = i < 2 ? "delta_dtype" : i == 2 ? "pool_dtype" : nullptr;
    char const* expected = i < 2 ? delta_dtypes : i == 2 ? pool_dtypes.c_str() : i == 3 ? "float32" : "int32";
    specs.push_back({name, base[i], declared, /*writable=*/i == 2, keyword, expected});
  }
  nb::object k_scale_array, v_scale_array;
  if (!k_scale.is_none()) {
    k_scale_array = scale_array(k_scale, "k_scale");
    v_scale_array = scale_array(v_scale, "v_scale");
    specs.push_back({"k_scale", k_scale_array, DType::kOther, false, nullptr, "float32"});
    specs.push_back({"v_scale", v_scale_array, DType::kOther, false, nullptr, "float32"});
  }
  if (attrs.scale_pool)
    specs.push_back({kScalePoolName, scale_pool, DType::kOther, true, nullptr, "float32"});
  if (attrs.k_norm)
    specs.push_back({"k_norm_weight", k_norm_weight, delta, false, "delta_dtype",
                     "float16, bfloat16 or float32 (k_delta's)"});
  std::vector<TensorDesc> operands;
  for (ArraySpec const& spec : specs)
    operands.push_back(spec.writable ? describe_array<Device>(spec, keep.writable)
                                     : describe_array<Device>(spec, keep.read_only));
  KVUpdateParams p;
  if (std::string e =
          params_from_operands(operands.data(), int32_t(operands.size()), attrs, &p, /*need_data=*/true);
      !e.empty()) {
    // An unnamed uint8 pool is taken as int4 bytes; it may have been meant as FP8 bits.
    if (operands.size() > 2 && operands[2].dtype == DType::kUInt8 && pool_name.empty())
      e += " (a uint8 pool is an int4 pool's bytes; FP8 pools may also cross as uint8 views of their bits "
           "named with pool_dtype=\"...\")";
    throw nb::value_error(e.c_str());
  }
  return p;
}

}  // namespace dflash::jax
