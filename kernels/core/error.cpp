#include "kernels/core/error.h"

namespace loom::detail {

void throw_error(const std::string& message) { throw Error(message); }

void throw_internal(const char* cond, const char* file, int line, const std::string& message) {
  throw Error(str("internal error in Loom (please report it): ", cond, " failed at ", file, ":", line,
                  message.empty() ? "" : ": ", message));
}

}  // namespace loom::detail
