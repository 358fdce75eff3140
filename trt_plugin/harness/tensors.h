// A call's tensors as TensorRT describes them, for every addressing form, and access to the plugin.
//
// A Case names one problem (contract, dtypes, sizes, fields); its tensors are built in SPEC.md's
// input order: the base inputs, then k_scale and v_scale for a kFP8 or kINT8 pool (or scale_pool
// with per-token-head scales), then k_norm_weight.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "DFlashTargetKVCacheUpdatePlugin.h"
#include "dflash/kv_update.h"
#include "doubles.h"
#include "report.h"

namespace harness {

namespace dtrt = dflash::trt;
using dflash::Contract;

inline constexpr int64_t kP = dtrt::kTOKENS_PER_PAGE;

struct Case {
  std::string name;
  Contract contract{Contract::kSlot};
  DataType delta{DataType::kHALF};
  DataType pool{DataType::kHALF};
  int64_t B{0}, L{0}, T{0}, H{1}, D{1}, N{1}, P{kP};
  int64_t pagesPerSlot{0};  // slot
  int64_t Rb{1}, S{0};      // slot rope table [Rb, S, R]
  int64_t R{0};
  int64_t M{0};             // paged table [B, 2, M]
  DataType slotIndex{DataType::kINT64};  // slot_mapping [T]: int32 or int64
  int64_t scaleHeads{1};    // kFP8 and kINT8 pools with static scales: scales [1] or [H]
  bool ring{false}, kNorm{false}, vNorm{false};
  // Per-token-head scales (the field scale_pool = 1): input scale_pool [2, N, P, H] in place of
  // k_scale, v_scale, and the second output present_scale_pool.
  bool scalePool{false};
  float eps{1e-6f};
  // k_scale and v_scale follow the base inputs: a pool with static scales and no scale pool.
  bool staticScales() const { return !scalePool && (pool == DataType::kFP8 || pool == DataType::kINT8); }
  // An int4 pool: kUINT8 bytes [2, N, P, H, D / 2].
  bool int4() const { return pool == DataType::kUINT8; }
  int32_t nbOutputs() const { return scalePool ? 2 : 1; }
};

struct Tensor {
  std::string name;
  DataType type{DataType::kFLOAT};
  Dims dims{};
};

Dims makeDims(std::initializer_list<int64_t> values);
std::string dtypeName(DataType type);  // SPEC.md's names ("float16", ..., "float8_e4m3fn", "int32")
int64_t elementBytes(DataType type);
int64_t volume(Dims const& dims);  // only for dims known to be small

std::vector<Tensor> inputs(Case const& c);
Tensor output(Case const& c);  // the pool's shape and dtype
Tensor scaleOutput(Case const& c);  // present_scale_pool: the scale pool's shape and dtype
std::vector<Tensor> outputs(Case const& c);  // the pool's, then (scalePool) the scale pool's
std::string tag(Case const& c);  // " [name]"

// Positions of the extras in a case's inputs (-1 when absent).
int32_t kScaleIndex(Case const& c);
int32_t scalePoolIndex(Case const& c);
int32_t kNormWeightIndex(Case const& c);

// ---- descriptors ---------------------------------------------------------------------------------

struct RuntimeDescs {
  std::vector<PluginTensorDesc> in;
  std::vector<PluginTensorDesc> outs;
  int32_t nbInputs() const { return int32_t(in.size()); }
  int32_t nbOutputs() const { return int32_t(outs.size()); }
  PluginTensorDesc* out() { return outs.data(); }
};
// `extra` (may be empty): the outputs after the pool's (present_scale_pool).
RuntimeDescs runtimeDescs(std::vector<Tensor> const& in, Tensor const& out,
                          std::vector<Tensor> const& extra = {});
RuntimeDescs runtimeDescs(Case const& c);

struct BuildDescs {
  std::vector<DynamicPluginTensorDesc> in;
  std::vector<DynamicPluginTensorDesc> outs;
  int32_t nbInputs() const { return int32_t(in.size()); }
  int32_t nbOutputs() const { return int32_t(outs.size()); }
  DynamicPluginTensorDesc* out() { return outs.data(); }
};
// An optimization profile: desc.dims holds -1 wherever min and max differ (TensorRT's wildcards).
BuildDescs buildDescs(Case const& min, Case const& opt, Case const& max);
BuildDescs buildDescs(std::vector<Tensor> const& min, std::vector<Tensor> const& opt,
                      std::vector<Tensor> const& max, Tensor const& outMin, Tensor const& outOpt,
                      Tensor const& outMax, std::vector<Tensor> const& extra = {});
// Sets dims at min, opt, max and desc of one tensor (a fixed shape).
void setAllDims(DynamicPluginTensorDesc& d, Dims const& dims);

// ---- fields --------------------------------------------------------------------------------------

struct Fields {
  std::vector<PluginField> fields;
  std::deque<std::vector<char>> storage;  // deep copies, as an engine's serialized fields are
  PluginFieldCollection collection() const { return {int32_t(fields.size()), fields.data()}; }
  void add(char const* name, PluginFieldType type, void const* data, int32_t length, size_t bytes);
  void addInt32(char const* name, int32_t value) {
    add(name, PluginFieldType::kINT32, &value, 1, sizeof(value));
  }
  void addFloat32(char const* name, float value) {
    add(name, PluginFieldType::kFLOAT32, &value, 1, sizeof(value));
  }
};
// The fields an exporter writes for the case: pages_per_slot (slot), form (slot_mapping), and ring /
// k_norm / v_norm / norm_eps only where they differ from the defaults (so that Edge-LLM's nodes stay
// field-less).
Fields nodeFields(Case const& c);
Fields copyFields(PluginFieldCollection const* fc);

// ---- the plugin ----------------------------------------------------------------------------------

struct PluginDeleter {
  void operator()(IPluginV3* p) const { delete p; }
};
using PluginPtr = std::unique_ptr<IPluginV3, PluginDeleter>;

IPluginV3OneCore* core(IPluginV3* p);
IPluginV3OneBuildV2* build(IPluginV3* p);
IPluginV3OneRuntime* runtime(IPluginV3* p);
// The library's creator (getCreators), checked to be one IPluginCreatorV3One.
IPluginCreatorV3One* libraryCreator();

// ---- expecting failures ------------------------------------------------------------------------

// Runs `call`; checks that it failed (by `failed`) with an error logged that contains `expected`.
template <typename Call, typename Failed>
bool expectFailure(std::string const& what, std::string const& expected, Call call, Failed failed) {
  logger().clear();
  auto const result = call();
  bool const didFail = failed(result);
  bool const logged = logger().sawError(expected);
  return check(didFail && logged, "bad input rejected: " + what,
               std::string(didFail ? "" : "call did not fail; ") +
                   (logged ? "" : "expected a logged error with '" + expected + "'; ") +
                   "log: " + logger().all());
}
bool expectStatusFailure(std::string const& what, std::string const& expected, std::function<int32_t()> call);
bool expectNull(std::string const& what, std::string const& expected, std::function<IPluginV3*()> call);

}  // namespace harness
