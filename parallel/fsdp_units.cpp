// FSDP's units: the assignment fsdp_units.h describes.
#include "parallel/fsdp_units.h"

#include <functional>
#include <unordered_map>
#include <unordered_set>

#include "kernels/core/error.h"

namespace loom::dist {

std::vector<std::pair<std::string, nn::NamedTensors>> assign_fsdp_units(nn::Module& root, const FSDPOptions& options) {
  std::unordered_set<const TensorImpl*> claimed;
  std::vector<std::pair<std::string, nn::NamedTensors>> units;
  std::unordered_map<const nn::Module*, std::string> path;
  for (auto& [name, m] : root.named_modules()) path.emplace(m.get(), name);
  auto claim = [&](const std::string& prefix, nn::Module& m, nn::NamedTensors* into) {
    for (auto& [name, t] : m.named_parameters())
      if (claimed.insert(t.impl()).second) into->emplace_back(prefix.empty() ? name : prefix + "." + name, t);
  };
  if (!options.units.empty()) {
    for (const auto& modules : options.units) {
      std::string unit_name;
      nn::NamedTensors params;
      for (const auto& m : modules) {
        LOOM_CHECK(m && path.count(m.get()), "FSDP: a module of options.units is not part of the wrapped model");
        const std::string& prefix = path.at(m.get());
        LOOM_CHECK(!prefix.empty(), "FSDP: options.units names the root module; what no unit claims forms the root "
                   "unit already");
        unit_name += (unit_name.empty() ? "" : "+") + prefix;
        claim(prefix, *m, &params);
      }
      if (!params.empty()) units.emplace_back(unit_name, std::move(params));
    }
  } else if (options.min_num_params > 0) {
    // Bottom-up: returns how many parameters below `m` no unit has claimed yet.
    std::function<int64_t(nn::Module&, const std::string&)> visit = [&](nn::Module& m, const std::string& prefix) {
      for (auto& [name, child] : m.named_children()) visit(*child, prefix.empty() ? name : prefix + "." + name);
      int64_t free_params = 0;
      for (auto& [_, t] : m.named_parameters())
        if (!claimed.count(t.impl())) free_params += t.numel();
      if (&m != &root && free_params >= options.min_num_params) {
        nn::NamedTensors params;
        claim(prefix, m, &params);
        units.emplace_back(prefix, std::move(params));
        return int64_t(0);
      }
      return free_params;
    };
    visit(root, "");
  }
  nn::NamedTensors rest;
  claim("", root, &rest);
  if (!rest.empty()) units.emplace_back("", std::move(rest));
  return units;
}

}  // namespace loom::dist
