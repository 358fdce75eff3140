// The DFlash target KV-cache update as a TensorRT IPluginV3 plugin, and its creator.
//
// Every entry point that sees tensors (getOutputDataTypes, getOutputShapes,
// supportsFormatCombination, configurePlugin, getWorkspaceSize, onShapeChange, enqueue) checks
// them through DFlashPluginChecks.h, which hands them to the shared core's
// dflash::params_from_operands, the function the JAX handlers call: the plugin and JAX accept and
// reject the same shapes.
#include "DFlashTargetKVCacheUpdatePlugin.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <exception>
#include <memory>
#include <stdexcept>
#include <vector>

#include "DFlashPluginChecks.h"
#include "dflash/kv_update.h"
#include "dflash/kv_update_cuda.h"

namespace dflash::trt {

using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::DimsExprs;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;
using nvinfer1::PluginTensorDesc;
using Severity = nvinfer1::ILogger::Severity;

namespace {

// Runtime descriptors (and pointers, when given) as the checks' tensors.
std::array<TrtTensor, kMAX_INPUTS> runtimeTensors(PluginTensorDesc const* in, int32_t nbInputs,
                                                  void const* const* pointers = nullptr) {
  std::array<TrtTensor, kMAX_INPUTS> tensors{};
  for (int32_t i = 0; i < nbInputs && i < kMAX_INPUTS; ++i)
    tensors[i] = trtTensor(in[i], pointers == nullptr ? nullptr : pointers[i]);
  return tensors;
}

std::string checkRuntimeCall(PluginConfig const& config, PluginTensorDesc const* in, int32_t nbInputs,
                             PluginTensorDesc const* out, int32_t nbOutputs, void const* const* inputs,
                             bool needData, KVUpdateParams* params) {
  if (in == nullptr) return "the input descriptors are null";
  if (out == nullptr) return "the output descriptors are null";
  if (nbInputs < 0 || nbInputs > kMAX_INPUTS) {
    // More inputs than any form has: only the message needs them all.
    std::vector<TrtTensor> tensors;
    for (int32_t i = 0; i < nbInputs; ++i) tensors.push_back(trtTensor(in[i]));
    CallForm form;
    std::string e = callForm(config, nbInputs, nbOutputs, {tensors.data(), true, true}, &form);
    return e.empty() ? "expected at most " + std::to_string(kMAX_INPUTS) + " inputs, got " +
                           std::to_string(nbInputs) + " inputs"
                     : e;
  }
  auto const tensors = runtimeTensors(in, nbInputs, inputs);
  std::array<TrtTensor, kMAX_OUTPUTS> outputs{};
  for (int32_t o = 0; o < nbOutputs && o < kMAX_OUTPUTS; ++o) outputs[o] = trtTensor(out[o]);
  if (nbOutputs < 0 || nbOutputs > kMAX_OUTPUTS)
    return "expected " + std::to_string(outputCount(config)) + " outputs, got " + std::to_string(nbOutputs);
  CheckMode const mode{/*allowUnknown=*/false, needData};
  return checkCall(config, tensors.data(), nbInputs, outputs.data(), nbOutputs, mode, params);
}

}  // namespace

// ---- the plugin -----------------------------------------------------------------------------------

DFlashTargetKVCacheUpdatePlugin::DFlashTargetKVCacheUpdatePlugin(std::string const& name) : mName(name) {}

DFlashTargetKVCacheUpdatePlugin::DFlashTargetKVCacheUpdatePlugin(std::string const& name,
                                                                 PluginFieldCollection const* fc)
    : mName(name), mConfig(readFields(fc)) {}

int32_t DFlashTargetKVCacheUpdatePlugin::fail(char const* function,
                                              std::string const& message) const noexcept {
  return checkOrFail(message, function, mName, mErrorRecorder);
}

nvinfer1::IPluginCapability* DFlashTargetKVCacheUpdatePlugin::getCapabilityInterface(
    nvinfer1::PluginCapabilityType type) noexcept {
  try {
    switch (type) {
      case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
      case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuildV2*>(this);
      case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    }
    fail("getCapabilityInterface", "expected PluginCapabilityType kCORE, kBUILD or kRUNTIME, got " +
                                       std::to_string(static_cast<int32_t>(type)));
  } catch (std::exception const& e) { fail("getCapabilityInterface", e.what()); }
  return nullptr;
}

nvinfer1::IPluginV3* DFlashTargetKVCacheUpdatePlugin::clone() noexcept {
  try {
    auto copy = std::make_unique<DFlashTargetKVCacheUpdatePlugin>(mName);
    copy->mNamespace = mNamespace;
    copy->mConfig = mConfig;
    copy->mContract = mContract;
    copy->mErrorRecorder = mErrorRecorder;
    return copy.release();
  } catch (std::exception const& e) { fail("clone", e.what()); }
  return nullptr;
}

char const* DFlashTargetKVCacheUpdatePlugin::getPluginName() const noexcept { return kPLUGIN_NAME; }
char const* DFlashTargetKVCacheUpdatePlugin::getPluginVersion() const noexcept { return kPLUGIN_VERSION; }
char const* DFlashTargetKVCacheUpdatePlugin::getPluginNamespace() const noexcept {
  return mNamespace.c_str();
}

void DFlashTargetKVCacheUpdatePlugin::setPluginNamespace(char const* pluginNamespace) noexcept {
  try {
    mNamespace = pluginNamespace == nullptr ? "" : pluginNamespace;
  } catch (std::exception const& e) { fail("setPluginNamespace", e.what()); }
}

void DFlashTargetKVCacheUpdatePlugin::setPagesPerSlot(int32_t pagesPerSlot) noexcept {
  try {
    if (std::string e = checkPagesPerSlotValue(pagesPerSlot); !e.empty()) {
      fail("setPagesPerSlot", e);
      return;
    }
    mConfig.pagesPerSlot = pagesPerSlot;
  } catch (...) {}
}

int32_t DFlashTargetKVCacheUpdatePlugin::getNbOutputs() const noexcept { return outputCount(mConfig); }

int32_t DFlashTargetKVCacheUpdatePlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs,
                                                            DataType const* inputTypes,
                                                            int32_t nbInputs) const noexcept {
  try {
    if (outputTypes == nullptr || inputTypes == nullptr)
      return fail("getOutputDataTypes", "the type arrays must not be null");
    std::array<DataType, kMAX_OUTPUTS> types{};
    if (std::string e = checkInputTypes(mConfig, inputTypes, nbInputs, nbOutputs, types.data()); !e.empty())
      return fail("getOutputDataTypes", e);
    for (int32_t o = 0; o < nbOutputs; ++o) outputTypes[o] = types[o];  // the pool's, the scale pool's
    return kSTATUS_SUCCESS;
  } catch (std::exception const& e) { return fail("getOutputDataTypes", e.what()); }
}

