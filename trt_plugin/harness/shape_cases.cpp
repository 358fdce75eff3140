// --check-shapes FILE: the plugin's own verdict (configurePlugin and onShapeChange on a real
// plugin object) on each case of FILE, written into the report's "shape_cases". The format is
// documented in trt_plugin/README.md ("Shape cases").
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "cases.h"

namespace harness {

namespace {

std::vector<std::string> split(std::string const& text, char sep) {
  std::vector<std::string> parts;
  std::string part;
  std::istringstream in(text);
  while (std::getline(in, part, sep)) parts.push_back(part);
  if (!text.empty() && text.back() == sep) parts.emplace_back();
  return parts;
}

std::string trim(std::string s) {
  size_t const a = s.find_first_not_of(" \t\r");
  if (a == std::string::npos) return {};
  size_t const b = s.find_last_not_of(" \t\r");
  return s.substr(a, b - a + 1);
}

bool parseDtype(std::string const& name, DataType* type) {
  struct Named {
    char const* name;
    DataType type;
  };
  Named const names[] = {
      {"float16", DataType::kHALF},      {"bfloat16", DataType::kBF16}, {"float32", DataType::kFLOAT},
      {"float8_e4m3fn", DataType::kFP8}, {"int32", DataType::kINT32},   {"int64", DataType::kINT64},
      {"int8", DataType::kINT8},         {"uint8", DataType::kUINT8},   {"bool", DataType::kBOOL}};
  for (Named const& n : names)
    if (name == n.name) return *type = n.type, true;
  return false;
}

bool parseInt(std::string const& text, int64_t* value) {
  if (text.empty()) return false;
  errno = 0;
  char* end = nullptr;
  long long const v = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end == nullptr || *end != '\0') return false;
  *value = v;
  return true;
}

// "dtype:d0,d1,..." (rank 0: "dtype:").
bool parseTensor(std::string const& text, Tensor* t, std::string* error) {
  size_t const colon = text.find(':');
  if (colon == std::string::npos) return *error = "tensor '" + text + "': expected dtype:d0,d1,...", false;
  if (!parseDtype(trim(text.substr(0, colon)), &t->type))
    return *error = "tensor '" + text + "': unknown dtype '" + trim(text.substr(0, colon)) + "'", false;
  std::string const dims = trim(text.substr(colon + 1));
  t->dims = Dims{};
  if (dims.empty()) return true;
  std::vector<std::string> const parts = split(dims, ',');
  if (int32_t(parts.size()) > Dims::MAX_DIMS)
    return *error = "tensor '" + text + "': more than " + std::to_string(Dims::MAX_DIMS) + " dims", false;
  for (std::string const& p : parts) {
    int64_t v = 0;
    if (!parseInt(trim(p), &v))
      return *error = "tensor '" + text + "': dimension '" + p + "' is not an integer", false;
    t->dims.d[t->dims.nbDims++] = v;
  }
  return true;
}

// "key=value,..."; norm_eps is a FLOAT32 field, form a CHAR field (the form's name), everything
// else an INT32 field of that name.
bool parseFields(std::string const& text, Fields* fields, std::string* error) {
  if (trim(text).empty()) return true;
  for (std::string const& item : split(text, ',')) {
    size_t const eq = item.find('=');
    if (eq == std::string::npos) return *error = "field '" + item + "': expected key=value", false;
    std::string const key = trim(item.substr(0, eq)), value = trim(item.substr(eq + 1));
    fields->storage.emplace_back(key.begin(), key.end());
    fields->storage.back().push_back('\0');
    char const* name = fields->storage.back().data();
    if (key == dtrt::kFORM_FIELD) {
      fields->storage.emplace_back(value.begin(), value.end());
      std::vector<char> const& chars = fields->storage.back();
      fields->add(name, PluginFieldType::kCHAR, chars.data(), int32_t(chars.size()), chars.size());
    } else if (key == dtrt::kNORM_EPS_FIELD) {
      char* end = nullptr;
      float const v = std::strtof(value.c_str(), &end);
      if (value.empty() || *end != '\0') return *error = "field '" + item + "': expected a float", false;
      fields->addFloat32(name, v);
    } else {
      int64_t v = 0;
      if (!parseInt(value, &v) || v < INT32_MIN || v > INT32_MAX)
        return *error = "field '" + item + "': expected an int32", false;
      fields->addInt32(name, int32_t(v));
    }
  }
  return true;
}

JsonObject verdict(bool accepted, std::string const& message) {
  return JsonObject().add("accepted", accepted).add("message", message);
}

}  // namespace

