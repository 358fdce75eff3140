// The DFlash target KV-cache update as a TensorRT IPluginV3 plugin, and its creator.
//
// Every check of a shape, dtype or format is one of the small helpers below; supportsFormatCombination,
// getOutputDataTypes, getOutputShapes, configurePlugin, onShapeChange and enqueue all use them, so
// they never disagree. The numeric rules (numPages % pages_per_slot, B <= slots, S <= cap, R even
// and <= D, Rb in {1, B}) are dflash::check_params, the same function the JAX handlers call.
#include "DFlashTargetKVCacheUpdatePlugin.h"

#include <array>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <stdexcept>

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
using nvinfer1::TensorFormat;
using Severity = nvinfer1::ILogger::Severity;

namespace {

// ---- naming -----------------------------------------------------------------------------------

constexpr std::array<char const*, kNB_TENSORS> kTensorNames = {
    "k_delta", "v_delta", "past_key_value", "rope_cos_sin", "delta_start_positions",
    "delta_lengths", "present_key_value"};
constexpr std::array<int32_t, kNB_TENSORS> kTensorRanks = {4, 4, 5, 3, 1, 1, 5};
constexpr int64_t kUnknownDim = -1;  // a dimension not known yet (build-time wildcard)

char const* typeName(DataType type) {
  switch (type) {
    case DataType::kFLOAT: return "float32";
    case DataType::kHALF: return "float16";
    case DataType::kBF16: return "bfloat16";
    case DataType::kINT32: return "int32";
    case DataType::kINT64: return "int64";
    case DataType::kINT8: return "int8";
    case DataType::kUINT8: return "uint8";
    case DataType::kBOOL: return "bool";
    case DataType::kFP8: return "fp8";
    default: return "another dtype";
  }
}

std::string dimsToString(Dims const& dims) {
  std::string text = "[";
  for (int32_t i = 0; i < dims.nbDims && i < Dims::MAX_DIMS; ++i)
    text += (i ? ", " : "") + (dims.d[i] == kUnknownDim ? std::string("?") : std::to_string(dims.d[i]));
  return text + "]";
}

// ---- the rules, one helper each -----------------------------------------------------------------

std::string checkTensorCounts(int32_t nbInputs, int32_t nbOutputs) {
  if (nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS)
    return "expected " + std::to_string(kNB_INPUTS) + " inputs and " + std::to_string(kNB_OUTPUTS) +
           " output, got " + std::to_string(nbInputs) + " and " + std::to_string(nbOutputs);
  return {};
}

bool isPoolType(DataType type) {
  return type == DataType::kHALF || type == DataType::kBF16 || type == DataType::kFLOAT;
}

DType toKernelType(DataType type) {
  switch (type) {
    case DataType::kBF16: return DType::kBFloat16;
    case DataType::kFLOAT: return DType::kFloat32;
    default: return DType::kFloat16;
  }
}

// The dtype tensor `pos` must have, given k_delta's dtype: k_delta picks fp16, bf16 or fp32 and
// v_delta, the pool and the output follow it; the rope table is fp32; positions and lengths int32.
std::string checkTensorType(int32_t pos, DataType type, DataType deltaType) {
  std::string const name = kTensorNames[pos];
  switch (pos) {
    case kK_DELTA:
      if (!isPoolType(type))
        return name + ": expected dtype float16, bfloat16 or float32, got " + typeName(type);
      return {};
    case kV_DELTA:
    case kPAST_KEY_VALUE:
    case kPRESENT_KEY_VALUE:
      if (type != deltaType)
        return name + ": expected k_delta's dtype " + typeName(deltaType) +
               " (k, v and the pool must agree), got " + typeName(type);
      return {};
    case kROPE_COS_SIN:
      if (type != DataType::kFLOAT) return name + ": expected dtype float32, got " + typeName(type);
      return {};
    default:
      if (type != DataType::kINT32) return name + ": expected dtype int32, got " + typeName(type);
      return {};
  }
}

std::string checkTensorFormat(int32_t pos, TensorFormat format) {
  if (format != TensorFormat::kLINEAR)
    return std::string(kTensorNames[pos]) + ": expected the linear format (TensorFormat::kLINEAR), got format " +
           std::to_string(static_cast<int32_t>(format));
  return {};
}

// dtype and format of all seven tensors (inputs then output).
std::string checkTypesAndFormats(std::array<PluginTensorDesc const*, kNB_TENSORS> const& descs) {
  for (int32_t pos = 0; pos < kNB_TENSORS; ++pos) {
    if (std::string e = checkTensorFormat(pos, descs[pos]->format); !e.empty()) return e;
    if (std::string e = checkTensorType(pos, descs[pos]->type, descs[0]->type); !e.empty()) return e;
  }
  return {};
}

std::string checkPagesPerSlotSet(int32_t pagesPerSlot) {
  if (pagesPerSlot <= 0)
    return std::string("pages_per_slot is missing: give the plugin field '") + kPAGES_PER_SLOT_FIELD +
           "' (INT32 > 0) or call setPagesPerSlot() before building, got " + std::to_string(pagesPerSlot);
  return {};
}

bool known(int64_t dim) { return dim != kUnknownDim; }

// Ranks and the equalities between the tensors' dimensions; unknown (-1) dimensions are skipped.
// With pagesPerSlot > 0 and a known numPages, also numPages % pages_per_slot.
using TensorDims = std::array<Dims, kNB_TENSORS>;
std::string checkShapes(TensorDims const& dims, int32_t pagesPerSlot) {
  for (int32_t pos = 0; pos < kNB_TENSORS; ++pos) {
    if (dims[pos].nbDims != kTensorRanks[pos])
      return std::string(kTensorNames[pos]) + ": expected rank " + std::to_string(kTensorRanks[pos]) +
             ", got rank " + std::to_string(dims[pos].nbDims) + " " + dimsToString(dims[pos]);
    for (int32_t i = 0; i < dims[pos].nbDims; ++i)
      if (dims[pos].d[i] < 0 && known(dims[pos].d[i]))
        return std::string(kTensorNames[pos]) + ": expected non-negative dimensions, got " +
               dimsToString(dims[pos]);
  }
  Dims const& k = dims[kK_DELTA];
  Dims const& pool = dims[kPAST_KEY_VALUE];
  auto differ = [](int64_t a, int64_t b) { return known(a) && known(b) && a != b; };
  auto mismatch = [&](int32_t pos, std::string const& expected) {
    return std::string(kTensorNames[pos]) + ": expected " + expected + ", got " + dimsToString(dims[pos]) +
           " (k_delta " + dimsToString(k) + ", past_key_value " + dimsToString(pool) + ")";
  };
  for (int32_t i = 0; i < 4; ++i)
    if (differ(dims[kV_DELTA].d[i], k.d[i])) return mismatch(kV_DELTA, "k_delta's shape [B, L, H, D]");
  if (differ(pool.d[0], 2)) return mismatch(kPAST_KEY_VALUE, "dim 0 == 2 (K and V planes)");
  if (differ(pool.d[2], kTOKENS_PER_PAGE))
    return mismatch(kPAST_KEY_VALUE, "dim 2 == " + std::to_string(kTOKENS_PER_PAGE) + " tokens per page");
  if (differ(pool.d[3], k.d[2]) || differ(pool.d[4], k.d[3]))
    return mismatch(kPAST_KEY_VALUE, "[2, numPages, P, H, D] with k_delta's H and D");
  for (int32_t pos : {kDELTA_START_POSITIONS, kDELTA_LENGTHS})
    if (differ(dims[pos].d[0], k.d[0])) return mismatch(pos, "[B] with k_delta's B");
  for (int32_t i = 0; i < 5; ++i)
    if (differ(dims[kPRESENT_KEY_VALUE].d[i], pool.d[i]))
      return mismatch(kPRESENT_KEY_VALUE, "past_key_value's shape (the output aliases it)");
  if (pagesPerSlot > 0 && known(pool.d[1]) && pool.d[1] % pagesPerSlot != 0)
    return "past_key_value: numPages (dim 1) must be divisible by pages_per_slot=" +
           std::to_string(pagesPerSlot) + ", got numPages=" + std::to_string(pool.d[1]);
  return {};
}

// The launch parameters' sizes from concrete dims (pointers left null).
KVUpdateParams paramsFromShapes(TensorDims const& dims, DataType deltaType, int32_t pagesPerSlot) {
  KVUpdateParams p;
  Dims const& k = dims[kK_DELTA];
  Dims const& pool = dims[kPAST_KEY_VALUE];
  Dims const& rope = dims[kROPE_COS_SIN];
  p.dtype = toKernelType(deltaType);
  p.num_layers = 1;
  p.batch = k.d[0];
  p.delta_len = k.d[1];
  p.num_kv_heads = k.d[2];
  p.head_dim = k.d[3];
  p.num_pages = pool.d[1];
  p.page_size = pool.d[2];
  p.pages_per_slot = pagesPerSlot;
  p.rope_batch = rope.d[0];
  p.rope_seq_len = rope.d[1];
  p.rotary_dim = rope.d[2];
  return p;
}

// checkShapes, then the numeric rules of dflash::check_params on concrete dims. Build time has
// no buffers yet, so the pointers are placeholders here: only the sizes are being checked.
std::string checkSizes(TensorDims const& dims, DataType deltaType, int32_t pagesPerSlot) {
  if (std::string e = checkPagesPerSlotSet(pagesPerSlot); !e.empty()) return e;
  if (std::string e = checkShapes(dims, pagesPerSlot); !e.empty()) return e;
  for (int32_t pos = 0; pos < kNB_TENSORS; ++pos)
    for (int32_t i = 0; i < dims[pos].nbDims; ++i)
      if (!known(dims[pos].d[i]))
        return std::string(kTensorNames[pos]) + ": expected concrete dimensions, got " + dimsToString(dims[pos]);
  KVUpdateParams p = paramsFromShapes(dims, deltaType, pagesPerSlot);
  static char placeholder;
  p.k_delta = p.v_delta = p.pool = &placeholder;
  p.rope_cos_sin = reinterpret_cast<float const*>(&placeholder);
  p.delta_start_positions = p.delta_lengths = reinterpret_cast<int32_t const*>(&placeholder);
  return check_params(p);
}

// The bytes of a tensor of `dims` and `type`, or -1 when the product overflows.
int64_t tensorBytes(Dims const& dims, DataType type) {
  int64_t bytes = (type == DataType::kFLOAT || type == DataType::kINT32) ? 4 : 2;
  for (int32_t i = 0; i < dims.nbDims; ++i)
    if (__builtin_mul_overflow(bytes, dims.d[i], &bytes)) return -1;
  return bytes;
}

// ---- gathering the arguments --------------------------------------------------------------------

// Null checks and counts shared by the entry points that receive descriptor arrays.
template <typename Desc>
std::string checkDescArrays(Desc const* in, int32_t nbInputs, Desc const* out, int32_t nbOutputs) {
  if (in == nullptr) return "the input descriptors are null";
  if (out == nullptr) return "the output descriptors are null";
  return checkTensorCounts(nbInputs, nbOutputs);
}

std::array<PluginTensorDesc const*, kNB_TENSORS> tensorDescs(PluginTensorDesc const* in, PluginTensorDesc const* out) {
  std::array<PluginTensorDesc const*, kNB_TENSORS> descs{};
  for (int32_t i = 0; i < kNB_INPUTS; ++i) descs[i] = &in[i];
  descs[kPRESENT_KEY_VALUE] = &out[0];
  return descs;
}

template <typename Select>
TensorDims gatherDims(DynamicPluginTensorDesc const* in, DynamicPluginTensorDesc const* out, Select select) {
  TensorDims dims{};
  for (int32_t i = 0; i < kNB_INPUTS; ++i) dims[i] = select(in[i]);
  dims[kPRESENT_KEY_VALUE] = select(out[0]);
  return dims;
}

TensorDims gatherDims(PluginTensorDesc const* in, PluginTensorDesc const* out) {
  TensorDims dims{};
  for (int32_t i = 0; i < kNB_INPUTS; ++i) dims[i] = in[i].dims;
  dims[kPRESENT_KEY_VALUE] = out[0].dims;
  return dims;
}

// Everything onShapeChange and enqueue check before touching memory.
std::string checkRuntimeDescs(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out,
                              int32_t nbOutputs, int32_t pagesPerSlot) {
  if (std::string e = checkDescArrays(in, nbInputs, out, nbOutputs); !e.empty()) return e;
  if (std::string e = checkTypesAndFormats(tensorDescs(in, out)); !e.empty()) return e;
  return checkSizes(gatherDims(in, out), in[kK_DELTA].type, pagesPerSlot);
}

// The value of the pages_per_slot field: INT32 (or INT64, as some ONNX front ends give it), one
// element, > 0. Throws std::invalid_argument naming what was given.
int32_t readPagesPerSlot(PluginField const& field) {
  std::string const where = std::string("field '") + kPAGES_PER_SLOT_FIELD + "': ";
  if (field.data == nullptr) throw std::invalid_argument(where + "data is null");
  if (field.length != 1)
    throw std::invalid_argument(where + "expected 1 element, got " + std::to_string(field.length));
  int64_t value = 0;
  if (field.type == PluginFieldType::kINT32) {
    value = *static_cast<int32_t const*>(field.data);
  } else if (field.type == PluginFieldType::kINT64) {
    value = *static_cast<int64_t const*>(field.data);
  } else {
    throw std::invalid_argument(where + "expected type INT32 (PluginFieldType " +
                                std::to_string(static_cast<int32_t>(PluginFieldType::kINT32)) + "), got type " +
                                std::to_string(static_cast<int32_t>(field.type)));
  }
  if (value <= 0 || value > std::numeric_limits<int32_t>::max())
    throw std::invalid_argument(where + "expected an int32 > 0, got " + std::to_string(value));
  return static_cast<int32_t>(value);
}

}  // namespace

