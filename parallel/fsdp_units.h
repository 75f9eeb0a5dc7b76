// FSDP's units (fsdp.h, step 1): which parameters each unit holds, from FSDPOptions' lists of
// modules or its size policy (min_num_params, bottom-up: a module whose parameters no unit
// has claimed yet number at least min_num_params becomes a unit). A parameter tied to two
// modules belongs to the unit that claims it first; what no unit claims forms the root unit.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "../layers/module.h"
#include "fsdp.h"

namespace loom::dist {

// Each unit's name (its module paths joined by '+', "" for the root) and parameters under the
// model's names, in order, the root unit last (absent when every parameter is claimed).
std::vector<std::pair<std::string, nn::NamedTensors>> assign_fsdp_units(nn::Module& root, const FSDPOptions& options);

}  // namespace loom::dist
