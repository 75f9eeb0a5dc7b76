#include "data/sampler.h"

#include <numeric>
#include <utility>

#include "data/random.h"
#include "kernels/core/error.h"

namespace loom::data {

namespace {

void check_size(int64_t n, const char* sampler) {
  LOOM_CHECK(n >= 0, sampler, ": the dataset size must be >= 0, got ", n);
}

std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), int64_t{0});
  return v;
}

}  // namespace

std::vector<int64_t> random_permutation(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> v = iota(n);
  CounterRng rng(seed, epoch, 0, RngDomain::sampler);
  for (int64_t i = n - 1; i > 0; --i) std::swap(v[size_t(i)], v[size_t(rng.below(i + 1))]);
  return v;
}

SequentialSampler::SequentialSampler(int64_t dataset_size) : n_(dataset_size) {
  check_size(n_, "SequentialSampler");
}

std::vector<int64_t> SequentialSampler::indices(int64_t) const { return iota(n_); }

RandomSampler::RandomSampler(int64_t dataset_size, uint64_t seed) : n_(dataset_size), seed_(seed) {
  check_size(n_, "RandomSampler");
}

std::vector<int64_t> RandomSampler::indices(int64_t epoch) const { return random_permutation(n_, seed_, epoch); }

DistributedSampler::DistributedSampler(int64_t dataset_size, int rank, int world_size, Shuffle shuffle, uint64_t seed,
                                       DropLast drop_last)
    : n_(dataset_size), rank_(rank), world_size_(world_size), shuffle_(shuffle), seed_(seed), drop_last_(drop_last) {
  check_size(n_, "DistributedSampler");
  LOOM_CHECK(world_size_ >= 1, "DistributedSampler: world_size must be >= 1, got ", world_size_);
  LOOM_CHECK(rank_ >= 0 && rank_ < world_size_, "DistributedSampler: rank ", rank_, " is out of range for world_size ",
             world_size_, " (expected 0 to ", world_size_ - 1, ")");
  const int64_t w = world_size_;
  // As PyTorch: drop the tail that does not fill a round, or pad the last round.
  per_rank_ = drop_last_ == DropLast::yes ? n_ / w : (n_ + w - 1) / w;
}

std::vector<int64_t> DistributedSampler::indices(int64_t epoch) const {
  const std::vector<int64_t> order = shuffle_ == Shuffle::yes ? random_permutation(n_, seed_, epoch) : iota(n_);
  std::vector<int64_t> mine;
  mine.reserve(size_t(per_rank_));
  for (int64_t k = 0; k < per_rank_; ++k) {
    const int64_t pos = k * world_size_ + rank_;  // position in the padded (or cut) order
    mine.push_back(order[size_t(pos % n_)]);     // positions past n_ wrap to the start: the padding
  }
  return mine;
}

}  // namespace loom::data
