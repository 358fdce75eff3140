// From tensor descriptions to KVUpdateParams, once, for every runtime.
//
// The XLA FFI handlers, the TensorRT plugin and the raw (array) entries all describe their
// operands as TensorDescs in SPEC.md's order and call params_from_operands(), which checks every
// rule of the contract (ranks, the equalities between dims, dtypes, sizes and their overflow) and
// fills the parameters. Each message names the operand, what was expected and what was given.
#pragma once

#include <cstdint>
#include <string>

#include "dflash/contract.h"
#include "dflash/kv_update.h"

namespace dflash {

inline constexpr int32_t kMaxRank = 8;
// A dimension not known yet (TensorRT build time); rules that need it are skipped.
inline constexpr int64_t kUnknownDim = -1;

struct TensorDesc {
  DType dtype = DType::kOther;
  int32_t rank = 0;
  int64_t dims[kMaxRank] = {};
  void const* data = nullptr;  // may be null where only shapes are checked
};

// The static part of a call: the contract and its attributes (XLA attributes, plugin fields).
struct UpdateAttrs {
  Contract contract = Contract::kSlot;
  int64_t pages_per_slot = 0;  // slot contract, > 0
  bool ring = false;           // paged contract: every layer's pages are a ring
  // Paged contract, layer-batched form: one entry per layer (0 or 1: that layer's pages are a
  // ring) in place of `ring`; ring_layer_count < 0 when not given. The caller keeps the entries
  // alive for the call; they may be null where only shapes are checked (the count still is).
  int8_t const* ring_layers = nullptr;
  int64_t ring_layer_count = -1;
  bool k_norm = false;         // k_norm_weight is an operand
  bool v_norm = false;
  float norm_eps = kDefaultNormEps;
  // Per-token-head dynamic scales: the operand after the base ones is scale_pool (in place of
  // k_scale and v_scale), and the call has a second result aliasing it.
  bool scale_pool = false;
  // TensorRT's profile of the contract (the plugin, and the ONNX node that targets it): the
  // unbatched form only, pages of kTensorRTPageSize tokens, the pool formats TensorRT has
  // (kFP8 is e4m3), scales of shape [1] or [H].
  bool tensorrt = false;
};

inline constexpr int64_t kTensorRTPageSize = 128;

// The name of operand `index` (SPEC.md's), for messages; "present_key_value" for index == count.
char const* operand_name(UpdateAttrs const& attrs, int32_t index, int32_t count);

// The dtype operand `index` of `count` operands must have, given k_delta's and the pool's
// (TensorRT's supportsFormatCombination asks position by position); empty if `given` is fine.
std::string check_operand_dtype(UpdateAttrs const& attrs, int32_t index, int32_t count, DType given,
                                DType delta_dtype, DType pool_dtype);

// Checks `count` operands against the contract of `attrs` and fills *p (sizes, flags and the
// data pointers). Dims, and the slot contract's pages_per_slot, may be kUnknownDim when
// `allow_unknown` (TensorRT's build time; then *p is not usable): every rule between the known
// sizes is still checked, a size being known when any operand holding it has it. With
// `need_data`, operands that will be read must have non-null data. Returns "" when valid, else
// the reason.
// *type_error, when given, says whether the reason is an operand's dtype or the operand count
// (a TypeError to Python) rather than a shape or a value.
std::string params_from_operands(TensorDesc const* operands, int32_t count, UpdateAttrs const& attrs,
                                 KVUpdateParams* p, bool need_data, bool allow_unknown = false,
                                 bool* type_error = nullptr);

// "" when `eps` is a valid norm_eps: finite, > 0 and a normal float32 (a subnormal one would read
// as zero under a flush-to-zero mode, which XLA's CPU runtime sets).
std::string check_norm_eps(double eps);

// The numeric rules on filled parameters (also used by params_from_operands): sizes, their
// products without overflow (every element offset fits int64), the contract's equalities.
std::string check_params(KVUpdateParams const& p);

// The result of the call (the pool, aliased) must have exactly the pool's dims and dtype.
std::string check_result(TensorDesc const& result, TensorDesc const& pool);
// The second result of a call with scale_pool (aliased to it) must have exactly its dims and dtype.
std::string check_scale_result(TensorDesc const& result, TensorDesc const& scale_pool);

}  // namespace dflash
