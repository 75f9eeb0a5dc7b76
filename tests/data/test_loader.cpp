// DataLoader on the CPU: batches equal to a reference built example by example, whatever the
// number of workers; order, drop_last, resuming mid-epoch, errors from workers, the
// tensor-op (resident) path, prefetch bounds and stall time.
#include <atomic>
#include <chrono>
#include <thread>

#include "data/loader.h"
#include "tests/data/fixtures.h"

namespace loom::data {
namespace {

using test::synthetic_images;

struct HostBatch {
  Shape input_shape;
  std::vector<float> inputs;
  std::vector<int64_t> targets;
};

// The batches of `epoch`, built by stacking Dataset::get in the sampler's order.
std::vector<HostBatch> reference(const Dataset& ds, const Sampler& sampler, int64_t epoch, int64_t batch_size,
                                 DropLast drop_last) {
  const std::vector<int64_t> order = sampler.indices(epoch);
  std::vector<HostBatch> out;
  for (size_t first = 0; first < order.size(); first += size_t(batch_size)) {
    const size_t rows = std::min(order.size() - first, size_t(batch_size));
    if (drop_last == DropLast::yes && rows < size_t(batch_size)) break;
    HostBatch b;
    b.input_shape = {int64_t(rows)};
    for (int64_t d : ds.spec().input_shape) b.input_shape.push_back(d);
    for (size_t j = 0; j < rows; ++j) {
      const Example ex = ds.get(order[first + j], epoch);
      const std::vector<float> in = ex.input.to_vector<float>();
      b.inputs.insert(b.inputs.end(), in.begin(), in.end());
      b.targets.push_back(int64_t(ex.target.item()));
    }
    out.push_back(std::move(b));
  }
  return out;
}

void expect_batches(Epoch& epoch, const std::vector<HostBatch>& expected, int64_t first_index = 0) {
  size_t k = 0;
  for (Batch& batch : epoch) {
    ASSERT_LT(k, expected.size()) << "more batches than expected";
    SCOPED_TRACE(testing::Message() << "batch " << batch.index);
    EXPECT_EQ(batch.index, first_index + int64_t(k));
    EXPECT_EQ(batch.inputs.shape(), expected[k].input_shape);
    EXPECT_EQ(batch.inputs.dtype(), DType::f32);
    EXPECT_EQ(batch.targets.dtype(), DType::i64);
    EXPECT_EQ(batch.inputs.to_vector<float>(), expected[k].inputs);
    EXPECT_EQ(batch.targets.to_vector<int64_t>(), expected[k].targets);
    ++k;
  }
  EXPECT_EQ(k, expected.size());
}

std::shared_ptr<ImageDataset> augmented_dataset(int64_t count) {
  return std::make_shared<ImageDataset>(
      synthetic_images(count, 3, 4, 4),
      ImageTransforms{{random_crop(4, 1), random_horizontal_flip()}, Normalization{{0.5f, 0.4f, 0.3f}, {0.2f, 0.25f, 0.3f}}, 17});
}

TEST(DataLoader, BatchesEqualTheReferenceForAnyNumberOfWorkers) {
  const auto ds = augmented_dataset(23);
  const auto sampler = std::make_shared<RandomSampler>(23, 3);
  for (int workers : {0, 1, 3}) {
    for (int prefetch : {1, 4}) {
      SCOPED_TRACE(testing::Message() << workers << " workers, prefetch " << prefetch);
      const DataLoader loader(ds, sampler, {.batch_size = 5, .num_workers = workers, .prefetch = prefetch});
      EXPECT_EQ(loader.num_batches(), 5);
      for (int64_t e : {0, 1}) {
        Epoch epoch = loader.epoch(e);
        EXPECT_EQ(epoch.epoch(), e);
        EXPECT_EQ(epoch.num_batches(), 5);
        expect_batches(epoch, reference(*ds, *sampler, e, 5, DropLast::no));
      }
    }
  }
}

TEST(DataLoader, EpochsDifferInOrderAndAugmentation) {
  const auto ds = augmented_dataset(12);
  const DataLoader loader(ds, std::make_shared<RandomSampler>(12, 3), {.batch_size = 12});
  const Batch a = *loader.epoch(0).next(), b = *loader.epoch(1).next(), again = *loader.epoch(0).next();
  EXPECT_NE(a.targets.to_vector<int64_t>(), b.targets.to_vector<int64_t>());
  EXPECT_EQ(a.inputs.to_vector<float>(), again.inputs.to_vector<float>());
}

TEST(DataLoader, DropLastDropsOnlyAShortFinalBatch) {
  const auto ds = augmented_dataset(23);
  const auto sampler = std::make_shared<SequentialSampler>(23);
  for (DropLast drop : {DropLast::no, DropLast::yes}) {
    const DataLoader loader(ds, sampler, {.batch_size = 5, .num_workers = 2, .drop_last = drop});
    EXPECT_EQ(loader.num_batches(), drop == DropLast::yes ? 4 : 5);
    Epoch epoch = loader.epoch(0);
    expect_batches(epoch, reference(*ds, *sampler, 0, 5, drop));
  }
  const DataLoader even(ds, std::make_shared<SequentialSampler>(20), {.batch_size = 5, .drop_last = DropLast::yes});
  EXPECT_EQ(even.num_batches(), 4);
}

TEST(DataLoader, StartingAtABatchResumesTheSameBatches) {
  const auto ds = augmented_dataset(23);
  const auto sampler = std::make_shared<RandomSampler>(23, 8);
  for (int workers : {0, 2}) {
    const DataLoader loader(ds, sampler, {.batch_size = 4, .num_workers = workers});
    std::vector<HostBatch> full = reference(*ds, *sampler, 2, 4, DropLast::no);
    Epoch resumed = loader.epoch(2, 3);
    EXPECT_EQ(resumed.num_batches(), 6);
    expect_batches(resumed, std::vector<HostBatch>(full.begin() + 3, full.end()), 3);
    EXPECT_FALSE(loader.epoch(2, 6).next().has_value());  // resuming at the very end
    EXPECT_LOOM_ERROR(loader.epoch(2, 7), "start_batch 7 is out of range", "6 batches");
  }
}

TEST(DataLoader, AnExceptionInATransformReachesTheConsumerWithItsMessage) {
  ImageSet set = synthetic_images(12, 1, 2, 2);
  for (int64_t i = 0; i < 12; ++i) set.pixels[size_t(i * 4)] = i == 7 ? 255 : 0;
  const Transform fragile = [](Image& im, CounterRng&) {
    LOOM_CHECK(im.pixels[0] != 255, "corrupt image: bad pixel");
  };
  const auto ds = std::make_shared<ImageDataset>(set, ImageTransforms{{fragile}, {}, 0});
  for (int workers : {0, 1, 3}) {
    SCOPED_TRACE(testing::Message() << workers << " workers");
    const DataLoader loader(ds, std::make_shared<SequentialSampler>(12), {.batch_size = 4, .num_workers = workers});
    Epoch epoch = loader.epoch(0);
    const std::optional<Batch> first = epoch.next();
    ASSERT_TRUE(first.has_value());
    EXPECT_EQ(first->index, 0);
    EXPECT_LOOM_ERROR(epoch.next(), "corrupt image: bad pixel", "example 7", "batch 1 of epoch 0");
    EXPECT_LOOM_ERROR(epoch.next(), "corrupt image: bad pixel");  // the epoch stays stopped there
  }
}

TEST(DataLoader, ASamplerBeyondTheDatasetIsAnError) {
  const auto ds = augmented_dataset(5);
  const DataLoader loader(ds, std::make_shared<SequentialSampler>(8), {.batch_size = 4, .num_workers = 1});
  Epoch epoch = loader.epoch(0);
  EXPECT_TRUE(epoch.next().has_value());
  EXPECT_LOOM_ERROR(epoch.next(), "the sampler gave index 5 but the dataset has 5 examples");
}

TEST(DataLoader, ResidentBatchesOnTheCpuEqualTheWorkers) {
  const auto ds = std::make_shared<ImageDataset>(synthetic_images(21, 3, 5, 5),
                                                 ImageTransforms{{}, cifar10_normalization(), 0});
  const auto sampler = std::make_shared<RandomSampler>(21, 4);
  const DataLoader resident(ds, sampler, {.batch_size = 8, .gpu_resident = GpuResident::yes});
  for (int64_t e : {0, 1}) {
    Epoch epoch = resident.epoch(e);
    expect_batches(epoch, reference(*ds, *sampler, e, 8, DropLast::no));
  }
  Epoch resumed = resident.epoch(1, 2);
  expect_batches(resumed, {reference(*ds, *sampler, 1, 8, DropLast::no)[2]}, 2);

  const auto plain = std::make_shared<ImageDataset>(synthetic_images(6, 1, 2, 2));
  const DataLoader unnormalized(plain, std::make_shared<SequentialSampler>(6),
                                {.batch_size = 6, .gpu_resident = GpuResident::yes});
  Epoch epoch = unnormalized.epoch(0);
  expect_batches(epoch, reference(*plain, SequentialSampler(6), 0, 6, DropLast::no));
}

TEST(DataLoader, ResidentModeRefusesWhatItCannotRun) {
  EXPECT_LOOM_ERROR(DataLoader(augmented_dataset(4), std::make_shared<SequentialSampler>(4),
                               {.gpu_resident = GpuResident::yes}),
                    "cannot run the dataset's 2 augmentation(s)", "gpu_resident = no");
  TokenShard shard;
  shard.tokens.assign(20, 1);
  EXPECT_LOOM_ERROR(DataLoader(std::make_shared<TokenWindowDataset>(shard, 4), std::make_shared<SequentialSampler>(4),
                               {.gpu_resident = GpuResident::yes}),
                    "gpu_resident needs an ImageDataset");
}

TEST(DataLoader, TokenWindowsBatchAsInt64) {
  TokenShard shard;
  for (int t = 0; t < 41; ++t) shard.tokens.push_back(uint16_t(t * 3));
  const auto ds = std::make_shared<TokenWindowDataset>(shard, 8);
  const DataLoader loader(ds, std::make_shared<SequentialSampler>(ds->size()),
                          {.batch_size = 2, .num_workers = 2, .drop_last = DropLast::yes});
  Epoch epoch = loader.epoch(0);
  int64_t k = 0;
  for (Batch& b : epoch) {
    EXPECT_EQ(b.inputs.dtype(), DType::i64);
    EXPECT_EQ(b.inputs.shape(), (Shape{2, 8}));
    EXPECT_EQ(b.targets.shape(), (Shape{2, 8}));
    const std::vector<int64_t> in = b.inputs.to_vector<int64_t>(), tg = b.targets.to_vector<int64_t>();
    for (size_t i = 0; i < in.size(); ++i) {
      EXPECT_EQ(in[i], int64_t(3 * (16 * k + int64_t(i))));
      EXPECT_EQ(tg[i], in[i] + 3);
    }
    ++k;
  }
  EXPECT_EQ(k, 2);  // 5 windows of 8 in 41 tokens, in batches of 2: the short last one dropped
}

// Records the largest index built and can be slowed down.
class WatchedDataset : public Dataset {
 public:
  explicit WatchedDataset(int64_t n, std::chrono::milliseconds delay = {}) : n_(n), delay_(delay) {}
  int64_t size() const override { return n_; }
  ExampleSpec spec() const override { return {{1}, DType::f32, {}}; }
  void get_into(int64_t index, int64_t, void* input, int64_t* target) const override {
    std::this_thread::sleep_for(delay_);
    int64_t seen = max_index.load();
    while (index > seen && !max_index.compare_exchange_weak(seen, index)) {
    }
    *static_cast<float*>(input) = float(index);
    *target = index;
  }
  mutable std::atomic<int64_t> max_index{-1};