// ---- the plugin -----------------------------------------------------------------------------------

DFlashTargetKVCacheUpdatePlugin::DFlashTargetKVCacheUpdatePlugin(std::string const& name) : mName(name) {}

DFlashTargetKVCacheUpdatePlugin::DFlashTargetKVCacheUpdatePlugin(std::string const& name,
                                                                 PluginFieldCollection const* fc)
    : mName(name) {
  if (fc == nullptr) throw std::invalid_argument("the field collection is null");
  if (fc->nbFields < 0 || (fc->nbFields > 0 && fc->fields == nullptr))
    throw std::invalid_argument("the field collection has " + std::to_string(fc->nbFields) +
                                " fields and fields pointer " + (fc->fields ? "set" : "null"));
  for (int32_t i = 0; i < fc->nbFields; ++i) {
    PluginField const& field = fc->fields[i];
    if (field.name == nullptr) throw std::invalid_argument("field " + std::to_string(i) + " has a null name");
    if (std::strcmp(field.name, kPAGES_PER_SLOT_FIELD) == 0) {
      mPagesPerSlot = readPagesPerSlot(field);
    } else {
      logMessage(Severity::kWARNING, std::string(kPLUGIN_NAME) + ": ignoring unknown plugin field '" +
                                         field.name + "' (known: '" + kPAGES_PER_SLOT_FIELD + "')");
    }
  }
}

