// The TensorRT IPluginV3 plugin of the DFlash target KV-cache update (docs/SPEC.md, "The TensorRT
// plugin contract"; trt_plugin/README.md). One plugin serves both addressing contracts, told apart
// by its inputs:
//   slot  (Edge-LLM 0.10): k_delta, v_delta [B, L, H, D], past_key_value [2, N, 128, H, D],
//         rope_cos_sin [Rb, S, R], delta_start_positions [B], delta_lengths [B]; field pages_per_slot
//   paged (Edge-LLM 0.11): k_delta, v_delta [T, H, D], past_key_value [2, N, 128, H, D],
//         rope_cos_sin [T, R], delta_positions [T], delta_token_to_sequence [T],
//         kv_page_table [B, 2, M]; no field required
// then k_scale, v_scale (kFLOAT [1] or [H]) for a kFP8 or kINT8 pool, or, with the field
// scale_pool=1, scale_pool (kFLOAT [2, N, 128, H]: per-token-head scales) in their place (for a
// kFP8, kINT8 or int4 pool: kUINT8 [2, N, 128, H, D/2]), then k_norm_weight [D] when k_norm=1.
// Output 0, present_key_value, is the pool itself (aliased to input 2, updated in place); with
// scale_pool=1, output 1, present_scale_pool, is the scale pool (aliased to it).
//
// Every shape and dtype rule is dflash::params_from_operands (csrc/dflash/operands.h), the function
// the JAX handlers call; DFlashPluginChecks.h translates TensorRT's descriptors for it. enqueue
// calls dflash::launch_target_kv_cache_update, the launcher the JAX (XLA FFI) handler calls.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>

#include "dflash/contract.h"

#define DFLASH_TRT_API __attribute__((visibility("default")))

namespace dflash::trt {

// Plugin identity and the serialized fields, as TensorRT, the ONNX parser and engines see them.
inline constexpr char const* kPLUGIN_NAME = "DFlashTargetKVCacheUpdate";
inline constexpr char const* kPLUGIN_VERSION = "1";
inline constexpr char const* kPAGES_PER_SLOT_FIELD = "pages_per_slot";  // INT32 > 0, slot contract
inline constexpr char const* kRING_FIELD = "ring";                      // INT32 0/1, paged contract
inline constexpr char const* kK_NORM_FIELD = "k_norm";                  // INT32 0/1
inline constexpr char const* kV_NORM_FIELD = "v_norm";                  // INT32 0/1
inline constexpr char const* kNORM_EPS_FIELD = "norm_eps";              // FLOAT32 > 0
// INT32 0/1: per-token-head dynamic scales. 1: the input after the base ones is scale_pool (in
// place of k_scale, v_scale) and the plugin has a second output, present_scale_pool, aliasing it.
inline constexpr char const* kSCALE_POOL_FIELD = "scale_pool";
// CHAR, optional: the addressing form's name (dflash::kAddressingForms), which then decides the
// call's form; without it the inputs do (k_delta's rank, then the count).
inline constexpr char const* kFORM_FIELD = "form";
inline constexpr float kDEFAULT_NORM_EPS = dflash::kDefaultNormEps;
// Tokens per page of the pool (dim 2 of past_key_value), fixed by the TensorRT contract.
inline constexpr int32_t kTOKENS_PER_PAGE = 128;

// Base inputs of each contract (before the optional k_scale, v_scale, k_norm_weight).
inline constexpr int32_t kNB_INPUTS = dflash::base_operand_count(dflash::Contract::kSlot);
inline constexpr int32_t kNB_PAGED_INPUTS = dflash::base_operand_count(dflash::Contract::kPaged);
inline constexpr int32_t kNB_OUTPUTS = 1;  // 2 with the field scale_pool = 1

// Positions in the inOut arrays of the slot contract without extras (inputs, then the output).
enum TensorPosition : int32_t {
  kK_DELTA = 0,
  kV_DELTA = 1,
  kPAST_KEY_VALUE = 2,
  kROPE_COS_SIN = 3,
  kDELTA_START_POSITIONS = 4,
  kDELTA_LENGTHS = 5,
  kPRESENT_KEY_VALUE = 6,
};
inline constexpr int32_t kNB_TENSORS = kNB_INPUTS + kNB_OUTPUTS;
// The paged contract's own inputs (0..3 as in the slot contract).
enum PagedTensorPosition : int32_t {
  kDELTA_POSITIONS = 4,
  kDELTA_TOKEN_TO_SEQUENCE = 5,
  kKV_PAGE_TABLE = 6,
};

// The value of an error return (TensorRT only distinguishes 0 from non-zero).
inline constexpr int32_t kSTATUS_SUCCESS = 0;
inline constexpr int32_t kSTATUS_FAILURE = -1;

// The plugin's fields, as given (createPlugin) or set; carried by clone() and serialization.
struct PluginConfig {
  int32_t pagesPerSlot{0};  // 0: not given (the paged contract needs none)
  int32_t ring{0};
  int32_t kNorm{0};
  int32_t vNorm{0};
  float normEps{kDEFAULT_NORM_EPS};
  int32_t form{-1};  // index into dflash::kAddressingForms; -1: not given (the inputs decide)
  int32_t scalePool{0};
};

// The plugin's fields, in getFieldNames()'s order.
inline constexpr int32_t kNB_FIELDS = 7;

class DFLASH_TRT_API DFlashTargetKVCacheUpdatePlugin : public nvinfer1::IPluginV3,
                                                       public nvinfer1::IPluginV3OneCore,
                                                       public nvinfer1::IPluginV3OneBuildV2,
                                                       public nvinfer1::IPluginV3OneRuntime {
 public:
  explicit DFlashTargetKVCacheUpdatePlugin(std::string const& name);
  // Reads the fields (see PluginConfig). Throws std::invalid_argument on a bad or duplicate
  // field; the creator catches it and returns nullptr with a logged message.
  DFlashTargetKVCacheUpdatePlugin(std::string const& name, nvinfer1::PluginFieldCollection const* fc);
  DFlashTargetKVCacheUpdatePlugin() = delete;
  DFlashTargetKVCacheUpdatePlugin(DFlashTargetKVCacheUpdatePlugin const&) = delete;
  ~DFlashTargetKVCacheUpdatePlugin() override = default;

  // IPluginV3
  nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
  nvinfer1::IPluginV3* clone() noexcept override;

  // IPluginV3OneCore
  char const* getPluginName() const noexcept override;
  char const* getPluginVersion() const noexcept override;
  char const* getPluginNamespace() const noexcept override;

  // IPluginV3OneBuildV2
  int32_t getNbOutputs() const noexcept override;
  int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
                             nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
  int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
                          nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs,
                          nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                          nvinfer1::IExprBuilder& exprBuilder) noexcept override;
  bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut,
                                 int32_t nbInputs, int32_t nbOutputs) noexcept override;
  int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                          nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
  size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                          nvinfer1::DynamicPluginTensorDesc const* outputs,
                          int32_t nbOutputs) const noexcept override;
  int32_t getAliasedInput(int32_t outputIndex) noexcept override;

  // IPluginV3OneRuntime
  int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
                  void const* const* inputs, void* const* outputs, void* workspace,
                  cudaStream_t stream) noexcept override;
  int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
                        nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
  nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
  nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

  void setPluginNamespace(char const* pluginNamespace) noexcept;
  // The pool's pages per slot (slot contract: cap / kTOKENS_PER_PAGE): not derivable from the
  // pool binding, whose dim 1 is numPages = maxBatch * pagesPerSlot. Carried by clone() and
  // getFieldsToSerialize().
  void setPagesPerSlot(int32_t pagesPerSlot) noexcept;
  int32_t pagesPerSlot() const noexcept { return mConfig.pagesPerSlot; }
  PluginConfig const& config() const noexcept { return mConfig; }

 private:
  // Logs `message` as an error of `function` (and reports it to the context's error recorder
  // when attached) and returns kSTATUS_FAILURE; an empty message is success (checkOrFail).
  int32_t fail(char const* function, std::string const& message) const noexcept;

  std::string mName;
  std::string mNamespace;
  PluginConfig mConfig;
  int32_t mNbInputs{0};  // the count onShapeChange was given (0: none yet)
  // The contract the inputs said (getOutputShapes on): where the scale pool input is, for
  // getAliasedInput. -1: not known yet.
  int32_t mContract{-1};
  nvinfer1::IErrorRecorder* mErrorRecorder{nullptr};
  nvinfer1::PluginField mSerializedField[kNB_FIELDS];
  nvinfer1::PluginFieldCollection mSerializedFields{};
};