 private:
  int64_t n_;
  std::chrono::milliseconds delay_;
};

TEST(DataLoader, WorkersStayWithinThePrefetchWindow) {
  const auto ds = std::make_shared<WatchedDataset>(50);
  const DataLoader loader(ds, std::make_shared<SequentialSampler>(50),
                          {.batch_size = 1, .num_workers = 3, .prefetch = 2});
  Epoch epoch = loader.epoch(0);
  EXPECT_EQ(epoch.next()->targets.to_vector<int64_t>(), std::vector<int64_t>{0});
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  // Batch 0 taken: batches 1 and 2 may be claimed, batch 3 not before batch 1 is taken.
  EXPECT_LE(ds->max_index.load(), 2);
  EXPECT_EQ(epoch.next()->targets.to_vector<int64_t>(), std::vector<int64_t>{1});
}

TEST(DataLoader, StallTimeCountsWaitingForData) {
  const auto ds = std::make_shared<WatchedDataset>(6, std::chrono::milliseconds(10));
  const DataLoader loader(ds, std::make_shared<SequentialSampler>(6), {.batch_size = 2, .num_workers = 0});
  Epoch epoch = loader.epoch(0);
  EXPECT_EQ(epoch.stall_seconds(), 0.0);
  while (epoch.next()) {
  }
  EXPECT_GE(epoch.stall_seconds(), 0.05);  // six examples of 10 ms, built while the consumer waited
}

TEST(DataLoader, LeavingAnEpochEarlyStopsItsWorkers) {
  const auto ds = std::make_shared<WatchedDataset>(1000, std::chrono::milliseconds(2));
  const DataLoader loader(ds, std::make_shared<SequentialSampler>(1000),
                          {.batch_size = 4, .num_workers = 3, .prefetch = 6});
  const auto start = std::chrono::steady_clock::now();
  {
    Epoch epoch = loader.epoch(0);
    epoch.next();
    Epoch moved = std::move(epoch);  // the workers follow the state
    EXPECT_EQ(moved.next()->index, 1);
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_LT(ds->max_index.load(), 4 * 8 + 4);  // never ran ahead past the window
}

TEST(DataLoader, ChecksItsOptions) {
  const auto ds = augmented_dataset(4);
  const auto sampler = std::make_shared<SequentialSampler>(4);
  EXPECT_LOOM_ERROR(DataLoader(ds, sampler, {.batch_size = 0}), "batch_size must be >= 1");
  EXPECT_LOOM_ERROR(DataLoader(ds, sampler, {.num_workers = -1}), "num_workers must be >= 0");
  EXPECT_LOOM_ERROR(DataLoader(ds, sampler, {.prefetch = 0}), "prefetch must be >= 1");
  EXPECT_LOOM_ERROR(DataLoader(nullptr, sampler, {}), "dataset is null");
  if (!cuda_available()) EXPECT_LOOM_ERROR(DataLoader(ds, sampler, {.device = Device::cuda(0)}), "cuda:0");
}

}  // namespace
}  // namespace loom::data