int32_t DFlashTargetKVCacheUpdatePlugin::fail(char const* function, std::string const& message) const noexcept {
  try {
    std::string const text = std::string(kPLUGIN_NAME) + "::" + function + " (" + mName + "): " + message;
    logMessage(Severity::kERROR, text);
    if (mErrorRecorder != nullptr) mErrorRecorder->reportError(nvinfer1::ErrorCode::kINVALID_ARGUMENT, text.c_str());
  } catch (...) {
  }
  return kSTATUS_FAILURE;
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
  } catch (std::exception const& e) {
    fail("getCapabilityInterface", e.what());
  }
  return nullptr;
}

nvinfer1::IPluginV3* DFlashTargetKVCacheUpdatePlugin::clone() noexcept {
  try {
    auto copy = std::make_unique<DFlashTargetKVCacheUpdatePlugin>(mName);
    copy->mNamespace = mNamespace;
    copy->mPagesPerSlot = mPagesPerSlot;
    copy->mErrorRecorder = mErrorRecorder;
    return copy.release();
  } catch (std::exception const& e) {
    fail("clone", e.what());
  }
  return nullptr;
}

char const* DFlashTargetKVCacheUpdatePlugin::getPluginName() const noexcept { return kPLUGIN_NAME; }
char const* DFlashTargetKVCacheUpdatePlugin::getPluginVersion() const noexcept { return kPLUGIN_VERSION; }
char const* DFlashTargetKVCacheUpdatePlugin::getPluginNamespace() const noexcept { return mNamespace.c_str(); }

