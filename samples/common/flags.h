// Command-line flags for Loom's programs: each flag is declared once with its variable, a
// value name and a help line, and that one declaration drives parsing, validation and
// --help. Flags take the form `--name value` or `--name=value`; switches take no value.
// A flag may also have a one-letter short form (alias()), taken as `-x value` or `-xvalue`,
// for programs that mirror the command line of an established tool (nccl-tests' -b 8).
//
// A bad command line is the user's mistake, not the program's: parse() prints what was
// wrong (naming the flag and the value, and what was expected) and the usage to stderr and
// exits with status 2. --help prints the usage to stdout and exits 0.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace loom::samples {

class Flags {
 public:
  Flags(std::string program, std::string summary);

  // Integers and numbers, checked against [min, max].
  void add(const std::string& name, int64_t* value, const std::string& help, int64_t min = INT64_MIN,
           int64_t max = INT64_MAX);
  void add(const std::string& name, double* value, const std::string& help, double min = -1e308, double max = 1e308);
  // A string; `choices`, when given, lists the accepted values.
  void add(const std::string& name, std::string* value, const std::string& help,
           std::vector<std::string> choices = {}, std::string value_name = "");
  // A switch: present means true (and --no-<name> means false).
  void add_switch(const std::string& name, bool* value, const std::string& help);
  // Makes `-<letter>` another spelling of the flag `name` (declared before).
  void alias(char letter, const std::string& name);

  // Parses argv (exiting on --help or a mistake, see above); returns the positional arguments.
  std::vector<std::string> parse(int argc, char** argv);
  // Whether the user gave `name` on the command line (so a default may be chosen later).
  bool given(const std::string& name) const;

  std::string usage() const;
  [[noreturn]] void fail(const std::string& problem) const;

 private:
  struct Flag {
    std::string name, value_name, help, default_text;
    char letter = 0;  // the short form's letter, 0 for none
    bool is_switch = false;
    bool given = false;
    std::function<std::string(const std::string&)> set = nullptr;  // returns a problem, or ""
  };
  Flag* find(const std::string& name);

  std::string program_, summary_;
  std::vector<Flag> flags_;
};

}  // namespace loom::samples
