// Checkpoint metadata as text (checkpoint_text.h).
#include "layers/checkpoint_text.h"

#include <charconv>
#include <cstdio>
#include <sstream>

#include "engine/ops.h"
#include "kernels/core/error.h"

namespace loom::nn::checkpoint_text {

std::string exact(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

template <class T>
T parse(const std::string& file, const std::string& key, const std::string& text) {
  T v{};
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  const bool whole = !text.empty() && ec == std::errc() && end == text.data() + text.size();
  if constexpr (std::is_same_v<T, int64_t>)
    LOOM_CHECK(whole && v >= 0, file, ": checkpoint entry ", key, " = '", text, "' is not a whole number >= 0");
  else if constexpr (std::is_same_v<T, uint64_t>)
    LOOM_CHECK(whole, file, ": checkpoint entry ", key, " = '", text, "' is not an unsigned 64-bit integer");
  else
    LOOM_CHECK(whole, file, ": checkpoint entry ", key, " = '", text, "' is not a number");
  return v;
}

template double parse<double>(const std::string&, const std::string&, const std::string&);
template int64_t parse<int64_t>(const std::string&, const std::string&, const std::string&);
template uint64_t parse<uint64_t>(const std::string&, const std::string&, const std::string&);

const std::string& entry(const Metadata& meta, const std::string& file, const std::string& key) {
  auto it = meta.find(key);
  LOOM_CHECK(it != meta.end(), file, ": the checkpoint has no entry ", key);
  return it->second;
}

Metadata under(const Metadata& meta, const std::string& prefix) {
  Metadata out;
  for (auto it = meta.lower_bound(prefix); it != meta.end() && it->first.starts_with(prefix); ++it)
    out.emplace(it->first.substr(prefix.size()), it->second);
  return out;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s;
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s;
}

std::vector<int64_t> parse_shape(const std::string& text, const std::string& where) {
  std::vector<int64_t> shape;
  LOOM_CHECK(!text.ends_with(','), where, ": the shape '", text, "' is not a list of sizes");
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, ',');) {
    LOOM_CHECK(!part.empty() && part.find_first_not_of("0123456789") == std::string::npos, where, ": the shape '",
               text, "' is not a list of sizes");
    shape.push_back(parse<int64_t>(where, "shape", part));
  }
  return shape;
}

void write_schedule(Metadata& meta, const optim::LRScheduler& schedule) {
  for (const auto& [key, v] : schedule.state_dict()) meta["scheduler." + key] = exact(v);
}

std::map<std::string, double> read_schedule(const Metadata& meta, const std::string& file) {
  std::map<std::string, double> out;
  for (const auto& [key, v] : under(meta, "scheduler.")) out[key] = parse<double>(file, "scheduler." + key, v);
  return out;
}

void write_generator(Metadata& meta) {
  const auto [seed, offset] = rng_state();
  meta["rng.seed"] = std::to_string(seed);
  meta["rng.offset"] = std::to_string(offset);
}

std::optional<std::pair<uint64_t, uint64_t>> read_generator(const Metadata& meta, const std::string& file) {
  if (!meta.count("rng.seed") || !meta.count("rng.offset")) return std::nullopt;
  return std::pair{parse<uint64_t>(file, "rng.seed", meta.at("rng.seed")),
                   parse<uint64_t>(file, "rng.offset", meta.at("rng.offset"))};
}

}  // namespace loom::nn::checkpoint_text
