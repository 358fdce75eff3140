// The shared library's entry points: the creator list TensorRT's IPluginRegistry::loadLibrary and
// `trtexec --dynamicPlugins` read (getCreators, setLoggerFinder), an init function that registers
// the creator under a chosen namespace, and the plugin's logger. No TensorRT function is called
// directly, so the library links no TensorRT library: the registry is either handed in or looked
// up in the process (dlsym) where TensorRT is already loaded.
#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <string>

#include "DFlashTargetKVCacheUpdatePlugin.h"

namespace dflash::trt {
namespace {

std::atomic<nvinfer1::ILogger*> gLogger{nullptr};
std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder{nullptr};

// The creator handed to loadLibrary (default namespace "").
DFlashTargetKVCacheUpdatePluginCreator& libraryCreator() {
  static DFlashTargetKVCacheUpdatePluginCreator creator;
  return creator;
}

// Creators registered by initDFlashPlugin*, one per namespace; they live as long as the library.
std::mutex gRegisteredMutex;
std::deque<std::unique_ptr<DFlashTargetKVCacheUpdatePluginCreator>>& registeredCreators() {
  static std::deque<std::unique_ptr<DFlashTargetKVCacheUpdatePluginCreator>> creators;
  return creators;
}

char const* severityName(nvinfer1::ILogger::Severity severity) {
  switch (severity) {
    case nvinfer1::ILogger::Severity::kINTERNAL_ERROR: return "INTERNAL_ERROR";
    case nvinfer1::ILogger::Severity::kERROR: return "ERROR";
    case nvinfer1::ILogger::Severity::kWARNING: return "WARNING";
    case nvinfer1::ILogger::Severity::kINFO: return "INFO";
    case nvinfer1::ILogger::Severity::kVERBOSE: return "VERBOSE";
  }
  return "LOG";
}

using GetPluginRegistryFn = nvinfer1::IPluginRegistry* (*)();
using GetInferLibVersionFn = int32_t (*)();

// TensorRT's getPluginRegistry() and getInferLibVersion() from one library already loaded in the
// process; null members when there is none.
struct LoadedTensorRT {
  GetPluginRegistryFn getPluginRegistry = nullptr;
  GetInferLibVersionFn getInferLibVersion = nullptr;
};

LoadedTensorRT findLoadedTensorRT() {
  LoadedTensorRT found;
  if (void* symbol = dlsym(RTLD_DEFAULT, "getPluginRegistry")) {
    found.getPluginRegistry = reinterpret_cast<GetPluginRegistryFn>(symbol);
    found.getInferLibVersion =
        reinterpret_cast<GetInferLibVersionFn>(dlsym(RTLD_DEFAULT, "getInferLibVersion"));
    return found;
  }
  // Libraries loaded with RTLD_LOCAL (Python's bindings) are reachable by name without loading anything new.
  for (char const* soname :
       {"libnvinfer.so.10", "libnvinfer_lean.so.10", "libnvinfer_dispatch.so.10", "libnvinfer.so.11",
        "libnvinfer_lean.so.11", "libnvinfer_dispatch.so.11", "libnvinfer.so", "libnvinfer_lean.so"}) {
    if (void* handle = dlopen(soname, RTLD_LAZY | RTLD_NOLOAD)) {
      found.getPluginRegistry = reinterpret_cast<GetPluginRegistryFn>(dlsym(handle, "getPluginRegistry"));
      found.getInferLibVersion = reinterpret_cast<GetInferLibVersionFn>(dlsym(handle, "getInferLibVersion"));
      dlclose(handle);  // balances the NOLOAD reference; the library stays loaded
      if (found.getPluginRegistry != nullptr) return found;
    }
  }
  return {};
}

}  // namespace

void setPluginLogger(nvinfer1::ILogger* logger) noexcept { gLogger.store(logger); }
void setPluginLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept { gLoggerFinder.store(finder); }

void logMessage(nvinfer1::ILogger::Severity severity, std::string const& message) noexcept {
  try {
    nvinfer1::ILogger* logger = gLogger.load();
    if (logger == nullptr) {
      if (nvinfer1::ILoggerFinder* finder = gLoggerFinder.load()) logger = finder->findLogger();
    }
    if (logger != nullptr) {
      logger->log(severity, message.c_str());
    } else if (severity <= nvinfer1::ILogger::Severity::kWARNING) {
      std::fprintf(stderr, "[dflash_trt_plugin] %s: %s\n", severityName(severity), message.c_str());
    }
  } catch (...) {}
}

}  // namespace dflash::trt

