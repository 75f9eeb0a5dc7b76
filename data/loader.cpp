#include "data/loader.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "engine/autograd.h"
#include "engine/ops.h"
#include "kernels/core/error.h"

namespace loom::data {

namespace detail {

// What every epoch of one loader shares; immutable once built.
struct LoaderCore {
  std::shared_ptr<const Dataset> dataset;
  std::shared_ptr<const Sampler> sampler;
  LoaderOptions options;
  ExampleSpec spec;
  bool pinned = false;  // stage batches in pinned memory (GPU-bound, pin_memory yes)
  // GPU-resident mode: the whole dataset on options.device.
  bool resident = false;
  Tensor images;     // (N, C, H, W) u8
  Tensor labels;     // (N,) i64
  Tensor scale;      // () f32: 255
  Tensor mean, std;  // (1, C, 1, 1) f32; undefined without normalisation

  int64_t num_batches(int64_t n) const {
    const int64_t B = options.batch_size;
    return options.drop_last == DropLast::yes ? n / B : (n + B - 1) / B;
  }
};

// A batch in host memory, as a worker hands it over (or the error that stopped it).
struct HostBatch {
  Tensor inputs, targets;
  std::exception_ptr error;
};

struct EpochState {
  std::shared_ptr<const LoaderCore> core;
  int64_t epoch = 0, num_batches = 0;
  std::vector<int64_t> order;  // the sampler's indices for this epoch

  std::mutex mu;
  std::condition_variable built;  // a batch was put into `ready`
  std::condition_variable taken;  // the consumer moved on, or the epoch is stopping
  int64_t next_claim = 0;         // next batch a worker will build
  int64_t next_take = 0;          // next batch the consumer will take
  std::map<int64_t, HostBatch> ready;
  bool stopping = false;
  std::vector<std::thread> workers;

