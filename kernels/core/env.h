// Loom's switches from the environment (LOOM_GEMM_TUNE=0, LOOM_CUDNN_GRAPH=0, ...): each is
// read once, where it is used, through env_is.
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