void DFlashTargetKVCacheUpdatePlugin::setPluginNamespace(char const* pluginNamespace) noexcept {
  try {
    mNamespace = pluginNamespace == nullptr ? "" : pluginNamespace;
  } catch (std::exception const& e) {
    fail("setPluginNamespace", e.what());
  }
}

void DFlashTargetKVCacheUpdatePlugin::setPagesPerSlot(int32_t pagesPerSlot) noexcept {
  try {
    if (pagesPerSlot <= 0) {
      fail("setPagesPerSlot", "expected pages_per_slot > 0, got " + std::to_string(pagesPerSlot));
      return;
    }
    mPagesPerSlot = pagesPerSlot;
  } catch (...) {
  }
}

int32_t DFlashTargetKVCacheUpdatePlugin::getNbOutputs() const noexcept { return kNB_OUTPUTS; }

int32_t DFlashTargetKVCacheUpdatePlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs,
                                                            DataType const* inputTypes,
                                                            int32_t nbInputs) const noexcept {
  try {
    if (outputTypes == nullptr || inputTypes == nullptr)
      return fail("getOutputDataTypes", "the type arrays must not be null");
    if (std::string e = checkTensorCounts(nbInputs, nbOutputs); !e.empty()) return fail("getOutputDataTypes", e);
    for (int32_t pos = 0; pos < kNB_INPUTS; ++pos)
      if (std::string e = checkTensorType(pos, inputTypes[pos], inputTypes[kK_DELTA]); !e.empty())
        return fail("getOutputDataTypes", e);
    outputTypes[0] = inputTypes[kPAST_KEY_VALUE];
    return kSTATUS_SUCCESS;
  } catch (std::exception const& e) {
    return fail("getOutputDataTypes", e.what());
  }
}