int32_t DFlashTargetKVCacheUpdatePlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs,
                                                         DimsExprs const* /*shapeInputs*/,
                                                         int32_t nbShapeInputs, DimsExprs* outputs,
                                                         int32_t nbOutputs,
                                                         nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept {
  try {
    if (inputs == nullptr || outputs == nullptr)
      return fail("getOutputShapes", "the input and output shape arrays must not be null");
    if (nbShapeInputs != 0)
      return fail("getOutputShapes", "expected no shape inputs, got " + std::to_string(nbShapeInputs));
    // Constant dimensions are checked now, every rule between them even where others are
    // symbolic (-1 here); the symbolic ones from configurePlugin on. No dtypes are known yet: the
    // form comes from the ranks and the count, and the shapes are checked with the form's dtypes
    // (getOutputDataTypes checks the real ones). A pages_per_slot still to be set
    // (setPagesPerSlot) is not needed yet.
    std::vector<TrtTensor> tensors(static_cast<size_t>(std::max(nbInputs, 0)));
    int32_t badInput = -1, nullDim = -1;
    for (int32_t i = 0; i < nbInputs; ++i) {
      DimsExprs const& exprs = inputs[i];
      tensors[i].dims.nbDims = exprs.nbDims;
      if (exprs.nbDims < 0 || exprs.nbDims > Dims::MAX_DIMS) {
        if (badInput < 0) badInput = i;
        continue;
      }
      for (int32_t d = 0; d < exprs.nbDims; ++d) {
        if (exprs.d[d] == nullptr) {
          if (badInput < 0) {
            badInput = i;
            nullDim = d;
          }
          tensors[i].dims.d[d] = kUnknownDim;
          continue;
        }
        tensors[i].dims.d[d] = exprs.d[d]->isConstant() ? exprs.d[d]->getConstantValue() : kUnknownDim;
      }
    }
    CallForm form;
    if (std::string e = callForm(mConfig, nbInputs, nbOutputs,
                                 {tensors.data(), /*dimsKnown=*/true, /*typesKnown=*/false}, &form);
        !e.empty())
      return fail("getOutputShapes", e);
    if (badInput >= 0) {
      std::string const name = operand_name(form.attrs, badInput, nbInputs);
      return fail("getOutputShapes",
                  nullDim >= 0 ? name + ": dimension " + std::to_string(nullDim) + " is null"
                               : name + ": invalid rank " + std::to_string(inputs[badInput].nbDims));
    }
    mContract = static_cast<int32_t>(form.attrs.contract);
    for (int32_t i = 0; i < nbInputs; ++i) tensors[i].type = shapeCheckType(form, i, tensors.data());
    CheckMode const mode{/*allowUnknown=*/true, /*needData=*/false, /*pagesPerSlotPending=*/true};
    if (std::string e = checkCall(mConfig, tensors.data(), nbInputs, nullptr, nbOutputs, mode, nullptr);
        !e.empty())
      return fail("getOutputShapes", e);
    outputs[0] = inputs[kPAST_KEY_VALUE];  // the output is the pool
    if (form.attrs.scale_pool) outputs[1] = inputs[scalePoolInput(form.attrs.contract)];
    return kSTATUS_SUCCESS;
  } catch (std::exception const& e) { return fail("getOutputShapes", e.what()); }
}

