#include "samples/common/flags.h"

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace loom::samples {
namespace {

std::string number_text(double v) {
  std::ostringstream s;
  s << v;
  return s.str();
}

}  // namespace

Flags::Flags(std::string program, std::string summary) : program_(std::move(program)), summary_(std::move(summary)) {}

Flags::Flag* Flags::find(const std::string& name) {
  for (Flag& f : flags_)
    if (f.name == name) return &f;
  return nullptr;
}

void Flags::add(const std::string& name, int64_t* value, const std::string& help, int64_t min, int64_t max) {
  Flag f{name, "N", help, std::to_string(*value)};
  f.set = [=](const std::string& text) -> std::string {
    int64_t v = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (text.empty() || ec != std::errc() || end != text.data() + text.size())
      return "expects an integer, got '" + text + "'";
    if (v < min || v > max) {
      std::string range = max == INT64_MAX ? "at least " + std::to_string(min)
                                           : "between " + std::to_string(min) + " and " + std::to_string(max);
      return "must be " + range + ", got " + text;
    }
    *value = v;
    return "";
  };
  flags_.push_back(std::move(f));
}

void Flags::add(const std::string& name, double* value, const std::string& help, double min, double max) {
  Flag f{name, "X", help, number_text(*value)};
  f.set = [=](const std::string& text) -> std::string {
    char* end = nullptr;
    double v = std::strtod(text.c_str(), &end);
    if (text.empty() || *end) return "expects a number, got '" + text + "'";
    if (!(v >= min && v <= max)) {
      std::string range = max >= 1e308 ? "at least " + number_text(min)
                                       : "between " + number_text(min) + " and " + number_text(max);
      return "must be " + range + ", got " + text;
    }
    *value = v;
    return "";
  };
  flags_.push_back(std::move(f));
}

void Flags::add(const std::string& name, std::string* value, const std::string& help, std::vector<std::string> choices,
                std::string value_name) {
  std::string shown = value_name;
  if (shown.empty()) {
    for (size_t i = 0; i < choices.size(); ++i) shown += (i ? "|" : "") + choices[i];
    if (shown.empty()) shown = "VALUE";
  }
  Flag f{name, shown, help, *value};
  f.set = [=](const std::string& text) -> std::string {
    if (!choices.empty()) {
      bool ok = false;
      for (const auto& c : choices) ok = ok || c == text;
      if (!ok) return "expects one of " + shown + ", got '" + text + "'";
    }
    *value = text;
    return "";
  };
  flags_.push_back(std::move(f));
}

void Flags::add_switch(const std::string& name, bool* value, const std::string& help) {
  Flag f{name, "", help, *value ? "on" : "off"};
  f.is_switch = true;
  f.set = [=](const std::string& text) -> std::string {
    *value = text == "true";
    return "";
  };
  flags_.push_back(std::move(f));
}

void Flags::alias(char letter, const std::string& name) {
  Flag* f = find(name);
  if (!f) {
    std::fprintf(stderr, "%s: alias -%c names no declared flag --%s\n", program_.c_str(), letter, name.c_str());
    std::abort();
  }
  f->letter = letter;
}

std::string Flags::usage() const {
  std::ostringstream s;
  s << "usage: " << program_ << " [flags]\n" << summary_ << "\n\nflags:\n";
  for (const Flag& f : flags_) {
    std::string head = f.letter ? std::string("  -") + f.letter + ", --" : std::string("  --");
    head += f.name + (f.is_switch ? "" : " " + f.value_name);
    s << head;
    s << std::string(head.size() < 30 ? 30 - head.size() : 1, ' ') << f.help;
    if (!f.default_text.empty()) s << " (default: " << f.default_text << ")";
    s << "\n";
  }
  s << "  --help" << std::string(24, ' ') << "print this help and exit\n";
  return s.str();
}

void Flags::fail(const std::string& problem) const {
  std::fprintf(stderr, "%s: %s\n(run %s --help for every flag)\n", program_.c_str(), problem.c_str(),
               program_.c_str());
  std::exit(2);
}

std::vector<std::string> Flags::parse(int argc, char** argv) {
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::fputs(usage().c_str(), stdout);
      std::exit(0);
    }
    std::string name, value;
    bool has_value = false;
    Flag* f = nullptr;
    if (arg.size() >= 2 && arg[0] == '-' && arg[1] != '-') {
      for (Flag& candidate : flags_)
        if (candidate.letter == arg[1]) f = &candidate;
      if (!f) {
        positional.push_back(arg);
        continue;
      }
      name = f->name;
      has_value = arg.size() > 2;  // -b8
      value = arg.substr(2);
    } else if (!arg.starts_with("--")) {
      positional.push_back(arg);
      continue;
    } else {
      name = arg.substr(2);
      if (auto eq = name.find('='); eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
        has_value = true;
      }
      f = find(name);
    }
    bool negated = false;
    if (!f && name.starts_with("no-")) {
      f = find(name.substr(3));
      negated = f && f->is_switch;
      if (!negated) f = nullptr;
    }
    if (!f) fail("unknown flag --" + name);
    if (f->is_switch) {
      if (has_value) fail("--" + name + " is a switch and takes no value");
      f->set(negated ? "false" : "true");
    } else {
      if (!has_value) {
        if (i + 1 >= argc) fail("--" + name + " needs a value (" + f->value_name + ")");
        value = argv[++i];
      }
      if (std::string problem = f->set(value); !problem.empty()) fail("--" + name + " " + problem);
    }
    f->given = true;
  }
  return positional;
}

bool Flags::given(const std::string& name) const {
  for (const Flag& f : flags_)
    if (f.name == name) return f.given;
  return false;
}

}  // namespace loom::samples
