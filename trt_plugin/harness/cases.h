// The harness's parts, one per concern; main() runs them in this order.
#pragma once

#include <string>

#include "tensors.h"

namespace harness {

// Group names every run writes into its report (the test asserts them, by these names only).
inline constexpr char const* kSlotContractGroup = "slot_contract";
inline constexpr char const* kPagedContractGroup = "paged_contract";
inline constexpr char const* kSlotMappingContractGroup = "slot_mapping_contract";
inline constexpr char const* kQuantizedContractGroup = "quantized_contract";
inline constexpr char const* kQuantizedBadGroup = "quantized_bad_inputs";
inline constexpr char const* kFieldsGroup = "fields";
inline constexpr char const* kSlotBadGroup = "slot_bad_inputs";
inline constexpr char const* kPagedBadGroup = "paged_bad_inputs";
inline constexpr char const* kOverflowGroup = "overflow";
inline constexpr char const* kRegistrationGroup = "registration";
inline constexpr char const* kGpuSlotGroup = "gpu_slot";
inline constexpr char const* kGpuPagedGroup = "gpu_paged";
inline constexpr char const* kGpuSlotMappingGroup = "gpu_slot_mapping";
inline constexpr char const* kShapeCasesGroup = "shape_cases";

// The builder's and runtime's sequence for each addressing form's dtypes, FP8 pools and norms.
void slotContractCases(IPluginResourceContext* context);
void pagedContractCases(IPluginResourceContext* context);
void slotMappingContractCases(IPluginResourceContext* context);
// kINT8 pools with static scales, kINT8 / kFP8 / int4 pools with a scale pool, every form.
void quantizedContractCases(IPluginResourceContext* context);

// Every bad-input path: fields, each contract's bad shapes/dtypes/counts, 2^62 dims.
void fieldCases();
void slotBadInputs(IPluginResourceContext* context, RecordingErrorRecorder* recorder);
void pagedBadInputs(IPluginResourceContext* context);
void overflowCases(IPluginResourceContext* context);
// The quantized formats' bad inputs: scale pool shapes, dtypes and counts, int4's packing.
void quantizedBadInputs(IPluginResourceContext* context);

// --gpu: enqueue on device buffers; inputs and pools dumped as .npy under dumpDir (may be "").
void gpuCases(std::string const& dumpDir, IPluginResourceContext* context);

// --check-shapes FILE: the plugin's verdict on each case of FILE (format in trt_plugin/README.md).
bool shapeCases(std::string const& path, IPluginResourceContext* context);

}  // namespace harness
