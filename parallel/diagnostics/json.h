// Loom's one JSON writer: the doctor's report, the benchmarks' result files and the training
// programs' metrics lines all build a Json value and write it out, so every file Loom writes
// escapes strings and spells numbers the same way.
//
// Writing only (the safetensors header, a layer below, keeps its own strict reader and writer
// in engine/serialization.cpp). Objects keep their keys in insertion order, so a report reads in
// the order it was built; setting a key again replaces its value in place. Numbers are
// written as %.6g and non-finite ones as null (JSON has no NaN or infinity), strings with
// '"', '\' and control characters escaped (the latter as \u00XX).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace loom::dist::diagnostics {

class Json {
  using Object = std::vector<std::pair<std::string, Json>>;
  using Array = std::vector<Json>;

 public:
  Json() = default;  // null
  Json(bool v) : v_(v) {}
  Json(int v) : v_(int64_t(v)) {}
  Json(int64_t v) : v_(v) {}
  Json(uint64_t v) : v_(int64_t(v)) {}
  Json(double v) : v_(v) {}
  Json(const char* v) : v_(std::string(v)) {}
  Json(std::string v) : v_(std::move(v)) {}
  static Json object() { return Json(Object{}); }
  static Json array() { return Json(Array{}); }

  Json& set(const std::string& key, Json value);  // objects
  Json& push(Json value);                         // arrays

  // Compact with indent 0 ({"a":1,"b":[2]}), else one member per line, nested by `indent`
  // spaces: the layout for a report a person opens.
  std::string dump(int indent = 0) const;
  // One line with a space after each ',' and ':' ({"a": 1, "b": [2]}), as Python's json.dumps
  // writes it: the layout of JSON-lines files, which people grep and tools follow as they grow.
  std::string dump_line() const;

 private:
  struct Layout {
    int indent = 0;       // > 0: one member per line
    bool spaced = false;  // a space after ',' and ':' on one line
  };
  explicit Json(Object v) : v_(std::move(v)) {}
  explicit Json(Array v) : v_(std::move(v)) {}
  void write(std::string& out, const Layout& layout, int depth) const;
  std::variant<std::monostate, bool, int64_t, double, std::string, Object, Array> v_;
};

}  // namespace loom::dist::diagnostics
