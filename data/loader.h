// DataLoader: batches of a Dataset in a Sampler's order, on the device training runs on.
//
//   DataLoader loader(dataset, sampler, {.batch_size = 128, .num_workers = 4, .device = Device::cuda()});
//   for (int64_t e = 0; e < epochs; ++e)
//     for (Batch& batch : loader.epoch(e)) step(batch.inputs, batch.targets);
//
// Each epoch runs its own worker threads. A worker claims the next batch number, writes its
// examples into one host buffer (pinned when the batch goes to a GPU) and hands it over;
// at most `prefetch` batches are claimed ahead of the consumer, and the consumer takes them
// in order, so the result does not depend on the number of workers. Batches bound for a GPU
// are copied on the device's upload stream (engine/pinned.h), one batch ahead of the one
// being returned, so the copy of the next batch overlaps the compute of this one; the
// compute stream waits for a batch's copy by an event when the batch is returned, never the
// host. The time the consumer spent blocked waiting for a batch is the epoch's stall: a
// trainer that sees it grow has a GPU starved by its input pipeline.
//
// GPU-resident mode, for datasets that fit in device memory (Fashion-MNIST is 47 MB, CIFAR-10
// 150 MB): the 8-bit images and labels go to the device once, and each batch is an
// index_select, a conversion and a normalisation on the compute stream, with no worker and
// no copy. It applies to an ImageDataset without augmentations (they run on the host), and
// refuses one with them. On the CPU the same ops build the batch in host memory.
//
// An exception in a worker (a corrupt image, a failing transform) reaches the consumer when
// it asks for that batch, with the example's index and the original message; the batches
// before it are delivered first. Destroying an Epoch stops and joins its workers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>

#include "dataset.h"
#include "sampler.h"
#include "../engine/pinned.h"

namespace loom::data {

enum class PinMemory : bool { no = false, yes = true };
enum class GpuResident : bool { no = false, yes = true };

struct LoaderOptions {
  int64_t batch_size = 64;
  // Threads that build batches; 0 builds each batch on the consumer's thread when asked.
  int num_workers = 2;
  // Batches claimed by workers and not yet taken by the consumer, at most; at least
  // num_workers keeps every worker busy.
  int prefetch = 4;
  DropLast drop_last = DropLast::no;  // drop a last batch smaller than batch_size
  Device device = Device::cpu();
  PinMemory pin_memory = PinMemory::yes;  // stage GPU-bound batches in pinned host memory
  GpuResident gpu_resident = GpuResident::no;
};

struct Batch {
  Tensor inputs;      // (B, ...input_shape) on the loader's device, e.g. (B, C, H, W) f32
  Tensor targets;     // (B, ...target_shape) i64, e.g. (B,)
  int64_t index = 0;  // which batch of the epoch: a checkpoint taken after it resumes at index + 1
};

namespace detail {
struct LoaderCore;
struct EpochState;
}  // namespace detail

// One pass over the data. Move-only; destroying it stops and joins its workers.
class Epoch {
 public:
  explicit Epoch(std::unique_ptr<detail::EpochState> state);
  Epoch(Epoch&&) noexcept;
  Epoch& operator=(Epoch&&) noexcept;
  ~Epoch();

  // The next batch, or nothing at the end of the epoch. Rethrows a worker's error.
  std::optional<Batch> next();
  int64_t epoch() const;
  int64_t num_batches() const;  // in the whole epoch, including any skipped at the start
  // Seconds the consumer spent in next() waiting for a batch that was not ready yet.
  double stall_seconds() const;

  class iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    iterator(Epoch* epoch, std::optional<Batch> current) : epoch_(epoch), current_(std::move(current)) {}
    Batch& operator*() { return *current_; }
    iterator& operator++() {
      current_ = epoch_->next();
      return *this;
    }
    bool operator==(std::default_sentinel_t) const { return !current_.has_value(); }

   private:
    Epoch* epoch_;
    std::optional<Batch> current_;
  };
  iterator begin() { return iterator(this, next()); }
  std::default_sentinel_t end() { return {}; }

 private:
  std::unique_ptr<detail::EpochState> state_;
};

class DataLoader {
 public:
  DataLoader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<const Sampler> sampler, LoaderOptions options);
  ~DataLoader();

  // The batches of `epoch` from batch `start_batch` on (0 <= start_batch <= num_batches()),
  // to resume a checkpointed run mid-epoch. The epoch is passed to the sampler and to the
  // transforms, so every epoch has its own order and augmentations.
  Epoch epoch(int64_t epoch, int64_t start_batch = 0) const;
  int64_t num_batches() const;
  const LoaderOptions& options() const;

 private:
  std::shared_ptr<const detail::LoaderCore> core_;
};

}  // namespace loom::data
