// TensorRT descriptors and fields, translated for the shared core's checks (see the header).
#include "DFlashPluginChecks.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

namespace dflash::trt {

using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;
using nvinfer1::TensorFormat;
using Severity = nvinfer1::ILogger::Severity;

DType toDType(DataType type) {
  switch (type) {
    case DataType::kHALF: return DType::kFloat16;
    case DataType::kBF16: return DType::kBFloat16;
    case DataType::kFLOAT: return DType::kFloat32;
    case DataType::kFP8: return DType::kFloat8E4M3;  // TensorRT 10 describes e4m3 only
    case DataType::kINT32: return DType::kInt32;
    case DataType::kINT64: return DType::kInt64;
    case DataType::kINT8: return DType::kInt8;
    case DataType::kUINT8: return DType::kUInt8;
    case DataType::kBOOL: return DType::kBool;
    default: return DType::kOther;
  }
}

char const* typeName(DataType type) {
  switch (type) {
    case DataType::kFLOAT: return "kFLOAT";
    case DataType::kHALF: return "kHALF";
    case DataType::kBF16: return "kBF16";
    case DataType::kINT32: return "kINT32";
    case DataType::kINT64: return "kINT64";
    case DataType::kINT8: return "kINT8";
    case DataType::kUINT8: return "kUINT8";
    case DataType::kBOOL: return "kBOOL";
    case DataType::kFP8: return "kFP8";
    default: return "another DataType";
  }
}

std::string fieldTypeName(PluginFieldType type) {
  // By value, so that headers without the newer types (kINT4, kFP4) still build.
  static constexpr std::array<char const*, 14> kNames = {
      "kFLOAT16", "kFLOAT32", "kFLOAT64", "kINT8",  "kINT16", "kINT32", "kCHAR",
      "kDIMS",    "kUNKNOWN", "kBF16",    "kINT64", "kFP8",   "kINT4",  "kFP4"};
  auto const value = static_cast<int32_t>(type);
  if (value >= 0 && value < static_cast<int32_t>(kNames.size())) return kNames[value];
  return "PluginFieldType " + std::to_string(value);
}

std::string dimsToString(Dims const& dims) {
  if (dims.nbDims < 0 || dims.nbDims > Dims::MAX_DIMS)
    return "(invalid rank " + std::to_string(dims.nbDims) + ")";
  std::string text = "[";
  for (int32_t i = 0; i < dims.nbDims; ++i)
    text += (i ? ", " : "") + (dims.d[i] == kUnknownDim ? std::string("?") : std::to_string(dims.d[i]));
  return text + "]";
}

bool takesStaticScales(DataType pool) { return takes_scales(toDType(pool)); }
int32_t outputCount(PluginConfig const& config) { return config.scalePool != 0 ? 2 : 1; }
int32_t scalePoolInput(Contract contract) { return base_operand_count(contract); }

// ---- fields --------------------------------------------------------------------------------------

namespace {

constexpr std::array<char const*, kNB_FIELDS> kFieldNames = {
    kPAGES_PER_SLOT_FIELD, kRING_FIELD, kK_NORM_FIELD,    kV_NORM_FIELD,
    kNORM_EPS_FIELD,       kFORM_FIELD, kSCALE_POOL_FIELD};
// The node attributes that say which creator to use: TensorRT's ONNX parser may forward them as
// fields, and they are not the plugin's.
constexpr std::array<char const*, 2> kIgnoredFieldNames = {"plugin_version", "plugin_namespace"};

std::string knownFields() {
  std::string text;
  for (char const* name : kFieldNames) text += std::string(text.empty() ? "'" : ", '") + name + "'";
  return text;
}

std::string fieldWhere(PluginField const& field) { return std::string("field '") + field.name + "': "; }

// An integer field: INT32 (or INT64, as some ONNX front ends give integers), one element.
int64_t readInteger(PluginField const& field) {
  if (field.data == nullptr) throw std::invalid_argument(fieldWhere(field) + "data is null");
  if (field.length != 1)
    throw std::invalid_argument(fieldWhere(field) + "expected 1 element, got " +
                                std::to_string(field.length));
  if (field.type == PluginFieldType::kINT32) return *static_cast<int32_t const*>(field.data);
  if (field.type == PluginFieldType::kINT64) return *static_cast<int64_t const*>(field.data);
  throw std::invalid_argument(fieldWhere(field) + "expected type kINT32 (or kINT64), got " +
                              fieldTypeName(field.type));
}

int32_t readFlag(PluginField const& field) {
  int64_t const value = readInteger(field);
  if (value != 0 && value != 1)
    throw std::invalid_argument(fieldWhere(field) + "expected 0 or 1, got " + std::to_string(value));
  return static_cast<int32_t>(value);
}

float readEps(PluginField const& field) {
  if (field.data == nullptr) throw std::invalid_argument(fieldWhere(field) + "data is null");
  if (field.length != 1)
    throw std::invalid_argument(fieldWhere(field) + "expected 1 element, got " +
                                std::to_string(field.length));
  if (field.type != PluginFieldType::kFLOAT32)
    throw std::invalid_argument(fieldWhere(field) + "expected type kFLOAT32, got " +
                                fieldTypeName(field.type));
  float const value = *static_cast<float const*>(field.data);
  // The core's rule (a normal float32 > 0), worded for a field.
  if (std::string const e = check_norm_eps(value); !e.empty())
    throw std::invalid_argument(fieldWhere(field) + e.substr(e.find(':') + 2));
  return value;
}

// The form's index in kAddressingForms, from its name (a CHAR field; a trailing NUL is allowed).
int32_t readForm(PluginField const& field) {
  if (field.data == nullptr) throw std::invalid_argument(fieldWhere(field) + "data is null");
  if (field.type != PluginFieldType::kCHAR)
    throw std::invalid_argument(fieldWhere(field) + "expected type kCHAR, got " + fieldTypeName(field.type));
  if (field.length < 0 || field.length > 64)
    throw std::invalid_argument(fieldWhere(field) + "expected a name of at most 64 characters, got length " +
                                std::to_string(field.length));
  std::string name(static_cast<char const*>(field.data), size_t(field.length));
  name = name.substr(0, name.find('\0'));
  std::string known;
  for (size_t i = 0; i < std::size(kAddressingForms); ++i) {
    if (name == kAddressingForms[i].name) return int32_t(i);
    known += std::string(i ? ", '" : "'") + kAddressingForms[i].name + "'";
  }
  throw std::invalid_argument(fieldWhere(field) + "expected an addressing form, one of " + known + ", got '" +
                              name + "'");
}

}  // namespace

std::string checkPagesPerSlotValue(int64_t value) {
  if (value <= 0 || value > std::numeric_limits<int32_t>::max())
    return std::string("field '") + kPAGES_PER_SLOT_FIELD + "': expected an int32 > 0, got " +
           std::to_string(value);
  return {};
}

PluginConfig readFields(PluginFieldCollection const* fc) {
  if (fc == nullptr) throw std::invalid_argument("the field collection is null");
  if (fc->nbFields < 0 || (fc->nbFields > 0 && fc->fields == nullptr))
    throw std::invalid_argument("the field collection has " + std::to_string(fc->nbFields) +
                                " fields and fields pointer " + (fc->fields ? "set" : "null"));
  PluginConfig config;
  std::array<bool, kFieldNames.size()> seen{};
  for (int32_t i = 0; i < fc->nbFields; ++i) {
    PluginField const& field = fc->fields[i];
    if (field.name == nullptr) throw std::invalid_argument("field " + std::to_string(i) + " has a null name");
    size_t known = kFieldNames.size();
    for (size_t k = 0; k < kFieldNames.size(); ++k)
      if (std::strcmp(field.name, kFieldNames[k]) == 0) known = k;
    if (known == kFieldNames.size()) {
      if (std::any_of(kIgnoredFieldNames.begin(), kIgnoredFieldNames.end(),
                      [&](char const* name) { return std::strcmp(field.name, name) == 0; }))
        continue;
      throw std::invalid_argument(fieldWhere(field) + "unknown: expected one of " + knownFields() + " (or '" +
                                  kIgnoredFieldNames[0] + "', '" + kIgnoredFieldNames[1] +
                                  "', which are ignored)");
    }
    if (seen[known])
      throw std::invalid_argument(fieldWhere(field) + "given twice (expected each field at most once)");
    seen[known] = true;
    if (known == 0) {
      int64_t const value = readInteger(field);
      if (std::string e = checkPagesPerSlotValue(value); !e.empty()) throw std::invalid_argument(e);
      config.pagesPerSlot = static_cast<int32_t>(value);
    } else if (known == 1) {
      config.ring = readFlag(field);
    } else if (known == 2) {
      config.kNorm = readFlag(field);
    } else if (known == 3) {
      config.vNorm = readFlag(field);
    } else if (known == 4) {
      config.normEps = readEps(field);
    } else if (known == 5) {
      config.form = readForm(field);
    } else {
      config.scalePool = readFlag(field);
    }
  }
  return config;
}

// ---- the form of a call ----------------------------------------------------------------------------

namespace {

char const* contractName(Contract contract) { return addressing_form(contract).name; }
// "Edge-LLM 0.10, k_delta [B, L, H, D]": whose contract it is and the deltas' shape.
std::string contractOrigin(Contract contract) {
  AddressingForm const& form = addressing_form(contract);
  return std::string(form.origin) + ", k_delta " + form.base[kKDeltaOperand].dims;
}

// The inputs this form takes, for messages: "the slot contract: 6 base inputs + 2 scales (kFP8 pool)".
std::string describeForm(CallForm const& form) {
  Contract const c = form.attrs.contract;
  std::string text = std::string("the ") + contractName(c) + " contract (" + contractOrigin(c) +
                     "): " + std::to_string(base_operand_count(c)) + " base inputs";
  if (form.staticScales) text += std::string(" + k_scale, v_scale (") + typeName(form.poolType) + " pool)";
  if (form.attrs.scale_pool) text += " + scale_pool (scale_pool=1)";
  if (form.attrs.k_norm) text += " + k_norm_weight (k_norm=1)";
  return text;
}

int32_t expectedRank(Contract contract) { return addressing_form(contract).delta_rank; }
char const* deltaDims(Contract contract) { return addressing_form(contract).base[kKDeltaOperand].dims; }

// The inputs of a call: the base ones, k_scale and v_scale (`scaled`) or scale_pool, k_norm_weight.
int32_t inputCount(UpdateAttrs const& attrs, Contract contract, bool scaled) {
  return operand_count(contract, scaled && !attrs.scale_pool, attrs.k_norm, attrs.scale_pool);
}

bool isIntegerType(DataType type) {
  return type == DataType::kINT32 || type == DataType::kINT64 || type == DataType::kINT8 ||
         type == DataType::kUINT8 || type == DataType::kBOOL;
}

// The names of inputs [from, to) of a call of `count` inputs: "k_delta, v_delta, ...".
std::string inputNames(UpdateAttrs const& attrs, int32_t count, int32_t from, int32_t to) {
  std::string text;
  for (int32_t i = std::max(from, 0); i < to; ++i)
    text += std::string(text.empty() ? "" : ", ") + operand_name(attrs, i, count);
  return text;
}

// What is known of input `index`: "kHALF [64]", "[64]" (no dtype yet), "kHALF" (no dims).
std::string describeInput(CallFacts const& facts, int32_t index) {
  if (facts.inputs == nullptr) return {};
  std::string text = facts.typesKnown ? typeName(facts.inputs[index].type) : "";
  if (facts.dimsKnown) text += (text.empty() ? "" : " ") + dimsToString(facts.inputs[index].dims);
  return text;
}

// Whether input `index` may be a page table [B, 2, M] (an integer tensor of rank 3), as far as
// it is known: the paged contract's input 6, never the slot contract's.
bool mayBeTable(CallFacts const& facts, int32_t index) {
  TrtTensor const& t = facts.inputs[index];
  return (!facts.dimsKnown || t.dims.nbDims == 3) && (!facts.typesKnown || isIntegerType(t.type));
}

// A count that is not the form's: the inputs missing or unexpected, what the contract takes with
// these fields and this pool (both pools' counts when the pool's dtype is not known yet), and
// what else the count would fit.
std::string countMismatch(UpdateAttrs const& attrs, CallFacts const& facts, int32_t nbInputs, bool poolKnown,
                          DataType poolType) {
  Contract const c = attrs.contract;
  bool const dynamic = attrs.scale_pool;
  bool const fp8 = dynamic || (poolKnown && takesStaticScales(poolType));  // a pool with scales
  int32_t const plain = inputCount(attrs, c, false), scaled = inputCount(attrs, c, true);
  // Measured against the pool's count, or (its dtype unknown) the nearer one below the count.
  int32_t const expected = dynamic     ? scaled
                           : poolKnown ? (fp8 ? scaled : plain)
                                       : (nbInputs >= scaled ? scaled : plain);
  std::string const count = std::to_string(expected);
  std::string text;
  if (nbInputs < expected) {
    text = inputNames(attrs, expected, nbInputs, expected) + (expected - nbInputs == 1 ? " is" : " are") +
           " missing: ";
  } else {
    int32_t const extra = nbInputs - expected;
    std::string indices, described;
    for (int32_t i = expected; i < nbInputs; ++i) {
      indices += (i > expected ? ", " : "") + std::to_string(i);
      if (extra <= 3) described += (i > expected ? ", " : "") + describeInput(facts, i);
    }
    text = (extra == 1 ? "input " : "inputs ") + indices + (described.empty() ? "" : " (" + described + ")") +
           (extra == 1 ? " is" : " are") + " unexpected: ";
  }
  text += std::string("the ") + contractName(c) + " contract (" + contractOrigin(c) +
          ") with k_norm=" + (attrs.k_norm ? "1" : "0") + (dynamic ? ", scale_pool=1" : "");
  if (dynamic) {
    text += " takes " + count + " inputs (" + inputNames(attrs, expected, 0, expected) + ")";
  } else if (poolKnown) {
    text += std::string(" and a ") + typeName(poolType) + " pool takes " + count + " inputs (" +
            inputNames(attrs, expected, 0, expected) + ")";
  } else {
    text += " takes " + std::to_string(plain) + " inputs (" + inputNames(attrs, plain, 0, plain) + "), or " +
            std::to_string(scaled) + " with a kFP8 or kINT8 pool (+ k_scale, v_scale)";
  }
  text += ", got " + std::to_string(nbInputs) + " inputs";

  bool const rankKnown = facts.inputs != nullptr && facts.dimsKnown && nbInputs > 0;
  if (nbInputs > expected) {
    // The slot contract's inputs plus a page table: Edge-LLM 0.10.1's call, which has the same
    // node name and version but neither contract's addressing.
    bool const edgeLlm0101 = rankKnown && c == Contract::kSlot && expected == kNB_INPUTS &&
                             nbInputs == kNB_PAGED_INPUTS && mayBeTable(facts, kKV_PAGE_TABLE);
    if (edgeLlm0101) {
      text +=
          "; 7 inputs with a batch-major k_delta are Edge-LLM 0.10.1's call (the slot inputs and a page "
          "table), which this plugin does not serve: export Edge-LLM 0.11's token-major node or 0.10's node";
    } else if (dynamic && nbInputs == expected + 2) {
      text +=
          "; k_scale and v_scale are given with the field scale_pool=1: per-token-head scales (scale_pool) "
          "replace the static k_scale and v_scale, expected one or the other";
    } else {
      // What an input past these could be, with other fields or another pool.
      std::string could;
      auto add = [&](char const* what) { could += std::string(could.empty() ? "" : ", or ") + what; };
      if (!attrs.k_norm) add("k_norm_weight only with the field k_norm=1");
      if (!fp8) add("k_scale and v_scale only with a kFP8 or kINT8 pool");
      if (!dynamic) add("scale_pool (in place of k_scale, v_scale) only with the field scale_pool=1");
      if (!could.empty()) text += "; an input past these is " + could;
    }
  }
  if (rankKnown) {
    // The other contract's count, and input 6 what that contract has there: then k_delta's rank
    // may be what is wrong.
    Contract const other = c == Contract::kSlot ? Contract::kPaged : Contract::kSlot;
    bool const counted = poolKnown || dynamic ? nbInputs == inputCount(attrs, other, fp8)
                                              : nbInputs == inputCount(attrs, other, false) ||
                                                    nbInputs == inputCount(attrs, other, true);
    bool const input6 = nbInputs <= kKV_PAGE_TABLE
                            ? other == Contract::kSlot
                            : mayBeTable(facts, kKV_PAGE_TABLE) == (other == Contract::kPaged);
    if (counted && input6)
      text += "; " + std::to_string(nbInputs) + " inputs would be the " + contractName(other) +
              " contract's (" + contractOrigin(other) + "), but then k_delta: expected rank " +
              std::to_string(expectedRank(other)) + " " + deltaDims(other) + ", got rank " +
              std::to_string(facts.inputs[0].dims.nbDims) + " " + dimsToString(facts.inputs[0].dims);
  }
  return text;
}

// Appends TensorRT's name of a dtype the core can only call "another dtype".
std::string withTrtType(std::string reason, DataType given) {
  if (!reason.empty() && toDType(given) == DType::kOther)
    reason += std::string(" (TensorRT DataType ") + typeName(given) + ")";
  return reason;
}

std::string checkLinear(CallForm const& form, int32_t index, TensorFormat format) {
  if (format == TensorFormat::kLINEAR) return {};
  return std::string(operand_name(form.attrs, index, form.nbInputs)) +
         ": expected the linear format (TensorFormat::kLINEAR), got format " +
         std::to_string(static_cast<int32_t>(format));
}

TensorDesc toTensorDesc(TrtTensor const& t) {
  TensorDesc desc;
  desc.dtype = toDType(t.type);
  desc.rank = t.dims.nbDims;
  for (int32_t i = 0; i < t.dims.nbDims && i < kMaxRank; ++i) desc.dims[i] = t.dims.d[i];
  desc.data = t.data;
  return desc;
}

}  // namespace

std::string callForm(PluginConfig const& config, int32_t nbInputs, int32_t nbOutputs, CallFacts const& facts,
                     CallForm* form) {
  if (nbOutputs != outputCount(config))
    return config.scalePool != 0 ? "expected 2 outputs (present_key_value, present_scale_pool: the field "
                                   "scale_pool is 1), got " +
                                       std::to_string(nbOutputs)
                                 : "expected 1 output (present_key_value), got " + std::to_string(nbOutputs);
  CallForm f;
  f.nbInputs = nbInputs;
  f.attrs.k_norm = config.kNorm != 0;
  f.attrs.v_norm = config.vNorm != 0;
  f.attrs.norm_eps = config.normEps;
  f.attrs.ring = config.ring != 0;
  f.attrs.tensorrt = true;
  f.attrs.scale_pool = config.scalePool != 0;
  bool const rankKnown = facts.inputs != nullptr && facts.dimsKnown && nbInputs > 0;
  bool const poolKnown = facts.inputs != nullptr && facts.typesKnown && nbInputs > kPAST_KEY_VALUE;
  DataType const poolType = poolKnown ? facts.inputs[kPAST_KEY_VALUE].type : DataType::kHALF;
  if (config.form >= 0) {  // the field names the form; k_delta's rank must be the form's
    AddressingForm const& named = kAddressingForms[config.form];
    f.attrs.contract = named.contract;
    if (rankKnown && facts.inputs[kK_DELTA].dims.nbDims != named.delta_rank)
      return std::string("k_delta: expected rank ") + std::to_string(named.delta_rank) + " " +
             named.base[kKDeltaOperand].dims + " (field 'form' = '" + named.name + "'), got rank " +
             std::to_string(facts.inputs[kK_DELTA].dims.nbDims) + " " +
             dimsToString(facts.inputs[kK_DELTA].dims);
  } else if (rankKnown) {
    Dims const& k = facts.inputs[kK_DELTA].dims;
    if (k.nbDims != expectedRank(Contract::kSlot) && k.nbDims != expectedRank(Contract::kPaged))
      return "k_delta: expected rank 4 [B, L, H, D] (the slot contract, Edge-LLM 0.10) or rank 3 [T, H, D] "
             "(the paged contract, Edge-LLM 0.11), got rank " +
             std::to_string(k.nbDims) + " " + dimsToString(k);
    f.attrs.contract = k.nbDims == expectedRank(Contract::kSlot) ? Contract::kSlot : Contract::kPaged;
  } else if (poolKnown) {
    bool const tableAt6 = nbInputs > kKV_PAGE_TABLE && isIntegerType(facts.inputs[kKV_PAGE_TABLE].type);
    f.attrs.contract = tableAt6 ? Contract::kPaged : Contract::kSlot;
  } else {
    // Only the count: minus k_norm (and scale_pool), 6 and 8 are the slot contract, 7 and 9 the
    // paged one.
    switch (nbInputs - config.kNorm - config.scalePool) {
      case 6: f.attrs.contract = Contract::kSlot; break;
      case 8:
        f.attrs.contract = Contract::kSlot;
        f.staticScales = config.scalePool == 0;
        break;
      case 7: f.attrs.contract = Contract::kPaged; break;
      case 9:
        f.attrs.contract = Contract::kPaged;
        f.staticScales = config.scalePool == 0;
        break;
      default:
        return "expected 6 inputs (slot contract) or 7 (paged contract), + 2 (k_scale, v_scale) for a kFP8 "
               "or kINT8 pool or + 1 (scale_pool) when the field scale_pool is 1 (scale_pool=" +
               std::to_string(config.scalePool) +
               " here), + 1 (k_norm_weight) when the field k_norm is 1 (k_norm=" +
               std::to_string(config.kNorm) + " here), got " + std::to_string(nbInputs) + " inputs";
    }
  }
  if (rankKnown || poolKnown || config.form >= 0) {
    Contract const c = f.attrs.contract;
    int32_t const extras = nbInputs - inputCount(f.attrs, c, false);
    if (f.attrs.scale_pool) {
      f.staticScales = false;
      if (extras != 0) return countMismatch(f.attrs, facts, nbInputs, poolKnown, poolType);
    } else {
      f.staticScales = poolKnown ? takesStaticScales(poolType) : extras == 2;
      if (nbInputs != inputCount(f.attrs, c, f.staticScales) || (!poolKnown && extras != 0 && extras != 2))
        return countMismatch(f.attrs, facts, nbInputs, poolKnown, poolType);
    }
  }
  if (f.attrs.contract == Contract::kSlot) f.attrs.pages_per_slot = config.pagesPerSlot;
  f.poolType = poolKnown ? poolType : f.staticScales ? DataType::kFP8 : DataType::kHALF;
  *form = f;
  return {};
}

namespace {

// The fields that belong to one contract only, once the inputs said which contract it is.
std::string checkFieldsForContract(PluginConfig const& config, CallForm const& form) {
  AddressingForm const& descriptor = addressing_form(form.attrs.contract);
  if (!descriptor.has_ring && config.ring != 0)
    return std::string("field '") + kRING_FIELD + "' = 1 is for the paged contract only; these " +
           std::to_string(form.nbInputs) + " inputs are " + describeForm(form);
  if (descriptor.has_pages_per_slot && config.pagesPerSlot <= 0)
    return std::string("pages_per_slot is missing: the slot contract needs the plugin field '") +
           kPAGES_PER_SLOT_FIELD + "' (INT32 > 0) or setPagesPerSlot() before building, got " +
           std::to_string(config.pagesPerSlot);
  if (!descriptor.has_pages_per_slot && config.pagesPerSlot != 0)
    return std::string("field '") + kPAGES_PER_SLOT_FIELD + "' is for the slot contract only (got " +
           std::to_string(config.pagesPerSlot) + "); these " + std::to_string(form.nbInputs) +
           " inputs are " + describeForm(form);
  return {};
}

// What TensorRT's descriptors say of the inputs, for callForm.
std::vector<TrtTensor> descTensors(DynamicPluginTensorDesc const* descs, int32_t count) {
  std::vector<TrtTensor> tensors;
  for (int32_t i = 0; i < count; ++i) tensors.push_back(trtTensor(descs[i].desc));
  return tensors;
}

}  // namespace

DataType shapeCheckType(CallForm const& form, int32_t index, TrtTensor const* inputs) {
  int32_t const base = base_operand_count(form.attrs.contract);
  if (index == 0 || index == 1) return DataType::kHALF;
  if (index == kPAST_KEY_VALUE || index == form.nbInputs) {
    if (form.staticScales) return DataType::kFP8;
    if (!form.attrs.scale_pool) return DataType::kHALF;
    // A packed int4 pool's last dim is D / 2: told from an int8 pool by the known dims only.
    Dims const& pool = inputs[kPAST_KEY_VALUE].dims;
    Dims const& k = inputs[kK_DELTA].dims;
    int64_t const poolD = pool.nbDims > 0 ? pool.d[pool.nbDims - 1] : kUnknownDim;
    int64_t const kD = k.nbDims > 0 ? k.d[k.nbDims - 1] : kUnknownDim;
    bool const packed = poolD != kUnknownDim && kD != kUnknownDim && poolD * 2 == kD && kD != 0;
    return packed ? DataType::kUINT8 : DataType::kINT8;
  }
  if (index == kROPE_COS_SIN) return DataType::kFLOAT;
  if (index < base) return DataType::kINT32;
  if (form.attrs.scale_pool && index == base) return DataType::kFLOAT;
  if (form.staticScales && index < base + 2) return DataType::kFLOAT;
  return DataType::kHALF;  // k_norm_weight: the delta dtype
}

// ---- the checks ------------------------------------------------------------------------------------

std::string checkInputTypes(PluginConfig const& config, DataType const* inputTypes, int32_t nbInputs,
                            int32_t nbOutputs, DataType* outputTypes) {
  if (inputTypes == nullptr) return "the input type array is null";
  std::vector<TrtTensor> tensors(static_cast<size_t>(std::max(nbInputs, 0)));
  for (int32_t i = 0; i < nbInputs; ++i) tensors[i].type = inputTypes[i];
  CallForm form;
  if (std::string e = callForm(config, nbInputs, nbOutputs,
                               {tensors.data(), /*dimsKnown=*/false, /*typesKnown=*/true}, &form);
      !e.empty())
    return e;
  DType const delta = toDType(inputTypes[0]);
  DType const pool = toDType(inputTypes[kPAST_KEY_VALUE]);
  for (int32_t i = 0; i < nbInputs; ++i)
    if (std::string e = check_operand_dtype(form.attrs, i, nbInputs, toDType(inputTypes[i]), delta, pool);
        !e.empty())
      return withTrtType(e, inputTypes[i]) + " (" + std::to_string(nbInputs) +
             " inputs: " + describeForm(form) + ")";
  if (outputTypes != nullptr) {
    outputTypes[0] = inputTypes[kPAST_KEY_VALUE];
    if (form.attrs.scale_pool) outputTypes[1] = inputTypes[scalePoolInput(form.attrs.contract)];
  }
  return {};
}

std::string formatCallForm(PluginConfig const& config, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                           int32_t nbOutputs, CallForm* form) {
  if (inOut == nullptr) return "inOut is null";
  std::vector<TrtTensor> const tensors = descTensors(inOut, nbInputs);
  return callForm(config, nbInputs, nbOutputs, {tensors.data(), /*dimsKnown=*/true, /*typesKnown=*/false},
                  form);
}

std::string checkFormatAt(CallForm const& form, int32_t pos, DynamicPluginTensorDesc const* inOut,
                          int32_t nbInputs, int32_t nbOutputs) {
  if (inOut == nullptr) return "inOut is null";
  int32_t const nbTensors = nbInputs + nbOutputs;
  if (pos < 0 || pos >= nbTensors)
    return "expected pos in [0, " + std::to_string(nbTensors) + "), got " + std::to_string(pos);
  nvinfer1::PluginTensorDesc const& desc = inOut[pos].desc;
  if (std::string e = checkLinear(form, pos, desc.format); !e.empty()) return e;
  // TensorRT decides the tensors in order: only inOut[0..pos] may be read.
  DType const delta = toDType(inOut[0].desc.type);
  DType const pool = pos >= kPAST_KEY_VALUE ? toDType(inOut[kPAST_KEY_VALUE].desc.type)
                                            : (form.staticScales ? DType::kFloat8E4M3 : delta);
  // present_scale_pool: the scale pool's dtype, as check_scale_result has it.
  if (form.attrs.scale_pool && pos == nbInputs + 1) {
    DataType const scales = inOut[scalePoolInput(form.attrs.contract)].desc.type;
    if (desc.type == scales) return {};
    return std::string(kScaleResultName) + ": expected dtype " + typeName(scales) + " (" + kScalePoolName +
           "'s: the output is the scale pool), got " + typeName(desc.type);
  }
  return withTrtType(check_operand_dtype(form.attrs, pos, nbInputs, toDType(desc.type), delta, pool),
                     desc.type);
}

std::string checkCall(PluginConfig const& config, TrtTensor const* inputs, int32_t nbInputs,
                      TrtTensor const* outputs, int32_t nbOutputs, CheckMode const& mode,
                      KVUpdateParams* params) {
  if (inputs == nullptr) return "the input descriptors are null";
  CallForm form;
  if (std::string e =
          callForm(config, nbInputs, nbOutputs, {inputs, /*dimsKnown=*/true, /*typesKnown=*/true}, &form);
      !e.empty())
    return e;
  PluginConfig fields = config;
  bool const pending =
      mode.pagesPerSlotPending && form.attrs.contract == Contract::kSlot && config.pagesPerSlot <= 0;
  if (pending) {
    fields.pagesPerSlot = 1;                     // present, as far as the fields' rules go
    form.attrs.pages_per_slot = kUnknownDim;     // the core leaves the rules that need it
  }
  UpdateAttrs const& attrs = form.attrs;

  for (int32_t i = 0; i < nbInputs; ++i)
    if (inputs[i].dims.nbDims < 0 || inputs[i].dims.nbDims > kMaxRank)
      return std::string(operand_name(attrs, i, nbInputs)) + ": expected a rank in [0, " +
             std::to_string(kMaxRank) + "], got " + std::to_string(inputs[i].dims.nbDims);
  if (std::string e = checkFieldsForContract(fields, form); !e.empty()) return e;

  for (int32_t i = 0; i < nbInputs; ++i)
    if (std::string e = checkLinear(form, i, inputs[i].format); !e.empty()) return e;
  if (outputs != nullptr)
    for (int32_t o = 0; o < nbOutputs; ++o)
      if (std::string e = checkLinear(form, nbInputs + o, outputs[o].format); !e.empty()) return e;

  std::array<TensorDesc, kMAX_INPUTS> descs{};
  if (nbInputs > static_cast<int32_t>(descs.size()))
    return "expected at most " + std::to_string(descs.size()) + " inputs, got " + std::to_string(nbInputs) +
           " inputs";
  for (int32_t i = 0; i < nbInputs; ++i) descs[i] = toTensorDesc(inputs[i]);
  if (pending) descs[kPAST_KEY_VALUE].dims[1] = kUnknownDim;  // numPages' rules need pages_per_slot
  // With unknown dims the core checks every rule between the known sizes.
  KVUpdateParams p;
  if (std::string e =
          params_from_operands(descs.data(), nbInputs, attrs, &p, mode.needData, mode.allowUnknown);
      !e.empty())
    return e;
  if (outputs != nullptr) {
    if (std::string e = check_result(toTensorDesc(outputs[0]), toTensorDesc(inputs[kPAST_KEY_VALUE]));
        !e.empty())
      return e;
    if (attrs.scale_pool)
      if (std::string e = check_scale_result(toTensorDesc(outputs[1]),
                                             toTensorDesc(inputs[scalePoolInput(attrs.contract)]));
          !e.empty())
        return e;
  }
  if (params != nullptr) *params = p;
  return {};
}

std::string checkProfile(PluginConfig const& config, DynamicPluginTensorDesc const* in, int32_t nbInputs,
                         DynamicPluginTensorDesc const* out, int32_t nbOutputs) {
  if (in == nullptr) return "the input descriptors are null";
  if (out == nullptr) return "the output descriptors are null";
  if (nbInputs < 0 || nbInputs > kMAX_INPUTS || nbOutputs != outputCount(config)) {
    std::vector<TrtTensor> const tensors = descTensors(in, nbInputs);
    CallForm form;
    std::string e = callForm(config, nbInputs, nbOutputs, {tensors.data(), true, true}, &form);
    return e.empty() ? "expected at most " + std::to_string(kMAX_INPUTS) + " inputs, got " +
                           std::to_string(nbInputs) + " inputs"
                     : e;
  }
  struct Bound {
    char const* name;
    Dims DynamicPluginTensorDesc::* member;  // null: the build-time dims (with wildcards)
  };
  for (Bound bound :
       {Bound{nullptr, nullptr}, Bound{"min", &DynamicPluginTensorDesc::min},
        Bound{"opt", &DynamicPluginTensorDesc::opt}, Bound{"max", &DynamicPluginTensorDesc::max}}) {
    std::array<TrtTensor, kMAX_INPUTS> inputs{};
    auto select = [&](DynamicPluginTensorDesc const& d) {
      TrtTensor t = trtTensor(d.desc);
      if (bound.member != nullptr) t.dims = d.*(bound.member);
      return t;
    };
    for (int32_t i = 0; i < nbInputs; ++i) inputs[i] = select(in[i]);
    std::array<TrtTensor, kMAX_OUTPUTS> outputs{};
    for (int32_t o = 0; o < nbOutputs; ++o) outputs[o] = select(out[o]);
    CheckMode const mode{/*allowUnknown=*/bound.member == nullptr};
    std::string e = checkCall(config, inputs.data(), nbInputs, outputs.data(), nbOutputs, mode, nullptr);
    if (!e.empty()) return bound.name == nullptr ? e : std::string("profile ") + bound.name + " shapes: " + e;
  }
  return {};
}

int64_t tensorBytes(Dims const& dims, DataType type) {
  int64_t bytes = 4;
  switch (type) {
    case DataType::kHALF:
    case DataType::kBF16: bytes = 2; break;
    case DataType::kFP8:
    case DataType::kINT8:
    case DataType::kUINT8:
    case DataType::kBOOL: bytes = 1; break;
    case DataType::kINT64: bytes = 8; break;
    default: break;
  }
  if (dims.nbDims < 0 || dims.nbDims > Dims::MAX_DIMS) return -1;
  for (int32_t i = 0; i < dims.nbDims; ++i)
    if (dims.d[i] < 0 || __builtin_mul_overflow(bytes, dims.d[i], &bytes)) return -1;
  return bytes;
}

// ---- failing ---------------------------------------------------------------------------------------

int32_t checkOrFail(std::string const& reason, char const* function, std::string const& pluginName,
                    nvinfer1::IErrorRecorder* recorder) noexcept {
  if (reason.empty()) return kSTATUS_SUCCESS;
  try {
    std::string const text = std::string(kPLUGIN_NAME) + "::" + function + " (" + pluginName + "): " + reason;
    logMessage(Severity::kERROR, text);
    if (recorder != nullptr) recorder->reportError(nvinfer1::ErrorCode::kINVALID_ARGUMENT, text.c_str());
  } catch (...) {}
  return kSTATUS_FAILURE;
}

}  // namespace dflash::trt
