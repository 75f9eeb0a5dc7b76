// Samplers: which examples an epoch visits, and in what order.
//
// An epoch's order is a pure function of the sampler's settings and the epoch number, which
// is an argument of indices() rather than state set beforehand. PyTorch's DistributedSampler
// keeps the epoch as state (set_epoch), and a forgotten call silently repeats epoch 0's order
// every epoch; here there is nothing to forget, and the DataLoader, the only caller in a
// training loop, passes the epoch it is asked for.
#pragma once

#include <cstdint>
#include <vector>

namespace loom::data {

class Sampler {
 public:
  virtual ~Sampler() = default;
  // Indices into the dataset for `epoch`, in visiting order.
  virtual std::vector<int64_t> indices(int64_t epoch) const = 0;
  // How many indices every epoch gives.
  virtual int64_t size() const = 0;
};

// 0, 1, ..., n - 1 every epoch (evaluation).
class SequentialSampler : public Sampler {
 public:
  explicit SequentialSampler(int64_t dataset_size);
  std::vector<int64_t> indices(int64_t epoch) const override;
  int64_t size() const override { return n_; }

 private:
  int64_t n_;
};

// A permutation of 0..n-1 drawn from (seed, epoch): a new order every epoch, the same order
// for the same seed and epoch.
class RandomSampler : public Sampler {
 public:
  RandomSampler(int64_t dataset_size, uint64_t seed);
  std::vector<int64_t> indices(int64_t epoch) const override;
  int64_t size() const override { return n_; }

 private:
  int64_t n_;
  uint64_t seed_;
};

// The permutation of 0..n-1 that RandomSampler(n, seed) gives for `epoch` (Fisher-Yates over
// CounterRng(seed, epoch, 0, sampler)).
std::vector<int64_t> random_permutation(int64_t n, uint64_t seed, int64_t epoch);

enum class Shuffle : bool { no = false, yes = true };
enum class DropLast : bool { no = false, yes = true };

// One rank's shard of the dataset, as PyTorch's DistributedSampler: every rank builds the same
// order (a permutation from seed and epoch, or 0..n-1), makes its length a multiple of
// world_size — padding with indices from its start when drop_last is no, cutting the tail
// when it is yes — and takes positions rank, rank + world_size, ... So ranks' shards are
// disjoint, except for the padding, and all have size() indices, which keeps the ranks'
// collectives in step.
class DistributedSampler : public Sampler {
 public:
  DistributedSampler(int64_t dataset_size, int rank, int world_size, Shuffle shuffle = Shuffle::yes,
                     uint64_t seed = 0, DropLast drop_last = DropLast::no);
  std::vector<int64_t> indices(int64_t epoch) const override;
  int64_t size() const override { return per_rank_; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

 private:
  int64_t n_;
  int rank_, world_size_;
  Shuffle shuffle_;
  uint64_t seed_;
  DropLast drop_last_;
  int64_t per_rank_;
};

}  // namespace loom::data
