// The harness's report: checks, dump index, shape verdicts; JSON writer.
#include "report.h"

#include <cmath>
#include <cstdio>

namespace harness {
namespace {

struct Entry {
  std::string group, name, detail;
  bool passed;
};

std::vector<Entry> gEntries;
std::vector<std::string> gRequired, gDumps, gShapeCases;
std::string gGroup = "general";
int gPassed = 0, gFailed = 0;

}  // namespace

std::string jsonString(std::string const& text) {
  std::string out = "\"";
  for (unsigned char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20) {
          char buffer[8];
          std::snprintf(buffer, sizeof buffer, "\\u%04x", c);
          out += buffer;
        } else {
          out += char(c);
        }
    }
  }
  return out + "\"";
}

std::string jsonArray(std::vector<std::string> const& rawItems) {
  std::string out = "[";
  for (size_t i = 0; i < rawItems.size(); ++i) out += (i ? ", " : "") + rawItems[i];
  return out + "]";
}

JsonObject& JsonObject::addRaw(std::string const& key, std::string const& json) {
  mBody += (mBody.empty() ? "" : ", ") + jsonString(key) + ": " + json;
  return *this;
}
JsonObject& JsonObject::add(std::string const& key, std::string const& value) {
  return addRaw(key, jsonString(value));
}
JsonObject& JsonObject::add(std::string const& key, int64_t value) {
  return addRaw(key, std::to_string(value));
}
JsonObject& JsonObject::add(std::string const& key, bool value) {
  return addRaw(key, value ? "true" : "false");
}
JsonObject& JsonObject::add(std::string const& key, double value) {
  if (!std::isfinite(value)) return addRaw(key, "null");
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.9g", value);
  return addRaw(key, buffer);
}

bool check(bool ok, std::string const& name, std::string const& detail) {
  gEntries.push_back({gGroup, name, ok ? std::string() : detail, ok});
  if (ok) {
    ++gPassed;
    std::printf("PASS %s: %s\n", gGroup.c_str(), name.c_str());
  } else {
    ++gFailed;
    std::printf("FAIL %s: %s%s%s\n", gGroup.c_str(), name.c_str(), detail.empty() ? "" : ": ",
                detail.c_str());
  }
  return ok;
}

Group::Group(std::string name) : mPrevious(gGroup) { gGroup = std::move(name); }
Group::~Group() { gGroup = mPrevious; }

void requireGroup(std::string const& name) {
  for (auto const& g : gRequired)
    if (g == name) return;
  gRequired.push_back(name);
}
void addDump(JsonObject const& entry) { gDumps.push_back(entry.str()); }
void addShapeCase(JsonObject const& entry) { gShapeCases.push_back(entry.str()); }

int passedCount() { return gPassed; }
int failedCount() { return gFailed; }

bool writeReport(std::string const& path, std::string const& mode) {
  std::vector<std::string> checks, required;
  for (auto const& e : gEntries)
    checks.push_back(JsonObject()
                         .add("group", e.group)
                         .add("name", e.name)
                         .add("passed", e.passed)
                         .add("detail", e.detail)
                         .str());
  for (auto const& g : gRequired) required.push_back(jsonString(g));
  JsonObject report;
  report.add("mode", mode)
      .addRaw("required_groups", jsonArray(required))
      .addRaw("summary", JsonObject().add("passed", int64_t(gPassed)).add("failed", int64_t(gFailed)).str())
      .addRaw("checks", jsonArray(checks))
      .addRaw("dumps", jsonArray(gDumps))
      .addRaw("shape_cases", jsonArray(gShapeCases));
  FILE* file = std::fopen(path.c_str(), "w");
  if (file == nullptr) {
    std::fprintf(stderr, "cannot write the report %s\n", path.c_str());
    return false;
  }
  std::string const text = report.str() + "\n";
  bool const ok = std::fwrite(text.data(), 1, text.size(), file) == text.size();
  return std::fclose(file) == 0 && ok;
}

}  // namespace harness
