// The contract as data (docs/SPEC.md): pool formats and addressing forms as descriptors.
//
// A pool format says what a pool stores and how a float32 value becomes a stored element; an
// addressing form says which operands a call takes and in what order. The checker (operands.h),
// the FFI handlers, the TensorRT plugin and, through the CPU extension, the Python API and the
// ONNX node read these tables instead of asking "slot or paged" and "FP8 or not" themselves.
// Where a token lands is kv_update.h's layout math; what is stored there is numerics.h.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "dflash/kv_update.h"

namespace dflash {

// ---- pool formats --------------------------------------------------------------------------------

// Which scale operands a pool format takes. A format with static scales also takes, per call
// (UpdateAttrs::scale_pool), a scale pool in their place: [2, N, P, H] float32, updated in place,
// each written (plane, token, head) row getting s = max_j |y_j| / max_finite and its elements
// stored divided by s (SPEC.md, "Dynamic scales"). The format's row does not decide between the
// two: the same pool may be written either way.
enum class ScaleGranularity : int32_t {
  kNone = 0,     // 16/32-bit pools: the value is rounded to the element type
  kStatic = 1,   // k_scale and v_scale operands, [] / [1] per tensor or [H] per KV head
  kDynamic = 2,  // the call's scale_pool only, never k_scale and v_scale (int4)
};

// How a float32 value y becomes a stored element (numerics.h).
enum class Conversion : int32_t {
  kRound = 0,            // round_X(y), nearest even (the IEEE formats)
  kTimesReciprocal = 1,  // fp8(y * (1 / scale)), nearest even, saturating (SPEC.md, "FP8 pools")
  kDivideByScale = 2,    // clamp(round_half_even(y / scale), -max, max), NaN -> 0 (integers)
};

struct PoolFormat {
  DType element;
  ScaleGranularity scales;
  Conversion conversion;
  // The largest finite magnitude a scaled store saturates to; 0 for the IEEE formats, whose
  // rounding overflows to infinity.
  float max_finite;
  // Whether the TensorRT plugin takes the format: TensorRT has the element type (its kFP8 is e4m3;
  // int4's bytes are kUINT8).
  bool tensorrt;
  // Elements one stored byte holds along D: 1, or 2 for 4-bit elements (element 2j in the low
  // nibble, 2j + 1 in the high one); the pool's last dim is D / per_byte.
  int32_t per_byte;
  // Whether the CUDA kernel stores the format; the CUDA handler refuses the others (CPU only).
  bool cuda;
  // The format's name in messages and docs: the element type's, or "int4" for the packed bytes.
  char const* name;
};

inline constexpr PoolFormat kPoolFormats[] = {
    {DType::kFloat16, ScaleGranularity::kNone, Conversion::kRound, 0.0f, true, 1, true, "float16"},
    {DType::kBFloat16, ScaleGranularity::kNone, Conversion::kRound, 0.0f, true, 1, true, "bfloat16"},
    {DType::kFloat32, ScaleGranularity::kNone, Conversion::kRound, 0.0f, true, 1, true, "float32"},
    {DType::kFloat8E4M3, ScaleGranularity::kStatic, Conversion::kTimesReciprocal, 448.0f, true, 1, true,
     "float8_e4m3fn"},
    {DType::kFloat8E5M2, ScaleGranularity::kStatic, Conversion::kTimesReciprocal, 57344.0f, false, 1, true,
     "float8_e5m2"},
    {DType::kInt8, ScaleGranularity::kStatic, Conversion::kDivideByScale, 127.0f, true, 1, true, "int8"},
    // int4: uint8 bytes [.., D / 2], two 4-bit two's-complement elements each.
    {DType::kUInt8, ScaleGranularity::kDynamic, Conversion::kDivideByScale, 7.0f, true, 2, true, "int4"},
};

// The format of a pool of this dtype; null when no pool has it.
constexpr PoolFormat const* pool_format(DType element) {
  for (PoolFormat const& f : kPoolFormats)
    if (f.element == element) return &f;
  return nullptr;
}
constexpr bool is_pool_dtype(DType d) { return pool_format(d) != nullptr; }
// Whether a pool of this dtype takes k_scale and v_scale.
constexpr bool takes_scales(DType pool) {
  PoolFormat const* f = pool_format(pool);
  return f != nullptr && f->scales == ScaleGranularity::kStatic;
}
// Whether a pool of this dtype is stored with a scale pool only (never static scales).
constexpr bool needs_scale_pool(DType pool) {
  PoolFormat const* f = pool_format(pool);
  return f != nullptr && f->scales == ScaleGranularity::kDynamic;
}
// Elements per stored byte along D (1, or 2 for int4); 1 for a dtype no pool has.
constexpr int32_t pool_per_byte(DType pool) {
  PoolFormat const* f = pool_format(pool);
  return f != nullptr ? f->per_byte : 1;
}
// Whether a pool of this dtype stores round(y / scale) rather than y times the scale's reciprocal.
constexpr bool divides_by_scale(DType pool) {
  PoolFormat const* f = pool_format(pool);
  return f != nullptr && f->conversion == Conversion::kDivideByScale;
}
// "float16, bfloat16, float32, float8_e4m3fn or float8_e5m2", for messages; TensorRT's only
// with `tensorrt`.
std::string pool_dtype_list(bool tensorrt = false);
// "float8_e4m3fn, float8_e5m2 or int8": the formats with static scales, for messages; with
// `dynamic`, also those with a scale pool only ("... or uint8 (int4)").
std::string scaled_dtype_list(bool dynamic = false);

// ---- addressing forms ----------------------------------------------------------------------------

// What a base operand is: its dtype follows from the role.
enum class OperandRole : int32_t {
  kKDelta = 0,  // a delta dtype
  kVDelta,      // k_delta's dtype
  kPool,        // a pool format's element type
  kRope,        // float32
  kIndex,       // int32 positions and lengths, or positions and owners: one layout for the pair
  kPageTable,   // int32 page ids
  kSlotIndex,   // int32 or int64 flat slots (never narrowed)
};

struct OperandSpec {
  char const* name;  // SPEC.md's
  OperandRole role;
  char const* dims;  // unbatched, for messages and docs
};

inline constexpr int32_t kMaxBaseOperands = 7;
// The operands after the base ones: the scales (when the pool format takes them), the weight.
inline constexpr char const* kScaleNames[2] = {"k_scale", "v_scale"};
inline constexpr char const* kNormWeightName = "k_norm_weight";
inline constexpr char const* kResultName = "present_key_value";
// Per-token-head dynamic scales (UpdateAttrs::scale_pool): one operand in place of k_scale and
// v_scale, and the call's second result, aliasing it.
inline constexpr char const* kScalePoolName = "scale_pool";
inline constexpr char const* kScaleResultName = "present_scale_pool";
inline constexpr int32_t kMaxExtraOperands = 3;
// Operand indices every form shares.
inline constexpr int32_t kKDeltaOperand = 0, kVDeltaOperand = 1, kPoolOperand = 2, kRopeOperand = 3;

struct AddressingForm {
  Contract contract;
  char const* name;        // "slot", "paged"
  char const* origin;      // whose contract it is (TensorRT Edge-LLM's version)
  char const* ffi_target;  // the XLA FFI custom call
  int32_t base_count;
  OperandSpec base[kMaxBaseOperands];
  int32_t delta_rank;  // of k_delta / v_delta, unbatched
  int32_t rope_rank;
  // The form's attributes besides the norms' (k_norm, v_norm, norm_eps, which every form has).
  bool has_pages_per_slot;  // required, int64 > 0
  bool has_ring;            // bool
  bool cuda;                // whether the CUDA kernel serves it (else CPU only, so far)
};

inline constexpr AddressingForm kAddressingForms[] = {
    {Contract::kSlot,
     "slot",
     "Edge-LLM 0.10",
     "dflash_target_kv_cache_update",
     6,
     {{"k_delta", OperandRole::kKDelta, "[B, L, H, D]"},
      {"v_delta", OperandRole::kVDelta, "[B, L, H, D]"},
      {"past_key_value", OperandRole::kPool, "[2, N, P, H, D]"},
      {"rope_cos_sin", OperandRole::kRope, "[Rb, S, R]"},
      {"delta_start_positions", OperandRole::kIndex, "[B]"},
      {"delta_lengths", OperandRole::kIndex, "[B]"}},
     4,
     3,
     true,
     false,
     true},
    {Contract::kPaged,
     "paged",
     "Edge-LLM 0.11",
     "dflash_target_kv_cache_update_paged",
     7,
     {{"k_delta", OperandRole::kKDelta, "[T, H, D]"},
      {"v_delta", OperandRole::kVDelta, "[T, H, D]"},
      {"past_key_value", OperandRole::kPool, "[2, N, P, H, D]"},
      {"rope_cos_sin", OperandRole::kRope, "[T, R]"},
      {"delta_positions", OperandRole::kIndex, "[T]"},
      {"delta_token_to_sequence", OperandRole::kIndex, "[T]"},
      {"kv_page_table", OperandRole::kPageTable, "[B, 2, M]"}},
     3,
     2,
     false,
     true,
     true},
    {Contract::kSlotMapping,
     "slot_mapping",
     "vLLM, SGLang",
     "dflash_target_kv_cache_update_slots",
     5,
     {{"k_delta", OperandRole::kKDelta, "[T, H, D]"},
      {"v_delta", OperandRole::kVDelta, "[T, H, D]"},
      {"past_key_value", OperandRole::kPool, "[2, N, P, H, D]"},
      {"rope_cos_sin", OperandRole::kRope, "[T, R]"},
      {"slot_mapping", OperandRole::kSlotIndex, "[T]"}},
     3,
     2,
     false,
     false,
     true},
};

static_assert(kAddressingForms[0].cuda && kAddressingForms[1].cuda && kAddressingForms[2].cuda,
              "every addressing form runs on CUDA");

// The table is in the enum's order.
constexpr AddressingForm const& addressing_form(Contract contract) {
  return kAddressingForms[int32_t(contract)];
}
// The form named `name` ("slot", "paged"); null for another name.
inline AddressingForm const* addressing_form(char const* name) {
  for (AddressingForm const& f : kAddressingForms)
    if (std::strcmp(f.name, name) == 0) return &f;
  return nullptr;
}

// Whether a pool of this dtype can take a scale pool (per-token-head dynamic scales): every
// format with scales can.
constexpr bool takes_scale_pool(DType pool) { return takes_scales(pool) || needs_scale_pool(pool); }

// Operands before the extras.
constexpr int32_t base_operand_count(Contract contract) { return addressing_form(contract).base_count; }
// All operands: the base ones, then k_scale and v_scale when the pool takes static scales (or
// scale_pool for dynamic ones), then k_norm_weight with k_norm.
constexpr int32_t operand_count(Contract contract, bool scaled_pool, bool k_norm, bool scale_pool = false) {
  return base_operand_count(contract) + (scale_pool ? 1 : scaled_pool ? 2 : 0) + (k_norm ? 1 : 0);
}
// "k_delta, v_delta, ..." of the form's base operands, for messages.
std::string base_operand_list(AddressingForm const& form);

}  // namespace dflash