bool DFlashTargetKVCacheUpdatePlugin::supportsFormatCombination(int32_t pos,
                                                                DynamicPluginTensorDesc const* inOut,
                                                                int32_t nbInputs,
                                                                int32_t nbOutputs) noexcept {
  try {
    // A wrong count or k_delta rank is the call's error; a dtype or format is TensorRT's question.
    CallForm form;
    if (std::string e = formatCallForm(mConfig, inOut, nbInputs, nbOutputs, &form); !e.empty())
      return fail("supportsFormatCombination", e), false;
    mContract = static_cast<int32_t>(form.attrs.contract);
    if (pos < 0 || pos >= nbInputs + nbOutputs)
      return fail("supportsFormatCombination", "expected pos in [0, " + std::to_string(nbInputs + nbOutputs) +
                                                   "), got " + std::to_string(pos)),
             false;
    if (std::string reason = checkFormatAt(form, pos, inOut, nbInputs, nbOutputs); !reason.empty()) {
      // An unsupported combination is an ordinary answer while TensorRT searches, not an error.
      logMessage(Severity::kVERBOSE, std::string(kPLUGIN_NAME) + "::supportsFormatCombination: " + reason);
      return false;
    }
    return true;
  } catch (std::exception const& e) { return fail("supportsFormatCombination", e.what()), false; }
}

int32_t DFlashTargetKVCacheUpdatePlugin::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
                                                         DynamicPluginTensorDesc const* out,
                                                         int32_t nbOutputs) noexcept {
  try {
    std::string const reason = checkProfile(mConfig, in, nbInputs, out, nbOutputs);
    if (reason.empty()) {
      std::vector<TrtTensor> tensors;
      for (int32_t i = 0; i < nbInputs; ++i) tensors.push_back(trtTensor(in[i].desc));
      CallForm form;
      if (callForm(mConfig, nbInputs, nbOutputs, {tensors.data(), true, true}, &form).empty())
        mContract = static_cast<int32_t>(form.attrs.contract);
    }
    return fail("configurePlugin", reason);
  } catch (std::exception const& e) { return fail("configurePlugin", e.what()); }
}

size_t DFlashTargetKVCacheUpdatePlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs,
                                                         int32_t nbInputs,
                                                         DynamicPluginTensorDesc const* outputs,
                                                         int32_t nbOutputs) const noexcept {
  // The update works in place: 0 bytes for any call. TensorRT reads no failure from a size, so a
  // bad call is only logged (and reported); configurePlugin, given the same descriptors, fails it.
  try {
    std::string reason;
    if (inputs != nullptr && outputs != nullptr) {
      reason = checkProfile(mConfig, inputs, nbInputs, outputs, nbOutputs);
    } else {
      CallForm form;
      reason = callForm(mConfig, nbInputs, nbOutputs, {}, &form);
      if (reason.empty())
        reason = inputs == nullptr ? "the input descriptors are null" : "the output descriptors are null";
    }
    fail("getWorkspaceSize", reason);
  } catch (std::exception const& e) { fail("getWorkspaceSize", e.what()); }
  return 0;
}

int32_t DFlashTargetKVCacheUpdatePlugin::getAliasedInput(int32_t outputIndex) noexcept {
  if (outputIndex == 0) return kPAST_KEY_VALUE;
  if (outputIndex != 1 || mConfig.scalePool == 0) return -1;
  // The scale pool follows the base inputs: its index is the contract's, named by the field
  // 'form' or said by the inputs (getOutputShapes, which TensorRT calls first).
  int32_t const contract =
      mConfig.form >= 0 ? static_cast<int32_t>(kAddressingForms[mConfig.form].contract) : mContract;
  if (contract < 0) {
    fail("getAliasedInput",
         "present_scale_pool: the contract is not known yet (no getOutputShapes, "
         "supportsFormatCombination or configurePlugin before): its scale_pool input cannot be named");
    return -1;
  }
  return scalePoolInput(static_cast<Contract>(contract));
}

int32_t DFlashTargetKVCacheUpdatePlugin::onShapeChange(PluginTensorDesc const* in, int32_t nbInputs,
                                                       PluginTensorDesc const* out,
                                                       int32_t nbOutputs) noexcept {
  try {
    mNbInputs = nbInputs;  // enqueue is not told the count
    return fail("onShapeChange", checkRuntimeCall(mConfig, in, nbInputs, out, nbOutputs, nullptr,
                                                  /*needData=*/false, nullptr));
  } catch (std::exception const& e) { return fail("onShapeChange", e.what()); }
}

