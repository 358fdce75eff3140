// A call's tensors for both contracts, their descriptors and fields, and plugin access.
#include "tensors.h"

#include <cstring>

namespace harness {

Dims makeDims(std::initializer_list<int64_t> values) {
  Dims dims{};
  dims.nbDims = int32_t(values.size());
  int32_t i = 0;
  for (int64_t v : values) dims.d[i++] = v;
  return dims;
}

std::string dtypeName(DataType type) {
  switch (type) {
    case DataType::kHALF: return "float16";
    case DataType::kBF16: return "bfloat16";
    case DataType::kFLOAT: return "float32";
    case DataType::kFP8: return "float8_e4m3fn";
    case DataType::kINT32: return "int32";
    case DataType::kINT64: return "int64";
    case DataType::kINT8: return "int8";
    case DataType::kUINT8: return "uint8";
    case DataType::kBOOL: return "bool";
    default: return "other";
  }
}

int64_t elementBytes(DataType type) {
  switch (type) {
    case DataType::kHALF:
    case DataType::kBF16: return 2;
    case DataType::kFP8:
    case DataType::kINT8:
    case DataType::kUINT8:
    case DataType::kBOOL: return 1;
    case DataType::kINT64: return 8;
    default: return 4;
  }
}

int64_t volume(Dims const& dims) {
  int64_t n = 1;
  for (int32_t i = 0; i < dims.nbDims; ++i) n *= dims.d[i];
  return n;
}

std::vector<Tensor> inputs(Case const& c) {
  std::vector<Tensor> t;
  Dims const pool = output(c).dims;
  if (c.contract == Contract::kSlot) {
    Dims const delta = makeDims({c.B, c.L, c.H, c.D});
    t = {{"k_delta", c.delta, delta},
         {"v_delta", c.delta, delta},
         {"past_key_value", c.pool, pool},
         {"rope_cos_sin", DataType::kFLOAT, makeDims({c.Rb, c.S, c.R})},
         {"delta_start_positions", DataType::kINT32, makeDims({c.B})},
         {"delta_lengths", DataType::kINT32, makeDims({c.B})}};
  } else if (c.contract == Contract::kSlotMapping) {
    Dims const delta = makeDims({c.T, c.H, c.D});
    t = {{"k_delta", c.delta, delta},
         {"v_delta", c.delta, delta},
         {"past_key_value", c.pool, pool},
         {"rope_cos_sin", DataType::kFLOAT, makeDims({c.T, c.R})},
         {"slot_mapping", c.slotIndex, makeDims({c.T})}};
  } else {
    Dims const delta = makeDims({c.T, c.H, c.D});
    t = {{"k_delta", c.delta, delta},
         {"v_delta", c.delta, delta},
         {"past_key_value", c.pool, pool},
         {"rope_cos_sin", DataType::kFLOAT, makeDims({c.T, c.R})},
         {"delta_positions", DataType::kINT32, makeDims({c.T})},
         {"delta_token_to_sequence", DataType::kINT32, makeDims({c.T})},
         {"kv_page_table", DataType::kINT32, makeDims({c.B, 2, c.M})}};
  }
  if (c.staticScales()) {
    Dims const scale = makeDims({c.scaleHeads});
    t.push_back({"k_scale", DataType::kFLOAT, scale});
    t.push_back({"v_scale", DataType::kFLOAT, scale});
  }
  if (c.scalePool) t.push_back({"scale_pool", DataType::kFLOAT, makeDims({2, c.N, c.P, c.H})});
  if (c.kNorm) t.push_back({"k_norm_weight", c.delta, makeDims({c.D})});
  return t;
}

Tensor output(Case const& c) {
  return {"present_key_value", c.pool, makeDims({2, c.N, c.P, c.H, c.int4() ? c.D / 2 : c.D})};
}
Tensor scaleOutput(Case const& c) {
  return {"present_scale_pool", DataType::kFLOAT, makeDims({2, c.N, c.P, c.H})};
}
std::vector<Tensor> outputs(Case const& c) {
  if (c.scalePool) return {output(c), scaleOutput(c)};
  return {output(c)};
}
std::string tag(Case const& c) { return " [" + c.name + "]"; }

int32_t kScaleIndex(Case const& c) { return c.staticScales() ? dflash::base_operand_count(c.contract) : -1; }
int32_t scalePoolIndex(Case const& c) { return c.scalePool ? dflash::base_operand_count(c.contract) : -1; }
int32_t kNormWeightIndex(Case const& c) {
  if (!c.kNorm) return -1;
  return dflash::base_operand_count(c.contract) + (c.staticScales() ? 2 : c.scalePool ? 1 : 0);
}

RuntimeDescs runtimeDescs(std::vector<Tensor> const& in, Tensor const& out,
                          std::vector<Tensor> const& extra) {
  RuntimeDescs d;
  auto desc = [](Tensor const& t) {
    PluginTensorDesc p{};
    p.dims = t.dims;
    p.type = t.type;
    p.format = TensorFormat::kLINEAR;
    p.scale = 1.0f;
    return p;
  };
  for (Tensor const& t : in) d.in.push_back(desc(t));
  d.outs.push_back(desc(out));
  for (Tensor const& t : extra) d.outs.push_back(desc(t));
  return d;
}
RuntimeDescs runtimeDescs(Case const& c) {
  return runtimeDescs(inputs(c), output(c),
                      c.scalePool ? std::vector<Tensor>{scaleOutput(c)} : std::vector<Tensor>{});
}

namespace {
DynamicPluginTensorDesc dynamicDesc(Tensor const& min, Tensor const& opt, Tensor const& max) {
  DynamicPluginTensorDesc d{};
  d.desc.dims = opt.dims;
  for (int32_t i = 0; i < opt.dims.nbDims; ++i)
    if (min.dims.d[i] != max.dims.d[i]) d.desc.dims.d[i] = -1;
  d.desc.type = opt.type;
  d.desc.format = TensorFormat::kLINEAR;
  d.desc.scale = 1.0f;
  d.min = min.dims;
  d.opt = opt.dims;
  d.max = max.dims;
  return d;
}
}  // namespace

BuildDescs buildDescs(std::vector<Tensor> const& min, std::vector<Tensor> const& opt,
                      std::vector<Tensor> const& max, Tensor const& outMin, Tensor const& outOpt,
                      Tensor const& outMax, std::vector<Tensor> const& extra) {
  BuildDescs d;
  for (size_t i = 0; i < opt.size(); ++i) d.in.push_back(dynamicDesc(min[i], opt[i], max[i]));
  d.outs.push_back(dynamicDesc(outMin, outOpt, outMax));
  for (Tensor const& t : extra) d.outs.push_back(dynamicDesc(t, t, t));
  return d;
}
BuildDescs buildDescs(Case const& min, Case const& opt, Case const& max) {
  BuildDescs d = buildDescs(inputs(min), inputs(opt), inputs(max), output(min), output(opt), output(max));
  if (opt.scalePool) d.outs.push_back(dynamicDesc(scaleOutput(min), scaleOutput(opt), scaleOutput(max)));
  return d;
}
void setAllDims(DynamicPluginTensorDesc& d, Dims const& dims) { d.desc.dims = d.min = d.opt = d.max = dims; }

void Fields::add(char const* name, PluginFieldType type, void const* data, int32_t length, size_t bytes) {
  storage.emplace_back(static_cast<char const*>(data), static_cast<char const*>(data) + bytes);
  fields.emplace_back(name, storage.back().data(), type, length);
}

Fields nodeFields(Case const& c) {
  Fields f;
  if (c.contract == Contract::kSlot) f.addInt32(dtrt::kPAGES_PER_SLOT_FIELD, int32_t(c.pagesPerSlot));
  // The slot-mapping form has no input of its own to be told by: its node names it.
  if (c.contract == Contract::kSlotMapping) {
    char const* const form = dflash::addressing_form(c.contract).name;
    f.add(dtrt::kFORM_FIELD, PluginFieldType::kCHAR, form, int32_t(std::strlen(form)), std::strlen(form));
  }
  if (c.ring) f.addInt32(dtrt::kRING_FIELD, 1);
  if (c.kNorm) f.addInt32(dtrt::kK_NORM_FIELD, 1);
  if (c.vNorm) f.addInt32(dtrt::kV_NORM_FIELD, 1);
  if (c.eps != dtrt::kDEFAULT_NORM_EPS) f.addFloat32(dtrt::kNORM_EPS_FIELD, c.eps);
  if (c.scalePool) f.addInt32(dtrt::kSCALE_POOL_FIELD, 1);
  return f;
}

Fields copyFields(PluginFieldCollection const* fc) {
  Fields copy;
  for (int32_t i = 0; i < fc->nbFields; ++i) {
    PluginField const& f = fc->fields[i];
    size_t const bytes = f.type == PluginFieldType::kINT64 || f.type == PluginFieldType::kFLOAT64 ? 8
                         : f.type == PluginFieldType::kCHAR || f.type == PluginFieldType::kINT8   ? 1
                                                                                                  : 4;
    copy.add(f.name, f.type, f.data, f.length, bytes * size_t(f.length));
  }
  return copy;
}

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
  if (creators == nullptr || nb != 1) {
    check(false, "getCreators returns one creator", "nb=" + std::to_string(nb));
    return nullptr;
  }
  InterfaceInfo const info = creators[0]->getInterfaceInfo();
  if (std::strcmp(info.kind, "PLUGIN CREATOR_V3ONE") != 0 || info.major != 1) {
    check(false, "the creator is an IPluginCreatorV3One", info.kind);
    return nullptr;
  }
  return static_cast<IPluginCreatorV3One*>(creators[0]);
}

bool expectStatusFailure(std::string const& what, std::string const& expected,
                         std::function<int32_t()> call) {
  return expectFailure(what, expected, call, [](int32_t status) { return status != 0; });
}
bool expectNull(std::string const& what, std::string const& expected, std::function<IPluginV3*()> call) {
  return expectFailure(
      what, expected, [&] { return PluginPtr(call()); }, [](PluginPtr const& p) { return p == nullptr; });
}

}  // namespace harness