class DFLASH_TRT_API DFlashTargetKVCacheUpdatePluginCreator : public nvinfer1::IPluginCreatorV3One {
 public:
  DFlashTargetKVCacheUpdatePluginCreator();
  ~DFlashTargetKVCacheUpdatePluginCreator() override = default;

  char const* getPluginName() const noexcept override;
  char const* getPluginVersion() const noexcept override;
  nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
  char const* getPluginNamespace() const noexcept override;
  void setPluginNamespace(char const* pluginNamespace) noexcept;
  // No field is required here: the contract (and so whether pages_per_slot is needed) is known
  // only from the inputs, checked from configurePlugin and onShapeChange on.
  nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
                                    nvinfer1::TensorRTPhase phase) noexcept override;

 private:
  std::string mNamespace;
  nvinfer1::PluginField mFieldNames[kNB_FIELDS];
  nvinfer1::PluginFieldCollection mFieldCollection{};
};

// Where the plugin's messages go: an explicit logger, else the logger TensorRT's finder gives
// (setLoggerFinder), else stderr for warnings and errors.
void setPluginLogger(nvinfer1::ILogger* logger) noexcept;
void setPluginLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept;
void logMessage(nvinfer1::ILogger::Severity severity, std::string const& message) noexcept;

}  // namespace dflash::trt

// The shared library's C entry points.
extern "C" {
// IPluginRegistry::loadLibrary / trtexec --dynamicPlugins contract.
DFLASH_TRT_API void setLoggerFinder(nvinfer1::ILoggerFinder* finder);
DFLASH_TRT_API nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);

// Registers a creator under `pluginNamespace` (nullptr means "") with `registry` (an
// nvinfer1::IPluginRegistry* of the TensorRT major version this library was built against: see
// getDFlashPluginTensorRTVersion()); `logger` (an nvinfer1::ILogger*, may be null) receives the
// plugin's messages from then on. Returns false, with a logged message, on failure.
DFLASH_TRT_API bool initDFlashPluginWithRegistry(void* registry, void* logger, char const* pluginNamespace);
// The same with the process's TensorRT registry, found with dlsym("getPluginRegistry") in an
// already loaded libnvinfer / libnvinfer_lean, so that this library links no TensorRT library.
// Mirrors initLibNvInferPlugins(logger, namespace). Refuses (false, logged) a loaded TensorRT of
// another major version than the headers'.
DFLASH_TRT_API bool initDFlashPlugin(void* logger, char const* pluginNamespace);
// NV_TENSORRT_VERSION of the headers this library was compiled with (e.g. 101401 for 10.14.1).
DFLASH_TRT_API int32_t getDFlashPluginTensorRTVersion();
// Sets (or, with nullptr, clears) the logger that receives the plugin's messages.
DFLASH_TRT_API void setDFlashPluginLogger(void* logger);
}
