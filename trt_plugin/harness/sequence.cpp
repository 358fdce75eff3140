// The builder's and the runtime's call sequence, registration.
#include "sequence.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

namespace harness {
namespace {

// The dtypes TensorRT may pick at `pos` with inOut[0..pos) as in the case (the plugin accepts
// exactly these): any delta dtype for k_delta; for the pool any 16/32-bit one, or kFP8 and kINT8
// when the count has static scales, or those and kUINT8 (int4) with a scale pool; the case's
// dtype everywhere else.
std::vector<DataType> acceptedTypes(Case const& c, int32_t pos, int32_t nbInputs) {
  if (pos == 0) return {DataType::kHALF, DataType::kBF16, DataType::kFLOAT};
  if (pos == dtrt::kPAST_KEY_VALUE) {
    if (c.scalePool) return {DataType::kFP8, DataType::kINT8, DataType::kUINT8};
    return c.staticScales() ? std::vector<DataType>{DataType::kFP8, DataType::kINT8}
                            : std::vector<DataType>{DataType::kHALF, DataType::kBF16, DataType::kFLOAT};
  }
  if (pos == nbInputs) return {c.pool};
  if (pos == nbInputs + 1) return {DataType::kFLOAT};  // present_scale_pool
  dflash::AddressingForm const& form = dflash::addressing_form(c.contract);
  if (pos < form.base_count && form.base[pos].role == dflash::OperandRole::kSlotIndex)
    return {DataType::kINT32, DataType::kINT64};
  return {inputs(c)[pos].type};
}

constexpr std::array<DataType, 9> kProbeTypes = {DataType::kFLOAT, DataType::kHALF, DataType::kBF16,
                                                 DataType::kINT32, DataType::kINT8, DataType::kINT64,
                                                 DataType::kBOOL,  DataType::kFP8,  DataType::kUINT8};

}  // namespace

std::string fieldsMismatch(PluginFieldCollection const* fc, Case const& c) {
  if (fc == nullptr) return "no fields";
  struct Expected {
    char const* name;
    bool present;
    PluginFieldType type;
    double value;
  };
  Expected const expected[] = {
      {dtrt::kPAGES_PER_SLOT_FIELD, c.contract == Contract::kSlot, PluginFieldType::kINT32,
       double(c.pagesPerSlot)},
      {dtrt::kRING_FIELD, true, PluginFieldType::kINT32, double(c.ring)},
      {dtrt::kK_NORM_FIELD, true, PluginFieldType::kINT32, double(c.kNorm)},
      {dtrt::kV_NORM_FIELD, true, PluginFieldType::kINT32, double(c.vNorm)},
      {dtrt::kNORM_EPS_FIELD, true, PluginFieldType::kFLOAT32, double(c.eps)},
      {dtrt::kSCALE_POOL_FIELD, true, PluginFieldType::kINT32, double(c.scalePool)},
  };
  std::string problems;
  int32_t present = 0;
  for (Expected const& e : expected) {
    PluginField const* found = nullptr;
    for (int32_t i = 0; i < fc->nbFields; ++i)
      if (fc->fields[i].name && !std::strcmp(fc->fields[i].name, e.name)) found = &fc->fields[i];
    present += e.present;
    if (!e.present) {
      if (found) problems += std::string(e.name) + " serialized for a paged plugin; ";
      continue;
    }
    if (!found || found->type != e.type || found->length != 1 || found->data == nullptr) {
      problems += std::string(e.name) + " missing or not one " +
                  (e.type == PluginFieldType::kINT32 ? "INT32" : "FLOAT32") + "; ";
      continue;
    }
    double const value = e.type == PluginFieldType::kINT32 ? double(*static_cast<int32_t const*>(found->data))
                                                           : double(*static_cast<float const*>(found->data));
    if (value != e.value)
      problems += std::string(e.name) + " = " + std::to_string(value) + ", expected " +
                  std::to_string(e.value) + "; ";
  }
  // The form field: serialized where the node gave it (the slot-mapping cases), with its name.
  PluginField const* form = nullptr;
  for (int32_t i = 0; i < fc->nbFields; ++i)
    if (fc->fields[i].name && !std::strcmp(fc->fields[i].name, dtrt::kFORM_FIELD)) form = &fc->fields[i];
  if (c.contract == Contract::kSlotMapping) {
    std::string const name = dflash::addressing_form(c.contract).name;
    ++present;
    if (form == nullptr || form->type != PluginFieldType::kCHAR || form->data == nullptr ||
        std::string(static_cast<char const*>(form->data), size_t(form->length)).c_str() != name)
      problems += std::string(dtrt::kFORM_FIELD) + " missing or not '" + name + "'; ";
  } else if (form != nullptr) {
    problems += std::string(dtrt::kFORM_FIELD) + " serialized for a call its inputs tell apart; ";
  }
  if (fc->nbFields != present)
    problems += "expected " + std::to_string(present) + " fields, got " + std::to_string(fc->nbFields);
  return problems;
}

Played playContract(Case const& min, Case const& opt, Case const& max, IPluginResourceContext* context) {
  std::string const t = tag(opt);
  Played result;
  IPluginCreatorV3One* creator = libraryCreator();
  if (creator == nullptr) return result;
  check(!std::strcmp(creator->getPluginName(), dtrt::kPLUGIN_NAME) &&
            !std::strcmp(creator->getPluginVersion(), "1") && !std::strcmp(creator->getPluginNamespace(), ""),
        "creator name/version/namespace" + t);
  PluginFieldCollection const* names = creator->getFieldNames();
  bool namesOk = names != nullptr && names->nbFields == 7;
  for (int32_t i = 0; namesOk && i < names->nbFields; ++i) {
    char const* const name = names->fields[i].name;
    PluginFieldType const wanted = name == nullptr                             ? PluginFieldType::kUNKNOWN
                                   : !std::strcmp(name, dtrt::kNORM_EPS_FIELD) ? PluginFieldType::kFLOAT32
                                   : !std::strcmp(name, dtrt::kFORM_FIELD)     ? PluginFieldType::kCHAR
                                                                               : PluginFieldType::kINT32;
    namesOk = name != nullptr && names->fields[i].type == wanted;
  }
  check(namesOk,
        "creator getFieldNames lists pages_per_slot, ring, k_norm, v_norm, scale_pool (INT32), norm_eps "
        "(FLOAT32) and form (CHAR)" +
            t);

  Fields const nodeFc = nodeFields(opt);  // what the ONNX parser passes: the node's attributes
  PluginFieldCollection const fc = nodeFc.collection();
  logger().clear();
  PluginPtr built(creator->createPlugin("dflash_update", &fc, TensorRTPhase::kBUILD));
  if (!check(built != nullptr, "createPlugin(kBUILD) with " + std::to_string(fc.nbFields) + " fields" + t,
             logger().all()))
    return result;
  check(built->getInterfaceInfo().kind == std::string("PLUGIN") && built->getInterfaceInfo().major == 1,
        "the plugin is an IPluginV3" + t);
  IPluginV3OneCore* pluginCore = core(built.get());
  IPluginV3OneBuildV2* b = build(built.get());
  IPluginV3OneRuntime* r = runtime(built.get());
  check(pluginCore && pluginCore->getInterfaceInfo().kind == std::string("PLUGIN_V3ONE_CORE"),
        "capability kCORE" + t);
  check(b && b->getInterfaceInfo().kind == std::string("PLUGIN_V3ONE_BUILD") &&
            b->getInterfaceInfo().major == 2,
        "capability kBUILD is IPluginV3OneBuildV2 (version 2)" + t);
  check(r && r->getInterfaceInfo().kind == std::string("PLUGIN_V3ONE_RUNTIME"), "capability kRUNTIME" + t);
  if (!pluginCore || !b || !r) return result;
  check(!std::strcmp(pluginCore->getPluginName(), dtrt::kPLUGIN_NAME) &&
            !std::strcmp(pluginCore->getPluginVersion(), "1") &&
            !std::strcmp(pluginCore->getPluginNamespace(), ""),
        "core name/version/namespace" + t);
  int32_t const nbOut = opt.nbOutputs();
  check(b->getNbOutputs() == nbOut, "getNbOutputs == " + std::to_string(nbOut) + t);

  std::vector<Tensor> const optIn = inputs(opt);
  int32_t const nbIn = int32_t(optIn.size());
  std::vector<DataType> inTypes;
  for (Tensor const& x : optIn) inTypes.push_back(x.type);
  DataType outTypes[2] = {DataType::kBOOL, DataType::kBOOL};
  logger().clear();
  check(b->getOutputDataTypes(outTypes, nbOut, inTypes.data(), nbIn) == 0 && outTypes[0] == opt.pool &&
            (nbOut == 1 || outTypes[1] == DataType::kFLOAT),
        std::string("getOutputDataTypes gives the pool's dtype") +
            (nbOut > 1 ? " and kFLOAT (the scale pool's)" : "") + t,
        logger().all());

  // Shapes as the builder sees them: dims that differ between min and max are symbols.
  TestExprBuilder exprs;
  std::vector<Tensor> const minIn = inputs(min), maxIn = inputs(max);
  std::vector<std::pair<std::pair<int64_t, int64_t>, IDimensionExpr const*>> symbols;
  auto symbolFor = [&](int64_t lo, int64_t hi) {
    for (auto const& s : symbols)
      if (s.first == std::make_pair(lo, hi)) return s.second;
    symbols.push_back({{lo, hi}, exprs.symbol()});
    return symbols.back().second;
  };
  std::vector<DimsExprs> inExprs(nbIn);
  bool anySymbol = false;
  for (int32_t i = 0; i < nbIn; ++i) {
    inExprs[i].nbDims = optIn[i].dims.nbDims;
    for (int32_t d = 0; d < optIn[i].dims.nbDims; ++d) {
      bool const dynamic = minIn[i].dims.d[d] != maxIn[i].dims.d[d];
      anySymbol = anySymbol || dynamic;
      inExprs[i].d[d] =
          dynamic ? symbolFor(minIn[i].dims.d[d], maxIn[i].dims.d[d]) : exprs.constant(optIn[i].dims.d[d]);
    }
  }
  DimsExprs outExprs[2]{};
  logger().clear();
  int32_t const shapeStatus = b->getOutputShapes(inExprs.data(), nbIn, nullptr, 0, outExprs, nbOut, exprs);
  bool sameAsPool = shapeStatus == 0 && outExprs[0].nbDims == 5;
  for (int32_t i = 0; sameAsPool && i < 5; ++i)
    sameAsPool = outExprs[0].d[i] == inExprs[dtrt::kPAST_KEY_VALUE].d[i];
  if (opt.scalePool) {
    int32_t const sp = scalePoolIndex(opt);
    sameAsPool = sameAsPool && outExprs[1].nbDims == 4;
    for (int32_t i = 0; sameAsPool && i < 4; ++i) sameAsPool = outExprs[1].d[i] == inExprs[size_t(sp)].d[i];
  }
  check(sameAsPool,
        std::string("getOutputShapes") + (anySymbol ? " with symbolic dims" : "") +
            ": the output is the pool's shape" + (opt.scalePool ? " (and the scale pool's)" : "") + t,
        logger().all());

  BuildDescs descs = buildDescs(min, opt, max);
  std::vector<DynamicPluginTensorDesc> inOut = descs.in;
  inOut.insert(inOut.end(), descs.outs.begin(), descs.outs.end());
  bool allSupported = true;
  std::string refusals;
  logger().clear();
  for (int32_t pos = 0; pos < nbIn + nbOut; ++pos) {
    allSupported = b->supportsFormatCombination(pos, inOut.data(), nbIn, nbOut) && allSupported;
    std::vector<DataType> const accepted = acceptedTypes(opt, pos, nbIn);
    for (DataType other : kProbeTypes) {
      auto probe = inOut;
      probe[pos].desc.type = other;
      bool const expected = std::find(accepted.begin(), accepted.end(), other) != accepted.end();
      if (b->supportsFormatCombination(pos, probe.data(), nbIn, nbOut) != expected)
        refusals +=
            "pos " + std::to_string(pos) + " " + dtypeName(other) + (expected ? " refused; " : " accepted; ");
    }
    auto probe = inOut;
    probe[pos].desc.format = TensorFormat::kHWC8;
    if (b->supportsFormatCombination(pos, probe.data(), nbIn, nbOut))
      refusals += "pos " + std::to_string(pos) + " accepts kHWC8; ";
  }
  check(allSupported,
        "supportsFormatCombination accepts every position (" + std::to_string(nbIn + nbOut) + ")" + t,
        logger().all());
  check(
      refusals.empty() && logger().nbErrors() == 0,
      "supportsFormatCombination refuses every other dtype and format at every position, without errors" + t,
      refusals + logger().all());

  logger().clear();
  check(b->configurePlugin(descs.in.data(), nbIn, descs.out(), descs.nbOutputs()) == 0,
        "configurePlugin with min/opt/max" + t, logger().all());
  check(b->getWorkspaceSize(descs.in.data(), nbIn, descs.out(), descs.nbOutputs()) == 0,
        "getWorkspaceSize == 0" + t);
  if (opt.scalePool) {
    int32_t const sp = scalePoolIndex(opt);
    check(b->getAliasedInput(0) == 2 && b->getAliasedInput(1) == sp && b->getAliasedInput(2) == -1 &&
              b->getAliasedInput(-1) == -1,
          "getAliasedInput(0) == 2, getAliasedInput(1) == " + std::to_string(sp) +
              " (the outputs alias past_key_value and scale_pool)" + t);
  } else {
    check(b->getAliasedInput(0) == 2 && b->getAliasedInput(1) == -1 && b->getAliasedInput(-1) == -1,
          "getAliasedInput(0) == 2 (output aliases past_key_value)" + t);
  }

  PluginPtr cloned(built->clone());
  std::string const cloneProblem =
      cloned ? fieldsMismatch(runtime(cloned.get())->getFieldsToSerialize(), opt) : "clone() is null";
  check(cloneProblem.empty(), "clone() carries every field" + t, cloneProblem);
  PluginFieldCollection const* serialized = r->getFieldsToSerialize();
  std::string const serialProblem = fieldsMismatch(serialized, opt);
  if (!check(serialProblem.empty(), "getFieldsToSerialize gives every field" + t, serialProblem))
    return result;
  Fields engineFields = copyFields(serialized);
  built.reset();  // the engine outlives the builder's plugin
  cloned.reset();

  PluginFieldCollection const efc = engineFields.collection();
  logger().clear();
  PluginPtr deserialized(creator->createPlugin("dflash_update", &efc, TensorRTPhase::kRUNTIME));
  if (!check(deserialized != nullptr, "createPlugin(kRUNTIME) from the serialized fields" + t,
             logger().all()))
    return result;
  std::string const roundTrip = fieldsMismatch(runtime(deserialized.get())->getFieldsToSerialize(), opt);
  check(roundTrip.empty(), "the serialization round trip keeps every field" + t, roundTrip);
  IPluginV3OneRuntime* dr = runtime(deserialized.get());
  PluginPtr attached(dr ? dr->attachToContext(context) : nullptr);
  if (!check(attached != nullptr && attached.get() != deserialized.get(),
             "attachToContext returns a new plugin" + t))
    return result;
  IPluginV3OneRuntime* ar = runtime(attached.get());
  RuntimeDescs rd = runtimeDescs(opt);
  logger().clear();
  check(ar->onShapeChange(rd.in.data(), rd.nbInputs(), rd.out(), rd.nbOutputs()) == 0, "onShapeChange" + t,
        logger().all());
  result.runtimePlugin = std::move(attached);
  result.rt = ar;
  return result;
}

void enqueueEmpty(IPluginV3OneRuntime* rt, Case c) {
  c.name += "_empty";
  if (c.contract == Contract::kSlot) {
    c.B = 0;
  } else {  // the token-major forms
    c.T = 0;
  }
  RuntimeDescs d = runtimeDescs(c);
  // Host stand-ins: with no token the launcher launches nothing and reads nothing.
  std::array<char, 64> pool{};
  std::array<float, 16> small{};
  std::vector<void const*> pointers(d.in.size(), small.data());
  pointers[dtrt::kPAST_KEY_VALUE] = pool.data();
  void* outputs[2] = {pool.data(), small.data()};
  if (c.scalePool) pointers[size_t(scalePoolIndex(c))] = small.data();
  logger().clear();
  bool const shaped = rt->onShapeChange(d.in.data(), d.nbInputs(), d.out(), d.nbOutputs()) == 0;
  dflash::PoolFormat const* format =
      dflash::pool_format(c.int4() ? dflash::DType::kUInt8 : dflash::DType::kFloat16);
  if (c.int4() && !format->cuda) {  // contract.h's row: no CUDA kernel stores int4 yet
    bool const refused = rt->enqueue(d.in.data(), d.out(), pointers.data(), outputs, nullptr, nullptr) != 0;
    check(
        shaped && refused && logger().sawError("past_key_value: int4 pools (uint8) have no CUDA kernel yet"),
        "enqueue of a format without a CUDA kernel is refused, naming it" + tag(c), logger().all());
    return;
  }
  check(shaped && rt->enqueue(d.in.data(), d.out(), pointers.data(), outputs, nullptr, nullptr) == 0,
        "enqueue with no token (no launch)" + tag(c), logger().all());
}

void registration() {
  Group group("registration");
  TestPluginRegistry registry;
  logger().clear();
  check(initDFlashPluginWithRegistry(static_cast<IPluginRegistry*>(&registry), nullptr, "dflash_ns"),
        "initDFlashPluginWithRegistry(namespace)", logger().all());
  auto* creator =
      static_cast<IPluginCreatorV3One*>(registry.getCreator(dtrt::kPLUGIN_NAME, "1", "dflash_ns"));
  check(creator != nullptr && !std::strcmp(creator->getPluginNamespace(), "dflash_ns"),
        "the registered creator is found under its namespace (as the ONNX parser looks it up)");
  if (creator != nullptr) {
    Fields f;
    PluginFieldCollection const fc = f.collection();
    PluginPtr p(creator->createPlugin("n", &fc, TensorRTPhase::kBUILD));
    check(p && !std::strcmp(core(p.get())->getPluginNamespace(), "dflash_ns"),
          "its plugins carry the namespace");
  }
  expectFailure(
      "initDFlashPluginWithRegistry twice in one namespace", "already registered",
      [&] {
        return initDFlashPluginWithRegistry(static_cast<IPluginRegistry*>(&registry), nullptr, "dflash_ns");
      },
      [](bool ok) { return !ok; });
  expectFailure(
      "initDFlashPluginWithRegistry(nullptr registry)", "registry is null",
      [&] { return initDFlashPluginWithRegistry(nullptr, nullptr, ""); }, [](bool ok) { return !ok; });
  check(initDFlashPluginWithRegistry(static_cast<IPluginRegistry*>(&registry), nullptr, nullptr),
        "initDFlashPluginWithRegistry(default namespace)");
  // No TensorRT library in this process: the dlsym lookup must fail cleanly.
  expectFailure(
      "initDFlashPlugin without TensorRT loaded", "getPluginRegistry was not found",
      [&] { return initDFlashPlugin(nullptr, "x"); }, [](bool ok) { return !ok; });
  // An explicit logger takes over from the finder; nullptr hands back to the finder.
  RecordingLogger other;
  setDFlashPluginLogger(static_cast<ILogger*>(&other));
  initDFlashPluginWithRegistry(nullptr, nullptr, "");
  check(other.sawError("registry is null"), "setDFlashPluginLogger redirects the plugin's messages");
  setDFlashPluginLogger(nullptr);
}

}  // namespace harness
