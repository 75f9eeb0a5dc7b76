// One option changed for a scope, the others as they are:
//   OptionWith guard(&Options::fused_bias_sums, false);
#pragma once

#include "engine/options.h"

namespace loom::test {

class OptionWith {
 public:
  OptionWith(bool Options::*field, bool value) : guard_(changed(field, value)) {}

 private:
  static Options changed(bool Options::*field, bool value) {
    Options o = options();
    o.*field = value;
    return o;
  }
  OptionsGuard guard_;
};

}  // namespace loom::test