bool shapeCases(std::string const& path, IPluginResourceContext* context) {
  Group group(kShapeCasesGroup);
  requireGroup(kShapeCasesGroup);
  std::ifstream file(path);
  if (!file) {
    std::fprintf(stderr, "--check-shapes: cannot read %s\n", path.c_str());
    return false;
  }
  std::string line;
  int lineNumber = 0;
  while (std::getline(file, line)) {
    ++lineNumber;
    std::string const text = trim(line);
    if (text.empty() || text[0] == '#') continue;
    std::vector<std::string> const parts = split(text, '|');
    std::string error;
    if (parts.size() != 3 && parts.size() != 4) error = "expected name|fields|tensors[|output]";
    Fields fields;
    std::vector<Tensor> in;
    Tensor out;
    if (error.empty()) parseFields(parts[1], &fields, &error);
    if (error.empty())
      for (std::string const& t : split(parts[2], ';')) {
        Tensor tensor;
        if (!parseTensor(trim(t), &tensor, &error)) break;
        in.push_back(tensor);
      }
    if (error.empty() && parts.size() == 4 && !trim(parts[3]).empty()) {
      parseTensor(trim(parts[3]), &out, &error);
    } else if (error.empty()) {
      if (in.size() <= size_t(dtrt::kPAST_KEY_VALUE))
        error = "fewer than 3 inputs and no output given";
      else
        out = in[dtrt::kPAST_KEY_VALUE];
    }
    if (error.empty() && in.size() > 16) error = "more than 16 inputs";
    if (!error.empty()) {
      std::fprintf(stderr, "--check-shapes %s:%d: %s\n", path.c_str(), lineNumber, error.c_str());
      return false;
    }
    std::string const name = trim(parts[0]);
    JsonObject entry;
    entry.add("name", name).add("line", int64_t(lineNumber));

    PluginFieldCollection const fc = fields.collection();
    logger().clear();
    PluginPtr plugin(libraryCreator()->createPlugin(name.c_str(), &fc, TensorRTPhase::kBUILD));
    if (!plugin) {
      std::string const message = logger().errors();
      entry.add("accepted", false).add("stage", "createPlugin").add("message", message);
      entry.addRaw("configure", verdict(false, message).str())
          .addRaw("on_shape_change", verdict(false, message).str());
      addShapeCase(entry);
      check(!message.empty(), "rejected with a message: " + name);
      continue;
    }
    // With the field scale_pool=1 the second output is the scale pool: the input after the base
    // ones (the named form's, else the contract k_delta's rank says).
    std::vector<Tensor> extra;
    bool scalePool = false;
    int32_t base = !in.empty() && in[0].dims.nbDims == 4 ? dtrt::kNB_INPUTS : dtrt::kNB_PAGED_INPUTS;
    for (PluginField const& f : fields.fields) {
      if (!std::strcmp(f.name, dtrt::kSCALE_POOL_FIELD) && f.type == PluginFieldType::kINT32)
        scalePool = *static_cast<int32_t const*>(f.data) == 1;
      if (!std::strcmp(f.name, dtrt::kFORM_FIELD))
        if (dflash::AddressingForm const* form = dflash::addressing_form(
                std::string(static_cast<char const*>(f.data), size_t(f.length)).c_str()))
          base = form->base_count;
    }
    if (scalePool && in.size() > size_t(base)) extra.push_back(in[size_t(base)]);
    BuildDescs bd = buildDescs(in, in, in, out, out, out, extra);
    logger().clear();
    bool const configured =
        build(plugin.get())->configurePlugin(bd.in.data(), bd.nbInputs(), bd.out(), bd.nbOutputs()) == 0;
    std::string const configureMessage = logger().errors();
    RuntimeDescs rd = runtimeDescs(in, out, extra);
    PluginPtr attached(runtime(plugin.get())->attachToContext(context));
    logger().clear();
    bool const shaped =
        runtime(attached.get())->onShapeChange(rd.in.data(), rd.nbInputs(), rd.out(), rd.nbOutputs()) == 0;
    std::string const shapeMessage = logger().errors();
    entry.add("accepted", configured).add("stage", "configurePlugin").add("message", configureMessage);
    entry.addRaw("configure", verdict(configured, configureMessage).str())
        .addRaw("on_shape_change", verdict(shaped, shapeMessage).str());
    addShapeCase(entry);
    check(configured == shaped, "configurePlugin and onShapeChange agree: " + name,
          "configurePlugin: " + configureMessage + "; onShapeChange: " + shapeMessage);
    check(configured == configureMessage.empty(),
          "a verdict comes with a message exactly when rejected: " + name, configureMessage);
  }
  return true;
}

}  // namespace harness
