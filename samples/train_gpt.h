// What train_gpt's two files share: its options and the steps both runs take.
// train_gpt.cpp holds the flags, the data and the plain, DDP and FSDP runs;
// train_gpt_pipeline.cpp the --pp run.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "data/loader.h"
#include "data/text.h"
#include "layers/models/gpt.h"
#include "parallel/init.h"
#include "samples/common/flags.h"
#include "samples/common/metrics.h"

namespace loom::train_gpt {

struct Options {
  std::string config = "auto", data = data::kFortunesDir, shards, precision = "auto", device = "auto";
  std::string save, resume, metrics = "train_gpt.jsonl", plot = "train_gpt.svg", prompt = "Q: ";
  std::string schedule = "1f1b", trace, reshard_after_forward = "yes";
  int64_t pp = 1, dp = 0, microbatches = 0, stages_per_rank = 2, min_params = 0, hsdp = 1;
  int64_t epochs = 0, batch_size = 16, context = 128, seed = 0, workers = 2, max_steps = 0, gpus = 0;
  int64_t generate = 300, top_k = 40, timeout_s = 600, scaling = 0;
  double lr = 1e-3, weight_decay = 0.1, clip = 1.0, temperature = 0.8;
  bool recompute = false, allow_nonfinite = false, fsdp = false, graph = true;
};

// Samples `count` bytes after `prompt` (temperature, top-k) with the model on `device`.
std::string generate(nn::GPT& model, const std::string& prompt, int64_t count, double temperature, int64_t top_k,
                     Device device, uint64_t seed);

// The mean of the validation batches' losses, with no gradient: every rank (every pipeline)
// evaluates them all. Summed on the device and read once, so validation does not wait for the
// GPU per batch.
double validation_loss(data::DataLoader& val_loader, const std::optional<DType>& autocast,
                       const std::function<Tensor(const data::Batch&)>& loss);

// An epoch's end as both runs record it: a line of metrics (--metrics, rank 0) and the
// train and validation curves redrawn into --plot (rank 0).
class EpochLog {
 public:
  EpochLog(const Options& o, bool main_rank);
  // `extra` fields follow the common ones in the metrics line.
  void record(int64_t epoch, int64_t step, double train_loss, double val_loss, double tokens_per_s,
              const std::string& device, const samples::MetricRecord& extra = {});

 private:
  const Options& o_;
  bool main_rank_;
  samples::MetricsLog metrics_;
  std::vector<std::pair<double, double>> train_curve_, val_curve_;
};

// The entries a checkpoint carries: where the data stands (the next epoch and batch, the step
// count), and the settings a resumed run must share.
std::map<std::string, std::string> saved_entries(const Options& o, int world_size, int64_t train_windows, int64_t epoch,
                                                 int64_t batch, int64_t step);

// A pipeline checkpoint's entries with "pipelines", its run's data-parallel pipelines (its
// ranks over its --pp), which its data position depends on.
std::map<std::string, std::string> with_pipelines(const samples::Flags& flags, const std::string& path,
                                                  std::map<std::string, std::string> entries);

// The --pp run (train_gpt_pipeline.cpp).
int train_pipelined(Options& o, dist::DistContext& ctx, const nn::GPTConfig& config, const samples::Flags& flags,
                    data::DataLoader& train_loader, data::DataLoader& val_loader, int64_t steps_per_epoch,
                    int64_t total_steps, int64_t train_windows);

}  // namespace loom::train_gpt
