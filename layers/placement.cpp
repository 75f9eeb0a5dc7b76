// Block placement (placement.h): the policies, the device-list parser and the table.
#include "layers/placement.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>

namespace loom::nn {
namespace {

// 1234567 -> "1,234,567"
std::string grouped(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace

PlacementPolicy parse_placement_policy(const std::string& text) {
  if (text == "round-robin") return PlacementPolicy::round_robin;
  if (text == "contiguous") return PlacementPolicy::contiguous;
  LOOM_FAIL("unknown placement '", text, "': expected round-robin or contiguous");
}

const char* placement_policy_name(PlacementPolicy policy) {
  return policy == PlacementPolicy::round_robin ? "round-robin" : "contiguous";
}

std::vector<Device> parse_device_list(const std::string& text) {
  LOOM_CHECK(!text.empty(), "empty device list: expected devices separated by commas, such as cuda:0,cuda:1 or cpu,cpu");
  std::vector<Device> out;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    const std::string entry = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    LOOM_CHECK(!entry.empty(), "device list '", text, "' has an empty entry: expected devices separated by commas, ",
               "such as cuda:0,cuda:1 or cpu,cpu");
    try {
      out.push_back(Device::parse(entry));
    } catch (const Error&) {
      LOOM_FAIL("device list '", text, "': '", entry, "' is not a device; expected cpu, cuda or cuda:N");
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

std::vector<Device> assign_devices(size_t blocks, const std::vector<Device>& devices, PlacementPolicy policy) {
  LOOM_CHECK(!devices.empty(), "assign_devices: no devices to place ", blocks, " blocks on");
  const size_t n = devices.size();
  std::vector<Device> out(blocks);
  for (size_t i = 0; i < blocks; ++i) {
    if (policy == PlacementPolicy::round_robin) {
      out[i] = devices[i % n];
    } else {
      // Ranges of blocks / n, the first blocks % n of them one longer.
      const size_t base = blocks / n, extra = blocks % n;
      const size_t long_end = extra * (base + 1);
      out[i] = devices[i < long_end ? i / (base + 1) : extra + (i - long_end) / std::max<size_t>(base, 1)];
    }
  }
  return out;
}

BlockPlacement::BlockPlacement(NamedModules blocks, std::vector<Device> devices)
    : blocks_(std::move(blocks)), devices_(std::move(devices)) {
  LOOM_CHECK(blocks_.size() == devices_.size(), "BlockPlacement: ", blocks_.size(), " blocks but ", devices_.size(),
             " devices; give one device a block");
  for (size_t i = 0; i < blocks_.size(); ++i) {
    LOOM_CHECK(blocks_[i].second != nullptr, "BlockPlacement: block ", blocks_[i].first, " is null");
    blocks_[i].second->to(devices_[i]);
  }
}

BlockPlacement::BlockPlacement(NamedModules blocks, const std::vector<Device>& devices, PlacementPolicy policy)
    : BlockPlacement(blocks, assign_devices(blocks.size(), devices, policy)) {}

Tensor BlockPlacement::forward(size_t i, const Tensor& x) const {
  LOOM_CHECK(i < blocks_.size(), "BlockPlacement: block ", i, " is past the last of ", blocks_.size());
  return blocks_[i].second->forward(x.to(devices_[i]));
}

Tensor BlockPlacement::forward(const Tensor& x) const {
  Tensor h = x;
  for (size_t i = 0; i < blocks_.size(); ++i) h = forward(i, h);
  return h;
}

std::string BlockPlacement::table() const {
  size_t name_width = 5;
  for (const auto& [name, _] : blocks_) name_width = std::max(name_width, name.size());
  std::ostringstream os;
  char line[256];
  std::snprintf(line, sizeof line, "%-*s  %-8s  %s\n", int(name_width), "module", "device", "parameters");
  os << line;
  std::vector<std::string> order;  // devices in order of first use
  std::map<std::string, std::pair<int, int64_t>> per_device;  // device -> (blocks, parameters)
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const std::string device = devices_[i].str();
    const int64_t params = blocks_[i].second->num_parameters();
    std::snprintf(line, sizeof line, "%-*s  %-8s  %s\n", int(name_width), blocks_[i].first.c_str(), device.c_str(),
                  grouped(params).c_str());
    os << line;
    if (!per_device.count(device)) order.push_back(device);
    per_device[device].first += 1;
    per_device[device].second += params;
  }
  for (const std::string& device : order)
    os << device << ": " << per_device[device].first << (per_device[device].first == 1 ? " module, " : " modules, ")
       << grouped(per_device[device].second) << " parameters\n";
  return os.str();
}

}  // namespace loom::nn