int32_t DFlashTargetKVCacheUpdatePlugin::enqueue(PluginTensorDesc const* inputDesc,
                                                 PluginTensorDesc const* outputDesc,
                                                 void const* const* inputs, void* const* outputs,
                                                 void* /*workspace*/, cudaStream_t stream) noexcept {
  try {
    if (inputs == nullptr || outputs == nullptr)
      return fail("enqueue", "the input and output pointer arrays must not be null");
    if (inputDesc == nullptr) return fail("enqueue", "the input descriptors are null");
    if (outputDesc == nullptr) return fail("enqueue", "the output descriptors are null");
    // TensorRT tells onShapeChange the input count, not enqueue. Without an onShapeChange first,
    // the count is the form k_delta's rank and the pool's dtype say.
    int32_t nbInputs = mNbInputs;
    if (nbInputs <= 0) {
      // The form the field names, else the one k_delta's rank says.
      int32_t const base = mConfig.form >= 0               ? kAddressingForms[mConfig.form].base_count
                           : inputDesc[0].dims.nbDims == 3 ? kNB_PAGED_INPUTS
                                                           : kNB_INPUTS;
      int32_t const scales = mConfig.scalePool != 0                               ? 1
                             : takesStaticScales(inputDesc[kPAST_KEY_VALUE].type) ? 2
                                                                                  : 0;
      nbInputs = base + scales + mConfig.kNorm;
    }
    int32_t const nbOutputs = outputCount(mConfig);
    KVUpdateParams p;
    if (std::string e = checkRuntimeCall(mConfig, inputDesc, nbInputs, outputDesc, nbOutputs, inputs,
                                         /*needData=*/true, &p);
        !e.empty())
      return fail("enqueue", e);
    if (!dflash::addressing_form(p.contract).cuda)
      return fail("enqueue", std::string("form: the ") + dflash::addressing_form(p.contract).name +
                                 " form has no CUDA kernel yet (CPU only)");
    // The outputs start as copies of their inputs where TensorRT did not alias them (the
    // ALIASED_PLUGIN_IO preview feature off): the pool, then the scale pool with scale_pool=1.
    struct InPlace {
      int32_t input, output;
      char const* name;
      int64_t bytes;
    };
    std::array<InPlace, kMAX_OUTPUTS> inPlace{};
    for (int32_t o = 0; o < nbOutputs; ++o) {
      int32_t const at = o == 0 ? kPAST_KEY_VALUE : scalePoolInput(p.contract);
      inPlace[o] = {at, o, o == 0 ? kResultName : kScaleResultName,
                    tensorBytes(inputDesc[at].dims, inputDesc[at].type)};
      if (inPlace[o].bytes < 0)
        return fail("enqueue", std::string(o == 0 ? "past_key_value" : kScalePoolName) +
                                   ": the size in bytes overflows int64");
      if (outputs[o] == nullptr && inPlace[o].bytes > 0)
        return fail("enqueue", std::string(inPlace[o].name) + ": the device pointer is null for shape " +
                                   dimsToString(outputDesc[o].dims));
    }
    // contract.h's row says whether a CUDA kernel stores the pool's format.
    if (PoolFormat const* format = pool_format(p.pool_dtype); format != nullptr && !format->cuda)
      return fail("enqueue", std::string("past_key_value: ") + format->name + " pools (" +
                                 dtype_name(p.pool_dtype) +
                                 ") have no CUDA kernel yet (no kernel stores them)");
    for (int32_t o = 0; o < nbOutputs; ++o) {
      InPlace const& x = inPlace[o];
      if (x.bytes == 0 || inputs[x.input] == outputs[o]) continue;
      cudaError_t const copied = cudaMemcpyAsync(outputs[o], inputs[x.input], static_cast<size_t>(x.bytes),
                                                 cudaMemcpyDeviceToDevice, stream);
      if (copied != cudaSuccess)
        return fail("enqueue", std::string("copying ") + (o == 0 ? "the pool" : "the scale pool") +
                                   " to the (unaliased) output: " + cudaGetErrorString(copied));
    }
    p.pool = outputs[0];
    if (nbOutputs > 1) p.scale_pool = static_cast<float*>(outputs[1]);
    if (cudaError_t const status = launch_target_kv_cache_update(p, stream); status != cudaSuccess)
      return fail("enqueue", std::string("kernel launch failed: ") + cudaGetErrorString(status));
    return kSTATUS_SUCCESS;
  } catch (std::exception const& e) { return fail("enqueue", e.what()); }
}

nvinfer1::IPluginV3* DFlashTargetKVCacheUpdatePlugin::attachToContext(
    nvinfer1::IPluginResourceContext* context) noexcept {
  try {
    if (context == nullptr) return fail("attachToContext", "the resource context is null"), nullptr;
    nvinfer1::IPluginV3* copy = clone();
    if (copy != nullptr)
      static_cast<DFlashTargetKVCacheUpdatePlugin*>(copy)->mErrorRecorder = context->getErrorRecorder();
    return copy;
  } catch (std::exception const& e) { return fail("attachToContext", e.what()), nullptr; }
}

