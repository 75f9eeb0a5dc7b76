// The pipeline executor: walks this rank's row of the schedule (see pipeline.h for the
// schedules and what each action does).
#include "parallel/pipeline.h"

#include <algorithm>
#include <map>
#include <sstream>

#include "engine/allocator.h"
#include "engine/autograd.h"
#include "engine/ops.h"
#include "layers/optim/clip.h"
#include "parallel/trace.h"

namespace loom::dist::pipeline {

// What one (local stage, micro-batch) holds between its actions.
struct Pipeline::MicrobatchState {
  Tensor input;        // stage 0: the data; else the activation, a leaf requiring its gradient
  Tensor output;       // the activation sent on, or the last stage's loss
  Tensor output_grad;  // received from the next stage (or handed over by it on this rank)
  Tensor input_grad;   // to send to the stage before
  DeferredGradients weight_half;  // ZB-H1: what backward-input left for backward-weight
};

namespace {

int64_t bytes_in_use(Device device) { return int64_t(memory::stats(device).allocated); }

// A shape as text, "(2, 16, 64)".
std::string shape_text(const Shape& s) { return shape_str(s); }

// The tag of a transfer: who sends it (stage), which micro-batch, activation or gradient.
int tag_of(int sending_stage, int microbatch, int microbatches, bool gradient) {
  return (sending_stage * microbatches + microbatch) * 2 + (gradient ? 1 : 0);
}

}  // namespace

std::vector<int64_t> stage_cuts(std::vector<int64_t> cuts, int64_t layers, int stages) {
  LOOM_CHECK(stages >= 1 && layers >= stages, "pipeline: ", stages, " stages need ", stages,
             " or more blocks; the model has ", layers);
  if (cuts.empty()) {
    cuts.push_back(0);
    for (int s = 0; s < stages; ++s) cuts.push_back(cuts.back() + layers / stages + (s < layers % stages ? 1 : 0));
  }
  std::string listed;
  for (int64_t c : cuts) listed += (listed.empty() ? "" : ",") + std::to_string(c);
  LOOM_CHECK(int(cuts.size()) == stages + 1 && cuts.front() == 0 && cuts.back() == layers, "pipeline: the stage cuts [",
             listed, "] do not cut ", layers, " blocks into ", stages, " stages; expected ", stages + 1,
             " indices from 0 to ", layers);
  for (size_t i = 1; i < cuts.size(); ++i)
    LOOM_CHECK(cuts[i] > cuts[i - 1], "pipeline: the stage cuts [", listed, "] leave stage ", i - 1,
               " without blocks; expected increasing indices (", layers, " blocks, ", stages, " stages)");
  return cuts;
}

Pipeline::Pipeline(std::shared_ptr<ProcessGroup> group, std::vector<Stage> stages, PipelineOptions options)
    : group_(std::move(group)), stages_(std::move(stages)), options_(std::move(options)) {
  LOOM_CHECK(group_ != nullptr, "Pipeline: no process group");
  // NCCL runs a group's transfers one call after another on its stream, so a send holds what
  // follows it until its partner is posted: the paired placement. Gloo's sends go on their
  // own: eager, unless options.transfers asks for the paired placement.
  const Transfers transfers =
      group_->backend() == "nccl" ? Transfers::paired : options_.transfers.value_or(Transfers::eager);
  receive_ahead_ = group_->backend() != "nccl";  // see post_receives_ahead
  schedule_ = build_schedule(options_.schedule, group_->size(), options_.microbatches,
                             options_.schedule == ScheduleKind::interleaved ? options_.stages_per_rank : 1, transfers);
  LOOM_CHECK(options_.schedule == ScheduleKind::interleaved || options_.stages_per_rank == 1, "Pipeline: the ",
             schedule_name(options_.schedule), " schedule runs one stage per rank, not ", options_.stages_per_rank,
             " (virtual stages are the interleaved schedule's)");
  simulation_ = check_schedule(schedule_);
  const std::vector<int> mine = schedule_.stages_of(group_->rank());
  std::vector<int> given;
  for (const Stage& s : stages_) given.push_back(s.index);
  auto list = [](const std::vector<int>& v) {
    std::string out;
    for (int x : v) out += (out.empty() ? "" : ", ") + std::to_string(x);
    return "[" + out + "]";
  };
  LOOM_CHECK(given == mine, "Pipeline: rank ", group_->rank(), " of ", group_->size(), " holds stages ", list(mine),
             " of ", schedule_.stages, " under the ", schedule_name(options_.schedule), " schedule, but was given ",
             list(given));
  for (const Stage& s : stages_) {
    LOOM_CHECK(s.module != nullptr && s.forward, "Pipeline: stage ", s.index, " has no module or no forward");
    LOOM_CHECK(s.index == 0 || s.input_shape, "Pipeline: stage ", s.index, " does not declare its input shape");
    LOOM_CHECK(s.index == schedule_.stages - 1 || s.output_shape, "Pipeline: stage ", s.index,
               " does not declare its output shape");
  }
  state_.resize(stages_.size() * size_t(options_.microbatches));
  for (const Stage& s : stages_) {
    LOOM_CHECK(bool(s.sharded) == bool(stages_.front().sharded), "Pipeline: stage ", s.index, " is ",
               s.sharded ? "" : "not ", "sharded (FSDP) and stage ", stages_.front().index, " is ",
               stages_.front().sharded ? "" : "not ", "; a rank's stages are all sharded or none");
    LOOM_CHECK(!s.sharded || !schedule_.split_backward(), "Pipeline: stage ", s.index, " is sharded (FSDP), and the ",
               schedule_name(options_.schedule), " schedule splits backward into input and weight halves, which FSDP "
               "does not follow; use 1f1b, gpipe or interleaved");
    LOOM_CHECK(!s.sharded || options_.data_parallel, "Pipeline: stage ", s.index, " is sharded (FSDP), and "
               "options.data_parallel, the group its loss is averaged over, is not set");
    int last = -1;
    for (const Action& a : schedule_.actions[size_t(group_->rank())])
      if (a.stage == s.index && (a.op == Op::backward || a.op == Op::backward_input)) last = a.microbatch;
    last_backward_.push_back(last);
  }
}

Pipeline::~Pipeline() = default;

Stage& Pipeline::local_stage(int stage) {
  for (Stage& s : stages_)
    if (s.index == stage) return s;
  LOOM_FAIL("Pipeline: stage ", stage, " is not on rank ", group_->rank());
}

std::string Pipeline::where(const Action& a) const {
  std::ostringstream out;
  out << "pipeline stage " << a.stage << " (rank " << group_->world_ranks()[size_t(group_->rank())] << "), micro-batch "
      << a.microbatch;
  return out.str();
}

// ---- tied parameters ---------------------------------------------------------------------

void Pipeline::tie(const Tensor& on_first_stage, const Tensor& on_last_stage) {
  const int first_rank = schedule_.rank_of(0), last_rank = schedule_.rank_of(schedule_.stages - 1);
  const int me = group_->rank();
  LOOM_CHECK((me == first_rank) == on_first_stage.defined() && (me == last_rank) == on_last_stage.defined(),
             "Pipeline::tie: rank ", me, " passes ", on_first_stage.defined() ? "a" : "no", " first-stage copy and ",
             on_last_stage.defined() ? "a" : "no", " last-stage copy; stage 0 lives on rank ", first_rank,
             " and the last stage on rank ", last_rank);
  tied_ = true;
  tied_first_ = on_first_stage;
  tied_last_ = on_last_stage;
  if (first_rank == last_rank) {
    if (on_first_stage.impl() == on_last_stage.impl()) return;
    NoGradGuard no_grad;
    copy_(on_last_stage, on_first_stage);
    return;
  }
  if (me == first_rank) group_->send(on_first_stage, last_rank, 0)->wait();
  if (me == last_rank) {
    NoGradGuard no_grad;
    Tensor incoming = Tensor::empty(on_last_stage.shape(), on_last_stage.dtype(), on_last_stage.device());
    group_->recv(incoming, first_rank, 0)->wait();
    copy_(on_last_stage, incoming);
  }
}

void Pipeline::sum_tied_gradients() {
  if (!tied_) return;
  const int first_rank = schedule_.rank_of(0), last_rank = schedule_.rank_of(schedule_.stages - 1);
  if (first_rank == last_rank) {
    if (tied_first_.impl() == tied_last_.impl()) return;
    NoGradGuard no_grad;
    Tensor sum_grad = add(tied_first_.grad(), tied_last_.grad());
    copy_(tied_first_.grad(), sum_grad);
    copy_(tied_last_.grad(), sum_grad);
    return;
  }
  const bool first = group_->rank() == first_rank;
  Tensor mine = first ? tied_first_ : tied_last_;
  if (!mine.defined()) return;
  LOOM_CHECK(mine.grad().defined(), "Pipeline: the tied parameter on stage ", first ? 0 : schedule_.stages - 1,
             " got no gradient this step");
  trace::Span span("tied gradient", trace::Category::allreduce);
  NoGradGuard no_grad;
  Tensor theirs = empty_like(mine.grad());
  const int peer = first ? last_rank : first_rank;
  auto works = group_->batch_isend_irecv({P2POp::send(mine.grad(), peer, 1), P2POp::recv(theirs, peer, 1)});
  for (auto& w : works) w->wait();
  // a + b on one side, b + a on the other: the same sum, bit for bit.
  add_(mine.grad(), theirs);
}

// ---- data parallel -----------------------------------------------------------------------

void Pipeline::average_over_data_parallel() {
  if (!options_.data_parallel || options_.data_parallel->size() == 1) return;
  trace::Span span("data-parallel all_reduce", trace::Category::allreduce);
  NoGradGuard no_grad;
  // One flat buffer per dtype, all_reduce(avg), copied back.
  std::map<DType, TensorList> by_dtype;
  for (const Stage& s : stages_)
    if (!s.sharded)  // FSDP has reduce-scattered a sharded stage's gradients already
      for (const Tensor& p : s.module->parameters())
        if (p.grad().defined()) by_dtype[p.grad().dtype()].push_back(p.grad());
  for (auto& [dtype, grads] : by_dtype) {
    TensorList flat;
    for (const Tensor& g : grads) flat.push_back(g.contiguous().reshape({-1}));
    Tensor buffer = cat(flat, 0);
    options_.data_parallel->all_reduce(buffer, ReduceOp::avg)->wait();
    int64_t offset = 0;
    for (const Tensor& g : grads) {
      copy_(g, buffer.slice(0, offset, offset + g.numel()).reshape(g.shape()));
      offset += g.numel();
    }
  }
}

double Pipeline::clip_grad_norm(double max_norm) {
  LOOM_CHECK(max_norm >= 0, "Pipeline::clip_grad_norm: max_norm must not be negative, got ", max_norm);
  // The sum of squares over this rank's stages, the last stage's tied copy left out (stage 0's
  // copy holds the same gradient), summed over the pipeline on the device and read once.
  // A sharded stage counts its shards, summed over its shard group too (under HSDP the
  // replicas hold the same shards, so not over data_parallel).
  TensorList params, counted;
  ProcessGroup* shard_group = nullptr;
  for (const Stage& s : stages_) {
    if (s.sharded) shard_group = &s.sharded->group();
    for (const Tensor& p : s.sharded ? s.sharded->parameters() : s.module->parameters()) {
      params.push_back(p);
      const bool tied_copy = tied_ && tied_last_.defined() && p.impl() == tied_last_.impl() &&
                             tied_first_.impl() != p.impl();
      if (!tied_copy) counted.push_back(p);
    }
  }
  Tensor total = optim::grad_squared_sum(counted, options_.device);
  group_->all_reduce(total)->wait();
  if (shard_group && shard_group->size() > 1) shard_group->all_reduce(total)->wait();
  const Tensor norm = sqrt(total);
  optim::scale_grads_to_norm(params, norm, max_norm);
  return norm.item();
}

// ---- shapes ------------------------------------------------------------------------------

void Pipeline::agree_on_shapes(int64_t rows) {
  // Each rank lists, per stage it holds: stage, input shape, output shape (8 slots each, -1
  // for none), as f64; all_gather; every rank checks every boundary the same way.
  constexpr int kSlots = 1 + 2 * 9;
  const int v = schedule_.stages_per_rank();
  std::vector<double> mine(size_t(kSlots * v), -1.0);
  auto put = [](std::vector<double>& out, size_t at, const Shape& s) {
    LOOM_CHECK(s.size() <= 8, "Pipeline: activations of more than 8 dimensions");
    out[at] = double(s.size());
    for (size_t i = 0; i < s.size(); ++i) out[at + 1 + i] = double(s[i]);
  };
  for (size_t i = 0; i < stages_.size(); ++i) {
    const Stage& s = stages_[i];
    const size_t base = i * kSlots;
    mine[base] = s.index;
    if (s.index > 0) put(mine, base + 1, s.input_shape(rows));
    if (s.index < schedule_.stages - 1) put(mine, base + 10, s.output_shape(rows));
  }
  Tensor in = Tensor::empty({int64_t(mine.size())}, DType::f64, Device::cpu());
  std::copy(mine.begin(), mine.end(), in.data<double>());
  Tensor out = Tensor::empty({int64_t(mine.size()) * group_->size()}, DType::f64, Device::cpu());
  if (options_.device.is_cuda()) {
    Tensor din = in.to(options_.device), dout = out.to(options_.device);
    group_->all_gather(dout, din)->wait();
    out = dout.to(Device::cpu());
  } else {
    group_->all_gather(out, in)->wait();
  }
  std::map<int, std::pair<Shape, Shape>> declared;  // stage -> (input, output)
  const double* all = out.data<double>();
  auto get = [&](size_t at) {
    Shape s;
    if (all[at] < 0) return s;
    for (int i = 0; i < int(all[at]); ++i) s.push_back(int64_t(all[at + 1 + size_t(i)]));
    return s;
  };
  for (int r = 0; r < group_->size(); ++r)
    for (int i = 0; i < v; ++i) {
      size_t base = size_t(r * kSlots * v + i * kSlots);
      declared[int(all[base])] = {get(base + 1), get(base + 10)};
    }
  for (int s = 0; s + 1 < schedule_.stages; ++s) {
    const Shape& gives = declared[s].second;
    const Shape& takes = declared[s + 1].first;
    LOOM_CHECK(gives == takes, "pipeline: stage ", s, " (rank ", group_->world_ranks()[size_t(schedule_.rank_of(s))],
               ") sends activations of shape ", shape_text(gives), " but stage ", s + 1, " (rank ",
               group_->world_ranks()[size_t(schedule_.rank_of(s + 1))], ") expects ", shape_text(takes),
               " for micro-batches of ", rows, " rows");
  }
  agreed_rows_ = rows;
}

// ---- the step ----------------------------------------------------------------------------

Tensor Pipeline::step(const Tensor& inputs, const Tensor& targets) {
  const int m = options_.microbatches;
  LOOM_CHECK(inputs.dim() >= 1 && inputs.size(0) % m == 0, "Pipeline::step: a batch of ",
             inputs.dim() ? inputs.size(0) : 0, " rows does not cut into ", m, " equal micro-batches");
  LOOM_CHECK(targets.size(0) == inputs.size(0), "Pipeline::step: ", inputs.size(0), " input rows but ",
             targets.size(0), " target rows");
  const int64_t rows = inputs.size(0) / m;
  if (agreed_rows_ != rows) agree_on_shapes(rows);
  std::vector<Tensor> in_parts, target_parts;
  for (int i = 0; i < m; ++i) {
    in_parts.push_back(inputs.slice(0, i * rows, (i + 1) * rows));
    target_parts.push_back(targets.slice(0, i * rows, (i + 1) * rows));
  }
  const int64_t base_bytes = bytes_in_use(options_.device);
  peak_bytes_ = 0;
  step_start_ns_ = trace::now_ns();
  const Tensor loss_total = run_schedule(schedule_, in_parts, target_parts, {});
  peak_bytes_ = std::max<int64_t>(0, peak_bytes_ - base_bytes);
  step_end_ns_ = trace::now_ns();
  sum_tied_gradients();
  average_over_data_parallel();
  // The loss: the last stage's sum over micro-batches, shared with the pipeline (and
  // averaged over the data-parallel replicas).
  // Computed on the device and not read here, so the host is not made to wait for the step.
  Tensor loss = loss_total.defined() ? mul(loss_total.to(DType::f32).reshape({1}), 1.0 / m)
                                     : zeros({1}, DType::f32, options_.device);
  if (group_->size() > 1) group_->all_reduce(loss)->wait();
  if (options_.data_parallel && options_.data_parallel->size() > 1)
    options_.data_parallel->all_reduce(loss, ReduceOp::avg)->wait();
  return loss;
}

Tensor Pipeline::evaluate(const Tensor& inputs, const Tensor& targets) {
  LOOM_CHECK(inputs.dim() >= 1 && inputs.size(0) >= 1, "Pipeline::evaluate: a batch of no rows; expected 1 or more");
  LOOM_CHECK(targets.dim() >= 1 && targets.size(0) == inputs.size(0), "Pipeline::evaluate: ", inputs.size(0),
             " input rows but ", targets.dim() ? targets.size(0) : 0, " target rows");
  const int64_t rows = inputs.size(0);
  const int m = int(std::min<int64_t>(options_.microbatches, rows));
  std::vector<Tensor> in_parts, target_parts;
  std::vector<double> weights;
  for (int64_t i = 0, begin = 0; i < m; ++i) {
    const int64_t part = rows / m + (i < rows % m ? 1 : 0);
    in_parts.push_back(inputs.slice(0, begin, begin + part));
    target_parts.push_back(targets.slice(0, begin, begin + part));
    weights.push_back(double(part));
    begin += part;
  }
  // The stages' declared shapes are functions of the rows: agreeing on them at one count is
  // what step() does too.
  if (agreed_rows_ < 0) agree_on_shapes(in_parts[0].size(0));
  auto found = evaluation_schedules_.find(m);
  if (found == evaluation_schedules_.end()) {
    Schedule built = build_forward_schedule(schedule_, m);
    check_schedule(built);
    found = evaluation_schedules_.emplace(m, std::move(built)).first;
  }
  NoGradGuard no_grad;
  const int64_t peak = peak_bytes_;
  const Tensor loss_total = run_schedule(found->second, in_parts, target_parts, weights);
  peak_bytes_ = peak;  // last_step_peak_bytes() speaks of training steps
  Tensor loss = loss_total.defined() ? mul(loss_total.to(DType::f32).reshape({1}), 1.0 / double(rows))
                                     : zeros({1}, DType::f32, options_.device);
  if (group_->size() > 1) group_->all_reduce(loss)->wait();
  return loss;
}

Tensor Pipeline::run_schedule(const Schedule& schedule, const std::vector<Tensor>& inputs,
                              const std::vector<Tensor>& targets, const std::vector<double>& loss_weights) {
  const int m = schedule.microbatches;
  running_ = &schedule;
  running_rows_.clear();
  for (const Tensor& part : inputs) running_rows_.push_back(part.size(0));
  state_.clear();
  state_.resize(stages_.size() * size_t(m));
  early_receives_.clear();
  for (auto& s : state_) s = std::make_unique<MicrobatchState>();
  Tensor loss_total;
  {
    trace::Span span(schedule.forward_only ? "pipeline evaluation" : "pipeline schedule", trace::Category::step);
    const auto& row = schedule.actions[size_t(group_->rank())];
    for (size_t i = 0; i < row.size();) {
      if (is_compute(row[i].op)) {
        run_compute(row[i], inputs, targets);
        const Action& a = row[i];
        if (a.op == Op::forward && a.stage == schedule.stages - 1) {
          Tensor l = state_[size_t(&local_stage(a.stage) - stages_.data()) * size_t(m) + size_t(a.microbatch)]
                         ->output.detach();
          if (!loss_weights.empty()) l = mul(l.to(DType::f32), loss_weights[size_t(a.microbatch)]);
          loss_total = loss_total.defined() ? add(loss_total, l) : l;
        }
        peak_bytes_ = std::max(peak_bytes_, bytes_in_use(options_.device));
        ++i;
        continue;
      }
      size_t end = i;
      while (end < row.size() && !is_compute(row[end].op) && row[end].batch == row[i].batch) ++end;
      run_batch(std::vector<Action>(row.begin() + long(i), row.begin() + long(end)));
      if (receive_ahead_) post_receives_ahead(row, end);
      peak_bytes_ = std::max(peak_bytes_, bytes_in_use(options_.device));
      i = end;
    }
  }
  finish_sends(true);
  LOOM_ASSERT(early_receives_.empty(), "a receive posted ahead was never reached");
  for (auto& s : state_) s.reset();
  return loss_total;
}

// Over Gloo a send moves its bytes only once the receiver has posted the matching receive
// (its transport answers a posted receive with a note to the sender, whose thread then
// writes): a receive posted when its batch comes costs a round trip between two busy
// processes before any data flows. So after each batch of transfers, the receives of the
// next batch that has any are posted at once, and their batch waits for them where the
// schedule says. Gloo's transfers proceed independently, so this cannot hold anything back.
// Not over NCCL: its transfers on one communicator run in order on one stream, where a
// receive posted ahead would stall the sends behind it until its own data came.
void Pipeline::post_receives_ahead(const std::vector<Action>& row, size_t from) {
  size_t j = from;
  while (j < row.size() && (is_compute(row[j].op) || is_send(row[j].op))) ++j;
  if (j >= row.size()) return;
  const int batch = row[j].batch;
  std::vector<P2POp> ops;
  std::vector<Action> posted;
  for (size_t k = j; k < row.size() && !is_compute(row[k].op) && row[k].batch == batch; ++k) {
    const Action& a = row[k];
    if (is_send(a.op)) continue;
    // After a batch of sends alone, the next batch with receives is the one posted already.
    if (find_early_receive(a) != early_receives_.end()) continue;
    Tensor buffer = receive_buffer(a);
    const int m = running_->microbatches;
    ops.push_back(a.op == Op::recv_activation
                      ? P2POp::recv(buffer, schedule_.rank_of(a.stage - 1), tag_of(a.stage - 1, a.microbatch, m, false))
                      : P2POp::recv(buffer, schedule_.rank_of(a.stage + 1), tag_of(a.stage + 1, a.microbatch, m, true)));
    posted.push_back(a);
  }
  if (ops.empty()) return;
  std::vector<WorkPtr> works;
  try {
    works = group_->batch_isend_irecv(ops);
  } catch (const loom::Error& e) {
    LOOM_FAIL(where(posted.front()), ": posting the receive ", posted.front().str(), " ahead (from ",
              peer_text(posted.front()), ") failed: ", e.what());
  }
  for (size_t k = 0; k < posted.size(); ++k) early_receives_.push_back({posted[k], ops[k].tensor, works[k]});
}

std::vector<Pipeline::EarlyReceive>::iterator Pipeline::find_early_receive(const Action& a) {
  return std::find_if(early_receives_.begin(), early_receives_.end(), [&](const EarlyReceive& e) {
    return e.action.op == a.op && e.action.stage == a.stage && e.action.microbatch == a.microbatch;
  });
}

// The tensor a receive lands in: the stage's declared input (an activation) or output (a
// gradient) shape at the micro-batch's rows.
Tensor Pipeline::receive_buffer(const Action& a) {
  const int64_t rows = running_rows_[size_t(a.microbatch)];
  Stage& stage = local_stage(a.stage);
  return Tensor::empty(a.op == Op::recv_activation ? stage.input_shape(rows) : stage.output_shape(rows),
                       options_.activation_dtype, options_.device);
}

void Pipeline::run_compute(const Action& a, const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets) {
  const int m = running_->microbatches;
  const bool evaluating = running_->forward_only;
  Stage& stage = local_stage(a.stage);
  const size_t local = size_t(&stage - stages_.data());
  auto state = [&](size_t stage_slot, int mb) -> MicrobatchState& { return *state_[stage_slot * size_t(m) + size_t(mb)]; };
  MicrobatchState& st = state(local, a.microbatch);
  const bool last = a.stage == schedule_.stages - 1;
  // The neighbouring stage's slot when it is on this rank (one rank, or virtual stages).
  auto local_slot = [&](int other) -> int {
    if (other < 0 || other >= schedule_.stages || schedule_.rank_of(other) != group_->rank()) return -1;
    return int(&local_stage(other) - stages_.data());
  };
  const trace::Args args{.microbatch = a.microbatch, .stage = a.stage};
  switch (a.op) {
    case Op::forward: {
      trace::Span span("forward", trace::Category::forward, args);
      if (a.stage == 0) {
        st.input = inputs[size_t(a.microbatch)];
      } else {
        const int before = local_slot(a.stage - 1);
        if (before >= 0) st.input = state(size_t(before), a.microbatch).output.detach();
        LOOM_CHECK(st.input.defined(), where(a), ": forward without its input");
        if (!evaluating) st.input.set_requires_grad(true);
        // Evaluating, the stage before on this rank is done with its output once it is taken.
        if (evaluating && before >= 0) state(size_t(before), a.microbatch).output = Tensor();
      }
      Tensor out = stage.forward(st.input, targets[size_t(a.microbatch)]);
      if (evaluating) st.input = Tensor();
      if (last) {
        LOOM_CHECK(out.numel() == 1, where(a), ": the last stage returned ", shape_text(out.shape()),
                   "; expected the micro-batch's loss, one value");
      } else {
        const Shape want = stage.output_shape(inputs[size_t(a.microbatch)].size(0));
        LOOM_CHECK(out.shape() == want && out.dtype() == options_.activation_dtype, where(a), ": stage ", a.stage,
                   " produced an activation of shape ", shape_text(out.shape()), " ", dtype_name(out.dtype()),
                   " but declared ", shape_text(want), " ", dtype_name(options_.activation_dtype));
        LOOM_CHECK(evaluating || out.requires_grad(), where(a),
                   ": the stage's output does not depend on anything trained");
      }
      st.output = out;
      break;
    }
    case Op::backward:
    case Op::backward_input: {
      trace::Span span(a.op == Op::backward ? "backward" : "backward-input", trace::Category::backward, args);
      Tensor grad = last ? full(st.output.shape(), 1.0 / m, st.output.dtype(), st.output.device()) : st.output_grad;
      if (!last && !grad.defined()) {
        const int after = local_slot(a.stage + 1);
        if (after >= 0) grad = state(size_t(after), a.microbatch).input_grad;
      }
      LOOM_CHECK(grad.defined(), where(a), ": backward without the gradient of its output");
      // A sharded stage keeps its full gradients until its last backward of the step reduces them.
      if (stage.sharded) stage.sharded->set_gradient_sync(a.microbatch == last_backward_[local]);
      if (a.op == Op::backward) {
        run_backward({st.output}, {grad});
      } else {
        st.weight_half = run_backward_split({st.output}, {grad}, a.stage > 0 ? TensorList{st.input} : TensorList{});
      }
      if (a.stage > 0) {
        st.input_grad = st.input.grad();
        LOOM_CHECK(st.input_grad.defined(), where(a), ": the stage's input got no gradient");
      }
      st.output = Tensor();
      st.output_grad = Tensor();
      st.input = Tensor();
      // The stage after, on this rank, handed its input gradient over: it can go.
      if (const int after = local_slot(a.stage + 1); after >= 0) state(size_t(after), a.microbatch).input_grad = Tensor();
      break;
    }
    case Op::backward_weight: {
      trace::Span span("backward-weight", trace::Category::backward_weight, args);
      st.weight_half.run();
      break;
    }
    default: LOOM_FAIL("Pipeline: ", a.str(), " is not a compute action");
  }
}

void Pipeline::run_batch(const std::vector<Action>& batch) {
  const int m = running_->microbatches;
  finish_sends(false);
  std::vector<P2POp> ops;
  // Per action of the batch: its index in `ops`, or (a receive posted ahead) its work.
  std::vector<size_t> op_index(batch.size(), SIZE_MAX);
  std::vector<WorkPtr> early(batch.size());
  for (size_t k = 0; k < batch.size(); ++k) {
    const Action& a = batch[k];
    Stage& stage = local_stage(a.stage);
    MicrobatchState& st = *state_[size_t(&stage - stages_.data()) * size_t(m) + size_t(a.microbatch)];
    if (!is_send(a.op)) {
      if (auto found = find_early_receive(a); found != early_receives_.end()) {
        (a.op == Op::recv_activation ? st.input : st.output_grad) = found->tensor;
        early[k] = found->work;
        early_receives_.erase(found);
        continue;
      }
    }
    op_index[k] = ops.size();
    switch (a.op) {
      case Op::send_activation:
        // A detached alias: what waits for the send must not keep the stage's graph alive.
        // Packed row-major if it is not (a transposed view, a channels-last activation).
        ops.push_back(P2POp::send(st.output.detach().contiguous(), schedule_.rank_of(a.stage + 1),
                                  tag_of(a.stage, a.microbatch, m, false)));
        // No backward will want it: the send holds it from now on, and frees it once done.
        if (running_->forward_only) st.output = Tensor();
        break;
      case Op::recv_activation:
        st.input = receive_buffer(a);
        ops.push_back(P2POp::recv(st.input, schedule_.rank_of(a.stage - 1), tag_of(a.stage - 1, a.microbatch, m, false)));
        break;
      case Op::send_gradient:
        ops.push_back(P2POp::send(st.input_grad.contiguous(), schedule_.rank_of(a.stage - 1),
                                  tag_of(a.stage, a.microbatch, m, true)));
        break;
      case Op::recv_gradient:
        st.output_grad = receive_buffer(a);
        ops.push_back(P2POp::recv(st.output_grad, schedule_.rank_of(a.stage + 1), tag_of(a.stage + 1, a.microbatch, m, true)));
        break;
      default: LOOM_FAIL("Pipeline: ", a.str(), " is not a transfer");
    }
  }
  const bool sending = std::all_of(batch.begin(), batch.end(), [](const Action& a) { return is_send(a.op); });
  trace::Span span(sending ? "send" : "send/recv", sending ? trace::Category::send : trace::Category::recv,
                   {.microbatch = batch.front().microbatch, .stage = batch.front().stage});
  std::vector<WorkPtr> works;
  try {
    if (!ops.empty()) works = group_->batch_isend_irecv(ops);
  } catch (const loom::Error& e) {
    std::string listed;
    for (const Action& a : batch) listed += " " + a.str();
    LOOM_FAIL(where(batch.front()), ": posting the transfers", listed, " (with ", peer_text(batch.front()),
              ") failed: ", e.what());
  }
  // Paired transfers are all waited for here; eager sends are left running and finished by
  // finish_sends (at the next batch, or at the end of the step).
  const bool eager = schedule_.transfers == Transfers::eager;
  for (size_t k = 0; k < batch.size(); ++k) {
    const Action& a = batch[k];
    const size_t i = op_index[k];
    if (i == SIZE_MAX) {
      wait_for(early[k], a);
      continue;
    }
    if (eager && is_send(a.op)) {
      pending_sends_.push_back({works[i], ops[i].tensor, a});
      continue;
    }
    wait_for(works[i], a);
    if (a.op == Op::send_activation) release_if_unshared(ops[i].tensor, a);
  }
  // Input gradients handed to a send are held by it from now on.
  for (const Action& a : batch)
    if (a.op == Op::send_gradient)
      state_[size_t(&local_stage(a.stage) - stages_.data()) * size_t(m) + size_t(a.microbatch)]->input_grad = Tensor();
}

void Pipeline::wait_for(const WorkPtr& work, const Action& a) {
  try {
    work->wait();
  } catch (const loom::Error& e) {
    const bool recv = !is_send(a.op);
    LOOM_FAIL(where(a), ": waiting to ", recv ? "receive " : "send ",
              a.op == Op::send_activation || a.op == Op::recv_activation ? "the activation" : "the gradient",
              recv ? " from " : " to ", peer_text(a), ": ", e.what());
  }
}

std::string Pipeline::peer_text(const Action& a) const {
  const int peer_stage = (a.op == Op::send_activation || a.op == Op::recv_gradient) ? a.stage + 1 : a.stage - 1;
  return "stage " + std::to_string(peer_stage) + " (rank " +
         std::to_string(group_->world_ranks()[size_t(schedule_.rank_of(peer_stage))]) + ")";
}

// A sent activation's storage goes unless backward saved it: its only holders are then the
// alias that was sent and, until its backward, the stage's output (kept for its node).
void Pipeline::release_if_unshared(const Tensor& sent, const Action& a) {
  const MicrobatchState& st =
      *state_[size_t(&local_stage(a.stage) - stages_.data()) * size_t(running_->microbatches) + size_t(a.microbatch)];
  const bool output_held = st.output.defined() && st.output.storage() == sent.storage();
  if (sent.storage().use_count() == 1 + (output_held ? 1 : 0)) sent.storage()->release();
}

void Pipeline::finish_sends(bool all) {
  auto done = [&](PendingSend& s) {
    if (!all && !s.work->is_completed()) return false;
    wait_for(s.work, s.action);
    if (s.action.op == Op::send_activation) release_if_unshared(s.tensor, s.action);
    return true;
  };
  std::erase_if(pending_sends_, done);
}

// The bubble as the formulas count it: every rank over the pipeline's whole step, from its
// start to the last rank's end. The ranks start a step together (the previous one ended in a
// collective), so each rank's window is its start plus the longest step of any rank: only
// durations cross between ranks, never clock readings, which differ between hosts.
double Pipeline::measured_bubble() {
  LOOM_CHECK(trace::enabled(), "Pipeline::measured_bubble: tracing was off during the step; turn it on with "
             "trace::set_enabled(true) before the step");
  auto to_device = [&](Tensor t) { return options_.device.is_cuda() ? t.to(options_.device) : t; };
  Tensor longest = to_device(full({1}, double(step_end_ns_ - step_start_ns_), DType::f64, Device::cpu()));
  group_->all_reduce(longest, ReduceOp::max)->wait();
  const int64_t window_ns = int64_t(longest.to(Device::cpu()).item());
  const auto util = trace::utilization(trace::events(), step_start_ns_, step_start_ns_ + window_ns);
  const double busy = util.empty() ? 0.0 : double(util.front().busy_ns);
  Tensor t = full({2}, 0.0, DType::f64, Device::cpu());
  t.data<double>()[0] = double(window_ns) - busy;
  t.data<double>()[1] = double(window_ns);
  t = to_device(t);
  group_->all_reduce(t)->wait();
  t = t.to(Device::cpu());
  return t.data<double>()[1] > 0 ? t.data<double>()[0] / t.data<double>()[1] : 0.0;
}

}  // namespace loom::dist::pipeline