int32_t DFlashTargetKVCacheUpdatePlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs,
                                                         DimsExprs const* /*shapeInputs*/, int32_t nbShapeInputs,
                                                         DimsExprs* outputs, int32_t nbOutputs,
                                                         nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept {
  try {
    if (inputs == nullptr || outputs == nullptr)
      return fail("getOutputShapes", "the input and output shape arrays must not be null");
    if (std::string e = checkTensorCounts(nbInputs, nbOutputs); !e.empty()) return fail("getOutputShapes", e);
    if (nbShapeInputs != 0)
      return fail("getOutputShapes", "expected no shape inputs, got " + std::to_string(nbShapeInputs));
    // Constant dimensions are checked now; symbolic ones (-1 here) at configurePlugin/enqueue.
    TensorDims dims{};
    for (int32_t pos = 0; pos < kNB_TENSORS; ++pos) {
      DimsExprs const& exprs = inputs[pos == kPRESENT_KEY_VALUE ? kPAST_KEY_VALUE : pos];
      if (exprs.nbDims < 0 || exprs.nbDims > Dims::MAX_DIMS)
        return fail("getOutputShapes", std::string(kTensorNames[pos]) + ": invalid rank " + std::to_string(exprs.nbDims));
      dims[pos].nbDims = exprs.nbDims;
      for (int32_t i = 0; i < exprs.nbDims; ++i) {
        if (exprs.d[i] == nullptr)
          return fail("getOutputShapes", std::string(kTensorNames[pos]) + ": dimension " + std::to_string(i) + " is null");
        dims[pos].d[i] = exprs.d[i]->isConstant() ? exprs.d[i]->getConstantValue() : kUnknownDim;
      }
    }
    if (std::string e = checkShapes(dims, mPagesPerSlot); !e.empty()) return fail("getOutputShapes", e);
    outputs[0] = inputs[kPAST_KEY_VALUE];  // the output is the pool
    return kSTATUS_SUCCESS;
  } catch (std::exception const& e) {
    return fail("getOutputShapes", e.what());
  }
}

