// bench_gpt: training throughput of a GPT on one GPU, the figure samples/bench_gpt_torch.py
// measures for PyTorch (eager and torch.compile) with the same model, batch and optimizer:
// AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1 on the matrices only), bf16 autocast over
// f32 master weights, random tokens already on the GPU. A step is forward, loss, backward and
// the optimizer step. Each step is bracketed by CUDA events (no host synchronisation between
// steps) and the median step is reported, with tokens/s, MFU and peak memory:
//   FLOPs per token = 6 N + 12 L d T   (N parameters, L layers, d width, T sequence)
//   MFU = tokens/s x FLOPs per token / 989e12   (H200 dense bf16)
//   bench_gpt [--config gpt2-124m|gpt2-350m] [--batch 16] [--seq 1024] [--precision bf16|f32]
//             [--warmup N] [--steps N] [--loss-chunk-rows N]
//             [--ddp | --fsdp | --pipeline | --graph] [--json FILE] [--profile-step]
//             [--deterministic] [--no-weight-copies] [--no-gradient-copies] [--no-hopper-attention]
// A --seq longer than the config's context (1024 for GPT-2) grows the model's position table
// to it, GPT-2 124M at T = 2048 or 4096, and with it the parameter count the MFU formula
// takes; bench_gpt_torch.py does the same.
// --ddp measures what data parallelism costs on one GPU: the same model is stepped plainly and
// through DistributedDataParallel (NCCL, world size 1) in alternating rounds within one run,
// so both see the same clocks and memory state, and the two medians are compared. --fsdp does
// the same for FullyShardedDataParallel (parallel/fsdp.h; NCCL, world size 1; one unit per
// block and one for the embeddings, ZeRO-3, prefetch on; with bf16, its mixed precision: bf16
// parameters gathered from f32 shards, gradients reduced in f32): what sharding's gathers,
// copies and hooks cost when there is nobody to share with. --pipeline
// does the same for the pipeline machinery (parallel/pipeline.h): the model built as one
// GPTStage and stepped through a Pipeline of one stage and one micro-batch (NCCL, world size
// 1), what a pipeline adds when it has nothing to overlap. --graph compares the eager step
// with the same step captured as one CUDA graph and replayed (layers/optim/captured_step.h),
// on the same model and optimizer: what the kernel launches and the gaps between them cost.
// --profile-step runs one more step between cudaProfilerStart and cudaProfilerStop, so that
// `ncu --profile-from-start off` (or nsys's cudaProfilerApi capture range) sees exactly one
// steady-state step.
// --deterministic, --no-weight-copies, --no-gradient-copies and --no-hopper-attention set the
// options of engine/options.h, to measure what each costs or saves.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "engine/allocator.h"
#include "engine/autocast.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "engine/options.h"
#include "layers/layers.h"
#include "layers/optim/captured_step.h"
#include "parallel/fsdp.h"
#include "parallel/gpt_pipeline.h"
#include "parallel/ddp.h"
#include "samples/common/flags.h"
#include "samples/common/metrics.h"
#include "samples/common/step_timing.h"

using namespace loom;
using samples::median;


