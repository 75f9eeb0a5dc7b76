// Layer-wise model parallelism in one process: a model's blocks are placed on a list of
// devices and the activations follow them, as the guide's model_parallel.py does with
// `.to(device)`. One process drives every device; a block runs on the device its weights
// live on, and the activation is copied there first. Tensor::to is differentiable, so
// backward retraces the copies in reverse: each gradient is copied back to the device its
// activation came from, and every parameter's gradient lands on the parameter's own device.
//
// Two policies assign blocks to devices:
//
//   round-robin (the guide's)   block i -> devices[i % n]
//     6 blocks on [a, b]:       a b a b a b      (an activation crosses devices 5 times)
//   contiguous                  blocks cut into n ranges of nearly equal length, in order
//     6 blocks on [a, b]:       a a a b b b      (one crossing)
//     6 blocks on [a, b, c, d]: a a b b c d      (the first ranges take the extra blocks)
//
// Round-robin is what the guide writes; contiguous is what one wants in practice, since each
// crossing is a copy and the devices still work one after another (nothing here overlaps
// them: that is what a pipeline of micro-batches adds, parallel/ and its schedules).
//
// Nothing here changes the arithmetic: a placed model computes the same values as the model
// on one device, up to the devices' own rounding (cpu,cpu is bitwise the unsplit model).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "module.h"

namespace loom::nn {

enum class PlacementPolicy { round_robin, contiguous };

// "round-robin" or "contiguous"; anything else throws naming the text and both choices.
PlacementPolicy parse_placement_policy(const std::string& text);
const char* placement_policy_name(PlacementPolicy policy);

// "cuda:0,cuda:1", "cuda:0,cpu", "cpu,cpu": devices separated by commas, each as
// Device::parse reads it. An empty list or entry, or an unknown device, throws naming the
// entry and what was expected.
std::vector<Device> parse_device_list(const std::string& text);

// The device of each of `blocks` blocks under `policy` (see the header comment).
std::vector<Device> assign_devices(size_t blocks, const std::vector<Device>& devices, PlacementPolicy policy);

// A model's blocks with the device each lives on. Construction moves every block to its
// device (Module::to, in place, so handles held elsewhere stay valid); forward() moves an
// activation to a block's device before running it. The model keeps owning the blocks.
class BlockPlacement {
 public:
  using NamedModules = std::vector<std::pair<std::string, std::shared_ptr<Module>>>;

  BlockPlacement() = default;
  // blocks[i] goes to devices[i]; the lists must have the same length.
  BlockPlacement(NamedModules blocks, std::vector<Device> devices);
  // The blocks over `devices` by `policy`.
  BlockPlacement(NamedModules blocks, const std::vector<Device>& devices, PlacementPolicy policy);

  // Block i's forward of x, with x moved to the block's device first.
  Tensor forward(size_t i, const Tensor& x) const;
  // Every block in order, each on its own device: the result is on the last block's device.
  Tensor forward(const Tensor& x) const;

  size_t size() const { return blocks_.size(); }
  Device device(size_t i) const { return devices_.at(i); }
  const NamedModules& blocks() const { return blocks_; }

  // The placement as a table, one row per block (name, device, parameters), then the
  // parameters and blocks per device, e.g.
  //   module    device   parameters
  //   blocks.0  cuda:0   3,152,384
  //   ...
  //   cuda:0: 3 modules, 9,457,152 parameters
  std::string table() const;

 private:
  NamedModules blocks_;
  std::vector<Device> devices_;
};

}  // namespace loom::nn
