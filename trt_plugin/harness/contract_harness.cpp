// Contract harness of the TensorRT plugin: makes the calls a TensorRT builder and runtime make,
// in their order, through the library's C entry points and TensorRT's interfaces only (plus the
// seed's setPagesPerSlot()), with test doubles for what TensorRT would provide: a recording
// ILogger (reached through setLoggerFinder, as TensorRT does), an IExprBuilder/IDimensionExpr,
// an IPluginResourceContext with a recording IErrorRecorder, and an IPluginRegistry.
//
//   dflash_trt_contract_harness                  everything but the kernel, and every bad-input path
//   dflash_trt_contract_harness --gpu --dump DIR  also enqueue on device buffers for several shapes
//                                                and every dtype; writes inputs and output pools as
//                                                .npy under DIR for tests/test_trt_plugin.py
// Prints one PASS/FAIL line per check and a SUMMARY line; exits 0 only when every check passed.
#include <NvInferRuntime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "DFlashTargetKVCacheUpdatePlugin.h"

using namespace nvinfer1;
namespace dtrt = dflash::trt;

namespace {

// ---- reporting --------------------------------------------------------------------------------

int gPassed = 0;
int gFailed = 0;
std::string gTag;  // appended to the bad-input checks' names: which case they ran on

bool check(bool ok, std::string const& what, std::string const& detail = {}) {
  if (ok) {
    ++gPassed;
    std::printf("PASS %s\n", what.c_str());
  } else {
    ++gFailed;
    std::printf("FAIL %s%s%s\n", what.c_str(), detail.empty() ? "" : ": ", detail.c_str());
  }
  return ok;
}

// ---- test doubles -----------------------------------------------------------------------------

class RecordingLogger : public ILogger {
 public:
  void log(Severity severity, char const* msg) noexcept override {
    messages.emplace_back(severity, msg == nullptr ? "" : msg);
  }
  // The first error-or-worse message logged since the last clear() that contains `text`.
  bool sawError(std::string const& text) const {
    for (auto const& [severity, message] : messages)
      if (severity <= Severity::kERROR && message.find(text) != std::string::npos) return true;
    return false;
  }
  bool saw(Severity wanted, std::string const& text) const {
    for (auto const& [severity, message] : messages)
      if (severity == wanted && message.find(text) != std::string::npos) return true;
    return false;
  }
  int nbErrors() const {
    int n = 0;
    for (auto const& entry : messages) n += entry.first <= Severity::kERROR;
    return n;
  }
  std::string all() const {
    std::string text;
    for (auto const& entry : messages) text += "[" + std::to_string(int(entry.first)) + "] " + entry.second + " | ";
    return text.empty() ? "(nothing logged)" : text;
  }
  void clear() { messages.clear(); }

  std::vector<std::pair<Severity, std::string>> messages;
};

class TestLoggerFinder : public ILoggerFinder {
 public:
  explicit TestLoggerFinder(ILogger* logger) : mLogger(logger) {}
  ILogger* findLogger() override { return mLogger; }

 private:
  ILogger* mLogger;
};

class RecordingErrorRecorder : public IErrorRecorder {
 public:
  int32_t getNbErrors() const noexcept override { return int32_t(errors.size()); }
  ErrorCode getErrorCode(int32_t i) const noexcept override { return errors.at(i).first; }
  ErrorDesc getErrorDesc(int32_t i) const noexcept override { return errors.at(i).second.c_str(); }
  bool hasOverflowed() const noexcept override { return false; }
  void clear() noexcept override { errors.clear(); }
  bool reportError(ErrorCode code, ErrorDesc desc) noexcept override {
    errors.emplace_back(code, desc == nullptr ? "" : desc);
    return true;
  }
  RefCount incRefCount() noexcept override { return ++refs; }
  RefCount decRefCount() noexcept override { return --refs; }

  std::vector<std::pair<ErrorCode, std::string>> errors;
  RefCount refs{0};
};

class TestResourceContext : public IPluginResourceContext {
 public:
  explicit TestResourceContext(IErrorRecorder* recorder) : mRecorder(recorder) {}
  IGpuAllocator* getGpuAllocator() const noexcept override { return nullptr; }
  IErrorRecorder* getErrorRecorder() const noexcept override { return mRecorder; }

 private:
  IErrorRecorder* mRecorder;
};

// A dimension expression: a build-time constant, or a symbol (a runtime dimension).
class TestDimensionExprImpl : public apiv::VDimensionExpr {
 public:
  TestDimensionExprImpl(bool constant, int64_t value) : mConstant(constant), mValue(value) {}
  bool isConstant() const override { return mConstant; }
  int64_t getConstantValue() const override {
    return mConstant ? mValue : std::numeric_limits<int64_t>::min();
  }
  bool isSizeTensor() const override { return false; }

 private:
  bool mConstant;
  int64_t mValue;
};

class TestDimensionExpr : public IDimensionExpr {
 public:
  TestDimensionExpr(bool constant, int64_t value) : mStorage(constant, value) { mImpl = &mStorage; }
  ~TestDimensionExpr() noexcept override = default;

 private:
  TestDimensionExprImpl mStorage;
};

class TestExprBuilderImpl : public apiv::VExprBuilder {
 public:
  IDimensionExpr const* constant(int64_t value) override { return make(true, value); }
  IDimensionExpr const* symbol() { return make(false, 0); }
  IDimensionExpr const* operation(DimensionOperation op, IDimensionExpr const& a, IDimensionExpr const& b) override {
    if (!a.isConstant() || !b.isConstant()) return symbol();
    int64_t const x = a.getConstantValue(), y = b.getConstantValue();
    switch (op) {
      case DimensionOperation::kSUM: return constant(x + y);
      case DimensionOperation::kPROD: return constant(x * y);
      case DimensionOperation::kMAX: return constant(std::max(x, y));
      case DimensionOperation::kMIN: return constant(std::min(x, y));
      case DimensionOperation::kSUB: return constant(x - y);
      case DimensionOperation::kEQUAL: return constant(x == y);
      case DimensionOperation::kLESS: return constant(x < y);
      case DimensionOperation::kFLOOR_DIV: return y == 0 ? nullptr : constant(x / y - ((x % y != 0) && ((x < 0) != (y < 0))));
      case DimensionOperation::kCEIL_DIV: return y == 0 ? nullptr : constant(x / y + ((x % y != 0) && ((x < 0) == (y < 0))));
    }
    return nullptr;
  }
  IDimensionExpr const* declareSizeTensor(int32_t, IDimensionExpr const&, IDimensionExpr const&) override {
    return symbol();
  }

 private:
  IDimensionExpr const* make(bool isConstant, int64_t value) {
    mExprs.push_back(std::make_unique<TestDimensionExpr>(isConstant, value));
    return mExprs.back().get();
  }
  std::deque<std::unique_ptr<TestDimensionExpr>> mExprs;
};

class TestExprBuilder : public IExprBuilder {
 public:
  TestExprBuilder() { mImpl = &mStorage; }
  ~TestExprBuilder() noexcept override = default;
  IDimensionExpr const* symbol() { return mStorage.symbol(); }