bool DFlashTargetKVCacheUpdatePlugin::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut,
                                                                int32_t nbInputs, int32_t nbOutputs) noexcept {
  try {
    if (inOut == nullptr) return fail("supportsFormatCombination", "inOut is null"), false;
    if (std::string e = checkTensorCounts(nbInputs, nbOutputs); !e.empty())
      return fail("supportsFormatCombination", e), false;
    if (pos < 0 || pos >= kNB_TENSORS)
      return fail("supportsFormatCombination", "expected pos in [0, " + std::to_string(kNB_TENSORS) + "), got " +
                                                    std::to_string(pos)),
             false;
    // TensorRT asks about pos with inOut[0..pos] decided; the rules only look back at k_delta.
    std::string reason = checkTensorFormat(pos, inOut[pos].desc.format);
    if (reason.empty()) reason = checkTensorType(pos, inOut[pos].desc.type, inOut[kK_DELTA].desc.type);
    if (!reason.empty()) {
      // An unsupported combination is an ordinary answer while TensorRT searches, not an error.
      logMessage(Severity::kVERBOSE, std::string(kPLUGIN_NAME) + "::supportsFormatCombination: " + reason);
      return false;
    }
    return true;
  } catch (std::exception const& e) {
    return fail("supportsFormatCombination", e.what()), false;
  }
}

int32_t DFlashTargetKVCacheUpdatePlugin::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
                                                         DynamicPluginTensorDesc const* out,
                                                         int32_t nbOutputs) noexcept {
  try {
    if (std::string e = checkDescArrays(in, nbInputs, out, nbOutputs); !e.empty()) return fail("configurePlugin", e);
    std::array<PluginTensorDesc const*, kNB_TENSORS> descs{};
    for (int32_t i = 0; i < kNB_INPUTS; ++i) descs[i] = &in[i].desc;
    descs[kPRESENT_KEY_VALUE] = &out[0].desc;
    if (std::string e = checkTypesAndFormats(descs); !e.empty()) return fail("configurePlugin", e);
    if (std::string e = checkPagesPerSlotSet(mPagesPerSlot); !e.empty()) return fail("configurePlugin", e);
    if (std::string e = checkShapes(gatherDims(in, out, [](auto const& t) { return t.desc.dims; }), mPagesPerSlot);
        !e.empty())
      return fail("configurePlugin", e);
    DataType const deltaType = in[kK_DELTA].desc.type;
    struct Bound {
      char const* name;
      Dims DynamicPluginTensorDesc::*member;
    };
    for (Bound bound : {Bound{"min", &DynamicPluginTensorDesc::min}, Bound{"opt", &DynamicPluginTensorDesc::opt},
                        Bound{"max", &DynamicPluginTensorDesc::max}}) {
      TensorDims const dims = gatherDims(in, out, [&](auto const& t) { return t.*(bound.member); });
      if (std::string e = checkSizes(dims, deltaType, mPagesPerSlot); !e.empty())
        return fail("configurePlugin", std::string("profile ") + bound.name + " shapes: " + e);
    }
    return kSTATUS_SUCCESS;
  } catch (std::exception const& e) {
    return fail("configurePlugin", e.what());
  }
}

