// Translates the XLA FFI buffers of the custom call into the shared KVUpdateParams.
// Shapes were checked at trace time (jax_dflash/_shapes.py); they are checked again here, since
// a custom call can be reached by hand-written HLO too.
#pragma once

#include <string>
#include <utility>

#include "dflash/kv_update.h"
#include "xla/ffi/api/ffi.h"

namespace dflash::jax {

namespace ffi = ::xla::ffi;

inline ffi::Error invalid(std::string const& message) {
  return ffi::Error::InvalidArgument("dflash_target_kv_cache_update: " + message);
}

template <typename A, typename B>
bool same_dims(A const& a, B const& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

inline ffi::Error to_dtype(ffi::DataType type, DType* dtype) {
  switch (type) {
    case ffi::DataType::F16: *dtype = DType::kFloat16; return ffi::Error::Success();
    case ffi::DataType::BF16: *dtype = DType::kBFloat16; return ffi::Error::Success();
    case ffi::DataType::F32: *dtype = DType::kFloat32; return ffi::Error::Success();
    default: return invalid("k_delta, v_delta and past_key_value must be float16, bfloat16 or float32");
  }
}

// Fills *p from the operands. Ranks tell the layer-batched form apart: a pool of rank 6 carries
// a leading layer axis; then rope (rank 4) and positions/lengths (rank 2) may carry one too.
inline ffi::Error params_from_buffers(ffi::AnyBuffer k_delta, ffi::AnyBuffer v_delta,
                                      ffi::AnyBuffer past_key_value,
                                      ffi::Buffer<ffi::F32> rope_cos_sin,
                                      ffi::Buffer<ffi::S32> delta_start_positions,
                                      ffi::Buffer<ffi::S32> delta_lengths, int64_t pages_per_slot,
                                      KVUpdateParams* p) {
  auto const pool = past_key_value.dimensions();
  auto const k = k_delta.dimensions();
  auto const rope = rope_cos_sin.dimensions();
  auto const starts = delta_start_positions.dimensions();
  bool const layered = pool.size() == 6;
  size_t const lead = layered ? 1 : 0;
  if (pool.size() != 5 + lead || k.size() != 4 + lead || !same_dims(v_delta.dimensions(), k))
    return invalid("expected pool rank 5 (or 6 with layers) and k/v of rank 4 (5) and equal shape");
  if (past_key_value.element_type() != k_delta.element_type() ||
      v_delta.element_type() != k_delta.element_type())
    return invalid("k_delta, v_delta and past_key_value must share one dtype");
  if (ffi::Error e = to_dtype(k_delta.element_type(), &p->dtype); e.failure()) return e;
  if (!(rope.size() == 3 || (layered && rope.size() == 4)))
    return invalid("rope_cos_sin must be [Rb, S, R] (or [layers, Rb, S, R])");
  if (starts.size() < 1 || starts.size() > 1 + lead || !same_dims(delta_lengths.dimensions(), starts))
    return invalid("delta_start_positions and delta_lengths must be [B] (or [layers, B])");

  p->num_layers = layered ? pool[0] : 1;
  if (pool[lead] != 2) return invalid("past_key_value dim 0 must be 2 (K and V planes)");
  p->num_pages = pool[lead + 1];
  p->page_size = pool[lead + 2];
  p->num_kv_heads = pool[lead + 3];
  p->head_dim = pool[lead + 4];
  p->batch = k[lead];
  p->delta_len = k[lead + 1];
  if (k[lead + 2] != p->num_kv_heads || k[lead + 3] != p->head_dim)
    return invalid("k_delta heads/head dim must match past_key_value's");
  if (layered && k[0] != p->num_layers) return invalid("k_delta layers must match past_key_value's");
  p->rope_per_layer = rope.size() == 4;
  size_t const rope_lead = p->rope_per_layer ? 1 : 0;
  if (p->rope_per_layer && rope[0] != p->num_layers)
    return invalid("rope_cos_sin layers must match past_key_value's");
  p->rope_batch = rope[rope_lead];
  p->rope_seq_len = rope[rope_lead + 1];
  p->rotary_dim = rope[rope_lead + 2];
  p->positions_per_layer = starts.size() == 2;
  if (p->positions_per_layer && starts[0] != p->num_layers)
    return invalid("delta_start_positions layers must match past_key_value's");
  if (starts.back() != p->batch) return invalid("delta_start_positions must have B entries");
  p->pages_per_slot = pages_per_slot;

  p->k_delta = k_delta.untyped_data();
  p->v_delta = v_delta.untyped_data();
  p->pool = past_key_value.untyped_data();
  p->rope_cos_sin = rope_cos_sin.typed_data();
  p->delta_start_positions = delta_start_positions.typed_data();
  p->delta_lengths = delta_lengths.typed_data();
  if (std::string const error = check_params(*p); !error.empty()) return invalid(error);
  return ffi::Error::Success();
}

// The custom call's operands, result and attribute, in SPEC.md's order; both handlers bind
// these after their platform context (if any).
template <typename Binding>
auto bind_update_operands(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // k_delta
      .template Arg<ffi::AnyBuffer>()              // v_delta
      .template Arg<ffi::AnyBuffer>()              // past_key_value
      .template Arg<ffi::Buffer<ffi::F32>>()       // rope_cos_sin
      .template Arg<ffi::Buffer<ffi::S32>>()       // delta_start_positions
      .template Arg<ffi::Buffer<ffi::S32>>()       // delta_lengths
      .template Ret<ffi::AnyBuffer>()              // present_key_value (aliases past_key_value)
      .template Attr<int64_t>("pages_per_slot");
}

}  // namespace dflash::jax
