// gather_state_dicts: the header of a rank's tensors as text, then the tensors (pipeline_gather.h).
#include "parallel/pipeline_gather.h"

#include <cstring>
#include <sstream>
#include <string>

#include "engine/autograd.h"
#include "engine/ops.h"

namespace loom::dist::pipeline {

namespace {

constexpr int kHeaderTag = 7001, kTensorTag = 7002;

// One line per tensor: "name<TAB>dtype<TAB>d0,d1,...".
std::string header_of(const nn::NamedTensors& tensors) {
  std::ostringstream out;
  for (const auto& [name, t] : tensors) {
    out << name << '\t' << int(t.dtype()) << '\t';
    for (size_t i = 0; i < t.shape().size(); ++i) out << (i ? "," : "") << t.shape()[i];
    out << '\n';
  }
  return out.str();
}

// Empty tensors of the names, dtypes and shapes a header lists, on `device`.
nn::NamedTensors tensors_of(const std::string& header, Device device, int from) {
  nn::NamedTensors out;
  std::istringstream in(header);
  for (std::string line; std::getline(in, line);) {
    const size_t a = line.find('\t'), b = line.find('\t', a + 1);
    LOOM_CHECK(a != std::string::npos && b != std::string::npos, "gather_state_dicts: rank ", from,
               " sent a header line that is not name, dtype, shape: '", line, "'");
    Shape shape;
    std::istringstream dims(line.substr(b + 1));
    for (std::string d; std::getline(dims, d, ',');) shape.push_back(std::stoll(d));
    out.emplace_back(line.substr(0, a),
                     Tensor::empty(shape, DType(std::stoi(line.substr(a + 1, b - a - 1))), device));
  }
  return out;
}

}  // namespace

nn::NamedTensors gather_state_dicts(ProcessGroup& group, const std::vector<std::shared_ptr<nn::Module>>& modules) {
  nn::NamedTensors mine;
  for (const auto& m : modules)
    for (auto& entry : m->state_dict()) mine.push_back(entry);
  return gather_state_dicts(group, mine);
}

nn::NamedTensors gather_state_dicts(ProcessGroup& group, const nn::NamedTensors& given) {
  NoGradGuard no_grad;
  nn::NamedTensors mine;
  for (const auto& [name, t] : given) mine.emplace_back(name, t.contiguous());
  const Device device = mine.empty() ? Device::cpu() : mine.front().second.device();
  if (group.rank() != 0) {
    const std::string header = header_of(mine);
    Tensor bytes = Tensor::empty({int64_t(header.size())}, DType::u8);
    std::memcpy(bytes.data_ptr(), header.data(), header.size());
    Tensor length = from_vector(std::vector<int64_t>{int64_t(header.size())}, {1}).to(device);
    group.send(length, 0, kHeaderTag)->wait();
    group.send(bytes.to(device), 0, kHeaderTag)->wait();
    for (const auto& [_, t] : mine) group.send(t, 0, kTensorTag)->wait();
    return {};
  }
  nn::NamedTensors all = mine;
  for (int r = 1; r < group.size(); ++r) {
    Tensor length = Tensor::empty({1}, DType::i64, device);
    group.recv(length, r, kHeaderTag)->wait();
    Tensor bytes = Tensor::empty({int64_t(length.to(Device::cpu()).item())}, DType::u8, device);
    group.recv(bytes, r, kHeaderTag)->wait();
    const Tensor host = bytes.to(Device::cpu());
    const std::string text(static_cast<const char*>(host.data_ptr()), size_t(host.numel()));
    for (auto& [name, t] : tensors_of(text, device, r)) {
      group.recv(t, r, kTensorTag)->wait();
      all.emplace_back(name, t);
    }
  }
  return all;
}

}  // namespace loom::dist::pipeline