size_t DFlashTargetKVCacheUpdatePlugin::getWorkspaceSize(DynamicPluginTensorDesc const* /*inputs*/,
                                                         int32_t /*nbInputs*/,
                                                         DynamicPluginTensorDesc const* /*outputs*/,
                                                         int32_t /*nbOutputs*/) const noexcept {
  return 0;  // the update works in place
}

int32_t DFlashTargetKVCacheUpdatePlugin::getAliasedInput(int32_t outputIndex) noexcept {
  return outputIndex == 0 ? kPAST_KEY_VALUE : -1;
}

int32_t DFlashTargetKVCacheUpdatePlugin::onShapeChange(PluginTensorDesc const* in, int32_t nbInputs,
                                                       PluginTensorDesc const* out, int32_t nbOutputs) noexcept {
  try {
    if (std::string e = checkRuntimeDescs(in, nbInputs, out, nbOutputs, mPagesPerSlot); !e.empty())
      return fail("onShapeChange", e);
    return kSTATUS_SUCCESS;
  } catch (std::exception const& e) {
    return fail("onShapeChange", e.what());
  }
}

int32_t DFlashTargetKVCacheUpdatePlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
                                                 void const* const* inputs, void* const* outputs, void* /*workspace*/,
                                                 cudaStream_t stream) noexcept {
  try {
    if (inputs == nullptr || outputs == nullptr) return fail("enqueue", "the input and output pointer arrays must not be null");
    if (std::string e = checkRuntimeDescs(inputDesc, kNB_INPUTS, outputDesc, kNB_OUTPUTS, mPagesPerSlot); !e.empty())
      return fail("enqueue", e);

    for (int32_t pos = 0; pos < kNB_TENSORS; ++pos) {
      bool const isOutput = pos == kPRESENT_KEY_VALUE;
      PluginTensorDesc const& desc = isOutput ? outputDesc[0] : inputDesc[pos];
      void const* pointer = isOutput ? outputs[0] : inputs[pos];
      if (pointer == nullptr && tensorBytes(desc.dims, desc.type) != 0)
        return fail("enqueue", std::string(kTensorNames[pos]) + ": the device pointer is null for shape " +
                                   dimsToString(desc.dims));
    }
    KVUpdateParams p =
        paramsFromShapes(gatherDims(inputDesc, outputDesc), inputDesc[kK_DELTA].type, mPagesPerSlot);
    p.k_delta = inputs[kK_DELTA];
    p.v_delta = inputs[kV_DELTA];
    p.pool = outputs[0];
    p.rope_cos_sin = static_cast<float const*>(inputs[kROPE_COS_SIN]);
    p.delta_start_positions = static_cast<int32_t const*>(inputs[kDELTA_START_POSITIONS]);
    p.delta_lengths = static_cast<int32_t const*>(inputs[kDELTA_LENGTHS]);
    if (std::string e = check_params(p); !e.empty()) return fail("enqueue", e);

    int64_t const poolBytes = tensorBytes(inputDesc[kPAST_KEY_VALUE].dims, inputDesc[kPAST_KEY_VALUE].type);
    if (poolBytes < 0) return fail("enqueue", "past_key_value: the size in bytes overflows int64");
    void const* past = inputs[kPAST_KEY_VALUE];
    // Aliased (ALIASED_PLUGIN_IO preview feature on): the output is the pool. Otherwise TensorRT
    // gave the output its own memory: it starts as a copy of the pool.
    if (poolBytes > 0 && past != outputs[0]) {
      cudaError_t const copied =
          cudaMemcpyAsync(outputs[0], past, static_cast<size_t>(poolBytes), cudaMemcpyDeviceToDevice, stream);
      if (copied != cudaSuccess)
        return fail("enqueue", std::string("copying the pool to the (unaliased) output: ") + cudaGetErrorString(copied));
    }
    if (cudaError_t const status = launch_target_kv_cache_update(p, stream); status != cudaSuccess)
      return fail("enqueue", std::string("kernel launch failed: ") + cudaGetErrorString(status));
    return kSTATUS_SUCCESS;
  } catch (std::exception const& e) {
    return fail("enqueue", e.what());
  }
}