 private:
  TestExprBuilderImpl mStorage;
};

// The part of a plugin registry that initDFlashPluginWithRegistry and a parser use.
class TestPluginRegistry : public IPluginRegistry {
 public:
  bool registerCreator(IPluginCreatorInterface& creator, AsciiChar const* const ns) noexcept override {
    if (std::strcmp(creator.getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") != 0) return false;
    auto& v3 = static_cast<IPluginCreatorV3One&>(creator);
    if (std::strcmp(v3.getPluginNamespace(), ns) != 0) return false;  // the creator must say its namespace
    if (getCreator(v3.getPluginName(), v3.getPluginVersion(), ns) != nullptr) return false;
    mCreators.push_back(&creator);
    return true;
  }
  IPluginCreatorInterface* const* getAllCreators(int32_t* const numCreators) const noexcept override {
    *numCreators = int32_t(mCreators.size());
    return mCreators.data();
  }
  IPluginCreatorInterface* getCreator(AsciiChar const* const name, AsciiChar const* const version,
                                      AsciiChar const* const ns) noexcept override {
    for (IPluginCreatorInterface* c : mCreators) {
      auto* v3 = static_cast<IPluginCreatorV3One*>(c);
      if (!std::strcmp(v3->getPluginName(), name) && !std::strcmp(v3->getPluginVersion(), version) &&
          !std::strcmp(v3->getPluginNamespace(), ns))
        return c;
    }
    return nullptr;
  }
  bool deregisterCreator(IPluginCreatorInterface const&) noexcept override { return false; }
  // Unused by the plugin: inert.
  bool registerCreator(IPluginCreator&, AsciiChar const* const) noexcept override { return false; }
  IPluginCreator* const* getPluginCreatorList(int32_t* const n) const noexcept override { *n = 0; return nullptr; }
  IPluginCreator* getPluginCreator(AsciiChar const* const, AsciiChar const* const, AsciiChar const* const) noexcept override {
    return nullptr;
  }
  void setErrorRecorder(IErrorRecorder* const) noexcept override {}
  IErrorRecorder* getErrorRecorder() const noexcept override { return nullptr; }
  bool deregisterCreator(IPluginCreator const&) noexcept override { return false; }
  bool isParentSearchEnabled() const override { return false; }
  void setParentSearchEnabled(bool const) override {}
  PluginLibraryHandle loadLibrary(AsciiChar const*) noexcept override { return nullptr; }
  void deregisterLibrary(PluginLibraryHandle) noexcept override {}
  IPluginResource* acquirePluginResource(AsciiChar const*, IPluginResource*) noexcept override { return nullptr; }
  int32_t releasePluginResource(AsciiChar const*) noexcept override { return 0; }
  IPluginCreatorInterface* const* getAllCreatorsRecursive(int32_t* const n) noexcept override {
    return getAllCreators(n);
  }

 private:
  std::vector<IPluginCreatorInterface*> mCreators;
};

RecordingLogger gLogger;
TestLoggerFinder gLoggerFinder(&gLogger);

// ---- shapes -------------------------------------------------------------------------------------

constexpr int32_t kTensors = dtrt::kNB_TENSORS;
constexpr int32_t kPool = dtrt::kPAST_KEY_VALUE;
constexpr int32_t kOut = dtrt::kPRESENT_KEY_VALUE;
constexpr int64_t kP = dtrt::kTOKENS_PER_PAGE;

struct Case {
  std::string name;
  DataType type;
  int64_t B, L, H, D, numPages, pagesPerSlot, Rb, S, R;
};

char const* dtypeName(DataType type) {
  return type == DataType::kHALF ? "float16" : type == DataType::kBF16 ? "bfloat16" : "float32";
}
int64_t elementBytes(DataType type) { return type == DataType::kHALF || type == DataType::kBF16 ? 2 : 4; }

Dims makeDims(std::initializer_list<int64_t> values) {
  Dims dims{};
  dims.nbDims = int32_t(values.size());
  int32_t i = 0;
  for (int64_t v : values) dims.d[i++] = v;
  return dims;
}

std::array<Dims, kTensors> tensorDims(Case const& c) {
  Dims const pool = makeDims({2, c.numPages, kP, c.H, c.D});
  return {makeDims({c.B, c.L, c.H, c.D}), makeDims({c.B, c.L, c.H, c.D}), pool, makeDims({c.Rb, c.S, c.R}),
          makeDims({c.B}), makeDims({c.B}), pool};
}

DataType tensorType(int32_t pos, DataType poolType) {
  if (pos == dtrt::kROPE_COS_SIN) return DataType::kFLOAT;
  if (pos == dtrt::kDELTA_START_POSITIONS || pos == dtrt::kDELTA_LENGTHS) return DataType::kINT32;
  return poolType;
}

int64_t volume(Dims const& dims) {
  int64_t n = 1;
  for (int32_t i = 0; i < dims.nbDims; ++i) n *= dims.d[i];
  return n;
}

struct RuntimeDescs {
  std::array<PluginTensorDesc, dtrt::kNB_INPUTS> in{};
  std::array<PluginTensorDesc, dtrt::kNB_OUTPUTS> out{};
  PluginTensorDesc& at(int32_t pos) { return pos < dtrt::kNB_INPUTS ? in[pos] : out[pos - dtrt::kNB_INPUTS]; }
};

RuntimeDescs runtimeDescs(Case const& c) {
  RuntimeDescs descs;
  auto const dims = tensorDims(c);
  for (int32_t pos = 0; pos < kTensors; ++pos) {
    PluginTensorDesc& d = descs.at(pos);
    d.dims = dims[pos];
    d.type = tensorType(pos, c.type);
    d.format = TensorFormat::kLINEAR;
    d.scale = 1.0f;
  }
  return descs;
}

struct BuildDescs {
  std::array<DynamicPluginTensorDesc, dtrt::kNB_INPUTS> in{};
  std::array<DynamicPluginTensorDesc, dtrt::kNB_OUTPUTS> out{};
  DynamicPluginTensorDesc& at(int32_t pos) { return pos < dtrt::kNB_INPUTS ? in[pos] : out[pos - dtrt::kNB_INPUTS]; }
};

// An optimization profile: desc.dims holds -1 wherever min and max differ (TensorRT's wildcards).
BuildDescs buildDescs(Case const& min, Case const& opt, Case const& max) {
  BuildDescs descs;
  auto const dmin = tensorDims(min), dopt = tensorDims(opt), dmax = tensorDims(max);
  for (int32_t pos = 0; pos < kTensors; ++pos) {
    DynamicPluginTensorDesc& d = descs.at(pos);
    d.desc.dims = dopt[pos];
    for (int32_t i = 0; i < dopt[pos].nbDims; ++i)
      if (dmin[pos].d[i] != dmax[pos].d[i]) d.desc.dims.d[i] = -1;
    d.desc.type = tensorType(pos, opt.type);
    d.desc.format = TensorFormat::kLINEAR;
    d.desc.scale = 1.0f;
    d.min = dmin[pos];
    d.opt = dopt[pos];
    d.max = dmax[pos];
  }
  return descs;
}

// ---- plugin access ------------------------------------------------------------------------------

struct PluginDeleter {
  void operator()(IPluginV3* p) const { delete p; }
};
using PluginPtr = std::unique_ptr<IPluginV3, PluginDeleter>;

IPluginV3OneCore* core(IPluginV3* p) {
  return static_cast<IPluginV3OneCore*>(p->getCapabilityInterface(PluginCapabilityType::kCORE));
}
IPluginV3OneBuildV2* build(IPluginV3* p) {
  return static_cast<IPluginV3OneBuildV2*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
}
IPluginV3OneRuntime* runtime(IPluginV3* p) {
  return static_cast<IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
}

IPluginCreatorV3One* libraryCreator() {
  int32_t nb = -1;
  IPluginCreatorInterface* const* creators = getCreators(nb);
  if (!check(creators != nullptr && nb == 1, "getCreators returns one creator", "nb=" + std::to_string(nb)))
    return nullptr;
  IPluginCreatorInterface* c = creators[0];
  InterfaceInfo const info = c->getInterfaceInfo();
  if (!check(std::strcmp(info.kind, "PLUGIN CREATOR_V3ONE") == 0 && info.major == 1,
             "the creator is an IPluginCreatorV3One", info.kind))
    return nullptr;
  return static_cast<IPluginCreatorV3One*>(c);
}

struct Fields {
  std::vector<PluginField> fields;
  std::deque<std::vector<char>> storage;  // deep copies, as an engine's serialized fields are
  PluginFieldCollection collection() const { return {int32_t(fields.size()), fields.data()}; }
  void add(char const* name, PluginFieldType type, void const* data, int32_t length, size_t bytes) {
    storage.emplace_back(static_cast<char const*>(data), static_cast<char const*>(data) + bytes);
    fields.emplace_back(name, storage.back().data(), type, length);
  }
  void addInt32(char const* name, int32_t value) { add(name, PluginFieldType::kINT32, &value, 1, sizeof(value)); }
};

Fields copyFields(PluginFieldCollection const* fc) {
  Fields copy;
  for (int32_t i = 0; i < fc->nbFields; ++i) {
    PluginField const& f = fc->fields[i];
    size_t const bytes = f.type == PluginFieldType::kINT64 || f.type == PluginFieldType::kFLOAT64 ? 8 : 4;
    copy.add(f.name, f.type, f.data, f.length, bytes * size_t(f.length));
  }
  return copy;
}

// Runs `call` and checks it failed (by `failed`) with an error logged that contains `expected`.
template <typename Call, typename Failed>
void expectFailure(std::string const& what, std::string const& expected, Call call, Failed failed) {
  gLogger.clear();
  auto const result = call();
  bool const didFail = failed(result);
  bool const logged = gLogger.sawError(expected);
  check(didFail && logged, "bad input rejected: " + what + gTag,
        std::string(didFail ? "" : "call did not fail; ") + (logged ? "" : "expected a logged error with '" + expected + "'; ") +
            "log: " + gLogger.all());
}
void expectStatusFailure(std::string const& what, std::string const& expected, std::function<int32_t()> call) {
  expectFailure(what, expected, call, [](int32_t status) { return status != 0; });
}
void expectNull(std::string const& what, std::string const& expected, std::function<IPluginV3*()> call) {
  expectFailure(what, expected, [&] { return PluginPtr(call()); }, [](PluginPtr const& p) { return p == nullptr; });
}

// ---- the builder's and runtime's call sequence ----------------------------------------------

struct Contract {
  PluginPtr runtimePlugin;  // deserialized (kRUNTIME) and attached to a context
  IPluginV3OneRuntime* rt = nullptr;
};

// Builder: field names, createPlugin(kBUILD), capabilities, output types and shapes, formats,
// configurePlugin, workspace, aliasing, serialization. Runtime: createPlugin(kRUNTIME) from the
// serialized fields, attachToContext, onShapeChange. Returns the attached runtime plugin.
Contract playContract(Case const& opt, Case const& min, Case const& max, TestResourceContext* context) {
  std::string const tag = " [" + opt.name + "]";
  Contract result;
  IPluginCreatorV3One* creator = libraryCreator();
  if (creator == nullptr) return result;
  check(!std::strcmp(creator->getPluginName(), dtrt::kPLUGIN_NAME) && !std::strcmp(creator->getPluginVersion(), "1") &&
            !std::strcmp(creator->getPluginNamespace(), ""),
        "creator name/version/namespace" + tag);

  PluginFieldCollection const* names = creator->getFieldNames();
  check(names != nullptr && names->nbFields == 1 && !std::strcmp(names->fields[0].name, "pages_per_slot") &&
            names->fields[0].type == PluginFieldType::kINT32,
        "creator getFieldNames lists pages_per_slot INT32" + tag);

  Fields onnxFields;  // what the ONNX parser passes: the node's attributes
  onnxFields.addInt32("pages_per_slot", int32_t(opt.pagesPerSlot));
  PluginFieldCollection const fc = onnxFields.collection();
  PluginPtr built(creator->createPlugin("dflash_update", &fc, TensorRTPhase::kBUILD));
  if (!check(built != nullptr, "createPlugin(kBUILD)" + tag, gLogger.all())) return result;
  check(built->getInterfaceInfo().kind == std::string("PLUGIN") && built->getInterfaceInfo().major == 1,
        "the plugin is an IPluginV3" + tag);

  IPluginV3OneCore* pluginCore = core(built.get());
  IPluginV3OneBuildV2* b = build(built.get());
  IPluginV3OneRuntime* r = runtime(built.get());
  check(pluginCore && pluginCore->getInterfaceInfo().kind == std::string("PLUGIN_V3ONE_CORE"), "capability kCORE" + tag);
  check(b && b->getInterfaceInfo().kind == std::string("PLUGIN_V3ONE_BUILD") && b->getInterfaceInfo().major == 2,
        "capability kBUILD is IPluginV3OneBuildV2 (version 2)" + tag);
  check(r && r->getInterfaceInfo().kind == std::string("PLUGIN_V3ONE_RUNTIME"), "capability kRUNTIME" + tag);
  if (!pluginCore || !b || !r) return result;
  check(!std::strcmp(pluginCore->getPluginName(), dtrt::kPLUGIN_NAME) &&
            !std::strcmp(pluginCore->getPluginVersion(), "1") && !std::strcmp(pluginCore->getPluginNamespace(), ""),
        "core name/version/namespace" + tag);

  check(b->getNbOutputs() == 1, "getNbOutputs == 1" + tag);
  std::array<DataType, dtrt::kNB_INPUTS> inTypes{};
  for (int32_t pos = 0; pos < dtrt::kNB_INPUTS; ++pos) inTypes[pos] = tensorType(pos, opt.type);
  DataType outType = DataType::kINT8;
  check(b->getOutputDataTypes(&outType, 1, inTypes.data(), dtrt::kNB_INPUTS) == 0 && outType == opt.type,
        "getOutputDataTypes gives the pool's dtype" + tag, gLogger.all());

  // Shapes as the builder sees them: B and L symbolic (dynamic), everything else constant.
  TestExprBuilder exprs;
  auto const dims = tensorDims(opt);
  std::array<DimsExprs, dtrt::kNB_INPUTS> inExprs{};
  IDimensionExpr const* batch = exprs.symbol();
  IDimensionExpr const* deltaLen = exprs.symbol();
  for (int32_t pos = 0; pos < dtrt::kNB_INPUTS; ++pos) {
    inExprs[pos].nbDims = dims[pos].nbDims;
    for (int32_t i = 0; i < dims[pos].nbDims; ++i) inExprs[pos].d[i] = exprs.constant(dims[pos].d[i]);
  }
  for (int32_t pos : {dtrt::kK_DELTA, dtrt::kV_DELTA}) {
    inExprs[pos].d[0] = batch;
    inExprs[pos].d[1] = deltaLen;
  }
  inExprs[dtrt::kDELTA_START_POSITIONS].d[0] = batch;
  inExprs[dtrt::kDELTA_LENGTHS].d[0] = batch;
  DimsExprs outExprs{};
  int32_t const shapeStatus = b->getOutputShapes(inExprs.data(), dtrt::kNB_INPUTS, nullptr, 0, &outExprs, 1, exprs);
  bool sameAsPool = shapeStatus == 0 && outExprs.nbDims == 5;
  for (int32_t i = 0; sameAsPool && i < 5; ++i) sameAsPool = outExprs.d[i] == inExprs[kPool].d[i];
  check(sameAsPool, "getOutputShapes: the output is the pool's shape" + tag, gLogger.all());

  BuildDescs descs = buildDescs(min, opt, max);
  std::array<DynamicPluginTensorDesc, kTensors> inOut{};
  for (int32_t pos = 0; pos < kTensors; ++pos) inOut[pos] = descs.at(pos);
  bool allSupported = true;
  for (int32_t pos = 0; pos < kTensors; ++pos) {
    bool const ok = b->supportsFormatCombination(pos, inOut.data(), dtrt::kNB_INPUTS, dtrt::kNB_OUTPUTS);
    allSupported = allSupported && ok;
    // Every other dtype, and a non-linear format, is refused at this position.
    for (DataType other : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16, DataType::kINT32, DataType::kINT8,
                           DataType::kINT64, DataType::kBOOL}) {
      if (other == inOut[pos].desc.type) continue;
      auto probe = inOut;
      probe[pos].desc.type = other;
      bool const refusedIsExpected = !(pos == dtrt::kK_DELTA && (other == DataType::kFLOAT || other == DataType::kHALF ||
                                                                    other == DataType::kBF16));
      bool const supported = b->supportsFormatCombination(pos, probe.data(), dtrt::kNB_INPUTS, dtrt::kNB_OUTPUTS);
      if (supported == refusedIsExpected)
        check(false, "supportsFormatCombination pos " + std::to_string(pos) + " dtype " + std::to_string(int(other)) + tag);
    }
    auto probe = inOut;
    probe[pos].desc.format = TensorFormat::kHWC8;
    if (b->supportsFormatCombination(pos, probe.data(), dtrt::kNB_INPUTS, dtrt::kNB_OUTPUTS))
      check(false, "supportsFormatCombination refuses a non-linear format at pos " + std::to_string(pos) + tag);
  }
  check(allSupported, "supportsFormatCombination accepts every position of the combination" + tag, gLogger.all());

  gLogger.clear();
  check(b->configurePlugin(descs.in.data(), dtrt::kNB_INPUTS, descs.out.data(), dtrt::kNB_OUTPUTS) == 0,
        "configurePlugin with min/opt/max" + tag, gLogger.all());
  check(b->getWorkspaceSize(descs.in.data(), dtrt::kNB_INPUTS, descs.out.data(), dtrt::kNB_OUTPUTS) == 0,
        "getWorkspaceSize == 0" + tag);
  check(b->getAliasedInput(0) == 2 && b->getAliasedInput(1) == -1 && b->getAliasedInput(-1) == -1,
        "getAliasedInput(0) == 2 (output aliases past_key_value)" + tag);

  PluginPtr cloned(built->clone());
  PluginFieldCollection const* clonedFields = cloned ? runtime(cloned.get())->getFieldsToSerialize() : nullptr;
  check(clonedFields && clonedFields->nbFields == 1 &&
            *static_cast<int32_t const*>(clonedFields->fields[0].data) == int32_t(opt.pagesPerSlot),
        "clone() carries pages_per_slot" + tag);

  PluginFieldCollection const* serialized = r->getFieldsToSerialize();
  bool const serializedOk = serialized && serialized->nbFields == 1 &&
                            !std::strcmp(serialized->fields[0].name, "pages_per_slot") &&
                            serialized->fields[0].type == PluginFieldType::kINT32 && serialized->fields[0].length == 1 &&
                            *static_cast<int32_t const*>(serialized->fields[0].data) == int32_t(opt.pagesPerSlot);
  if (!check(serializedOk, "getFieldsToSerialize gives pages_per_slot" + tag)) return result;
  Fields engineFields = copyFields(serialized);
  built.reset();  // the engine outlives the builder's plugin
  cloned.reset();

  // Runtime: deserialize, attach, shapes, enqueue.
  PluginFieldCollection const efc = engineFields.collection();
  PluginPtr deserialized(creator->createPlugin("dflash_update", &efc, TensorRTPhase::kRUNTIME));
  if (!check(deserialized != nullptr, "createPlugin(kRUNTIME) from the serialized fields" + tag, gLogger.all()))
    return result;
  IPluginV3OneRuntime* dr = runtime(deserialized.get());
  PluginPtr attached(dr ? dr->attachToContext(context) : nullptr);
  if (!check(attached != nullptr && attached.get() != deserialized.get(), "attachToContext returns a new plugin" + tag))
    return result;
  IPluginV3OneRuntime* ar = runtime(attached.get());
  RuntimeDescs rd = runtimeDescs(opt);
  gLogger.clear();
  check(ar->onShapeChange(rd.in.data(), dtrt::kNB_INPUTS, rd.out.data(), dtrt::kNB_OUTPUTS) == 0,
        "onShapeChange" + tag, gLogger.all());
  result.runtimePlugin = std::move(attached);
  result.rt = ar;
  return result;
}

// ---- every bad-input path -------------------------------------------------------------------------

void badInputs(Case const& good, TestResourceContext* context, RecordingErrorRecorder* recorder) {
  gTag = " [" + good.name + "]";
  IPluginCreatorV3One* creator = libraryCreator();
  if (creator == nullptr) return;

  // createPlugin
  Fields none;
  PluginFieldCollection const noFields = none.collection();
  expectNull("createPlugin(kRUNTIME) without pages_per_slot", "pages_per_slot is missing",
             [&] { return creator->createPlugin("p", &noFields, TensorRTPhase::kRUNTIME); });
  expectNull("createPlugin with a null field collection", "field collection is null",
             [&] { return creator->createPlugin("p", nullptr, TensorRTPhase::kBUILD); });
  expectNull("createPlugin with a null name", "name is null",
             [&] { return creator->createPlugin(nullptr, &noFields, TensorRTPhase::kBUILD); });
  expectNull("createPlugin with an unknown phase", "expected phase",
             [&] { return creator->createPlugin("p", &noFields, static_cast<TensorRTPhase>(7)); });
  {
    Fields f;
    float const value = 2.0f;
    f.add("pages_per_slot", PluginFieldType::kFLOAT32, &value, 1, sizeof(value));
    PluginFieldCollection const fc = f.collection();
    expectNull("pages_per_slot of type FLOAT32", "expected type INT32",
               [&] { return creator->createPlugin("p", &fc, TensorRTPhase::kBUILD); });
  }
  for (int32_t value : {0, -3}) {
    Fields f;
    f.addInt32("pages_per_slot", value);
    PluginFieldCollection const fc = f.collection();
    expectNull("pages_per_slot = " + std::to_string(value), "expected an int32 > 0",
               [&] { return creator->createPlugin("p", &fc, TensorRTPhase::kBUILD); });
  }
  {
    Fields f;
    int32_t const values[2] = {1, 2};
    f.add("pages_per_slot", PluginFieldType::kINT32, values, 2, sizeof(values));
    PluginFieldCollection const fc = f.collection();
    expectNull("pages_per_slot with 2 elements", "expected 1 element",
               [&] { return creator->createPlugin("p", &fc, TensorRTPhase::kBUILD); });
    PluginField nullData("pages_per_slot", nullptr, PluginFieldType::kINT32, 1);
    PluginFieldCollection const nfc{1, &nullData};
    expectNull("pages_per_slot with null data", "data is null",
               [&] { return creator->createPlugin("p", &nfc, TensorRTPhase::kBUILD); });
    PluginFieldCollection const broken{3, nullptr};
    expectNull("a field collection with null fields", "fields pointer null",
               [&] { return creator->createPlugin("p", &broken, TensorRTPhase::kBUILD); });
  }
  {
    Fields f;
    f.addInt32("pages_per_slot", 2);
    f.addInt32("unknown_attribute", 5);
    PluginFieldCollection const fc = f.collection();
    gLogger.clear();
    PluginPtr p(creator->createPlugin("p", &fc, TensorRTPhase::kBUILD));
    check(p != nullptr && gLogger.saw(ILogger::Severity::kWARNING, "unknown_attribute"),
          "an unknown field is ignored with a warning", gLogger.all());
  }

  // A build plugin whose pages_per_slot is missing: the seed's builder sets it after parsing.
  PluginPtr unset(creator->createPlugin("p", &noFields, TensorRTPhase::kBUILD));
  if (!check(unset != nullptr, "createPlugin(kBUILD) without pages_per_slot is allowed (set later)")) return;
  BuildDescs goodBuild = buildDescs(good, good, good);
  IPluginV3OneBuildV2* ub = build(unset.get());
  expectStatusFailure("configurePlugin with pages_per_slot missing", "pages_per_slot is missing", [&] {
    return ub->configurePlugin(goodBuild.in.data(), 6, goodBuild.out.data(), 1);
  });
  RuntimeDescs goodRt = runtimeDescs(good);
  std::array<char, 64> dummy{};  // host stand-ins: every call below must fail before touching memory
  std::array<void const*, 6> hostInputs{};
  hostInputs.fill(dummy.data());
  void* hostOutputs[1] = {dummy.data()};
  expectStatusFailure("enqueue with pages_per_slot missing", "pages_per_slot is missing", [&] {
    return runtime(unset.get())->enqueue(goodRt.in.data(), goodRt.out.data(), hostInputs.data(), hostOutputs, nullptr, nullptr);
  });
  expectStatusFailure("getFieldsToSerialize with pages_per_slot missing logs an error", "pages_per_slot is missing", [&] {
    return runtime(unset.get())->getFieldsToSerialize() ? 1 : 0;
  });
  auto* concrete = dynamic_cast<dtrt::DFlashTargetKVCacheUpdatePlugin*>(unset.get());
  if (check(concrete != nullptr, "the plugin is a DFlashTargetKVCacheUpdatePlugin (dynamic_cast across the library)")) {
    expectStatusFailure("setPagesPerSlot(0)", "expected pages_per_slot > 0", [&] {
      concrete->setPagesPerSlot(0);
      return concrete->pagesPerSlot() == 0 ? 1 : 0;
    });
    concrete->setPagesPerSlot(int32_t(good.pagesPerSlot));
    gLogger.clear();
    check(ub->configurePlugin(goodBuild.in.data(), 6, goodBuild.out.data(), 1) == 0,
          "setPagesPerSlot() then configurePlugin succeeds", gLogger.all());
    PluginPtr clone(unset->clone());
    PluginFieldCollection const* fields = runtime(clone.get())->getFieldsToSerialize();
    check(*static_cast<int32_t const*>(fields->fields[0].data) == int32_t(good.pagesPerSlot),
          "setPagesPerSlot() value survives clone() and getFieldsToSerialize()");
  }

  // Capabilities
  expectFailure("getCapabilityInterface(unknown type)", "expected PluginCapabilityType",
                [&] { return unset->getCapabilityInterface(static_cast<PluginCapabilityType>(9)); },
                [](IPluginCapability* c) { return c == nullptr; });

  // getOutputDataTypes
  std::array<DataType, 6> types{};
  for (int32_t pos = 0; pos < 6; ++pos) types[pos] = tensorType(pos, good.type);
  DataType outType{};
  expectStatusFailure("getOutputDataTypes with null arrays", "must not be null",
                      [&] { return ub->getOutputDataTypes(nullptr, 1, types.data(), 6); });
  expectStatusFailure("getOutputDataTypes with 5 inputs", "expected 6 inputs and 1 output",
                      [&] { return ub->getOutputDataTypes(&outType, 1, types.data(), 5); });
  {
    auto bad = types;
    bad[0] = bad[1] = bad[2] = DataType::kINT8;
    expectStatusFailure("getOutputDataTypes with int8 tensors", "k_delta: expected dtype float16, bfloat16 or float32",
                        [&] { return ub->getOutputDataTypes(&outType, 1, bad.data(), 6); });
    bad = types;
    bad[kPool] = good.type == DataType::kFLOAT ? DataType::kHALF : DataType::kFLOAT;
    expectStatusFailure("getOutputDataTypes with a pool dtype unlike k_delta's", "past_key_value: expected k_delta's dtype",
                        [&] { return ub->getOutputDataTypes(&outType, 1, bad.data(), 6); });
    bad = types;
    bad[dtrt::kROPE_COS_SIN] = DataType::kHALF;
    expectStatusFailure("getOutputDataTypes with an fp16 rope table", "rope_cos_sin: expected dtype float32",
                        [&] { return ub->getOutputDataTypes(&outType, 1, bad.data(), 6); });
    bad = types;
    bad[dtrt::kDELTA_LENGTHS] = DataType::kINT64;
    expectStatusFailure("getOutputDataTypes with int64 lengths", "delta_lengths: expected dtype int32",
                        [&] { return ub->getOutputDataTypes(&outType, 1, bad.data(), 6); });
  }

  // getOutputShapes
  {
    TestExprBuilder exprs;
    auto const dims = tensorDims(good);
    std::array<DimsExprs, 6> in{};
    for (int32_t pos = 0; pos < 6; ++pos) {
      in[pos].nbDims = dims[pos].nbDims;
      for (int32_t i = 0; i < dims[pos].nbDims; ++i) in[pos].d[i] = exprs.constant(dims[pos].d[i]);
    }
    DimsExprs out{};
    expectStatusFailure("getOutputShapes with null inputs", "must not be null",
                        [&] { return ub->getOutputShapes(nullptr, 6, nullptr, 0, &out, 1, exprs); });
    expectStatusFailure("getOutputShapes with 7 inputs", "expected 6 inputs",
                        [&] { return ub->getOutputShapes(in.data(), 7, nullptr, 0, &out, 1, exprs); });
    auto mutate = [&](std::string const& what, std::string const& expected, auto change) {
      auto bad = in;
      change(bad);
      expectStatusFailure("getOutputShapes: " + what, expected,
                          [&] { return ub->getOutputShapes(bad.data(), 6, nullptr, 0, &out, 1, exprs); });
    };
    mutate("pool of rank 4", "past_key_value: expected rank 5", [](auto& e) { e[kPool].nbDims = 4; });
    mutate("pool page size 64", "tokens per page", [&](auto& e) { e[kPool].d[2] = exprs.constant(64); });
    mutate("pool dim 0 == 3", "K and V planes", [&](auto& e) { e[kPool].d[0] = exprs.constant(3); });
    mutate("pool heads unlike k_delta's", "k_delta's H and D", [&](auto& e) { e[kPool].d[3] = exprs.constant(good.H + 1); });
    mutate("numPages not divisible by pages_per_slot", "divisible by pages_per_slot",
           [&](auto& e) { e[kPool].d[1] = exprs.constant(good.numPages + 1); });
    mutate("a null dimension expression", "dimension 1 is null", [&](auto& e) { e[0].d[1] = nullptr; });
  }

  // supportsFormatCombination
  {
    std::array<DynamicPluginTensorDesc, kTensors> inOut{};
    for (int32_t pos = 0; pos < kTensors; ++pos) inOut[pos] = goodBuild.at(pos);
    expectFailure("supportsFormatCombination pos 7", "expected pos in [0, 7)",
                  [&] { return ub->supportsFormatCombination(7, inOut.data(), 6, 1); }, [](bool ok) { return !ok; });
    expectFailure("supportsFormatCombination pos -1", "expected pos in [0, 7)",
                  [&] { return ub->supportsFormatCombination(-1, inOut.data(), 6, 1); }, [](bool ok) { return !ok; });
    expectFailure("supportsFormatCombination null inOut", "inOut is null",
                  [&] { return ub->supportsFormatCombination(0, nullptr, 6, 1); }, [](bool ok) { return !ok; });
    expectFailure("supportsFormatCombination 5 inputs", "expected 6 inputs",
                  [&] { return ub->supportsFormatCombination(0, inOut.data(), 5, 1); }, [](bool ok) { return !ok; });
    gLogger.clear();
    auto probe = inOut;
    probe[dtrt::kV_DELTA].desc.type = DataType::kINT8;
    bool const refused = !ub->supportsFormatCombination(dtrt::kV_DELTA, probe.data(), 6, 1);
    check(refused && gLogger.saw(ILogger::Severity::kVERBOSE, "v_delta: expected k_delta's dtype") && gLogger.nbErrors() == 0,
          "supportsFormatCombination refuses an unsupported combination with a verbose reason (not an error)",
          gLogger.all());
  }

  // configurePlugin: every shape rule, on the profile's bounds.
  auto configureWith = [&](std::string const& what, std::string const& expected, Case min, Case opt, Case max,
                           std::function<void(BuildDescs&)> change = {}) {
    BuildDescs d = buildDescs(min, opt, max);
    if (change) change(d);
    expectStatusFailure("configurePlugin: " + what, expected,
                        [&] { return ub->configurePlugin(d.in.data(), 6, d.out.data(), 1); });
  };
  auto with = [&](auto change) {
    Case c = good;
    change(c);
    return c;
  };
  Case const slotsExceeded = with([](Case& c) { c.B = c.numPages / c.pagesPerSlot + 1; });
  Case const capExceeded = with([](Case& c) { c.S = c.pagesPerSlot * kP + 1; });
  Case const oddRotary = with([](Case& c) { c.R = 3; });
  Case const wideRotary = with([](Case& c) { c.R = c.D + 2; });
  Case const ropeBatch = with([](Case& c) { c.Rb = c.B + 1; });
  Case const indivisible = with([](Case& c) { c.numPages = c.numPages + 1; });
  configureWith("B > slots in the max profile", "batch B must be <=", good, good, slotsExceeded);
  configureWith("S > cap", "length S must be <= slot capacity", capExceeded, capExceeded, capExceeded);
  configureWith("R odd", "rotary dim R must be even", oddRotary, oddRotary, oddRotary);
  configureWith("R > D", "rotary dim R must be even and <= head dim", wideRotary, wideRotary, wideRotary);
  configureWith("rope batch not 1 or B", "rope_cos_sin batch must be 1 or B", ropeBatch, ropeBatch, ropeBatch);
  configureWith("numPages % pages_per_slot != 0", "divisible by pages_per_slot", indivisible, indivisible, indivisible);
  {
    BuildDescs d = buildDescs(good, good, good);
    expectStatusFailure("configurePlugin: null input descriptors", "input descriptors are null",
                        [&] { return ub->configurePlugin(nullptr, 6, d.out.data(), 1); });
    expectStatusFailure("configurePlugin: 2 outputs", "expected 6 inputs and 1 output",
                        [&] { return ub->configurePlugin(d.in.data(), 6, d.out.data(), 2); });
  }
  configureWith("v_delta in bf16/fp16 mismatch", "v_delta: expected k_delta's dtype", good, good, good,
                [&](BuildDescs& d) { d.in[1].desc.type = good.type == DataType::kHALF ? DataType::kBF16 : DataType::kHALF; });
  configureWith("delta_start_positions int64", "delta_start_positions: expected dtype int32", good, good, good,
                [](BuildDescs& d) { d.in[4].desc.type = DataType::kINT64; });
  configureWith("pool in a non-linear format", "past_key_value: expected the linear format", good, good, good,
                [](BuildDescs& d) { d.in[kPool].desc.format = TensorFormat::kHWC8; });
  configureWith("k_delta of rank 3", "k_delta: expected rank 4", good, good, good, [](BuildDescs& d) {
    d.in[0].desc.dims.nbDims = 3;
    d.in[0].min.nbDims = d.in[0].opt.nbDims = d.in[0].max.nbDims = 3;
  });
  configureWith("lengths [B+1]", "delta_lengths: expected [B]", good, good, good, [](BuildDescs& d) {
    d.in[5].desc.dims.d[0] += 1;
    d.in[5].min.d[0] += 1;
    d.in[5].opt.d[0] += 1;
    d.in[5].max.d[0] += 1;
  });
  configureWith("output shape unlike the pool's", "the output aliases it", good, good, good, [](BuildDescs& d) {
    d.out[0].desc.dims.d[1] += 1;
    d.out[0].max.d[1] += 1;
  });

  // onShapeChange and enqueue on a deserialized, attached plugin.
  Fields f;
  f.addInt32("pages_per_slot", int32_t(good.pagesPerSlot));
  PluginFieldCollection const fc = f.collection();
  PluginPtr deserialized(creator->createPlugin("p", &fc, TensorRTPhase::kRUNTIME));
  PluginPtr attached(runtime(deserialized.get())->attachToContext(context));
  IPluginV3OneRuntime* rt = runtime(attached.get());
  expectFailure("attachToContext(nullptr)", "resource context is null",
                [&] { return PluginPtr(runtime(deserialized.get())->attachToContext(nullptr)); },
                [](PluginPtr const& p) { return p == nullptr; });

  auto enqueueWith = [&](std::string const& what, std::string const& expected, Case const& c,
                         std::function<void(RuntimeDescs&)> change = {}) {
    RuntimeDescs d = runtimeDescs(c);
    if (change) change(d);
    expectStatusFailure("onShapeChange: " + what, expected,
                        [&] { return rt->onShapeChange(d.in.data(), 6, d.out.data(), 1); });
    expectStatusFailure("enqueue: " + what, expected, [&] {
      return rt->enqueue(d.in.data(), d.out.data(), hostInputs.data(), hostOutputs, nullptr, nullptr);
    });
  };
  enqueueWith("B > slots", "batch B must be <=", slotsExceeded);
  enqueueWith("S > cap", "length S must be <= slot capacity", capExceeded);
  enqueueWith("R odd", "rotary dim R must be even", oddRotary);
  enqueueWith("R > D", "rotary dim R must be even and <= head dim", wideRotary);
  enqueueWith("rope batch not 1 or B", "rope_cos_sin batch must be 1 or B", ropeBatch);
  enqueueWith("numPages % pages_per_slot != 0", "divisible by pages_per_slot", indivisible);
  enqueueWith("page size 64", "tokens per page", good, [](RuntimeDescs& d) { d.in[kPool].dims.d[2] = 64; d.out[0].dims.d[2] = 64; });
  enqueueWith("pool of rank 6", "past_key_value: expected rank 5", good, [](RuntimeDescs& d) {
    d.in[kPool].dims.nbDims = 6;
    d.in[kPool].dims.d[5] = 1;
  });
  enqueueWith("k_delta int32", "k_delta: expected dtype float16, bfloat16 or float32", good,
              [](RuntimeDescs& d) { d.in[0].type = DataType::kINT32; });
  enqueueWith("output dtype unlike the pool's", "present_key_value: expected k_delta's dtype", good,
              [&](RuntimeDescs& d) { d.out[0].type = good.type == DataType::kFLOAT ? DataType::kHALF : DataType::kFLOAT; });
  enqueueWith("rope format kCHW32", "rope_cos_sin: expected the linear format", good,
              [](RuntimeDescs& d) { d.in[3].format = TensorFormat::kCHW32; });
  enqueueWith("negative dimension", "expected non-negative dimensions", good, [](RuntimeDescs& d) { d.in[0].dims.d[1] = -5; d.in[1].dims.d[1] = -5; });
  {
    RuntimeDescs d = runtimeDescs(good);
    expectStatusFailure("enqueue: null input descriptors", "input descriptors are null", [&] {
      return rt->enqueue(nullptr, d.out.data(), hostInputs.data(), hostOutputs, nullptr, nullptr);
    });
    expectStatusFailure("enqueue: null output descriptors", "output descriptors are null", [&] {
      return rt->enqueue(d.in.data(), nullptr, hostInputs.data(), hostOutputs, nullptr, nullptr);
    });
    expectStatusFailure("enqueue: null pointer arrays", "pointer arrays must not be null", [&] {
      return rt->enqueue(d.in.data(), d.out.data(), nullptr, hostOutputs, nullptr, nullptr);
    });
    expectStatusFailure("onShapeChange: 0 outputs", "expected 6 inputs and 1 output",
                        [&] { return rt->onShapeChange(d.in.data(), 6, d.out.data(), 0); });
    for (int32_t pos = 0; pos < kTensors; ++pos) {
      auto inputs = hostInputs;
      void* outputs[1] = {dummy.data()};
      if (pos < 6) inputs[pos] = nullptr; else outputs[0] = nullptr;
      std::string const name = pos < 6 ? std::array<char const*, 6>{"k_delta", "v_delta", "past_key_value",
                                                                     "rope_cos_sin", "delta_start_positions",
                                                                     "delta_lengths"}[pos]
                                       : "present_key_value";
      expectStatusFailure("enqueue: null " + name + " pointer", name + ": the device pointer is null", [&] {
        return rt->enqueue(d.in.data(), d.out.data(), inputs.data(), outputs, nullptr, nullptr);
      });
    }
    recorder->clear();
    rt->enqueue(d.in.data(), d.out.data(), nullptr, hostOutputs, nullptr, nullptr);
    check(recorder->getNbErrors() == 1 && recorder->getErrorCode(0) == ErrorCode::kINVALID_ARGUMENT &&
              std::string(recorder->getErrorDesc(0)).find("enqueue") != std::string::npos,
          "an attached plugin reports errors to the context's IErrorRecorder");
  }
  check(rt->getFieldsToSerialize()->nbFields == 1, "the attached plugin still serializes pages_per_slot" + gTag);
  gTag.clear();
}

// ---- registration -------------------------------------------------------------------------------

void registration() {
  TestPluginRegistry registry;
  gLogger.clear();
  check(initDFlashPluginWithRegistry(static_cast<IPluginRegistry*>(&registry), nullptr, "dflash_ns"), "initDFlashPluginWithRegistry(namespace)",
        gLogger.all());
  auto* creator = static_cast<IPluginCreatorV3One*>(registry.getCreator(dtrt::kPLUGIN_NAME, "1", "dflash_ns"));
  check(creator != nullptr && !std::strcmp(creator->getPluginNamespace(), "dflash_ns"),
        "the registered creator is found under its namespace (as the ONNX parser looks it up)");
  if (creator != nullptr) {
    Fields f;
    f.addInt32("pages_per_slot", 4);
    PluginFieldCollection const fc = f.collection();
    PluginPtr p(creator->createPlugin("n", &fc, TensorRTPhase::kBUILD));
    check(p && !std::strcmp(core(p.get())->getPluginNamespace(), "dflash_ns"), "its plugins carry the namespace");
  }
  expectFailure("initDFlashPluginWithRegistry twice in one namespace", "already registered",
                [&] { return initDFlashPluginWithRegistry(static_cast<IPluginRegistry*>(&registry), nullptr, "dflash_ns"); }, [](bool ok) { return !ok; });
  expectFailure("initDFlashPluginWithRegistry(nullptr registry)", "registry is null",
                [&] { return initDFlashPluginWithRegistry(nullptr, nullptr, ""); }, [](bool ok) { return !ok; });
  check(initDFlashPluginWithRegistry(static_cast<IPluginRegistry*>(&registry), nullptr, nullptr), "initDFlashPluginWithRegistry(default namespace)");
  // No TensorRT library in this process: the dlsym lookup must fail cleanly.
  expectFailure("initDFlashPlugin without TensorRT loaded", "getPluginRegistry was not found",
                [&] { return initDFlashPlugin(nullptr, "x"); }, [](bool ok) { return !ok; });
  // An explicit logger takes over from the finder; nullptr hands back to the finder.
  RecordingLogger other;
  setDFlashPluginLogger(static_cast<ILogger*>(&other));
  initDFlashPluginWithRegistry(nullptr, nullptr, "");
  check(other.sawError("registry is null"), "setDFlashPluginLogger redirects the plugin's messages");
  setDFlashPluginLogger(nullptr);
}

// ---- GPU: enqueue on device buffers, dumps for the JAX parity test -----------------------------

uint64_t gRandomState = 0;
uint64_t nextRandom() {  // splitmix64
  uint64_t z = (gRandomState += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
float uniform(float lo, float hi) { return lo + (hi - lo) * float(nextRandom() >> 40) / float(1ull << 24); }

std::vector<char> randomValues(int64_t count, DataType type, float lo, float hi) {
  std::vector<char> bytes(size_t(count * elementBytes(type)));
  for (int64_t i = 0; i < count; ++i) {
    float const x = uniform(lo, hi);
    if (type == DataType::kFLOAT) {
      std::memcpy(bytes.data() + 4 * i, &x, 4);
    } else if (type == DataType::kHALF) {
      __half_raw const raw = __half(__float2half_rn(x));
      std::memcpy(bytes.data() + 2 * i, &raw.x, 2);
    } else {
      __nv_bfloat16_raw const raw = __nv_bfloat16(__float2bfloat16_rn(x));
      std::memcpy(bytes.data() + 2 * i, &raw.x, 2);
    }
  }
  return bytes;
}

bool writeNpy(std::string const& path, char const* descr, Dims const& dims, void const* data, size_t bytes) {
  std::string shape = "(";
  for (int32_t i = 0; i < dims.nbDims; ++i) shape += std::to_string(dims.d[i]) + (dims.nbDims == 1 ? ",)" : i + 1 < dims.nbDims ? ", " : ")");
  if (dims.nbDims == 0) shape += ")";
  std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
  size_t const total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) return false;
  unsigned char const preamble[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  uint16_t const length = uint16_t(header.size());
  bool ok = std::fwrite(preamble, 1, 8, file) == 8 && std::fwrite(&length, 2, 1, file) == 1 &&
            std::fwrite(header.data(), 1, header.size(), file) == header.size() &&
            std::fwrite(data, 1, bytes, file) == bytes;
  return std::fclose(file) == 0 && ok;
}

char const* npyDescr(DataType type) {
  switch (type) {
    case DataType::kHALF: return "<f2";
    case DataType::kBF16: return "<u2";  // numpy has no bfloat16: the test views it as ml_dtypes.bfloat16
    case DataType::kINT32: return "<i4";
    default: return "<f4";
  }
}

#define CUDA_OK(call, what) check((call) == cudaSuccess, what, cudaGetErrorString(cudaGetLastError()))

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(size_t bytes) {
    if (cudaMalloc(&ptr, bytes ? bytes : 1) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(DeviceBuffer const&) = delete;
  DeviceBuffer& operator=(DeviceBuffer const&) = delete;
};

// Starts and lengths with every guard in play: ordinary, crossing the slot's end, negative,
// near INT32_MAX and INT32_MIN, lengths beyond L, zero and negative.
void hostilePositions(Case const& c, std::vector<int32_t>& starts, std::vector<int32_t>& lengths) {
  int64_t const cap = c.pagesPerSlot * kP;
  for (int64_t b = 0; b < c.B; ++b) {
    int32_t start = 0, length = int32_t(c.L);
    switch (b % 7) {
      case 0: start = int32_t(nextRandom() % uint64_t(std::max<int64_t>(1, cap - c.L + 1))); break;
      case 1: start = int32_t(cap - c.L / 2 - 1); break;  // crosses the slot's end: the tail is dropped
      case 2: start = -3; length = int32_t(c.L + 5); break;
      case 3: start = std::numeric_limits<int32_t>::max() - 2; break;
      case 4: start = int32_t(nextRandom() % uint64_t(cap)); length = int32_t(c.L / 2); break;
      case 5: start = std::numeric_limits<int32_t>::min(); length = -1; break;
      case 6: start = 0; length = 0; break;
    }
    starts.push_back(start);
    lengths.push_back(length);
  }
  if (c.B > 0 && c.B <= 2) {  // small batches: keep one ordinary sequence
    starts[0] = int32_t(std::max<int64_t>(0, cap - c.L) / 2);
    lengths[0] = int32_t(c.L);
  }
}

void gpuCase(Case const& c, std::string const& dumpDir, TestResourceContext* context) {
  std::string const tag = " [" + c.name + "]";
  Contract contract = playContract(c, c, c, context);
  if (contract.rt == nullptr) return;
  gRandomState = std::hash<std::string>{}(c.name);

  RuntimeDescs d = runtimeDescs(c);
  auto const dims = tensorDims(c);
  std::vector<std::vector<char>> host(6);
  host[0] = randomValues(volume(dims[0]), c.type, -2.f, 2.f);
  host[1] = randomValues(volume(dims[1]), c.type, -2.f, 2.f);
  host[2] = randomValues(volume(dims[2]), c.type, -4.f, 4.f);
  host[3] = randomValues(volume(dims[3]), DataType::kFLOAT, -1.f, 1.f);
  std::vector<int32_t> starts, lengths;
  hostilePositions(c, starts, lengths);
  host[4].assign(reinterpret_cast<char*>(starts.data()), reinterpret_cast<char*>(starts.data() + starts.size()));
  host[5].assign(reinterpret_cast<char*>(lengths.data()), reinterpret_cast<char*>(lengths.data() + lengths.size()));

  // The pool sits between two guard bands; nothing may be written there.
  constexpr size_t kGuard = 4096;
  size_t const poolBytes = host[2].size();
  std::vector<std::unique_ptr<DeviceBuffer>> device;
  for (int32_t i = 0; i < 6; ++i) device.push_back(std::make_unique<DeviceBuffer>(i == 2 ? poolBytes + 2 * kGuard : host[i].size()));
  DeviceBuffer separateOutput(poolBytes);
  for (auto const& buffer : device)
    if (buffer->ptr == nullptr) return void(check(false, "cudaMalloc" + tag));
  char* pool = static_cast<char*>(device[2]->ptr) + kGuard;
  std::vector<char> guardPattern(poolBytes + 2 * kGuard, char(0xA5));
  CUDA_OK(cudaMemcpy(device[2]->ptr, guardPattern.data(), guardPattern.size(), cudaMemcpyHostToDevice), "guard bands" + tag);
  for (int32_t i = 0; i < 6; ++i) {
    void* target = i == 2 ? pool : device[i]->ptr;
    CUDA_OK(cudaMemcpy(target, host[i].data(), host[i].size(), cudaMemcpyHostToDevice), "upload input " + std::to_string(i) + tag);
  }
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreate(&stream), "cudaStreamCreate" + tag);

  // Not aliased first (the output starts as a copy of the pool), then aliased (in place).
  std::array<void const*, 6> inputs{};
  for (int32_t i = 0; i < 6; ++i) inputs[i] = i == 2 ? pool : device[i]->ptr;
  void* separate[1] = {separateOutput.ptr};
  gLogger.clear();
  check(contract.rt->enqueue(d.in.data(), d.out.data(), inputs.data(), separate, nullptr, stream) == 0,
        "enqueue into a separate output" + tag, gLogger.all());
  void* aliased[1] = {pool};
  check(contract.rt->enqueue(d.in.data(), d.out.data(), inputs.data(), aliased, nullptr, stream) == 0,
        "enqueue in place (output aliases the pool)" + tag, gLogger.all());
  CUDA_OK(cudaStreamSynchronize(stream), "cudaStreamSynchronize" + tag);

  std::vector<char> withGuards(poolBytes + 2 * kGuard), unaliased(poolBytes);
  CUDA_OK(cudaMemcpy(withGuards.data(), device[2]->ptr, withGuards.size(), cudaMemcpyDeviceToHost), "download pool" + tag);
  CUDA_OK(cudaMemcpy(unaliased.data(), separateOutput.ptr, poolBytes, cudaMemcpyDeviceToHost), "download output" + tag);
  bool guardsIntact = std::memcmp(withGuards.data(), guardPattern.data(), kGuard) == 0 &&
                      std::memcmp(withGuards.data() + kGuard + poolBytes, guardPattern.data(), kGuard) == 0;
  check(guardsIntact, "no write outside the pool" + tag);
  check(std::memcmp(withGuards.data() + kGuard, unaliased.data(), poolBytes) == 0,
        "aliased and separate outputs are identical" + tag);
  bool const changed = std::memcmp(withGuards.data() + kGuard, host[2].data(), poolBytes) != 0;
  check(changed || c.B == 0, "the pool was updated" + tag);

  // A rejected enqueue on real buffers leaves the pool untouched.
  std::vector<char> before(withGuards);
  RuntimeDescs tooMany = d;
  int64_t const slots = c.numPages / c.pagesPerSlot;
  for (int32_t pos : {0, 1}) tooMany.in[pos].dims.d[0] = slots + 1;
  tooMany.in[4].dims.d[0] = tooMany.in[5].dims.d[0] = slots + 1;
  gLogger.clear();
  bool const rejected = contract.rt->enqueue(tooMany.in.data(), tooMany.out.data(), inputs.data(), aliased, nullptr, stream) != 0;
  cudaStreamSynchronize(stream);
  CUDA_OK(cudaMemcpy(withGuards.data(), device[2]->ptr, withGuards.size(), cudaMemcpyDeviceToHost), "download pool" + tag);
  check(rejected && gLogger.sawError("batch B must be <=") && withGuards == before,
        "a rejected enqueue (B > slots) on device buffers leaves the pool as it was" + tag);
  cudaStreamDestroy(stream);

  if (dumpDir.empty()) return;
  std::string const dir = dumpDir + "/" + c.name;
  mkdir(dir.c_str(), 0755);
  bool ok = true;
  for (int32_t i = 0; i < 6; ++i) {
    DataType const type = d.in[i].type;
    char const* names[6] = {"k_delta", "v_delta", "past_key_value", "rope_cos_sin", "delta_start_positions", "delta_lengths"};
    ok = ok && writeNpy(dir + "/" + names[i] + ".npy", npyDescr(type), dims[i], host[i].data(), host[i].size());
  }
  ok = ok && writeNpy(dir + "/present_key_value.npy", npyDescr(c.type), dims[kOut], withGuards.data() + kGuard, poolBytes);
  FILE* meta = std::fopen((dir + "/meta.json").c_str(), "w");
  ok = ok && meta != nullptr;
  if (meta) {
    std::fprintf(meta, "{\"name\": \"%s\", \"dtype\": \"%s\", \"pages_per_slot\": %lld}\n", c.name.c_str(),
                 dtypeName(c.type), static_cast<long long>(c.pagesPerSlot));
    std::fclose(meta);
  }
  check(ok, "dumped inputs and output to " + dir);
}

std::vector<Case> gpuCases() {
  std::vector<Case> cases;
  struct Shape {
    char const* name;
    int64_t B, L, H, D, numPages, pagesPerSlot, Rb, S, R;
  };
  // Decode-like; partial rotary with per-sequence tables and S < cap; odd sizes (vector width 1);
  // a long delta crossing pages; no RoPE at all.
  Shape const shapes[] = {
      {"decode", 4, 16, 8, 128, 8, 2, 1, 256, 128},
      {"partial_rotary", 3, 40, 2, 64, 4, 1, 3, 100, 32},
      {"odd_sizes", 7, 9, 3, 6, 14, 2, 1, 200, 2},
      {"long_delta", 2, 300, 1, 32, 9, 3, 2, 384, 16},
      {"no_rope", 2, 5, 2, 16, 2, 1, 1, 0, 0},
  };
  for (DataType type : {DataType::kHALF, DataType::kBF16, DataType::kFLOAT})
    for (Shape const& s : shapes)
      cases.push_back({std::string(s.name) + "_" + dtypeName(type), type, s.B, s.L, s.H, s.D, s.numPages,
                       s.pagesPerSlot, s.Rb, s.S, s.R});
  return cases;
}

}  // namespace

int main(int argc, char** argv) {
  bool gpu = false;
  std::string dumpDir;
  for (int i = 1; i < argc; ++i) {
    std::string const arg = argv[i];
    if (arg == "--gpu") {
      gpu = true;
    } else if (arg == "--dump" && i + 1 < argc) {
      dumpDir = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--gpu [--dump DIR]]\n", argv[0]);
      return 2;
    }
  }
  setLoggerFinder(&gLoggerFinder);  // as TensorRT does when it loads the library

  RecordingErrorRecorder recorder;
  TestResourceContext context(&recorder);
  for (DataType type : {DataType::kHALF, DataType::kBF16, DataType::kFLOAT}) {
    Case opt{std::string("contract_") + dtypeName(type), type, 4, 16, 8, 128, 12, 2, 1, 200, 64};
    Case min = opt, max = opt;
    min.B = 1;
    min.L = 1;
    min.S = 1;
    max.B = 6;
    max.L = 256;
    max.S = 256;
    Contract contract = playContract(opt, min, max, &context);
    if (contract.rt != nullptr) {
      // On CPU the kernel cannot run; an empty batch exercises enqueue end to end without it.
      Case empty = opt;
      empty.B = 0;
      RuntimeDescs d = runtimeDescs(empty);
      std::array<char, 16> pool{};
      std::array<void const*, 6> inputs = {nullptr, nullptr, pool.data(), nullptr, nullptr, nullptr};
      float rope[1] = {0.f};
      inputs[3] = rope;
      void* outputs[1] = {pool.data()};
      gLogger.clear();
      check(contract.rt->enqueue(d.in.data(), d.out.data(), inputs.data(), outputs, nullptr, nullptr) == 0,
            "enqueue with an empty batch (no launch) [" + opt.name + "]", gLogger.all());
    }
  }
  badInputs(Case{"bad", DataType::kHALF, 2, 8, 2, 64, 4, 2, 1, 128, 64}, &context, &recorder);
  badInputs(Case{"bad_fp32", DataType::kFLOAT, 3, 4, 1, 32, 9, 3, 3, 64, 32}, &context, &recorder);
  registration();

  if (gpu) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      check(false, "--gpu: a CUDA device is present");
    } else {
      if (!dumpDir.empty()) mkdir(dumpDir.c_str(), 0755);
      for (Case const& c : gpuCases()) gpuCase(c, dumpDir, &context);
    }
  }
  std::printf("SUMMARY passed=%d failed=%d mode=%s\n", gPassed, gFailed, gpu ? "gpu" : "cpu");
  return gFailed == 0 ? 0 : 1;
}
