// Test doubles for what TensorRT provides a plugin: a recording ILogger (reached through
// setLoggerFinder, as TensorRT does), an IExprBuilder with symbols, an IPluginResourceContext with
// a recording IErrorRecorder, and the part of an IPluginRegistry that registration uses.
#pragma once

#include <NvInferRuntime.h>

#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace harness {

using namespace nvinfer1;

class RecordingLogger : public ILogger {
 public:
  void log(Severity severity, char const* msg) noexcept override {
    messages.emplace_back(severity, msg == nullptr ? "" : msg);
  }
  // Whether an error-or-worse message logged since the last clear() contains `text`.
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
    for (auto const& entry : messages)
      text += "[" + std::to_string(int(entry.first)) + "] " + entry.second + " | ";
    return text.empty() ? "(nothing logged)" : text;
  }
  // The error-or-worse messages since the last clear(), joined by " | ".
  std::string errors() const {
    std::string text;
    for (auto const& entry : messages)
      if (entry.first <= Severity::kERROR) text += (text.empty() ? "" : " | ") + entry.second;
    return text;
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
  IDimensionExpr const* operation(DimensionOperation op, IDimensionExpr const& a,
                                  IDimensionExpr const& b) override {
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
      case DimensionOperation::kFLOOR_DIV:
        return y == 0 ? nullptr : constant(x / y - ((x % y != 0) && ((x < 0) != (y < 0))));
      case DimensionOperation::kCEIL_DIV:
        return y == 0 ? nullptr : constant(x / y + ((x % y != 0) && ((x < 0) == (y < 0))));
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
  IPluginCreator* const* getPluginCreatorList(int32_t* const n) const noexcept override {
    *n = 0;
    return nullptr;
  }
  IPluginCreator* getPluginCreator(AsciiChar const* const, AsciiChar const* const,
                                   AsciiChar const* const) noexcept override {
    return nullptr;
  }
  void setErrorRecorder(IErrorRecorder* const) noexcept override {}
  IErrorRecorder* getErrorRecorder() const noexcept override { return nullptr; }
  bool deregisterCreator(IPluginCreator const&) noexcept override { return false; }
  bool isParentSearchEnabled() const override { return false; }
  void setParentSearchEnabled(bool const) override {}
  PluginLibraryHandle loadLibrary(AsciiChar const*) noexcept override { return nullptr; }
  void deregisterLibrary(PluginLibraryHandle) noexcept override {}
  IPluginResource* acquirePluginResource(AsciiChar const*, IPluginResource*) noexcept override {
    return nullptr;
  }
  int32_t releasePluginResource(AsciiChar const*) noexcept override { return 0; }
  IPluginCreatorInterface* const* getAllCreatorsRecursive(int32_t* const n) noexcept override {
    return getAllCreators(n);
  }

 private:
  std::vector<IPluginCreatorInterface*> mCreators;
};

// The logger the plugin library's finder hands out (installed by main()).
RecordingLogger& logger();
TestLoggerFinder& loggerFinder();

}  // namespace harness
