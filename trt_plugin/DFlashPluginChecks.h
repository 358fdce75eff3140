// TensorRT's view of a call, translated for the shared core's checks (csrc/dflash/operands.h).
//
// The plugin has no shape rules of its own: every entry point turns TensorRT's DataTypes, Dims
// (with -1 wildcards at build time) and fields into dflash::TensorDescs and dflash::UpdateAttrs
// and asks dflash::params_from_operands / check_operand_dtype / check_result. What is TensorRT's
// alone is here: which contract a call is (k_delta's rank, then the input count), linear formats,
// 128 tokens per page, scales given as [1] or [H], and the fields.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>

#include "DFlashTargetKVCacheUpdatePlugin.h"
#include "dflash/operands.h"

namespace dflash::trt {

DType toDType(nvinfer1::DataType type);
char const* typeName(nvinfer1::DataType type);
// "kINT32", "kFLOAT32", ...; "PluginFieldType <n>" for a value the headers do not name.
std::string fieldTypeName(nvinfer1::PluginFieldType type);
std::string dimsToString(nvinfer1::Dims const& dims);

// The most inputs a call has: 7 (paged) + k_scale, v_scale + k_norm_weight.
inline constexpr int32_t kMAX_INPUTS = 10;
// The most outputs: present_key_value, then present_scale_pool with the field scale_pool = 1.
inline constexpr int32_t kMAX_OUTPUTS = 2;

// Whether a pool of this TensorRT dtype takes k_scale and v_scale (kFP8, kINT8: contract.h's
// formats with static scales).
bool takesStaticScales(nvinfer1::DataType pool);
// The outputs a plugin with these fields has: 1, or 2 with the field scale_pool = 1.
int32_t outputCount(PluginConfig const& config);
// The input the scale pool is in a call of this contract (after the base inputs).
int32_t scalePoolInput(Contract contract);

// ---- fields --------------------------------------------------------------------------------------

// Reads createPlugin's fields. Throws std::invalid_argument naming the field on a wrong type,
// length or value, a field given twice, or an unknown field (a misspelt field would otherwise
// leave its default in place without a word: `rnig=1` is no ring); plugin_version and
// plugin_namespace, which TensorRT's ONNX parser may pass on with the node's attributes, are
// ignored.
PluginConfig readFields(nvinfer1::PluginFieldCollection const* fc);
// "" when `value` is a valid pages_per_slot, else the reason.
std::string checkPagesPerSlotValue(int64_t value);

// ---- the form of a call ----------------------------------------------------------------------------

// One tensor as TensorRT describes it. dims may hold -1 (unknown) where allowUnknown is given.
struct TrtTensor {
  nvinfer1::DataType type{nvinfer1::DataType::kFLOAT};
  nvinfer1::TensorFormat format{nvinfer1::TensorFormat::kLINEAR};
  nvinfer1::Dims dims{};
  void const* data{nullptr};
};
inline TrtTensor trtTensor(nvinfer1::PluginTensorDesc const& desc, void const* data = nullptr) {
  return {desc.type, desc.format, desc.dims, data};
}

// What a call is: the contract (slot: 6 base inputs, paged: 7), then either k_scale and v_scale
// (a kFP8 or kINT8 pool with static scales) or scale_pool (field scale_pool = 1), then
// k_norm_weight (field k_norm = 1).
struct CallForm {
  UpdateAttrs attrs;
  bool staticScales{false};
  int32_t nbInputs{0};
  // The pool's dtype where known, else the one the count implies (for messages).
  nvinfer1::DataType poolType{nvinfer1::DataType::kHALF};
};

// What an entry point knows of its inputs when it asks for the form: their ranks and dims (all
// but getOutputDataTypes), their dtypes (getOutputDataTypes and the calls with descriptors, not
// getOutputShapes nor supportsFormatCombination, where TensorRT has not chosen them yet).
struct CallFacts {
  TrtTensor const* inputs{nullptr};  // nbInputs of them; null: only the count is known
  bool dimsKnown{false};
  bool typesKnown{false};
};

// Fills *form from the fields and the facts; "" when the input count is the form's. The contract
// is k_delta's rank (4: slot, Edge-LLM 0.10; 3: paged, 0.11) where the dims are known, else input
// 6's dtype (the paged contract's kv_page_table is an integer tensor, the slot contract's input 6
// a float extra or none), else the count. The scales follow from the pool's dtype where it is
// known, else from the count. Deciding the contract before counting is what lets a wrong count
// be reported as the inputs missing or unexpected for that contract with these fields and pool,
// instead of as another contract whose rank k_delta does not have.
std::string callForm(PluginConfig const& config, int32_t nbInputs, int32_t nbOutputs, CallFacts const& facts,
                     CallForm* form);

// The dtypes a call of this form is checked with when TensorRT gives none (getOutputShapes):
// float16 deltas, a float16 pool (kFP8 with static scales; with a scale pool kINT8, or kUINT8
// (int4) where the pool's last dim is half k_delta's), and the contract's fixed dtypes.
nvinfer1::DataType shapeCheckType(CallForm const& form, int32_t index, TrtTensor const* inputs);

// ---- the checks, one per entry point ---------------------------------------------------------------

// getOutputDataTypes: every input's dtype, and the outputs' (the pool's, then the scale pool's)
// through outputTypes (nbOutputs of them).
std::string checkInputTypes(PluginConfig const& config, nvinfer1::DataType const* inputTypes,
                            int32_t nbInputs, int32_t nbOutputs, nvinfer1::DataType* outputTypes);

// supportsFormatCombination's form: from the dims and the count, not the dtypes, which TensorRT
// is choosing (a kFP8 pool probed on a 16-bit call is a refusal, not a wrong count).
std::string formatCallForm(PluginConfig const& config, nvinfer1::DynamicPluginTensorDesc const* inOut,
                           int32_t nbInputs, int32_t nbOutputs, CallForm* form);
// supportsFormatCombination: tensor `pos` (inputs, then the output) of a call of this form, given
// inOut[0..pos] decided.
std::string checkFormatAt(CallForm const& form, int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut,
                          int32_t nbInputs, int32_t nbOutputs);

// How checkCall treats what is not known yet.
struct CheckMode {
  bool allowUnknown{false};  // -1 dims skip the rules that need them (build time)
  bool needData{false};      // the inputs read must have device pointers (enqueue)
  // A slot call whose pages_per_slot may still be set (setPagesPerSlot() after parsing): the
  // rules that need it are skipped (getOutputShapes).
  bool pagesPerSlotPending{false};
};

// Every rule on a whole call: the form, formats, dtypes, 128 tokens per page, the core's shape
// rules (dims, their equalities, sizes and the int64 overflow of every tensor) and the outputs'
// match with the pool (and the scale pool). `outputs` (nbOutputs of them) may be null
// (getOutputShapes: the outputs are made from the inputs). With unknown dims, every rule between
// known sizes is still checked. Fills *params (usable only when no dim was unknown).
std::string checkCall(PluginConfig const& config, TrtTensor const* inputs, int32_t nbInputs,
                      TrtTensor const* outputs, int32_t nbOutputs, CheckMode const& mode,
                      KVUpdateParams* params);

// configurePlugin and getWorkspaceSize: checkCall on the build-time descriptors (wildcards
// allowed), then on each of the profile's min, opt and max shapes.
std::string checkProfile(PluginConfig const& config, nvinfer1::DynamicPluginTensorDesc const* in,
                         int32_t nbInputs, nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs);

// The bytes of a tensor, or -1 when the product overflows int64.
int64_t tensorBytes(nvinfer1::Dims const& dims, nvinfer1::DataType type);

// ---- failing ---------------------------------------------------------------------------------------

// The one way an entry point fails: when `reason` is not empty it is logged as an error of
// "DFlashTargetKVCacheUpdate::<function> (<pluginName>)" and reported to `recorder` (if any) as
// kINVALID_ARGUMENT. Returns kSTATUS_SUCCESS for an empty reason, else kSTATUS_FAILURE.
int32_t checkOrFail(std::string const& reason, char const* function, std::string const& pluginName,
                    nvinfer1::IErrorRecorder* recorder) noexcept;

}  // namespace dflash::trt
