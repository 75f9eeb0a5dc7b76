// The metadata of Loom's checkpoints as text, shared by the single-file training checkpoints
// (checkpoint.h) and the sharded and pipeline checkpoints (parallel/sharded_checkpoint.h,
// parallel/pipeline_checkpoint.h). Numbers are written as decimal text that reads back to the
// same value and read back with an error naming the file and the entry; every kind keeps the
// learning-rate schedule's state ("scheduler.<key>") and the random generator's ("rng.seed",
// "rng.offset") the same way.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "optim/schedule.h"

namespace loom::nn::checkpoint_text {

using Metadata = std::map<std::string, std::string>;

// Decimal text that reads back to the same double.
std::string exact(double v);

// Entry `key` of `file`'s metadata read as a number: double, int64_t (>= 0) or uint64_t.
// Malformed text is a loom::Error naming the file, the entry and the text.
template <class T>
T parse(const std::string& file, const std::string& key, const std::string& text);

// Entry `key` of `meta`; a missing one names the file.
const std::string& entry(const Metadata& meta, const std::string& file, const std::string& key);
// The entries under `prefix`, prefix removed.
Metadata under(const Metadata& meta, const std::string& prefix);
// The items of a comma-separated entry ("a.weight,a.bias"), empty items skipped.
std::vector<std::string> split_list(const std::string& text);
// A shape as "768,3072" ("" for a scalar), and read back; a malformed one names `where`.
std::string shape_text(const std::vector<int64_t>& shape);
std::vector<int64_t> parse_shape(const std::string& text, const std::string& where);

// The schedule's state as "scheduler.<key>" entries, and read back (empty when there is none).
void write_schedule(Metadata& meta, const optim::LRScheduler& schedule);
std::map<std::string, double> read_schedule(const Metadata& meta, const std::string& file);

// The generator's state now as "rng.seed" and "rng.offset", and read back (none when absent).
void write_generator(Metadata& meta);
std::optional<std::pair<uint64_t, uint64_t>> read_generator(const Metadata& meta, const std::string& file);

}  // namespace loom::nn::checkpoint_text