PluginFieldCollection const* DFlashTargetKVCacheUpdatePlugin::getFieldsToSerialize() noexcept {
  // Every field but an unset pages_per_slot (the paged contract has none; 0 is not a valid value).
  int32_t n = 0;
  if (mConfig.pagesPerSlot > 0)
    mSerializedField[n++] =
        PluginField(kPAGES_PER_SLOT_FIELD, &mConfig.pagesPerSlot, PluginFieldType::kINT32, 1);
  mSerializedField[n++] = PluginField(kRING_FIELD, &mConfig.ring, PluginFieldType::kINT32, 1);
  mSerializedField[n++] = PluginField(kK_NORM_FIELD, &mConfig.kNorm, PluginFieldType::kINT32, 1);
  mSerializedField[n++] = PluginField(kV_NORM_FIELD, &mConfig.vNorm, PluginFieldType::kINT32, 1);
  mSerializedField[n++] = PluginField(kNORM_EPS_FIELD, &mConfig.normEps, PluginFieldType::kFLOAT32, 1);
  if (mConfig.form >= 0) {  // only where given: a call without it is decided by its inputs
    char const* const name = dflash::kAddressingForms[mConfig.form].name;
    mSerializedField[n++] =
        PluginField(kFORM_FIELD, name, PluginFieldType::kCHAR, static_cast<int32_t>(std::strlen(name)));
  }
  mSerializedField[n++] = PluginField(kSCALE_POOL_FIELD, &mConfig.scalePool, PluginFieldType::kINT32, 1);
  mSerializedFields.nbFields = n;
  mSerializedFields.fields = mSerializedField;
  return &mSerializedFields;
}

// ---- the creator ----------------------------------------------------------------------------------

DFlashTargetKVCacheUpdatePluginCreator::DFlashTargetKVCacheUpdatePluginCreator() {
  mFieldNames[0] = PluginField(kPAGES_PER_SLOT_FIELD, nullptr, PluginFieldType::kINT32, 1);
  mFieldNames[1] = PluginField(kRING_FIELD, nullptr, PluginFieldType::kINT32, 1);
  mFieldNames[2] = PluginField(kK_NORM_FIELD, nullptr, PluginFieldType::kINT32, 1);
  mFieldNames[3] = PluginField(kV_NORM_FIELD, nullptr, PluginFieldType::kINT32, 1);
  mFieldNames[4] = PluginField(kNORM_EPS_FIELD, nullptr, PluginFieldType::kFLOAT32, 1);
  mFieldNames[5] = PluginField(kFORM_FIELD, nullptr, PluginFieldType::kCHAR, 0);
  mFieldNames[6] = PluginField(kSCALE_POOL_FIELD, nullptr, PluginFieldType::kINT32, 1);
  static_assert(kNB_FIELDS == 7, "every field has its name here");
  mFieldCollection.nbFields = kNB_FIELDS;
  mFieldCollection.fields = mFieldNames;
}

char const* DFlashTargetKVCacheUpdatePluginCreator::getPluginName() const noexcept { return kPLUGIN_NAME; }
char const* DFlashTargetKVCacheUpdatePluginCreator::getPluginVersion() const noexcept {
  return kPLUGIN_VERSION;
}
PluginFieldCollection const* DFlashTargetKVCacheUpdatePluginCreator::getFieldNames() noexcept {
  return &mFieldCollection;
}
char const* DFlashTargetKVCacheUpdatePluginCreator::getPluginNamespace() const noexcept {
  return mNamespace.c_str();
}

void DFlashTargetKVCacheUpdatePluginCreator::setPluginNamespace(char const* pluginNamespace) noexcept {
  try {
    mNamespace = pluginNamespace == nullptr ? "" : pluginNamespace;
  } catch (std::exception const& e) {
    logMessage(Severity::kERROR, std::string(kPLUGIN_NAME) + " creator: setPluginNamespace: " + e.what());
  }
}

nvinfer1::IPluginV3* DFlashTargetKVCacheUpdatePluginCreator::createPlugin(
    char const* name, PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept {
  try {
    if (name == nullptr) throw std::invalid_argument("the plugin name is null");
    if (phase != nvinfer1::TensorRTPhase::kBUILD && phase != nvinfer1::TensorRTPhase::kRUNTIME)
      throw std::invalid_argument("expected phase kBUILD or kRUNTIME, got " +
                                  std::to_string(static_cast<int32_t>(phase)));
    auto plugin = std::make_unique<DFlashTargetKVCacheUpdatePlugin>(name, fc);
    plugin->setPluginNamespace(mNamespace.c_str());
    return plugin.release();
  } catch (std::exception const& e) {
    logMessage(Severity::kERROR, std::string(kPLUGIN_NAME) + "Creator::createPlugin: " + e.what());
  } catch (...) {}
  return nullptr;
}

}  // namespace dflash::trt
