// The harness's results: one entry per check (group, name, passed, detail), the GPU dump index
// and the --check-shapes verdicts, written as JSON (--report FILE) and printed as PASS/FAIL lines.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace harness {

// A JSON object built field by field (values are escaped; raw values are JSON already).
class JsonObject {
 public:
  JsonObject& add(std::string const& key, std::string const& value);
  JsonObject& add(std::string const& key, char const* value) { return add(key, std::string(value)); }
  JsonObject& add(std::string const& key, int64_t value);
  JsonObject& add(std::string const& key, int32_t value) { return add(key, int64_t(value)); }
  JsonObject& add(std::string const& key, bool value);
  JsonObject& add(std::string const& key, double value);
  JsonObject& addRaw(std::string const& key, std::string const& json);
  std::string str() const { return "{" + mBody + "}"; }

 private:
  std::string mBody;
};
std::string jsonString(std::string const& text);
std::string jsonArray(std::vector<std::string> const& rawItems);

// Records a check under the current group; returns ok.
bool check(bool ok, std::string const& name, std::string const& detail = {});

// Sets the group of the checks recorded while it lives (groups nest: the inner one wins).
class Group {
 public:
  explicit Group(std::string name);
  ~Group();
  Group(Group const&) = delete;
  Group& operator=(Group const&) = delete;

 private:
  std::string mPrevious;
};

// Groups every complete run of this mode must contain (written into the report, so that a reader
// can tell a group that found nothing to check from one that did not run).
void requireGroup(std::string const& name);
void addDump(JsonObject const& entry);
void addShapeCase(JsonObject const& entry);

int passedCount();
int failedCount();
// Writes the report; false (with a message on stderr) when the file cannot be written.
bool writeReport(std::string const& path, std::string const& mode);

}  // namespace harness
