#include "parallel/diagnostics/json.h"

#include <cmath>
#include <cstdio>

namespace loom::dist::diagnostics {
namespace {

void write_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += {'\\', char(c)};
    } else if (c >= 0x20) {
      out += char(c);
    } else {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", unsigned(c));
      out += escaped;
    }
  }
  out += '"';
}

void write_number(std::string& out, double v) {
  if (!std::isfinite(v)) {
    out += "null";
    return;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  out += buf;
}

}  // namespace

Json& Json::set(const std::string& key, Json value) {
  auto& object = std::get<Object>(v_);
  for (auto& [k, v] : object)
    if (k == key) {
      v = std::move(value);
      return *this;
    }
  object.emplace_back(key, std::move(value));
  return *this;
}

Json& Json::push(Json value) {
  std::get<Array>(v_).push_back(std::move(value));
  return *this;
}

void Json::write(std::string& out, const Layout& layout, int depth) const {
  auto newline = [&](int d) {
    if (layout.indent > 0) out += "\n" + std::string(size_t(layout.indent * d), ' ');
  };
  const bool spaced = layout.indent == 0 && layout.spaced;
  const auto* object = std::get_if<Object>(&v_);
  const auto* array = std::get_if<Array>(&v_);
  if (object || array) {
    const size_t n = object ? object->size() : array->size();
    out += object ? '{' : '[';
    for (size_t k = 0; k < n; ++k) {
      if (k) out += spaced ? ", " : ",";
      newline(depth + 1);
      if (object) {
        write_string(out, (*object)[k].first);
        out += layout.indent > 0 || spaced ? ": " : ":";
      }
      (object ? (*object)[k].second : (*array)[k]).write(out, layout, depth + 1);
    }
    if (n > 0) newline(depth);
    out += object ? '}' : ']';
  } else if (auto b = std::get_if<bool>(&v_)) {
    out += *b ? "true" : "false";
  } else if (auto i = std::get_if<int64_t>(&v_)) {
    out += std::to_string(*i);
  } else if (auto d = std::get_if<double>(&v_)) {
    write_number(out, *d);
  } else if (auto str = std::get_if<std::string>(&v_)) {
    write_string(out, *str);
  } else {
    out += "null";
  }
}

std::string Json::dump(int indent) const {
  std::string out;
  write(out, {indent, false}, 0);
  return out;
}

std::string Json::dump_line() const {
  std::string out;
  write(out, {0, true}, 0);
  return out;
}

}  // namespace loom::dist::diagnostics