  // Consumer-side only.
  std::exception_ptr failed;  // the error of the batch the epoch stopped at
  int64_t ahead_index = -1;   // batch whose upload has already started
  std::optional<PendingCopy> ahead_inputs, ahead_targets;
  double stall = 0;
};

}  // namespace detail

using detail::EpochState;
using detail::HostBatch;
using detail::LoaderCore;

namespace {

using Clock = std::chrono::steady_clock;

Shape batch_shape(int64_t rows, const Shape& example) {
  Shape s{rows};
  s.insert(s.end(), example.begin(), example.end());
  return s;
}

// Builds batch b of the epoch on the host; runs on worker threads.
HostBatch build_batch(const LoaderCore& core, const std::vector<int64_t>& order, int64_t epoch, int64_t b) {
  HostBatch out;
  try {
    const ExampleSpec& spec = core.spec;
    const int64_t B = core.options.batch_size, first = b * B;
    const int64_t rows = std::min<int64_t>(B, int64_t(order.size()) - first);
    const Shape in_shape = batch_shape(rows, spec.input_shape), target_shape = batch_shape(rows, spec.target_shape);
    if (core.pinned) {
      set_current_device(core.options.device);  // pinned memory is allocated under the loader's device
      out.inputs = pinned_empty(in_shape, spec.input_dtype);
      out.targets = pinned_empty(target_shape, DType::i64);
    } else {
      out.inputs = Tensor::empty(in_shape, spec.input_dtype);
      out.targets = Tensor::empty(target_shape, DType::i64);
    }
    const size_t input_bytes = size_t(shape_numel(spec.input_shape)) * dtype_size(spec.input_dtype);
    const int64_t target_numel = shape_numel(spec.target_shape);
    char* inputs = static_cast<char*>(out.inputs.data_ptr());
    int64_t* targets = out.targets.data<int64_t>();
    const int64_t n = core.dataset->size();
    for (int64_t j = 0; j < rows; ++j) {
      const int64_t index = order[size_t(first + j)];
      try {
        LOOM_CHECK(index >= 0 && index < n, "the sampler gave index ", index, " but the dataset has ", n,
                   " examples: build the sampler with the dataset's size");
        core.dataset->get_into(index, epoch, inputs + j * input_bytes, targets + j * target_numel);
      } catch (const std::exception& e) {
        LOOM_FAIL("DataLoader: example ", index, " (batch ", b, " of epoch ", epoch, "): ", e.what());
      }
    }
  } catch (...) {
    out = HostBatch{};
    out.error = std::current_exception();
  }
  return out;
}

// Batch b of a GPU-resident loader: tensor ops on the compute stream, the same arithmetic as
// to_unit_range and normalize.
Batch resident_batch(const LoaderCore& core, const std::vector<int64_t>& order, int64_t b) {
  NoGradGuard no_grad;
  const int64_t B = core.options.batch_size, first = b * B;
  const int64_t rows = std::min<int64_t>(B, int64_t(order.size()) - first);
  const std::vector<int64_t> picked(order.begin() + first, order.begin() + first + rows);
  const Tensor index = from_vector(picked, {rows}, core.options.device);
  Tensor x = div(index_select(core.images, 0, index).to(DType::f32), core.scale);
  if (core.mean.defined()) x = div(sub(x, core.mean), core.std);
  return Batch{x, index_select(core.labels, 0, index), b};
}

void make_resident(LoaderCore& core) {
  const auto* images = dynamic_cast<const ImageDataset*>(core.dataset.get());
  LOOM_CHECK(images != nullptr,
             "gpu_resident needs an ImageDataset (8-bit images with labels); this dataset builds its examples on ",
             "the host: use gpu_resident = no");
  LOOM_CHECK(images->transforms().augment.empty(), "gpu_resident builds batches with tensor ops on the device and ",
             "cannot run the dataset's ", images->transforms().augment.size(),
             " augmentation(s) (random crop, flip, ...), which run on the host: use gpu_resident = no (worker threads) ",
             "or an ImageDataset without augmentations");
  const ImageSet& set = images->images();
  const Device device = core.options.device;
  NoGradGuard no_grad;
  // A view of the dataset's own pixels (read only, kept alive by core.dataset): no host copy.
  auto pixels = std::make_shared<Storage>(Device::cpu(), const_cast<uint8_t*>(set.pixels.data()), set.pixels.size(),
                                          nullptr);
  const Shape shape{set.count, set.channels, set.height, set.width};
  core.images = Tensor::from_storage(pixels, shape, contiguous_strides(shape), 0, DType::u8).to(device);
  core.labels = from_vector(set.labels, {set.count}, device);
  core.scale = scalar_tensor(255.0, DType::f32, device);
  const Normalization& norm = images->transforms().normalize;
  if (!norm.empty()) {
    const Shape per_channel{1, set.channels, 1, 1};
    core.mean = from_vector(norm.mean, per_channel, device);
    core.std = from_vector(norm.std, per_channel, device);
  }
  core.resident = true;
}

void worker_loop(EpochState* st) {
  const LoaderCore& core = *st->core;
  for (;;) {
    int64_t b;
    {
      std::unique_lock lock(st->mu);
      st->taken.wait(lock, [&] {
        return st->stopping || st->next_claim >= st->num_batches ||
               st->next_claim < st->next_take + core.options.prefetch;
      });
      if (st->stopping || st->next_claim >= st->num_batches) return;
      b = st->next_claim++;
    }
    HostBatch batch = build_batch(core, st->order, st->epoch, b);
    {
      std::lock_guard lock(st->mu);
      st->ready.emplace(b, std::move(batch));
    }
    st->built.notify_all();
  }
}

void stop_workers(EpochState& st) {
  {
    std::lock_guard lock(st.mu);
    st.stopping = true;
  }
  st.taken.notify_all();
  for (std::thread& t : st.workers) t.join();
  st.workers.clear();
}

// Starts the upload of batch b if a worker has built it, so that its copy overlaps the
// compute of the batch being returned now.
void upload_ahead(EpochState& st, int64_t b) {
  HostBatch batch;
  {
    std::lock_guard lock(st.mu);
    auto it = st.ready.find(b);
    if (it == st.ready.end() || it->second.error) return;
    batch = std::move(it->second);
    st.ready.erase(it);
  }
  const Device device = st.core->options.device;
  st.ahead_inputs = copy_to_device_async(batch.inputs, device);
  st.ahead_targets = copy_to_device_async(batch.targets, device);
  st.ahead_index = b;
}

}  // namespace

// ---- Epoch ----------------------------------------------------------------------------

Epoch::Epoch(std::unique_ptr<EpochState> state) : state_(std::move(state)) {}
Epoch::Epoch(Epoch&&) noexcept = default;
Epoch& Epoch::operator=(Epoch&& other) noexcept {
  if (this != &other) {
    if (state_) stop_workers(*state_);
    state_ = std::move(other.state_);
  }
  return *this;
}
Epoch::~Epoch() {
  if (state_) stop_workers(*state_);
}

int64_t Epoch::epoch() const { return state_->epoch; }
int64_t Epoch::num_batches() const { return state_->num_batches; }
double Epoch::stall_seconds() const { return state_->stall; }

std::optional<Batch> Epoch::next() {
  LOOM_CHECK(state_, "Epoch::next on a moved-from Epoch");
  EpochState& st = *state_;
  const LoaderCore& core = *st.core;
  if (st.failed) std::rethrow_exception(st.failed);
  const int64_t b = st.next_take;  // only the consumer changes next_take
  if (b >= st.num_batches) return std::nullopt;
  if (core.resident) {
    Batch batch = resident_batch(core, st.order, b);
    st.next_take = b + 1;
    return batch;
  }

  const Device device = core.options.device;
  if (st.ahead_index == b) {  // built and already uploading
    const PendingCopy inputs = *std::exchange(st.ahead_inputs, std::nullopt);
    const PendingCopy targets = *std::exchange(st.ahead_targets, std::nullopt);
    st.ahead_index = -1;
    {
      std::lock_guard lock(st.mu);
      st.next_take = b + 1;
    }
    st.taken.notify_all();
    upload_ahead(st, b + 1);
    return Batch{inputs.finish(), targets.finish(), b};
  }

  const auto start = Clock::now();
  HostBatch host;
  if (core.options.num_workers == 0) {
    host = build_batch(core, st.order, st.epoch, b);
  } else {
    std::unique_lock lock(st.mu);
    st.built.wait(lock, [&] { return st.ready.contains(b); });
    auto it = st.ready.find(b);
    host = std::move(it->second);
    st.ready.erase(it);
  }
  st.stall += std::chrono::duration<double>(Clock::now() - start).count();
  if (host.error) {
    st.failed = host.error;
    stop_workers(st);
    std::rethrow_exception(st.failed);
  }
  {
    std::lock_guard lock(st.mu);
    st.next_take = b + 1;
  }
  st.taken.notify_all();

  if (device.is_cpu()) return Batch{host.inputs, host.targets, b};
  const PendingCopy inputs = copy_to_device_async(host.inputs, device);
  const PendingCopy targets = copy_to_device_async(host.targets, device);
  if (core.options.num_workers > 0) upload_ahead(st, b + 1);
  return Batch{inputs.finish(), targets.finish(), b};
}

// ---- DataLoader -----------------------------------------------------------------------

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<const Sampler> sampler,
                       LoaderOptions options) {
  LOOM_CHECK(dataset != nullptr, "DataLoader: the dataset is null");
  LOOM_CHECK(sampler != nullptr, "DataLoader: the sampler is null");
  LOOM_CHECK(options.batch_size >= 1, "DataLoader: batch_size must be >= 1, got ", options.batch_size);
  LOOM_CHECK(options.num_workers >= 0, "DataLoader: num_workers must be >= 0, got ", options.num_workers);
  LOOM_CHECK(options.prefetch >= 1, "DataLoader: prefetch must be >= 1, got ", options.prefetch);
  auto core = std::make_shared<LoaderCore>();
  core->spec = dataset->spec();
  LOOM_CHECK(core->spec.input_dtype == DType::f32 || core->spec.input_dtype == DType::i64,
             "DataLoader: examples' inputs must be f32 or i64, the dataset gives ", dtype_name(core->spec.input_dtype));
  core->dataset = std::move(dataset);
  core->sampler = std::move(sampler);
  core->options = options;
  set_current_device(options.device);  // a missing GPU fails here, not in a worker
  core->pinned = options.device.is_cuda() && options.pin_memory == PinMemory::yes;
  if (options.gpu_resident == GpuResident::yes) make_resident(*core);
  core_ = std::move(core);
}

