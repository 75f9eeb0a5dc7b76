#include "engine/options.h"

#include <atomic>

namespace loom {
namespace {

// One atomic per option: ops read them on every call from any thread, and a read never
// sees a half-written value. Relaxed order: an option guards no other memory.
struct Stored {
  std::atomic<bool> deterministic{Options{}.deterministic};
  std::atomic<bool> hopper_attention{Options{}.hopper_attention};
  std::atomic<bool> gemm_autotuning{Options{}.gemm_autotuning};
  std::atomic<bool> cudnn_graph_api{Options{}.cudnn_graph_api};
  std::atomic<bool> conv_autotuning{Options{}.conv_autotuning};
  std::atomic<bool> autocast_weight_copies{Options{}.autocast_weight_copies};
  std::atomic<bool> autocast_gradient_copies{Options{}.autocast_gradient_copies};
  std::atomic<bool> fused_bias_sums{Options{}.fused_bias_sums};
};

Stored stored;

}  // namespace

Options options() {
  constexpr auto relaxed = std::memory_order_relaxed;
  return {.deterministic = stored.deterministic.load(relaxed),
          .hopper_attention = stored.hopper_attention.load(relaxed),
          .gemm_autotuning = stored.gemm_autotuning.load(relaxed),
          .cudnn_graph_api = stored.cudnn_graph_api.load(relaxed),
          .conv_autotuning = stored.conv_autotuning.load(relaxed),
          .autocast_weight_copies = stored.autocast_weight_copies.load(relaxed),
          .autocast_gradient_copies = stored.autocast_gradient_copies.load(relaxed),
          .fused_bias_sums = stored.fused_bias_sums.load(relaxed)};
}

void set_options(const Options& o) {
  constexpr auto relaxed = std::memory_order_relaxed;
  stored.deterministic.store(o.deterministic, relaxed);
  stored.hopper_attention.store(o.hopper_attention, relaxed);
  stored.gemm_autotuning.store(o.gemm_autotuning, relaxed);
  stored.cudnn_graph_api.store(o.cudnn_graph_api, relaxed);
  stored.conv_autotuning.store(o.conv_autotuning, relaxed);
  stored.autocast_weight_copies.store(o.autocast_weight_copies, relaxed);
  stored.autocast_gradient_copies.store(o.autocast_gradient_copies, relaxed);
  stored.fused_bias_sums.store(o.fused_bias_sums, relaxed);
}

OptionsGuard::OptionsGuard(const Options& o) : previous_(options()) { set_options(o); }

OptionsGuard::~OptionsGuard() { set_options(previous_); }

}  // namespace loom