using dflash::trt::DFlashTargetKVCacheUpdatePluginCreator;
using dflash::trt::logMessage;
using Severity = nvinfer1::ILogger::Severity;

extern "C" {

void setLoggerFinder(nvinfer1::ILoggerFinder* finder) { dflash::trt::setPluginLoggerFinder(finder); }

nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  static nvinfer1::IPluginCreatorInterface* const creators[] = {&dflash::trt::libraryCreator()};
  nbCreators = static_cast<int32_t>(sizeof(creators) / sizeof(creators[0]));
  return creators;
}

void setDFlashPluginLogger(void* logger) {
  dflash::trt::setPluginLogger(static_cast<nvinfer1::ILogger*>(logger));
}

bool initDFlashPluginWithRegistry(void* registry, void* logger, char const* pluginNamespace) {
  try {
    if (logger != nullptr) dflash::trt::setPluginLogger(static_cast<nvinfer1::ILogger*>(logger));
    std::string const ns = pluginNamespace == nullptr ? "" : pluginNamespace;
    if (registry == nullptr) {
      logMessage(Severity::kERROR, "initDFlashPluginWithRegistry: the plugin registry is null");
      return false;
    }
    auto creator = std::make_unique<DFlashTargetKVCacheUpdatePluginCreator>();
    creator->setPluginNamespace(ns.c_str());
    auto* trtRegistry = static_cast<nvinfer1::IPluginRegistry*>(registry);
    std::lock_guard<std::mutex> lock(dflash::trt::gRegisteredMutex);
    if (!trtRegistry->registerCreator(*creator, ns.c_str())) {
      logMessage(Severity::kERROR, std::string("initDFlashPluginWithRegistry: the registry refused ") +
                                       dflash::trt::kPLUGIN_NAME + " version " +
                                       dflash::trt::kPLUGIN_VERSION + " in namespace '" + ns +
                                       "' (already registered?)");
      return false;
    }
    dflash::trt::registeredCreators().push_back(std::move(creator));
    logMessage(Severity::kINFO, std::string("registered ") + dflash::trt::kPLUGIN_NAME + " version " +
                                    dflash::trt::kPLUGIN_VERSION + " in namespace '" + ns + "'");
    return true;
  } catch (std::exception const& e) {
    logMessage(Severity::kERROR, std::string("initDFlashPluginWithRegistry: ") + e.what());
  } catch (...) { logMessage(Severity::kERROR, "initDFlashPluginWithRegistry: unknown exception"); }
  return false;
}

bool initDFlashPlugin(void* logger, char const* pluginNamespace) {
  try {
    if (logger != nullptr) dflash::trt::setPluginLogger(static_cast<nvinfer1::ILogger*>(logger));
    dflash::trt::LoadedTensorRT const loaded = dflash::trt::findLoadedTensorRT();
    if (loaded.getPluginRegistry == nullptr) {
      logMessage(
          Severity::kERROR,
          "initDFlashPlugin: getPluginRegistry was not found: load libnvinfer (or libnvinfer_lean) first, or "
          "call initDFlashPluginWithRegistry with the registry");
      return false;
    }
    // The registry is called through the vtable of the headers this library was built with;
    // another TensorRT major version lays IPluginRegistry out differently (11 dropped the
    // IPluginV2 methods), so only the loadLibrary path (getCreators) is safe across majors.
    int32_t const loadedVersion = loaded.getInferLibVersion ? loaded.getInferLibVersion() : 0;
    if (loadedVersion / 10000 != NV_TENSORRT_MAJOR) {
      logMessage(
          Severity::kERROR,
          "initDFlashPlugin: the loaded TensorRT is version " + std::to_string(loadedVersion) +
              " but this library was built with TensorRT " + std::to_string(NV_TENSORRT_MAJOR) +
              " headers, whose IPluginRegistry differs: load the library with IPluginRegistry::loadLibrary "
              "(trtexec --dynamicPlugins) instead, or rebuild it against that TensorRT (TENSORRT_ROOT)");
      return false;
    }
    return initDFlashPluginWithRegistry(loaded.getPluginRegistry(), nullptr, pluginNamespace);
  } catch (...) { logMessage(Severity::kERROR, "initDFlashPlugin: unknown exception"); }
  return false;
}

int32_t getDFlashPluginTensorRTVersion() { return NV_TENSORRT_VERSION; }

}  // extern "C"