DataLoader::~DataLoader() = default;

int64_t DataLoader::num_batches() const { return core_->num_batches(core_->sampler->size()); }
const LoaderOptions& DataLoader::options() const { return core_->options; }

Epoch DataLoader::epoch(int64_t epoch, int64_t start_batch) const {
  LOOM_CHECK(epoch >= 0, "DataLoader::epoch: epoch must be >= 0, got ", epoch);
  auto st = std::make_unique<EpochState>();
  st->core = core_;
  st->epoch = epoch;
  st->order = core_->sampler->indices(epoch);
  st->num_batches = core_->num_batches(int64_t(st->order.size()));
  LOOM_CHECK(start_batch >= 0 && start_batch <= st->num_batches, "DataLoader::epoch: start_batch ", start_batch,
             " is out of range: the epoch has ", st->num_batches, " batches");
  if (core_->resident) {  // device-side index_select does not check its indices
    const int64_t n = core_->dataset->size();
    for (int64_t index : st->order)
      LOOM_CHECK(index >= 0 && index < n, "the sampler gave index ", index, " but the dataset has ", n,
                 " examples: build the sampler with the dataset's size");
  }
  st->next_claim = st->next_take = start_batch;
  const int64_t threads =
      core_->resident ? 0 : std::min<int64_t>(core_->options.num_workers, st->num_batches - start_batch);
  EpochState* raw = st.get();
  Epoch result(std::move(st));  // from here on, its destructor joins whatever was started
  for (int64_t i = 0; i < threads; ++i) raw->workers.emplace_back(worker_loop, raw);
  return result;
}

}  // namespace loom::data
