// Every bad-input path: fields, each contract's bad counts, ranks, shapes, dtypes and formats
// (rejected at configurePlugin, onShapeChange and enqueue alike), and 2^62 dims. The expected
// text of each rejection is the name the message must carry (an operand, a field, a rule).
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "cases.h"
#include "sequence.h"

namespace harness {

namespace {

using Change = std::function<void(std::vector<Tensor>&, Tensor&)>;

struct Mutation {
  std::string what;
  std::string expected;
  Change change;
  bool countChanges = false;  // enqueue is given no count: only the entry points that are
  bool typesToo = false;      // also getOutputDataTypes
};

// Host stand-ins for the device pointers: every call below must fail before touching memory.
struct HostStandIns {
  std::array<char, 256> bytes{};
  std::array<void const*, 16> inputs{};
  void* outputs[2] = {bytes.data(), bytes.data()};
  HostStandIns() { inputs.fill(bytes.data()); }
};

PluginPtr makePlugin(Fields const& fields, TensorRTPhase phase) {
  PluginFieldCollection const fc = fields.collection();
  return PluginPtr(libraryCreator()->createPlugin("bad", &fc, phase));
}

// The mutation rejected by configurePlugin (min = opt = max), onShapeChange and enqueue (and
// getOutputDataTypes), each with a logged error naming `expected`.
void rejectEverywhere(Case const& good, Fields const& fields, Mutation const& m,
                      IPluginResourceContext* context) {
  std::vector<Tensor> in = inputs(good);
  Tensor out = output(good);
  m.change(in, out);
  std::vector<Tensor> const extra =
      good.scalePool ? std::vector<Tensor>{scaleOutput(good)} : std::vector<Tensor>{};
  std::string const t = tag(good);
  PluginPtr builder = makePlugin(fields, TensorRTPhase::kBUILD);
  PluginPtr deserialized = makePlugin(fields, TensorRTPhase::kRUNTIME);
  if (!builder || !deserialized) return void(check(false, "createPlugin for " + m.what + t, logger().all()));
  PluginPtr attached(runtime(deserialized.get())->attachToContext(context));
  IPluginV3OneBuildV2* b = build(builder.get());
  IPluginV3OneRuntime* rt = runtime(attached.get());

  BuildDescs bd = buildDescs(in, in, in, out, out, out, extra);
  expectStatusFailure("configurePlugin: " + m.what + t, m.expected, [&] {
    return b->configurePlugin(bd.in.data(), bd.nbInputs(), bd.out(), bd.nbOutputs());
  });
  RuntimeDescs rd = runtimeDescs(in, out, extra);
  expectStatusFailure("onShapeChange: " + m.what + t, m.expected, [&] {
    return rt->onShapeChange(rd.in.data(), rd.nbInputs(), rd.out(), rd.nbOutputs());
  });
  if (!m.countChanges) {
    HostStandIns host;
    rd.in.resize(16);  // enqueue reads as many descriptors as the form it infers: never past these
    expectStatusFailure("enqueue: " + m.what + t, m.expected, [&] {
      return rt->enqueue(rd.in.data(), rd.out(), host.inputs.data(), host.outputs, nullptr, nullptr);
    });
    check(std::all_of(host.bytes.begin(), host.bytes.end(), [](char c) { return c == 0; }),
          "a rejected enqueue writes nothing: " + m.what + t);
  }
  if (m.typesToo) {
    std::vector<DataType> types;
    for (Tensor const& x : in) types.push_back(x.type);
    DataType outTypes[2]{};
    expectStatusFailure("getOutputDataTypes: " + m.what + t, m.expected, [&] {
      return b->getOutputDataTypes(outTypes, good.nbOutputs(), types.data(), int32_t(types.size()));
    });
  }
}

Change setDim(int32_t index, int32_t dim, int64_t value) {
  return [=](std::vector<Tensor>& in, Tensor&) { in[index].dims.d[dim] = value; };
}
Change setType(int32_t index, DataType type) {
  return [=](std::vector<Tensor>& in, Tensor&) { in[index].type = type; };
}
Change setRank(int32_t index, int32_t rank) {
  return [=](std::vector<Tensor>& in, Tensor&) {
    for (int32_t d = in[index].dims.nbDims; d < rank; ++d) in[index].dims.d[d] = 1;
    in[index].dims.nbDims = rank;
  };
}
Change onPool(std::function<void(Dims&)> f) {
  return [=](std::vector<Tensor>& in, Tensor& out) {
    f(in[dtrt::kPAST_KEY_VALUE].dims);
    f(out.dims);
  };
}
Change both(Change a, Change b) {
  return [=](std::vector<Tensor>& in, Tensor& out) {
    a(in, out);
    b(in, out);
  };
}
Change appendScales(int64_t heads) {
  return [=](std::vector<Tensor>& in, Tensor&) {
    in.push_back({"k_scale", DataType::kFLOAT, makeDims({heads})});
    in.push_back({"v_scale", DataType::kFLOAT, makeDims({heads})});
  };
}
Change dropLast(int32_t n) {
  return [=](std::vector<Tensor>& in, Tensor&) { in.resize(in.size() - size_t(n)); };
}
Change eraseAt(int32_t index, int32_t n) {
  return [=](std::vector<Tensor>& in, Tensor&) { in.erase(in.begin() + index, in.begin() + index + n); };
}

// Mutations both contracts reject the same way.
std::vector<Mutation> commonMutations(Case const& g) {
  int32_t const pool = dtrt::kPAST_KEY_VALUE;
  int32_t const rope = dtrt::kROPE_COS_SIN;
  int32_t const ropeR = g.contract == Contract::kSlot ? 2 : 1;
  int32_t const nb = int32_t(inputs(g).size());
  DataType const otherFloat = g.delta == DataType::kHALF ? DataType::kBF16 : DataType::kHALF;
  std::vector<Mutation> m = {
      {"pool of rank 4", "past_key_value: expected rank 5", setRank(pool, 4)},
      {"pool of rank 6 (the layer-batched form)", "past_key_value: expected rank 5", onPool([](Dims& d) {
         for (int32_t i = 5; i > 0; --i) d.d[i] = d.d[i - 1];
         d.d[0] = 1;
         d.nbDims = 6;
       })},
      {"page size 64", "tokens per page", onPool([](Dims& d) { d.d[2] = 64; })},
      {"pool dim 0 == 3", "K and V planes", onPool([](Dims& d) { d.d[0] = 3; })},
      {"pool heads unlike k_delta's", "k_delta: expected", onPool([&](Dims& d) { d.d[3] = g.H + 1; })},
      {"R odd", "rotary dim R must be even", setDim(rope, ropeR, 3)},
      {"R > D", "rotary dim R must be even and <= head dim", setDim(rope, ropeR, g.D + 2)},
      {"v_delta's shape unlike k_delta's", "v_delta: expected k_delta's shape", setDim(1, 0, 1)},
      {"output shape unlike the pool's", "present_key_value: expected the pool's shape",
       [](std::vector<Tensor>&, Tensor& out) { out.dims.d[1] += 1; }},
      {"output dtype unlike the pool's", "present_key_value: expected the pool's shape",
       [](std::vector<Tensor>&, Tensor& out) {
         out.type = out.type == DataType::kFLOAT ? DataType::kHALF : DataType::kFLOAT;
       }},
      {"v_delta's dtype unlike k_delta's", "v_delta: expected dtype", setType(1, otherFloat), false, true},
      {"rope_cos_sin float16", "rope_cos_sin: expected dtype float32", setType(rope, DataType::kHALF), false,
       true},
      {"k_delta int32", "k_delta: expected dtype float16, bfloat16 or float32", setType(0, DataType::kINT32),
       false, true},
      {"k_delta kFP8", "k_delta: expected dtype float16, bfloat16 or float32", setType(0, DataType::kFP8),
       false, true},
      {"pool kINT8 without k_scale and v_scale", "k_scale, v_scale are missing",
       [](std::vector<Tensor>& in, Tensor& out) { in[2].type = out.type = DataType::kINT8; }, false, true},
      {"pool kUINT8 (int4) without a scale pool", "is stored with per-token-head dynamic scales only",
       [](std::vector<Tensor>& in, Tensor& out) { in[2].type = out.type = DataType::kUINT8; }, false, true},
      {"pool kINT32", "past_key_value: expected dtype", setType(pool, DataType::kINT32), false, true},
      {"pool in a non-linear format", "past_key_value: expected the linear format", {}, false, false},
      {"5 inputs", "got 5 inputs", dropLast(nb - 5), true, true},
      {"11 inputs", "11 inputs",
       [](std::vector<Tensor>& in, Tensor&) {
         while (in.size() < 11) in.push_back({"extra", DataType::kFLOAT, makeDims({1})});
       },
       true, true},
      {"k_scale and v_scale with a 16-bit pool", "k_scale and v_scale only with a kFP8 or kINT8 pool",
       appendScales(g.H), true, true},
      {"a kFP8 pool without k_scale and v_scale", "k_scale, v_scale are missing",
       [](std::vector<Tensor>& in, Tensor& out) { in[2].type = out.type = DataType::kFP8; }, true, true},
      // An extra input is reported as one, with what it could be, not as the other contract.
      {"k_norm_weight without the field k_norm=1", "k_norm_weight only with the field k_norm=1",
       [delta = g.delta, D = g.D](std::vector<Tensor>& in, Tensor&) {
         in.push_back({"k_norm_weight", delta, makeDims({D})});
       },
       true, true},
  };
  return m;
}

// The FP8 and k-norm extras of a case that has both.
std::vector<Mutation> extrasMutations(Case const& g) {
  int32_t const ks = kScaleIndex(g), w = kNormWeightIndex(g);
  return {
      {"k_scale of shape [H + 1]", "k_scale: expected",
       both(setDim(ks, 0, g.H + 1), setDim(ks + 1, 0, g.H + 1))},
      {"v_scale's shape unlike k_scale's", "v_scale: expected k_scale's shape", setDim(ks + 1, 0, 1)},
      {"k_scale of rank 2", "k_scale: expected", setRank(ks, 2)},
      {"k_scale float16", "k_scale: expected dtype float32", setType(ks, DataType::kHALF), false, true},
      {"k_norm_weight of length D + 1", "k_norm_weight: expected", setDim(w, 0, g.D + 1)},
      {"k_norm_weight of length D - 1", "k_norm_weight: expected", setDim(w, 0, g.D - 1)},
      {"k_norm_weight float32 with other deltas", "k_norm_weight: expected dtype",
       setType(w, DataType::kFLOAT), false, true},
      {"k_norm=1 without k_norm_weight", "k_norm_weight is missing", dropLast(1), true, true},
      // TensorRT's per-tensor scale is [1]: the JAX op's [] is not TensorRT's contract (nor the
      // ONNX node's).
      {"k_scale of rank 0", "k_scale: expected shape [1] or [H] = [" + std::to_string(g.H) + "], got []",
       setRank(ks, 0)},
      {"v_scale of rank 0", "v_scale: expected shape [1] or [H] = [" + std::to_string(g.H) + "], got []",
       setRank(ks + 1, 0)},
      {"k_scale and v_scale of rank 0",
       "k_scale: expected shape [1] or [H] = [" + std::to_string(g.H) + "], got []",
       both(setRank(ks, 0), setRank(ks + 1, 0))},
  };
}

void runAll(Case const& g, std::vector<Mutation> const& mutations, IPluginResourceContext* context) {
  Fields const fields = nodeFields(g);
  for (Mutation const& m : mutations) {
    if (m.what == "pool in a non-linear format") {
      // A format, not a shape: set on the descriptors themselves.
      PluginPtr builder = makePlugin(fields, TensorRTPhase::kBUILD);
      BuildDescs bd = buildDescs(g, g, g);
      bd.in[dtrt::kPAST_KEY_VALUE].desc.format = TensorFormat::kHWC8;
      expectStatusFailure("configurePlugin: " + m.what + tag(g), m.expected, [&] {
        return build(builder.get())->configurePlugin(bd.in.data(), bd.nbInputs(), bd.out(), bd.nbOutputs());
      });
      RuntimeDescs rd = runtimeDescs(g);
      rd.in[dtrt::kROPE_COS_SIN].format = TensorFormat::kCHW32;
      expectStatusFailure("onShapeChange: rope_cos_sin in format kCHW32" + tag(g),
                          "rope_cos_sin: expected the linear format", [&] {
                            return runtime(builder.get())
                                ->onShapeChange(rd.in.data(), rd.nbInputs(), rd.out(), rd.nbOutputs());
                          });
      continue;
    }
    rejectEverywhere(g, fields, m, context);
  }
}

// Null pointers, descriptor arrays, the error recorder, getOutputShapes and
// supportsFormatCombination's own arguments.
void entryPointArguments(Case const& g, IPluginResourceContext* context, RecordingErrorRecorder* recorder) {
  std::string const t = tag(g);
  Fields const fields = nodeFields(g);
  PluginPtr builder = makePlugin(fields, TensorRTPhase::kBUILD);
  PluginPtr deserialized = makePlugin(fields, TensorRTPhase::kRUNTIME);
  PluginPtr attached(runtime(deserialized.get())->attachToContext(context));
  IPluginV3OneBuildV2* b = build(builder.get());
  IPluginV3OneRuntime* rt = runtime(attached.get());
  RuntimeDescs d = runtimeDescs(g);
  int32_t const nb = d.nbInputs();
  HostStandIns host;
  std::vector<Tensor> const in = inputs(g);

  for (int32_t pos = 0; pos < nb + d.nbOutputs(); ++pos) {
    auto pointers = host.inputs;
    void* outputs[2] = {host.bytes.data(), host.bytes.data()};
    if (pos < nb)
      pointers[pos] = nullptr;
    else
      outputs[pos - nb] = nullptr;
    std::string const name = pos < nb ? in[pos].name : harness::outputs(g)[size_t(pos - nb)].name;
    expectStatusFailure("enqueue: null " + name + " pointer" + t, name + ": the ", [&] {
      return rt->enqueue(d.in.data(), d.out(), pointers.data(), outputs, nullptr, nullptr);
    });
  }
  expectStatusFailure("enqueue: null input descriptors" + t, "input descriptors are null", [&] {
    return rt->enqueue(nullptr, d.out(), host.inputs.data(), host.outputs, nullptr, nullptr);
  });
  expectStatusFailure("enqueue: null output descriptors" + t, "output descriptors are null", [&] {
    return rt->enqueue(d.in.data(), nullptr, host.inputs.data(), host.outputs, nullptr, nullptr);
  });
  expectStatusFailure("enqueue: null pointer arrays" + t, "pointer arrays must not be null", [&] {
    return rt->enqueue(d.in.data(), d.out(), nullptr, host.outputs, nullptr, nullptr);
  });
  expectStatusFailure("onShapeChange: 0 outputs" + t,
                      g.scalePool ? "expected 2 outputs" : "expected 1 output",
                      [&] { return rt->onShapeChange(d.in.data(), nb, d.out(), 0); });
  expectStatusFailure("onShapeChange: null input descriptors" + t, "input descriptors are null",
                      [&] { return rt->onShapeChange(nullptr, nb, d.out(), d.nbOutputs()); });
  expectFailure(
      "attachToContext(nullptr)" + t, "resource context is null",
      [&] { return PluginPtr(runtime(deserialized.get())->attachToContext(nullptr)); },
      [](PluginPtr const& p) { return p == nullptr; });
  if (recorder != nullptr) {
    recorder->clear();
    rt->enqueue(d.in.data(), d.out(), nullptr, host.outputs, nullptr, nullptr);
    check(recorder->getNbErrors() == 1 && recorder->getErrorCode(0) == ErrorCode::kINVALID_ARGUMENT &&
              std::string(recorder->getErrorDesc(0)).find("enqueue") != std::string::npos,
          "an attached plugin reports errors to the context's IErrorRecorder" + t);
  }

  // getOutputShapes on constant dims.
  TestExprBuilder exprs;
  std::vector<DimsExprs> shapes(nb);
  for (int32_t i = 0; i < nb; ++i) {
    shapes[i].nbDims = in[i].dims.nbDims;
    for (int32_t k = 0; k < in[i].dims.nbDims; ++k) shapes[i].d[k] = exprs.constant(in[i].dims.d[k]);
  }
  DimsExprs out[2]{};
  int32_t const nbOut = g.nbOutputs();
  expectStatusFailure("getOutputShapes with null inputs" + t, "must not be null",
                      [&] { return b->getOutputShapes(nullptr, nb, nullptr, 0, out, nbOut, exprs); });
  expectStatusFailure("getOutputShapes with one input more" + t, "inputs", [&] {
    auto more = shapes;
    more.push_back(shapes.back());
    more.push_back(shapes.back());
    more.push_back(shapes.back());
    return b->getOutputShapes(more.data(), nb + 3, nullptr, 0, out, nbOut, exprs);
  });
  auto shapeCase = [&](std::string const& what, std::string const& expected,
                       std::function<void(std::vector<DimsExprs>&)> f) {
    auto bad = shapes;
    f(bad);
    expectStatusFailure("getOutputShapes: " + what + t, expected,
                        [&] { return b->getOutputShapes(bad.data(), nb, nullptr, 0, out, nbOut, exprs); });
  };
  shapeCase("pool of rank 4", "past_key_value: expected rank 5",
            [](auto& e) { e[dtrt::kPAST_KEY_VALUE].nbDims = 4; });
  shapeCase("pool page size 64", "tokens per page",
            [&](auto& e) { e[dtrt::kPAST_KEY_VALUE].d[2] = exprs.constant(64); });
  shapeCase("pool heads unlike k_delta's", "k_delta: expected",
            [&](auto& e) { e[dtrt::kPAST_KEY_VALUE].d[3] = exprs.constant(g.H + 1); });
  shapeCase("a null dimension expression", "dimension 1 is null", [](auto& e) { e[0].d[1] = nullptr; });
  shapeCase("k_delta of the other contract's rank", "k_delta: expected rank", [&](auto& e) {
    if (g.contract == Contract::kPaged) e[0].d[3] = exprs.constant(g.D);
    e[0].nbDims = g.contract == Contract::kSlot ? 3 : 4;
  });

  // supportsFormatCombination's arguments.
  BuildDescs bd = buildDescs(g, g, g);
  std::vector<DynamicPluginTensorDesc> inOut = bd.in;
  inOut.insert(inOut.end(), bd.outs.begin(), bd.outs.end());
  expectFailure(
      "supportsFormatCombination pos past the output" + t,
      "expected pos in [0, " + std::to_string(nb + nbOut) + ")",
      [&] { return b->supportsFormatCombination(nb + nbOut, inOut.data(), nb, nbOut); },
      [](bool ok) { return !ok; });
  expectFailure(
      "supportsFormatCombination pos -1" + t, "expected pos in",
      [&] { return b->supportsFormatCombination(-1, inOut.data(), nb, nbOut); }, [](bool ok) { return !ok; });
  expectFailure(
      "supportsFormatCombination null inOut" + t, "inOut is null",
      [&] { return b->supportsFormatCombination(0, nullptr, nb, nbOut); }, [](bool ok) { return !ok; });
  expectFailure(
      "supportsFormatCombination with 5 inputs" + t, "got 5 inputs",
      [&] { return b->supportsFormatCombination(0, inOut.data(), 5, nbOut); }, [](bool ok) { return !ok; });
  {
    logger().clear();
    auto probe = inOut;
    probe[1].desc.type = DataType::kINT8;
    bool const refused = !b->supportsFormatCombination(1, probe.data(), nb, nbOut);
    check(
        refused && logger().saw(ILogger::Severity::kVERBOSE, "v_delta: expected dtype") &&
            logger().nbErrors() == 0,
        "supportsFormatCombination refuses an unsupported combination with a verbose reason (not an error)" +
            t,
        logger().all());
  }
  // getWorkspaceSize: 0 bytes for any call (TensorRT reads no failure from a size), a bad call
  // logged as the other entry points log it.
  {
    logger().clear();
    check(b->getWorkspaceSize(bd.in.data(), nb, bd.out(), bd.nbOutputs()) == 0 && logger().nbErrors() == 0,
          "getWorkspaceSize of a good call is 0, without errors" + t, logger().all());
    auto workspaceLogs = [&](std::string const& what, std::string const& expected,
                             std::function<size_t()> call) {
      logger().clear();
      size_t const size = call();
      check(size == 0 && logger().nbErrors() == 1 && logger().sawError("::getWorkspaceSize (bad): ") &&
                logger().sawError(expected),
            "getWorkspaceSize logs an error for " + what + t,
            "expected '" + expected + "'; log: " + logger().all());
    };
    workspaceLogs("5 inputs", "got 5 inputs",
                  [&] { return b->getWorkspaceSize(bd.in.data(), 5, bd.out(), bd.nbOutputs()); });
    workspaceLogs("0 outputs", g.scalePool ? "expected 2 outputs" : "expected 1 output",
                  [&] { return b->getWorkspaceSize(bd.in.data(), nb, bd.out(), 0); });
    workspaceLogs("null input descriptors", "the input descriptors are null",
                  [&] { return b->getWorkspaceSize(nullptr, nb, bd.out(), bd.nbOutputs()); });
    workspaceLogs("null descriptors and 5 inputs", "got 5 inputs",
                  [&] { return b->getWorkspaceSize(nullptr, 5, nullptr, nbOut); });
    BuildDescs bad = bd;
    bad.in[dtrt::kPAST_KEY_VALUE].desc.dims.nbDims = 4;
    workspaceLogs("a pool of rank 4", "past_key_value: expected rank 5",
                  [&] { return b->getWorkspaceSize(bad.in.data(), nb, bad.out(), bad.nbOutputs()); });
  }
  expectFailure(
      "getCapabilityInterface(unknown type)" + t, "expected PluginCapabilityType",
      [&] { return builder->getCapabilityInterface(static_cast<PluginCapabilityType>(9)); },
      [](IPluginCapability* c) { return c == nullptr; });
  expectStatusFailure("getOutputDataTypes with null arrays" + t, "must not be null",
                      [&] { return b->getOutputDataTypes(nullptr, 1, nullptr, nb); });
}

// getOutputShapes with some dims symbolic: every rule between constant dims is checked (a size
// may be constant in one tensor and symbolic in another), and the rules that need a symbolic dim
// are left to configurePlugin.
struct SymbolicCase {
  std::string what;
  std::string expected;  // empty: accepted
  Change change;         // of the constants; may be empty
  std::vector<std::vector<std::pair<int32_t, int32_t>>> symbols;  // (input, dim) sharing one symbol each
};

void symbolicShapes(Case const& g, Fields const& fields, std::vector<SymbolicCase> const& cases) {
  std::string const t = tag(g);
  PluginPtr builder = makePlugin(fields, TensorRTPhase::kBUILD);
  if (!builder) return void(check(false, "createPlugin for symbolic shapes" + t, logger().all()));
  IPluginV3OneBuildV2* b = build(builder.get());
  for (SymbolicCase const& c : cases) {
    std::vector<Tensor> in = inputs(g);
    Tensor out = output(g);
    if (c.change) c.change(in, out);
    TestExprBuilder exprs;
    std::vector<DimsExprs> shapes(in.size());
    for (size_t i = 0; i < in.size(); ++i) {
      shapes[i].nbDims = in[i].dims.nbDims;
      for (int32_t d = 0; d < in[i].dims.nbDims; ++d) shapes[i].d[d] = exprs.constant(in[i].dims.d[d]);
    }
    for (auto const& group : c.symbols) {
      IDimensionExpr const* symbol = exprs.symbol();
      for (auto const& [i, d] : group) shapes[i].d[d] = symbol;
    }
    DimsExprs outExprs[2]{};
    auto call = [&] {
      return b->getOutputShapes(shapes.data(), int32_t(shapes.size()), nullptr, 0, outExprs, g.nbOutputs(),
                                exprs);
    };
    if (c.expected.empty()) {
      logger().clear();
      check(call() == 0 && logger().nbErrors() == 0, "getOutputShapes accepts " + c.what + t, logger().all());
    } else {
      expectStatusFailure("getOutputShapes: " + c.what + t, c.expected, call);
    }
  }
}

// configurePlugin's pass on the build-time dims checks the rules between constants too: the
// call fails there, before any profile's shapes.
void configureOnWildcards(Case const& g, Case lo, Case hi, std::string const& what,
                          std::string const& expected) {
  PluginPtr builder = makePlugin(nodeFields(g), TensorRTPhase::kBUILD);
  if (!builder) return void(check(false, "createPlugin for " + what + tag(g), logger().all()));
  BuildDescs bd = buildDescs(lo, g, hi);
  logger().clear();
  int32_t const status =
      build(builder.get())->configurePlugin(bd.in.data(), bd.nbInputs(), bd.out(), bd.nbOutputs());
  check(status != 0 && logger().sawError(expected) && !logger().sawError("profile "),
        "configurePlugin rejects " + what + " on the build-time dims" + tag(g),
        "expected '" + expected + "' without a profile; log: " + logger().all());
}

Case slotGood() {
  Case g;
  g.name = "slot_bad";
  g.contract = Contract::kSlot;
  g.B = 2, g.L = 8, g.H = 2, g.D = 64, g.N = 4, g.pagesPerSlot = 2, g.Rb = 1, g.S = 128, g.R = 64;
  return g;
}

Case pagedGood() {
  Case g;
  g.name = "paged_bad";
  g.contract = Contract::kPaged;
  g.T = 16, g.H = 2, g.D = 64, g.N = 8, g.B = 3, g.M = 4, g.R = 64;
  return g;
}

Case slotMappingGood() {
  Case g;
  g.name = "slot_mapping_bad";
  g.contract = Contract::kSlotMapping;
  g.T = 16, g.H = 2, g.D = 64, g.N = 8, g.R = 64;
  return g;
}

Case withExtras(Case g) {
  g.name += "_fp8_k_norm";
  g.pool = DataType::kFP8, g.scaleHeads = g.H, g.kNorm = true, g.vNorm = true;
  return g;
}

Case withKNorm(Case g) {
  g.name += "_k_norm";
  g.kNorm = true;
  return g;
}

}  // namespace

void fieldCases() {
  Group group(kFieldsGroup);
  requireGroup(kFieldsGroup);
  IPluginCreatorV3One* creator = libraryCreator();
  if (creator == nullptr) return;
  auto rejected = [&](std::string const& what, std::string const& expected, Fields const& f) {
    PluginFieldCollection const fc = f.collection();
    for (TensorRTPhase phase : {TensorRTPhase::kBUILD, TensorRTPhase::kRUNTIME})
      expectNull("createPlugin(" + std::string(phase == TensorRTPhase::kBUILD ? "kBUILD" : "kRUNTIME") +
                     ") with " + what,
                 expected, [&] { return creator->createPlugin("p", &fc, phase); });
  };
  Fields none;
  PluginFieldCollection const noFields = none.collection();
  expectNull("createPlugin with a null field collection", "field collection is null",
             [&] { return creator->createPlugin("p", nullptr, TensorRTPhase::kBUILD); });
  expectNull("createPlugin with a null name", "name is null",
             [&] { return creator->createPlugin(nullptr, &noFields, TensorRTPhase::kBUILD); });
  expectNull("createPlugin with an unknown phase", "expected phase",
             [&] { return creator->createPlugin("p", &noFields, static_cast<TensorRTPhase>(7)); });
  {
    PluginFieldCollection const broken{3, nullptr};
    expectNull("a field collection with null fields", "fields pointer null",
               [&] { return creator->createPlugin("p", &broken, TensorRTPhase::kBUILD); });
    PluginField nullName(nullptr, nullptr, PluginFieldType::kINT32, 1);
    PluginFieldCollection const nn{1, &nullName};
    expectNull("a field with a null name", "null name",
               [&] { return creator->createPlugin("p", &nn, TensorRTPhase::kBUILD); });
    PluginField nullData(dtrt::kPAGES_PER_SLOT_FIELD, nullptr, PluginFieldType::kINT32, 1);
    PluginFieldCollection const nd{1, &nullData};
    expectNull("pages_per_slot with null data", "field 'pages_per_slot': data is null",
               [&] { return creator->createPlugin("p", &nd, TensorRTPhase::kBUILD); });
  }
  for (TensorRTPhase phase : {TensorRTPhase::kBUILD, TensorRTPhase::kRUNTIME}) {
    logger().clear();
    PluginPtr p(creator->createPlugin("p", &noFields, phase));
    check(p != nullptr && logger().nbErrors() == 0,
          std::string("createPlugin(") + (phase == TensorRTPhase::kBUILD ? "kBUILD" : "kRUNTIME") +
              ") without fields (Edge-LLM 0.11's node) is accepted",
          logger().all());
  }
  {
    Fields f;
    float const value = 2.0f;
    f.add(dtrt::kPAGES_PER_SLOT_FIELD, PluginFieldType::kFLOAT32, &value, 1, sizeof(value));
    rejected("pages_per_slot of type FLOAT32",
             "field 'pages_per_slot': expected type kINT32 (or kINT64), got kFLOAT32", f);
  }
  for (int32_t value : {0, -3}) {
    Fields f;
    f.addInt32(dtrt::kPAGES_PER_SLOT_FIELD, value);
    rejected("pages_per_slot = " + std::to_string(value), "field 'pages_per_slot': expected an int32 > 0", f);
  }
  {
    Fields f;
    int64_t const big = int64_t(1) << 40;
    f.add(dtrt::kPAGES_PER_SLOT_FIELD, PluginFieldType::kINT64, &big, 1, sizeof(big));
    rejected("pages_per_slot = 2^40 (INT64)", "field 'pages_per_slot': expected an int32 > 0", f);
  }
  {
    Fields f;
    int32_t const values[2] = {1, 2};
    f.add(dtrt::kPAGES_PER_SLOT_FIELD, PluginFieldType::kINT32, values, 2, sizeof(values));
    rejected("pages_per_slot with 2 elements", "field 'pages_per_slot': expected 1 element", f);
  }
  for (char const* name :
       {dtrt::kPAGES_PER_SLOT_FIELD, dtrt::kRING_FIELD, dtrt::kK_NORM_FIELD, dtrt::kV_NORM_FIELD}) {
    Fields f;
    f.addInt32(name, 1);
    f.addInt32(name, 1);
    rejected(std::string(name) + " given twice", std::string("field '") + name + "': given twice", f);
  }
  {
    Fields f;
    f.addFloat32(dtrt::kNORM_EPS_FIELD, 1e-5f);
    f.addFloat32(dtrt::kNORM_EPS_FIELD, 1e-5f);
    rejected("norm_eps given twice", "field 'norm_eps': given twice", f);
  }
  for (char const* name :
       {dtrt::kRING_FIELD, dtrt::kK_NORM_FIELD, dtrt::kV_NORM_FIELD, dtrt::kSCALE_POOL_FIELD}) {
    for (int32_t value : {2, -1}) {
      Fields f;
      f.addInt32(name, value);
      rejected(std::string(name) + " = " + std::to_string(value),
               std::string("field '") + name + "': expected 0 or 1", f);
    }
    Fields f;
    f.addFloat32(name, 1.0f);
    rejected(std::string(name) + " of type FLOAT32",
             std::string("field '") + name + "': expected type kINT32 (or kINT64), got kFLOAT32", f);
    Fields g;
    int32_t const values[2] = {1, 1};
    g.add(name, PluginFieldType::kINT32, values, 2, sizeof(values));
    rejected(std::string(name) + " with 2 elements", std::string("field '") + name + "': expected 1 element",
             g);
  }
  {
    Fields f;
    f.addInt32(dtrt::kNORM_EPS_FIELD, 1);
    rejected("norm_eps of type INT32", "field 'norm_eps': expected type kFLOAT32, got kINT32", f);
    // A subnormal eps is zero under a flush-to-zero mode: refused like zero.
    for (float value : {0.0f, -1e-6f, 1e-40f, std::numeric_limits<float>::quiet_NaN(),
                        std::numeric_limits<float>::infinity()}) {
      Fields g;
      g.addFloat32(dtrt::kNORM_EPS_FIELD, value);
      rejected("norm_eps = " + std::to_string(value),
               "field 'norm_eps': expected a finite float > 0 that is a normal float32", g);
    }
    Fields h;
    float const values[2] = {1e-6f, 1e-6f};
    h.add(dtrt::kNORM_EPS_FIELD, PluginFieldType::kFLOAT32, values, 2, sizeof(values));
    rejected("norm_eps with 2 elements", "field 'norm_eps': expected 1 element", h);
  }
  {
    // Field types by name, also those the plugin never takes.
    Fields f;
    int16_t const small = 1;
    f.add(dtrt::kRING_FIELD, PluginFieldType::kINT16, &small, 1, sizeof(small));
    rejected("ring of type INT16", "field 'ring': expected type kINT32 (or kINT64), got kINT16", f);
    Fields g;
    int32_t const one = 1;
    g.add(dtrt::kK_NORM_FIELD, static_cast<PluginFieldType>(42), &one, 1, sizeof(one));
    rejected("k_norm of an unnamed type",
             "field 'k_norm': expected type kINT32 (or kINT64), got PluginFieldType 42", g);
  }
  for (char const* name : {"rnig", "pages_per_slots", "unknown_attribute"}) {
    // A misspelt field would leave its default without a word (rnig=1: no ring).
    Fields f;
    f.addInt32(dtrt::kPAGES_PER_SLOT_FIELD, 2);
    f.addInt32(name, 1);
    rejected(std::string("the unknown field '") + name + "'",
             std::string("field '") + name +
                 "': unknown: expected one of 'pages_per_slot', 'ring', 'k_norm', 'v_norm', 'norm_eps'",
             f);
  }
  for (TensorRTPhase phase : {TensorRTPhase::kBUILD, TensorRTPhase::kRUNTIME}) {
    // The node attributes that pick the creator, which TensorRT's ONNX parser may pass on.
    Fields f;
    char const version[] = "1";
    char const ns[] = "";
    f.add("plugin_version", PluginFieldType::kCHAR, version, 1, sizeof(version));
    f.add("plugin_namespace", PluginFieldType::kCHAR, ns, 0, sizeof(ns));
    f.addInt32(dtrt::kRING_FIELD, 1);
    PluginFieldCollection const fc = f.collection();
    logger().clear();
    PluginPtr p(creator->createPlugin("p", &fc, phase));
    auto* concrete = dynamic_cast<dtrt::DFlashTargetKVCacheUpdatePlugin*>(p.get());
    bool const quiet = logger().nbErrors() == 0 && !logger().saw(ILogger::Severity::kWARNING, "plugin_");
    check(concrete != nullptr && concrete->config().ring == 1 && quiet,
          std::string("createPlugin(") + (phase == TensorRTPhase::kBUILD ? "kBUILD" : "kRUNTIME") +
              ") ignores plugin_version and plugin_namespace",
          logger().all());
  }

  // A slot plugin built without pages_per_slot: the builder may set it after parsing.
  Case g = slotGood();
  PluginPtr unset(creator->createPlugin("p", &noFields, TensorRTPhase::kBUILD));
  if (!unset) return;
  BuildDescs bd = buildDescs(g, g, g);
  RuntimeDescs rd = runtimeDescs(g);
  HostStandIns host;
  IPluginV3OneBuildV2* ub = build(unset.get());
  {
    // TensorRT asks for types and shapes while the network is built, before setPagesPerSlot().
    std::vector<DataType> types;
    for (Tensor const& x : inputs(g)) types.push_back(x.type);
    DataType outType{};
    TestExprBuilder exprs;
    std::vector<DimsExprs> shapes;
    for (Tensor const& x : inputs(g)) {
      DimsExprs e{};
      e.nbDims = x.dims.nbDims;
      for (int32_t k = 0; k < x.dims.nbDims; ++k) e.d[k] = exprs.constant(x.dims.d[k]);
      shapes.push_back(e);
    }
    DimsExprs out{};
    logger().clear();
    check(ub->getOutputDataTypes(&outType, 1, types.data(), int32_t(types.size())) == 0 &&
              ub->getOutputShapes(shapes.data(), int32_t(shapes.size()), nullptr, 0, &out, 1, exprs) == 0,
          "a slot plugin without pages_per_slot yet answers getOutputDataTypes and getOutputShapes",
          logger().all());
  }
  expectStatusFailure(
      "configurePlugin of the slot contract with pages_per_slot missing", "pages_per_slot is missing",
      [&] { return ub->configurePlugin(bd.in.data(), bd.nbInputs(), bd.out(), bd.nbOutputs()); });
  expectStatusFailure(
      "onShapeChange of the slot contract with pages_per_slot missing", "pages_per_slot is missing", [&] {
        return runtime(unset.get())->onShapeChange(rd.in.data(), rd.nbInputs(), rd.out(), rd.nbOutputs());
      });
  expectStatusFailure(
      "enqueue of the slot contract with pages_per_slot missing", "pages_per_slot is missing", [&] {
        return runtime(unset.get())
            ->enqueue(rd.in.data(), rd.out(), host.inputs.data(), host.outputs, nullptr, nullptr);
      });
  auto* concrete = dynamic_cast<dtrt::DFlashTargetKVCacheUpdatePlugin*>(unset.get());
  if (check(concrete != nullptr,
            "the plugin is a DFlashTargetKVCacheUpdatePlugin (dynamic_cast across the library)")) {
    expectStatusFailure("setPagesPerSlot(0)", "expected an int32 > 0", [&] {
      concrete->setPagesPerSlot(0);
      return concrete->pagesPerSlot() == 0 ? 1 : 0;
    });
    concrete->setPagesPerSlot(int32_t(g.pagesPerSlot));
    logger().clear();
    check(ub->configurePlugin(bd.in.data(), bd.nbInputs(), bd.out(), bd.nbOutputs()) == 0,
          "setPagesPerSlot() then configurePlugin succeeds", logger().all());
    PluginPtr clone(unset->clone());
    std::string const problem =
        clone ? fieldsMismatch(runtime(clone.get())->getFieldsToSerialize(), g) : "clone() is null";
    check(problem.empty(), "setPagesPerSlot() value survives clone() and getFieldsToSerialize()", problem);
  }
}

void slotBadInputs(IPluginResourceContext* context, RecordingErrorRecorder* recorder) {
  Group group(kSlotBadGroup);
  requireGroup(kSlotBadGroup);
  Case const g = slotGood();
  std::vector<Mutation> m = commonMutations(g);
  std::vector<Mutation> const slot = {
      {"k_delta of rank 3 (the paged contract's) with 6 inputs", "k_delta: expected rank 4", setRank(0, 3)},
      {"rope_cos_sin of rank 2 (the paged contract's)", "rope_cos_sin: expected",
       setRank(dtrt::kROPE_COS_SIN, 2)},
      {"numPages % pages_per_slot != 0", "divisible by pages_per_slot", onPool([](Dims& d) { d.d[1] = 5; })},
      {"B > slots", "batch B must be <=",
       [](std::vector<Tensor>& in, Tensor&) {
         in[0].dims.d[0] = in[1].dims.d[0] = in[4].dims.d[0] = in[5].dims.d[0] = 3;
       }},
      {"S > cap", "slot capacity", setDim(dtrt::kROPE_COS_SIN, 1, 2 * kP + 1)},
      {"rope batch not 1 or B", "batch Rb must be 1 or B", setDim(dtrt::kROPE_COS_SIN, 0, 3)},
      {"delta_lengths [B + 1]", "delta_lengths: expected", setDim(dtrt::kDELTA_LENGTHS, 0, 3)},
      {"delta_start_positions int64", "delta_start_positions: expected dtype int32",
       setType(dtrt::kDELTA_START_POSITIONS, DataType::kINT64), false, true},
      {"delta_lengths float32", "delta_lengths: expected dtype int32",
       setType(dtrt::kDELTA_LENGTHS, DataType::kFLOAT), false, true},
      {"7 inputs (the paged contract's count) with a slot k_delta: Edge-LLM 0.10.1's call",
       "are Edge-LLM 0.10.1's call (the slot inputs and a page table), which this plugin does not serve",
       [](std::vector<Tensor>& in, Tensor&) {
         in.push_back({"kv_page_table", DataType::kINT32, makeDims({2, 2, 2})});
       },
       true, false},
  };
  m.insert(m.end(), slot.begin(), slot.end());
  runAll(g, m, context);
  {
    // ring belongs to the paged contract.
    Case ringed = g;
    ringed.ring = true;
    Mutation const ring{"field ring = 1 on the slot contract", "'ring' = 1 is for the paged contract only",
                        [](std::vector<Tensor>&, Tensor&) {}};
    rejectEverywhere(g, nodeFields(ringed), ring, context);
  }
  rejectEverywhere(withKNorm(g), nodeFields(withKNorm(g)),
                   {"k_norm=1 without k_norm_weight",
                    "k_norm_weight is missing: the slot contract (Edge-LLM 0.10, k_delta [B, L, H, D]) with "
                    "k_norm=1 and a kHALF pool takes 7 inputs",
                    dropLast(1), true, true},
                   context);
  Case const x = withExtras(g);
  runAll(x, extrasMutations(x), context);
  entryPointArguments(g, context, recorder);
  entryPointArguments(x, context, nullptr);

  std::vector<std::pair<int32_t, int32_t>> const batch = {{0, 0}, {1, 0}, {4, 0}, {5, 0}};
  std::vector<std::pair<int32_t, int32_t>> const len = {{0, 1}, {1, 1}};
  std::vector<std::pair<int32_t, int32_t>> const seq = {{3, 1}};
  std::vector<std::pair<int32_t, int32_t>> const pages = {{2, 1}};
  Change const threeSeqs = [](std::vector<Tensor>& in, Tensor&) {
    in[0].dims.d[0] = in[1].dims.d[0] = in[4].dims.d[0] = in[5].dims.d[0] = 3;
  };
  symbolicShapes(
      g, nodeFields(g),
      {{"B and L symbolic, rope [1, 257, 64] past the slot capacity 256",
        "rope_cos_sin: length S must be <= the slot capacity pages_per_slot * P = 256, got S = 257",
        setDim(dtrt::kROPE_COS_SIN, 1, 257),
        {batch, len}},
       {"B symbolic, numPages 5 not divisible by pages_per_slot 2",
        "past_key_value: numPages N must be divisible by pages_per_slot = 2, got N = 5",
        onPool([](Dims& d) { d.d[1] = 5; }),
        {batch}},
       {"B symbolic, rope [1, 128, 63] (R odd)",
        "rope_cos_sin: rotary dim R must be even",
        setDim(dtrt::kROPE_COS_SIN, 2, 63),
        {batch}},
       {"S symbolic, B = 3 past the pool's 2 slots",
        "k_delta: batch B must be <= the pool's slots",
        threeSeqs,
        {seq}},
       {"B and S symbolic, valid", "", {}, {batch, seq}},
       {"numPages symbolic, B = 3", "", threeSeqs, {pages}},
       // Rb is 1 or B and B fits the pool's slots: two rules with B, whose value is not known.
       {"B symbolic, rope batch 3 past the pool's 2 slots", "", setDim(dtrt::kROPE_COS_SIN, 0, 3), {batch}}});
  Case unset = g;
  unset.name += "_pages_per_slot_not_set";
  symbolicShapes(unset, Fields{},
                 {{"B symbolic, S = 256 (pages_per_slot may be 2 or more)",
                   "",
                   setDim(dtrt::kROPE_COS_SIN, 1, 256),
                   {batch}},
                  {"numPages 5", "", onPool([](Dims& d) { d.d[1] = 5; }), {batch}},
                  {"B symbolic, rope [1, 128, 63] (R odd)",
                   "rope_cos_sin: rotary dim R must be even",
                   setDim(dtrt::kROPE_COS_SIN, 2, 63),
                   {batch}}});
  {
    Case odd = g, lo = g, hi = g;
    odd.R = lo.R = hi.R = 63;
    lo.B = 1, hi.B = 2;
    configureOnWildcards(odd, lo, hi, "R odd with B dynamic", "rope_cos_sin: rotary dim R must be even");
  }
}

void pagedBadInputs(IPluginResourceContext* context) {
  Group group(kPagedBadGroup);
  requireGroup(kPagedBadGroup);
  Case const g = pagedGood();
  int32_t const table = dtrt::kKV_PAGE_TABLE;
  std::vector<Mutation> m = commonMutations(g);
  std::vector<Mutation> const paged = {
      {"k_delta of rank 4 (the slot contract's) with 7 inputs", "k_delta: expected rank 3", setRank(0, 4)},
      {"M > N", "kv_page_table: pages per sequence M", setDim(table, 2, g.N + 1)},
      {"kv_page_table int64", "kv_page_table: expected dtype int32", setType(table, DataType::kINT64), false,
       true},
      {"kv_page_table of rank 2", "kv_page_table: expected", setRank(table, 2)},
      {"kv_page_table dim 1 == 3", "kv_page_table: expected", setDim(table, 1, 3)},
      {"rope_cos_sin [T + 1, R]", "rope_cos_sin: expected one row per token",
       setDim(dtrt::kROPE_COS_SIN, 0, g.T + 1)},
      {"rope_cos_sin of rank 3 (the slot contract's table)", "rope_cos_sin: expected",
       setRank(dtrt::kROPE_COS_SIN, 3)},
      {"delta_positions [T + 1]", "delta_positions: expected", setDim(dtrt::kDELTA_POSITIONS, 0, g.T + 1)},
      {"delta_token_to_sequence float16", "delta_token_to_sequence: expected dtype int32",
       setType(dtrt::kDELTA_TOKEN_TO_SEQUENCE, DataType::kHALF), false, true},
      {"delta_positions int64", "delta_positions: expected dtype int32",
       setType(dtrt::kDELTA_POSITIONS, DataType::kINT64), false, true},
      // k_delta's rank tells the contract; the count is then checked against it.
      {"6 inputs (the slot contract's count) with a paged k_delta",
       "kv_page_table is missing: the paged contract (Edge-LLM 0.11, k_delta [T, H, D]) with k_norm=0 and a "
       "kHALF pool takes 7 inputs",
       eraseAt(table, 1), true, false},
      {"6 inputs (the slot contract's count) with a paged k_delta: the rank named too",
       "6 inputs would be the slot contract's (Edge-LLM 0.10, k_delta [B, L, H, D]), but then "
       "k_delta: expected rank 4",
       eraseAt(table, 1), true, false},
      {"8 inputs with a 16-bit pool", "input 7 (kFLOAT [1]) is unexpected: the paged contract",
       [](std::vector<Tensor>& in, Tensor&) { in.push_back({"extra", DataType::kFLOAT, makeDims({1})}); },
       true, false},
  };
  m.insert(m.end(), paged.begin(), paged.end());
  runAll(g, m, context);
  {
    Case withPages = g;
    withPages.contract = Contract::kSlot;  // nodeFields then writes pages_per_slot
    withPages.pagesPerSlot = 2;
    Fields f = nodeFields(withPages);
    Mutation const pps{"field pages_per_slot on the paged contract",
                       "'pages_per_slot' is for the slot contract only",
                       [](std::vector<Tensor>&, Tensor&) {}};
    rejectEverywhere(g, f, pps, context);
  }
  rejectEverywhere(
      withKNorm(g), nodeFields(withKNorm(g)),
      {"k_norm=1 without k_norm_weight",
       "k_norm_weight is missing: the paged contract (Edge-LLM 0.11, k_delta [T, H, D]) with k_norm=1 and a "
       "kHALF pool takes 8 inputs",
       dropLast(1), true, true},
      context);
  Case const x = withExtras(g);
  runAll(x, extrasMutations(x), context);
  entryPointArguments(g, context, nullptr);
  entryPointArguments(x, context, nullptr);

  std::vector<std::pair<int32_t, int32_t>> const tokens = {{0, 0}, {1, 0}, {3, 0}, {4, 0}, {5, 0}};
  std::vector<std::pair<int32_t, int32_t>> const rows = {{table, 0}};
  std::vector<std::pair<int32_t, int32_t>> const pages = {{2, 1}};
  std::vector<std::pair<int32_t, int32_t>> const poolHeads = {{2, 3}};
  std::vector<std::pair<int32_t, int32_t>> const headDim = {{0, 2}, {1, 2}, {2, 4}};
  symbolicShapes(
      g, nodeFields(g),
      {{"T symbolic, rope [T, 63] (R odd, D = 64)",
        "rope_cos_sin: rotary dim R must be even",
        setDim(dtrt::kROPE_COS_SIN, 1, 63),
        {tokens}},
       {"T symbolic, rope [T, 66] (R > D = 64)",
        "rotary dim R must be even and <= head dim D = 64, got R = 66",
        setDim(dtrt::kROPE_COS_SIN, 1, 66),
        {tokens}},
       {"T symbolic, kv_page_table [3, 2, 9] with N = 8 (M > N)",
        "kv_page_table: pages per sequence M (last dim) must be <= numPages N = 8, got M = 9",
        setDim(table, 2, 9),
        {tokens}},
       {"T and B symbolic, kv_page_table [B, 2, 9] with N = 8",
        "kv_page_table: pages per sequence M (last dim) must be <= numPages N = 8, got M = 9",
        setDim(table, 2, 9),
        {tokens, rows}},
       {"the pool's D symbolic, k_delta's 64, rope [T, 66]",
        "rotary dim R must be even and <= head dim D = 64",
        setDim(dtrt::kROPE_COS_SIN, 1, 66),
        {tokens, {{2, 4}}}},
       {"T, B and numPages symbolic, valid", "", {}, {tokens, rows, pages}},
       {"numPages symbolic, kv_page_table [3, 2, 9]", "", setDim(table, 2, 9), {pages}},
       {"D symbolic everywhere, rope [T, 66]", "", setDim(dtrt::kROPE_COS_SIN, 1, 66), {headDim}}});
  int32_t const ks = kScaleIndex(x);
  symbolicShapes(x, nodeFields(x),
                 {{"the pool's H symbolic, k_delta's 2, scales [3]",
                   "k_scale: expected 1 or H = 2 scales, got shape [3]",
                   both(setDim(ks, 0, 3), setDim(ks + 1, 0, 3)),
                   {poolHeads}},
                  {"D symbolic but in k_norm_weight [64], rope [T, 66]",
                   "rotary dim R must be even and <= head dim D = 64",
                   setDim(dtrt::kROPE_COS_SIN, 1, 66),
                   {headDim}},
                  {"T and H symbolic, valid", "", {}, {tokens, poolHeads}}});
  {
    Case odd = g, lo = g, hi = g;
    odd.R = lo.R = hi.R = 63;
    lo.T = 1, hi.T = 64;
    configureOnWildcards(odd, lo, hi, "R odd with T dynamic", "rope_cos_sin: rotary dim R must be even");
    Case big = g;
    big.M = lo.M = hi.M = 9;
    lo.R = hi.R = 64;
    configureOnWildcards(big, lo, hi, "M > N with T dynamic", "kv_page_table: pages per sequence M");
  }
}

void quantizedBadInputs(IPluginResourceContext* context) {
  Group group(kQuantizedBadGroup);
  requireGroup(kQuantizedBadGroup);
  // A kINT8 pool with a scale pool, paged: every scale-pool rule.
  Case g = pagedGood();
  g.name = "paged_int8_scale_pool_bad";
  g.pool = DataType::kINT8, g.scalePool = true;
  int32_t const sp = scalePoolIndex(g);
  int32_t const pool = dtrt::kPAST_KEY_VALUE;
  std::string const spShape =
      "scale_pool: expected [2, " + std::to_string(g.N) + ", 128, " + std::to_string(g.H) + "]";
  std::vector<Mutation> const m = {
      {"a scale pool with a 16-bit pool", "scale_pool: a float16 pool takes no scale pool",
       [](std::vector<Tensor>& in, Tensor& out) { in[2].type = out.type = DataType::kHALF; }},
      {"a scale pool with a kFLOAT pool", "scale_pool: a float32 pool takes no scale pool",
       [](std::vector<Tensor>& in, Tensor& out) { in[2].type = out.type = DataType::kFLOAT; }},
      {"both static and dynamic scales",
       "per-token-head scales (scale_pool) replace the static k_scale and v_scale",
       [sp, H = g.H](std::vector<Tensor>& in, Tensor&) {
         in.insert(in.begin() + sp, {{"k_scale", DataType::kFLOAT, makeDims({H})},
                                     {"v_scale", DataType::kFLOAT, makeDims({H})}});
       },
       true, true},
      {"scale_pool=1 without the scale pool", "scale_pool is missing", eraseAt(sp, 1), true, true},
      {"a scale pool of H + 1 heads", spShape, setDim(sp, 3, g.H + 1)},
      {"a scale pool of 64 tokens per page", spShape, setDim(sp, 2, 64)},
      {"a scale pool of N + 1 pages", spShape, setDim(sp, 1, g.N + 1)},
      {"a scale pool of rank 5 (with D)", spShape,
       [sp, D = g.D](std::vector<Tensor>& in, Tensor&) {
         in[size_t(sp)].dims.nbDims = 5;
         in[size_t(sp)].dims.d[4] = D;
       }},
      {"a scale pool of rank 3", spShape, setRank(sp, 3)},
      {"a scale pool float16", "scale_pool: expected dtype float32", setType(sp, DataType::kHALF), false,
       true},
      {"a scale pool int32", "scale_pool: expected dtype float32", setType(sp, DataType::kINT32), false,
       true},
  };
  runAll(g, m, context);
  entryPointArguments(g, context, nullptr);
  {
    // present_scale_pool must be the scale pool: its own shape and dtype.
    PluginPtr builder = makePlugin(nodeFields(g), TensorRTPhase::kBUILD);
    PluginPtr attached(runtime(builder.get())->attachToContext(context));
    for (auto const& [what, change] :
         std::vector<std::pair<std::string, std::function<void(PluginTensorDesc&)>>>{
             {"present_scale_pool of N + 1 pages", [](PluginTensorDesc& d) { d.dims.d[1] += 1; }},
             {"present_scale_pool float16", [](PluginTensorDesc& d) { d.type = DataType::kHALF; }}}) {
      RuntimeDescs rd = runtimeDescs(g);
      change(rd.outs[1]);
      expectStatusFailure(
          "onShapeChange: " + what + tag(g), "present_scale_pool: expected scale_pool's shape",
          [&] { return runtime(attached.get())->onShapeChange(rd.in.data(), rd.nbInputs(), rd.out(), 2); });
      BuildDescs bd = buildDescs(g, g, g);
      bd.outs[1].desc.dims = rd.outs[1].dims, bd.outs[1].desc.type = rd.outs[1].type;
      bd.outs[1].min = bd.outs[1].opt = bd.outs[1].max = rd.outs[1].dims;
      expectStatusFailure(
          "configurePlugin: " + what + tag(g), "present_scale_pool: expected scale_pool's shape",
          [&] { return build(builder.get())->configurePlugin(bd.in.data(), bd.nbInputs(), bd.out(), 2); });
    }
    {
      // getOutputDataTypes (dtypes only) names the pool's dtype rule.
      std::vector<DataType> types;
      for (Tensor const& x : inputs(g)) types.push_back(x.type);
      types[size_t(pool)] = DataType::kHALF;
      DataType outTypes[2]{};
      expectStatusFailure(
          "getOutputDataTypes: a scale pool with a 16-bit pool" + tag(g),
          "past_key_value: scale_pool is given, so a pool format with scales", [&] {
            return build(builder.get())->getOutputDataTypes(outTypes, 2, types.data(), int32_t(types.size()));
          });
    }
    RuntimeDescs rd = runtimeDescs(g);
    expectStatusFailure(
        "onShapeChange: 1 output with scale_pool=1" + tag(g),
        "expected 2 outputs (present_key_value, present_scale_pool",
        [&] { return runtime(attached.get())->onShapeChange(rd.in.data(), rd.nbInputs(), rd.out(), 1); });
    // Aliasing: the scale pool's input index is the contract's, known once the inputs said it.
    PluginPtr fresh = makePlugin(nodeFields(g), TensorRTPhase::kBUILD);
    expectFailure(
        "getAliasedInput(1) before the contract is known" + tag(g), "the contract is not known yet",
        [&] { return build(fresh.get())->getAliasedInput(1); }, [](int32_t index) { return index == -1; });
    Case named = g;
    named.contract = Contract::kSlotMapping;
    PluginPtr withForm = makePlugin(nodeFields(named), TensorRTPhase::kBUILD);
    check(build(withForm.get())->getAliasedInput(1) == dflash::base_operand_count(Contract::kSlotMapping),
          "getAliasedInput(1) is the named form's scale_pool input (5) before any shape");
  }

  // A slot kFP8 pool with a scale pool: the k_scale, v_scale count of a static call is refused.
  Case f = slotGood();
  f.name = "slot_fp8_scale_pool_bad";
  f.pool = DataType::kFP8, f.scalePool = true;
  Case staticCount = f;
  staticCount.scalePool = false;
  rejectEverywhere(staticCount, nodeFields(staticCount),
                   {"a scale pool after k_scale, v_scale without the field scale_pool=1",
                    "scale_pool (in place of k_scale, v_scale) only with the field scale_pool=1",
                    [H = f.H, N = f.N](std::vector<Tensor>& in, Tensor&) {
                      in.push_back({"scale_pool", DataType::kFLOAT, makeDims({2, N, 128, H})});
                    },
                    true, true},
                   context);
  runAll(
      f,
      {{"a scale pool of H + 1 heads", "scale_pool: expected [2, ", setDim(scalePoolIndex(f), 3, f.H + 1)}},
      context);

  // int4: kUINT8 [2, N, 128, H, D / 2] with a scale pool.
  Case q = slotMappingGood();
  q.name = "slot_mapping_int4_bad";
  q.pool = DataType::kUINT8, q.scalePool = true;
  Change const oddD = [](std::vector<Tensor>& in, Tensor&) {
    in[0].dims.d[2] += 1;  // k_delta, v_delta [T, H, D + 1]
    in[1].dims.d[2] += 1;
  };
  runAll(q,
         {{"int4 with an odd D",
           "so the head dim D must be even, got k_delta's D = " + std::to_string(q.D + 1), oddD},
          {"int4 pool's last dim D (not D / 2)",
           "past_key_value: expected last dim D/2 = " + std::to_string(q.D / 2),
           onPool([D = q.D](Dims& d) { d.d[4] = D; })},
          {"int4 pool's last dim D / 2 + 1", "past_key_value: expected last dim D/2",
           onPool([D = q.D](Dims& d) { d.d[4] = D / 2 + 1; })},
          {"int4 scale pool of H + 1 heads", "scale_pool: expected [2, ",
           setDim(scalePoolIndex(q), 3, q.H + 1)}},
         context);
  entryPointArguments(q, context, nullptr);
  Case noPool = q;
  noPool.scalePool = false;
  noPool.name = "slot_mapping_int4_without_scale_pool_bad";
  rejectEverywhere(
      noPool, nodeFields(noPool),
      {"int4 without a scale pool",
       "an int4 pool (uint8 [2, N, P, H, D/2]) is stored with per-token-head dynamic scales only",
       [](std::vector<Tensor>&, Tensor&) {}, false, true},
      context);
  rejectEverywhere(noPool, nodeFields(noPool),
                   {"int4 with k_scale and v_scale", "k_scale and v_scale only with a kFP8 or kINT8 pool",
                    appendScales(q.H), true, true},
                   context);
  // A kINT8 pool's static scales: every extras rule the kFP8 pool's has.
  Case x = withExtras(pagedGood());
  x.name = "paged_int8_k_norm_bad";
  x.pool = DataType::kINT8;
  runAll(x, extrasMutations(x), context);
  entryPointArguments(x, context, nullptr);
}

void overflowCases(IPluginResourceContext* context) {
  Group group(kOverflowGroup);
  requireGroup(kOverflowGroup);
  int64_t const huge = int64_t(1) << 62;
  Case const s = slotGood();
  Case const p = pagedGood();
  // The same rule at build time (configurePlugin's max profile, with the dim a wildcard) and at
  // run time (onShapeChange, enqueue): nothing multiplies these dims but the core's checks.
  struct Big {
    std::string what;
    Case min, max;
  };
  std::vector<Big> bigs;
  {
    Case big = s;
    big.L = huge;
    bigs.push_back({"slot L = 2^62", s, big});
    big = s;
    big.N = huge;  // divisible by pages_per_slot = 2
    bigs.push_back({"slot pool numPages = 2^62", s, big});
    big = s;
    big.H = int64_t(1) << 31, big.D = int64_t(1) << 31, big.R = 64;
    bigs.push_back({"slot H = D = 2^31", s, big});
    big = p;
    big.T = huge;
    bigs.push_back({"paged T = 2^62", p, big});
    big = p;
    big.B = huge;
    bigs.push_back({"paged kv_page_table rows B = 2^62", p, big});
    big = withExtras(p);
    big.N = huge, big.M = 4;
    bigs.push_back({"paged kFP8 pool numPages = 2^62", withExtras(p), big});
  }
  for (Big const& b : bigs) {
    Fields const fields = nodeFields(b.max);
    PluginFieldCollection const fc = fields.collection();
    PluginPtr builder(libraryCreator()->createPlugin("big", &fc, TensorRTPhase::kBUILD));
    PluginPtr attached(runtime(builder.get())->attachToContext(context));
    BuildDescs bd = buildDescs(b.min, b.min, b.max);
    expectStatusFailure("configurePlugin: " + b.what + " in the max profile", "overflows int64", [&] {
      return build(builder.get())->configurePlugin(bd.in.data(), bd.nbInputs(), bd.out(), bd.nbOutputs());
    });
    RuntimeDescs rd = runtimeDescs(b.max);
    expectStatusFailure("onShapeChange: " + b.what, "overflows int64", [&] {
      return runtime(attached.get())->onShapeChange(rd.in.data(), rd.nbInputs(), rd.out(), rd.nbOutputs());
    });
    HostStandIns host;
    expectStatusFailure("enqueue: " + b.what, "overflows int64", [&] {
      return runtime(attached.get())
          ->enqueue(rd.in.data(), rd.out(), host.inputs.data(), host.outputs, nullptr, nullptr);
    });
  }
}

}  // namespace harness