int main(int argc, char** argv) {
  std::string config_name = "gpt2-124m", precision = "bf16", json;
  int64_t batch = 16, seq = 1024, warmup = 10, steps = 50, loss_chunk_rows = 0;
  bool ddp = false, fsdp = false, pipeline = false, graph = false, components = false, profile_step = false;
  Options run_options = options();
  samples::Flags flags("bench_gpt", "Training throughput of a GPT on the GPU with random tokens.");
  flags.add("config", &config_name, "model size", {"gpt2-124m", "gpt2-350m", "guide", "tiny"});
  flags.add("batch", &batch, "sequences per step", 1);
  flags.add("seq", &seq, "tokens per sequence (beyond the config's context, the position table grows)", 1);
  flags.add("precision", &precision, "bf16 autocast over f32 weights, or f32 (TF32 products)", {"bf16", "f32"});
  flags.add("warmup", &warmup, "untimed steps first", 0);
  flags.add("loss-chunk-rows", &loss_chunk_rows,
            "rows of logits the loss makes at a time (0: its choice; at least batch x seq: one chunk)", 0);
  flags.add("steps", &steps, "timed steps (with --ddp, --fsdp, --pipeline or --graph: per mode)", 2);
  flags.add_switch("ddp", &ddp, "also step through DistributedDataParallel (NCCL, one rank) and compare");
  flags.add_switch("fsdp", &fsdp, "also step the model through FullyShardedDataParallel (NCCL, one rank) and compare");
  flags.add_switch("pipeline", &pipeline,
                   "also step the model as a one-stage pipeline (NCCL, one rank) and compare");
  flags.add_switch("graph", &graph, "also step the model as one captured CUDA graph and compare");
  flags.add_switch("profile-step", &profile_step, "after the timed steps, one step inside cudaProfilerStart/Stop");
  flags.add_switch("components", &components, "also time each part of the model (forward, forward + backward)");
  flags.add("json", &json, "append the results here as JSON lines", {}, "FILE");
  flags.add_switch("deterministic", &run_options.deterministic, "attention's backward without atomics");
  flags.add_switch("weight-copies", &run_options.autocast_weight_copies, "keep autocast's bf16 weight copies");
  flags.add_switch("gradient-copies", &run_options.autocast_gradient_copies,
                   "LayerNorm's backward keeps the bf16 gradient a product reads");
  flags.add_switch("fused-bias-sums", &run_options.fused_bias_sums,
                   "LayerNorm's backward also sums the gradient it writes for a linear layer's bias");
  flags.add_switch("hopper-attention", &run_options.hopper_attention,
                   "attention on Hopper's warpgroup products on an H100 or H200");
  if (const std::vector<std::string> positional = flags.parse(argc, argv); !positional.empty())
    flags.fail("unexpected argument '" + positional[0] + "': this program takes only --flags");
  set_options(run_options);
  if (int(ddp) + int(fsdp) + int(pipeline) + int(graph) > 1)
    flags.fail("--ddp, --fsdp, --pipeline and --graph each compare with plain steps: give one");
  constexpr int kEagerFirst = 2;  // CapturedStep's eager steps before its capture
  if (graph && warmup <= kEagerFirst)
    flags.fail("--warmup " + std::to_string(warmup) + ": --graph needs at least " + std::to_string(kEagerFirst + 1) +
               " untimed steps (" + std::to_string(kEagerFirst) + " eager, then the capture)");
  try {
    if (cuda_device_count() == 0) flags.fail("needs a GPU and none is visible");
    const Device dev = Device::cuda(0);
    nn::GPTConfig config = nn::GPTConfig::named(config_name);
    config.context = std::max(config.context, seq);
    config.loss_chunk_rows = loss_chunk_rows;
    manual_seed(0);
    auto model = std::make_shared<nn::GPT>(config);
    model->to(dev);
    model->train();
    TensorList decay, no_decay;
    int64_t n_params = 0;
    for (const Tensor& p : model->parameters()) {
      n_params += p.numel();
      (p.dim() >= 2 ? decay : no_decay).push_back(p);
    }
    optim::AdamW opt(decay, {.lr = 6e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1});
    opt.add_param_group(no_decay, {.lr = 6e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.0});
    std::shared_ptr<dist::DistributedDataParallel> wrapped;
    if (ddp) {
      auto store = std::make_shared<dist::TcpStore>("127.0.0.1", 0, dist::TcpStore::Role::server);
      wrapped = std::make_shared<dist::DistributedDataParallel>(model, dist::new_nccl_group(store, 0, 1, dev));
    }
    // --pipeline: the same model (same seed, same draws) as one stage of a pipeline.
    dist::pipeline::GPTPipeline piped;
    std::unique_ptr<optim::AdamW> piped_opt;
    if (pipeline) {
      auto store = std::make_shared<dist::TcpStore>("127.0.0.1", 0, dist::TcpStore::Role::server);
      manual_seed(0);
      piped = dist::pipeline::make_gpt_pipeline(
          dist::new_nccl_group(store, 0, 1, dev), config, seq,
          {.schedule = dist::pipeline::ScheduleKind::one_f_one_b, .microbatches = 1, .device = dev});
      TensorList d, nd;
      for (const Tensor& p : piped.parameters()) (p.dim() >= 2 ? d : nd).push_back(p);
      piped_opt = std::make_unique<optim::AdamW>(
          d, optim::AdamWOptions{.lr = 6e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1});
      piped_opt->add_param_group(nd, {.lr = 6e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.0});
    }
    // --fsdp: the same model (same seed, same draws), sharded over a group of one.
    std::shared_ptr<nn::GPT> sharded_model;
    std::unique_ptr<dist::FullyShardedDataParallel> sharded;
    std::unique_ptr<optim::AdamW> sharded_opt;
    if (fsdp) {
      auto store = std::make_shared<dist::TcpStore>("127.0.0.1", 0, dist::TcpStore::Role::server);
      manual_seed(0);
      sharded_model = std::make_shared<nn::GPT>(config);
      sharded_model->to(dev);
      sharded_model->train();
      dist::FSDPOptions options;
      options.units.push_back({sharded_model->wte, sharded_model->wpe});
      for (auto& block : sharded_model->blocks) options.units.push_back({block});
      if (precision == "bf16") options.param_dtype = DType::bf16, options.reduce_dtype = DType::f32;
      sharded = std::make_unique<dist::FullyShardedDataParallel>(sharded_model, dist::new_nccl_group(store, 0, 1, dev),
                                                                 options);
      TensorList d, nd;
      for (const Tensor& p : sharded->parameters()) (p.dim() >= 2 ? d : nd).push_back(p);
      sharded_opt = std::make_unique<optim::AdamW>(
          d, optim::AdamWOptions{.lr = 6e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1});
      sharded_opt->add_param_group(nd, {.lr = 6e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.0});
    }
    // Uniform token ids in [0, vocab): U[0, 1) scaled, truncated by the conversion to i64.
    Tensor ids = mul(rand({batch, seq + 1}, DType::f32, dev), double(config.vocab_size)).to(DType::i64);
    Tensor x = ids.slice(1, 0, seq).contiguous(), y = ids.slice(1, 1, seq + 1).contiguous();
    std::optional<DType> cast = precision == "bf16" ? std::optional<DType>(DType::bf16) : std::nullopt;
    // marks, when given, gets an event recorded after the forward and after the backward.
    auto step_with = [&](bool through_ddp, Event* marks = nullptr) {
      opt.zero_grad();
      Tensor loss;
      {
        AutocastGuard guard(cast);
        loss = through_ddp ? wrapped->call([&] { return model->loss(x, y); }) : model->loss(x, y);
      }
      if (marks) marks[0].record(compute_stream(dev));
      loss.backward();
      if (marks) marks[1].record(compute_stream(dev));
      opt.step();
      return loss;
    };
    std::function<void()> plain = [&] { step_with(false); }, data_parallel = [&] { step_with(true); };
    // --graph: the plain step, captured after its eager steps and replayed from then on.
    std::optional<optim::CapturedStep> captured;
    if (graph)
      captured.emplace(dev, std::vector<optim::Optimizer*>{&opt}, [&] { return step_with(false); }, kEagerFirst);
    std::function<void()> replayed = [&] { captured->run(); };
    std::function<void()> fully_sharded = [&] {
      sharded_opt->zero_grad();
      Tensor loss;
      {
        AutocastGuard guard(cast);
        loss = sharded->call([&] { return sharded_model->loss(x, y); });
      }
      loss.backward();
      sharded_opt->step();
    };
    std::function<void()> pipelined = [&] {
      piped_opt->zero_grad();
      {
        AutocastGuard guard(cast);
        piped.pipeline->step(x, y);
      }
      piped_opt->step();
    };

    for (int64_t i = 0; i < warmup; ++i) {
      plain();
      if (ddp) data_parallel();
      if (fsdp) fully_sharded();
      if (pipeline) pipelined();
      if (graph) replayed();
    }
    synchronize(dev);
    memory::reset_peak(dev);
    std::vector<double> plain_ms, ddp_ms, fsdp_ms, pipeline_ms, graph_ms;
    if (graph) {
      std::tie(plain_ms, graph_ms) = samples::alternating_steps(plain, replayed, 6, std::max<int64_t>(1, steps / 6), dev);
    } else if (pipeline) {
      std::tie(plain_ms, pipeline_ms) =
          samples::alternating_steps(plain, pipelined, 6, std::max<int64_t>(1, steps / 6), dev);
    } else if (fsdp) {
      std::tie(plain_ms, fsdp_ms) =
          samples::alternating_steps(plain, fully_sharded, 6, std::max<int64_t>(1, steps / 6), dev);
    } else if (!ddp) {
      plain_ms = samples::timed_steps(plain, steps, dev);
    } else {
      // Alternating rounds (plain, ddp, ddp, plain, ...) so drifting clocks hit both alike.
      std::tie(plain_ms, ddp_ms) =
          samples::alternating_steps(plain, data_parallel, 6, std::max<int64_t>(1, steps / 6), dev);
    }
    const double peak_mib = double(memory::stats(dev).peak_allocated) / (1 << 20);
    const double flop_per_token =
        6.0 * double(n_params) + 12.0 * double(config.layers) * double(config.width) * double(seq);
    auto report = [&](const std::vector<double>& ms, const std::string& mode) {
      const double step_ms = median(ms);
      const double tokens_per_s = double(batch * seq) / (step_ms * 1e-3);
      const samples::MetricRecord record{{"engine", std::string("loom")},
                                           {"mode", mode},
                                           {"config", config_name},
                                           {"batch", batch},
                                           {"seq", seq},
                                           {"context", config.context},
                                           {"precision", precision},
                                           {"params", n_params},
                                           {"ms_per_step", step_ms},
                                           {"tokens_per_s", tokens_per_s},
                                           {"mfu", tokens_per_s * flop_per_token / 989e12},
                                           {"peak_mib", peak_mib}};
      std::printf("%s\n", samples::to_json(record).c_str());
      if (!json.empty()) samples::MetricsLog(json).write(record);
      return step_ms;
    };
    const double plain_step = report(plain_ms, "plain");
    if (profile_step) samples::profiled_step(plain, dev);
    if (components) {
      // Each part of the model alone at the step's shapes: median ms of its forward, and of its
      // forward plus a backward from a random output gradient.
      const int64_t C = config.width;
      Tensor h = randn({batch, seq, C}, DType::f32, dev).set_requires_grad(true);
      Tensor h16 = randn({batch, seq, C}, DType::bf16, dev).set_requires_grad(true);
      Tensor ids2 = x;
      const int64_t H = config.heads, D = C / H;
      Tensor h4 = randn({batch, seq, 4 * C}, DType::bf16, dev).set_requires_grad(true);
      Tensor logits16 = randn({batch * seq, config.vocab_size}, DType::bf16, dev).set_requires_grad(true);
      Tensor q = randn({batch, H, seq, D}, DType::bf16, dev).set_requires_grad(true);
      Tensor k = randn({batch, H, seq, D}, DType::bf16, dev).set_requires_grad(true);
      Tensor v = randn({batch, H, seq, D}, DType::bf16, dev).set_requires_grad(true);
      // The products of the MLP alone, bf16 weights: with only x needing a gradient the
      // backward is dX = dY W; with only W, it is dW = dY^T X.
      Tensor w_fc = randn({4 * C, C}, DType::bf16, dev), w_fc_g = w_fc.detach().set_requires_grad(true);
      Tensor w_pr = randn({C, 4 * C}, DType::bf16, dev), w_pr_g = w_pr.detach().set_requires_grad(true);
      Tensor x16 = h16.detach(), x4 = h4.detach();
      Tensor g4 = randn({batch * seq, 4 * C}, DType::bf16, dev).set_requires_grad(true);
      auto& blk = *model->blocks[0];
      struct Part {
        const char* name;
        std::function<Tensor()> run;
      };
      const Part parts[] = {
          {"embeddings", [&] { return add(model->wte->forward(ids2), model->wpe->forward(arange(0, double(seq), 1, DType::i64, dev))); }},
          {"layer norm (f32 in)", [&] { return blk.ln_1->forward_for_product(h); }},
          {"attention block (bf16 in)", [&] { return blk.attn->forward(h16); }},
          {"mlp (bf16 in)", [&] { return blk.mlp->forward(h16); }},
          {"  c_attn linear", [&] { return blk.attn->c_attn->forward(h16); }},
          {"  scaled_dot_product_attn", [&] { return scaled_dot_product_attention(q, k, v, true); }},
          {"  c_proj linear", [&] { return blk.attn->c_proj->forward(h16); }},
          {"  mlp c_fc linear", [&] { return blk.mlp->c_fc->forward(h16); }},
          {"  gelu", [&] { return gelu(h4); }},
          {"  mlp c_proj linear", [&] { return blk.mlp->c_proj->forward(h4); }},
          {"    c_fc product, dX", [&] { return matmul(h16, w_fc.t()); }},
          {"    c_fc product, dW", [&] { return matmul(x16, w_fc_g.t()); }},
          {"    mlp c_proj product, dX", [&] { return matmul(h4, w_pr.t()); }},
          {"    mlp c_proj product, dW", [&] { return matmul(x4, w_pr_g.t()); }},
          {"    bias gradient (rows of 4C)", [&] { return sum(g4, {0}); }},
          {"  residual add (f32 + bf16)", [&] { return add(h, h16); }},
          {"transformer block (f32 in)", [&] { return blk.forward(h); }},
          {"  lm_head matmul (bf16 in)", [&] { return matmul(h16, model->lm_head.t()); }},
          {"  cross_entropy (bf16 logits)", [&] { return cross_entropy(logits16, y.reshape({batch * seq})); }},
          // In chunks (batch x seq above loss_chunk_rows) the fused loss makes its gradients in
          // the forward call: its forward time holds them, and its backward only scales them.
          {"  lm_head + loss fused (bf16)", [&] { return linear_cross_entropy(h16.reshape({batch * seq, config.width}), model->lm_head, y.reshape({batch * seq}), -100, 0.0, loss_chunk_rows); }},
          {"ln_f + lm_head + loss", [&] { return linear_cross_entropy(model->ln_f->forward_for_product(h).reshape({batch * seq, config.width}), model->lm_head, y.reshape({batch * seq}), -100, 0.0, loss_chunk_rows); }},
      };
      for (const Part& part : parts) {
        std::vector<double> f, fb;
        Tensor out;
        {
          AutocastGuard guard(cast);
          out = part.run();
        }
        Tensor grad = randn(out.shape(), out.dtype(), dev);
        for (int i = 0; i < 23; ++i) {
          // Every repetition's backward writes fresh gradients, as a training step's does,
          // rather than adding into the last repetition's.
          opt.zero_grad();
          for (Tensor* leaf : {&h, &h16, &h4, &logits16, &q, &k, &v, &w_fc_g, &w_pr_g, &g4}) leaf->zero_grad();
          Event a, b, c;
          a.record(compute_stream(dev));
          {
            AutocastGuard guard(cast);
            out = part.run();
          }
          b.record(compute_stream(dev));
          out.backward(grad);
          c.record(compute_stream(dev));
          c.synchronize();
          if (i >= 3) f.push_back(b.elapsed_ms_since(a)), fb.push_back(c.elapsed_ms_since(a));
        }
        std::printf("  %-28s forward %7.3f ms   forward+backward %7.3f ms\n", part.name, median(f), median(fb));
      }
      opt.zero_grad();
    }
    {
      // Where a plain step's time goes: forward with the loss, backward, optimizer step.
      std::vector<double> fwd, bwd, opt_ms;
      for (int64_t i = 0; i < std::min<int64_t>(steps, 20); ++i) {
        Event start, marks[2], stop;
        start.record(compute_stream(dev));
        step_with(false, marks);
        stop.record(compute_stream(dev));
        stop.synchronize();
        fwd.push_back(marks[0].elapsed_ms_since(start));
        bwd.push_back(marks[1].elapsed_ms_since(marks[0]));
        opt_ms.push_back(stop.elapsed_ms_since(marks[1]));
      }
      std::printf("phases (median ms): forward+loss %.2f, backward %.2f, optimizer %.2f\n", median(fwd), median(bwd),
                  median(opt_ms));
    }
    if (graph) {
      const double graph_step = report(graph_ms, "graph");
      std::printf("the step captured as one CUDA graph over eager: %+.2f%% per step (medians %.2f vs %.2f ms)\n",
                  100.0 * (graph_step / plain_step - 1.0), graph_step, plain_step);
    }
    if (pipeline) {
      const double pipeline_step = report(pipeline_ms, "pipeline");
      std::printf("one-stage pipeline (1f1b, one micro-batch, NCCL world size 1) over plain: %+.2f%% per step "
                  "(medians %.2f vs %.2f ms)\n",
                  100.0 * (pipeline_step / plain_step - 1.0), pipeline_step, plain_step);
    }
    if (fsdp) {
      const double fsdp_step = report(fsdp_ms, "fsdp");
      std::printf("FSDP (NCCL, world size 1, ZeRO-3, %lld units, %lld all_gathers prefetched of %lld) over plain: "
                  "%+.2f%% per step (medians %.2f vs %.2f ms)\n",
                  (long long)sharded->unit_names().size(), (long long)sharded->memory().prefetches,
                  (long long)sharded->memory().gathers, 100.0 * (fsdp_step / plain_step - 1.0), fsdp_step, plain_step);
    }
    if (ddp) {
      const double ddp_step = report(ddp_ms, "ddp");
      std::printf("DDP (NCCL, world size 1) over plain: %+.2f%% per step (medians %.2f vs %.2f ms)\n",
                  100.0 * (ddp_step / plain_step - 1.0), ddp_step, plain_step);
    }
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_gpt: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {  // std::bad_alloc and the like: a message, not std::terminate
    std::fprintf(stderr, "bench_gpt: %s\n", e.what());
    return 1;
  }
}
