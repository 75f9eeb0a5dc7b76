// Settings read from the environment, where PyTorch users expect to set them (LOOM_DIST_DEBUG=1,
// as TORCH_DISTRIBUTED_DEBUG): each is read where it is used, through env_is. Choices between
// faster and more reproducible computations are not read here: a program sets them through
// the API and ops pass them down in the kernels' arguments, so a test can flip them.
#pragma once

#include <cstdlib>
#include <string_view>

namespace loom {

// True when the environment variable `name` is set to exactly `value`.
inline bool env_is(const char* name, std::string_view value) {
  const char* set = std::getenv(name);
  return set && value == set;
}

}  // namespace loom
