// _dflash_cpu: the XLA FFI handler of the update on CPU, and the same kernel for NumPy callers
// (the ONNX reference runtime uses it).
#include <cstring>

#include "dflash/kv_update_cpu.h"
#include "ffi_params.h"
#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "nanobind/stl/string.h"

namespace nb = nanobind;

namespace dflash::jax {
namespace {

ffi::Error target_kv_cache_update_cpu_impl(ffi::AnyBuffer k_delta, ffi::AnyBuffer v_delta,
                                           ffi::AnyBuffer past_key_value,
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
  // The output aliases the pool; should XLA ever hand us two buffers, start from the pool.
  if (present_key_value->untyped_data() != past_key_value.untyped_data())
    std::memcpy(present_key_value->untyped_data(), past_key_value.untyped_data(),
                past_key_value.size_bytes());
  p.pool = present_key_value->untyped_data();
  target_kv_cache_update_cpu(p);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TargetKVCacheUpdateCpu, target_kv_cache_update_cpu_impl,
                              bind_update_operands(ffi::Ffi::Bind()));

namespace {

using Array = nb::ndarray<nb::device::cpu, nb::c_contig>;

DType dtype_from_name(std::string const& name) {
  if (name == "float16") return DType::kFloat16;
  if (name == "bfloat16") return DType::kBFloat16;
  if (name == "float32") return DType::kFloat32;
  throw nb::value_error(("dtype must be float16, bfloat16 or float32, got " + name).c_str());
}

// In-place update of a NumPy pool [2, numPages, P, H, D] (16-bit dtypes passed as uint16 views,
// with `dtype` naming the real type). Same kernel as the custom call.
void update_numpy(Array k_delta, Array v_delta, Array pool, Array rope_cos_sin,
                  Array delta_start_positions, Array delta_lengths, int64_t pages_per_slot,
                  std::string const& dtype) {
  if (pool.ndim() != 5 || k_delta.ndim() != 4 || v_delta.ndim() != 4 || rope_cos_sin.ndim() != 3 ||
      delta_start_positions.ndim() != 1 || delta_lengths.ndim() != 1)
    throw nb::value_error("expected ranks k/v 4, pool 5, rope 3, positions/lengths 1");
  KVUpdateParams p;
  p.dtype = dtype_from_name(dtype);
  int64_t const elem = dtype_bytes(p.dtype) * 8;
  for (Array const* a : {&k_delta, &v_delta, &pool})
    if (a->dtype().bits != elem) throw nb::type_error("k/v/pool element size does not match dtype");
  if (rope_cos_sin.dtype() != nb::dtype<float>())
    throw nb::type_error("rope_cos_sin must be float32");
  if (delta_start_positions.dtype() != nb::dtype<int32_t>() ||
      delta_lengths.dtype() != nb::dtype<int32_t>())
    throw nb::type_error("delta_start_positions and delta_lengths must be int32");
  p.batch = int64_t(k_delta.shape(0));
  p.delta_len = int64_t(k_delta.shape(1));
  p.num_kv_heads = int64_t(pool.shape(3));
  p.head_dim = int64_t(pool.shape(4));
  p.num_pages = int64_t(pool.shape(1));
  p.page_size = int64_t(pool.shape(2));
  p.pages_per_slot = pages_per_slot;
  p.rope_batch = int64_t(rope_cos_sin.shape(0));
  p.rope_seq_len = int64_t(rope_cos_sin.shape(1));
  p.rotary_dim = int64_t(rope_cos_sin.shape(2));
  for (size_t i = 0; i < 4; ++i)
    if (k_delta.shape(i) != v_delta.shape(i)) throw nb::value_error("k_delta and v_delta differ in shape");
  if (pool.shape(0) != 2 || int64_t(k_delta.shape(2)) != p.num_kv_heads ||
      int64_t(k_delta.shape(3)) != p.head_dim)
    throw nb::value_error("pool must be [2, numPages, P, H, D] with k_delta's H and D");
  if (int64_t(delta_start_positions.shape(0)) != p.batch ||
      int64_t(delta_lengths.shape(0)) != p.batch)
    throw nb::value_error("delta_start_positions and delta_lengths must have B entries");
  p.k_delta = k_delta.data();
  p.v_delta = v_delta.data();
  p.pool = pool.data();
  p.rope_cos_sin = static_cast<float const*>(rope_cos_sin.data());
  p.delta_start_positions = static_cast<int32_t const*>(delta_start_positions.data());
  p.delta_lengths = static_cast<int32_t const*>(delta_lengths.data());
  if (std::string const error = check_params(p); !error.empty()) throw nb::value_error(error.c_str());
  nb::gil_scoped_release release;
  target_kv_cache_update_cpu(p);
}

}  // namespace
}  // namespace dflash::jax

NB_MODULE(_dflash_cpu, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["dflash_target_kv_cache_update"] =
        nb::capsule(reinterpret_cast<void*>(dflash::jax::TargetKVCacheUpdateCpu));
    return targets;
  });
  m.def("target_kv_cache_update", &dflash::jax::update_numpy, nb::arg("k_delta"),
        nb::arg("v_delta"), nb::arg("pool"), nb::arg("rope_cos_sin"),
        nb::arg("delta_start_positions"), nb::arg("delta_lengths"), nb::arg("pages_per_slot"),
        nb::arg("dtype"),
        "Updates `pool` in place with the CPU kernel (16-bit dtypes as uint16 views).");
}
