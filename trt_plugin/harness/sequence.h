// The calls a TensorRT builder, then a runtime, make on the plugin, in their order.
#pragma once

#include "tensors.h"

namespace harness {

struct Played {
  PluginPtr runtimePlugin;  // deserialized (kRUNTIME) and attached to a context
  IPluginV3OneRuntime* rt = nullptr;
};

// Builder: field names, createPlugin(kBUILD) with the node's fields, capabilities, output types
// and shapes (dims that differ between min and max are symbolic), supportsFormatCombination at
// every position (and every other dtype refused there), configurePlugin with min/opt/max,
// workspace, aliasing, clone and serialization. Runtime: createPlugin(kRUNTIME) from the
// serialized fields, attachToContext, onShapeChange. Returns the attached runtime plugin.
Played playContract(Case const& min, Case const& opt, Case const& max, IPluginResourceContext* context);

// What the serialized fields must say for the case; "" when they do.
std::string fieldsMismatch(PluginFieldCollection const* fc, Case const& c);

// On CPU the kernel cannot run; an empty call (no token) goes through enqueue end to end.
void enqueueEmpty(IPluginV3OneRuntime* rt, Case c);

// initDFlashPluginWithRegistry / initDFlashPlugin / setDFlashPluginLogger.
void registration();

}  // namespace harness