nvinfer1::IPluginV3* DFlashTargetKVCacheUpdatePlugin::attachToContext(nvinfer1::IPluginResourceContext* context) noexcept {
  try {
    if (context == nullptr) return fail("attachToContext", "the resource context is null"), nullptr;
    nvinfer1::IPluginV3* copy = clone();
    if (copy != nullptr) static_cast<DFlashTargetKVCacheUpdatePlugin*>(copy)->mErrorRecorder = context->getErrorRecorder();
    return copy;
  } catch (std::exception const& e) {
    return fail("attachToContext", e.what()), nullptr;
  }
}

PluginFieldCollection const* DFlashTargetKVCacheUpdatePlugin::getFieldsToSerialize() noexcept {
  try {
    // Serialized even when unset (0), so that the engine's deserialization names the problem.
    if (std::string e = checkPagesPerSlotSet(mPagesPerSlot); !e.empty()) fail("getFieldsToSerialize", e);
  } catch (...) {
  }
  mSerializedField = PluginField(kPAGES_PER_SLOT_FIELD, &mPagesPerSlot, PluginFieldType::kINT32, 1);
  mSerializedFields.nbFields = 1;
  mSerializedFields.fields = &mSerializedField;
  return &mSerializedFields;
}

// ---- the creator ----------------------------------------------------------------------------------

DFlashTargetKVCacheUpdatePluginCreator::DFlashTargetKVCacheUpdatePluginCreator() {
  mFieldNames[0] = PluginField(kPAGES_PER_SLOT_FIELD, nullptr, PluginFieldType::kINT32, 1);
  mFieldCollection.nbFields = 1;
  mFieldCollection.fields = mFieldNames;
}

char const* DFlashTargetKVCacheUpdatePluginCreator::getPluginName() const noexcept { return kPLUGIN_NAME; }
char const* DFlashTargetKVCacheUpdatePluginCreator::getPluginVersion() const noexcept { return kPLUGIN_VERSION; }
PluginFieldCollection const* DFlashTargetKVCacheUpdatePluginCreator::getFieldNames() noexcept {
  return &mFieldCollection;
}
char const* DFlashTargetKVCacheUpdatePluginCreator::getPluginNamespace() const noexcept { return mNamespace.c_str(); }

void DFlashTargetKVCacheUpdatePluginCreator::setPluginNamespace(char const* pluginNamespace) noexcept {
  try {
    mNamespace = pluginNamespace == nullptr ? "" : pluginNamespace;
  } catch (std::exception const& e) {
    logMessage(Severity::kERROR, std::string(kPLUGIN_NAME) + " creator: setPluginNamespace: " + e.what());
  }
}

nvinfer1::IPluginV3* DFlashTargetKVCacheUpdatePluginCreator::createPlugin(char const* name, PluginFieldCollection const* fc,
                                                                         nvinfer1::TensorRTPhase phase) noexcept {
  try {
    if (name == nullptr) throw std::invalid_argument("the plugin name is null");
    if (phase != nvinfer1::TensorRTPhase::kBUILD && phase != nvinfer1::TensorRTPhase::kRUNTIME)
      throw std::invalid_argument("expected phase kBUILD or kRUNTIME, got " + std::to_string(static_cast<int32_t>(phase)));
    auto plugin = std::make_unique<DFlashTargetKVCacheUpdatePlugin>(name, fc);
    // A build-phase plugin may get pages_per_slot later (setPagesPerSlot); a deserialized one must have it.
    if (phase == nvinfer1::TensorRTPhase::kRUNTIME)
      if (std::string e = checkPagesPerSlotSet(plugin->pagesPerSlot()); !e.empty())
        throw std::invalid_argument("runtime phase: " + e);
    plugin->setPluginNamespace(mNamespace.c_str());
    return plugin.release();
  } catch (std::exception const& e) {
    logMessage(Severity::kERROR, std::string(kPLUGIN_NAME) + "Creator::createPlugin: " + e.what());
  } catch (...) {
  }
  return nullptr;
}

}  // namespace dflash::trt
