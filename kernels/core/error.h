// Errors. LOOM_CHECK is for what a user can get wrong (shapes, files, flags): it throws
// loom::Error with a message that says what was expected. LOOM_ASSERT is for Loom's own
// invariants: failing one is a bug in Loom, and its message says so.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace loom {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
inline void append(std::ostringstream&) {}
template <class T, class... Rest>
void append(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append(os, rest...);
}
template <class... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  append(os, args...);
  return os.str();
}
[[noreturn]] void throw_error(const std::string& message);
[[noreturn]] void throw_internal(const char* cond, const char* file, int line, const std::string& message);
}  // namespace detail

}  // namespace loom

#define LOOM_CHECK(cond, ...) \
  do {                        \
    if (!(cond)) [[unlikely]] \
      ::loom::detail::throw_error(::loom::detail::str(__VA_ARGS__)); \
  } while (0)

#define LOOM_ASSERT(cond, ...) \
  do {                         \
    if (!(cond)) [[unlikely]]  \
      ::loom::detail::throw_internal(#cond, __FILE__, __LINE__, ::loom::detail::str(__VA_ARGS__)); \
  } while (0)

#define LOOM_FAIL(...) ::loom::detail::throw_error(::loom::detail::str(__VA_ARGS__))
