#include "parallel/pipeline_schedule.h"

#include <algorithm>
#include <deque>
#include <map>
#include <set>
#include <sstream>

#include "kernels/core/error.h"

namespace loom::dist::pipeline {

ScheduleKind parse_schedule(const std::string& name) {
  if (name == "gpipe") return ScheduleKind::gpipe;
  if (name == "1f1b") return ScheduleKind::one_f_one_b;
  if (name == "interleaved") return ScheduleKind::interleaved;
  if (name == "zb1") return ScheduleKind::zero_bubble_h1;
  LOOM_FAIL("unknown pipeline schedule '", name, "'; expected gpipe, 1f1b, interleaved or zb1");
}

const char* schedule_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::gpipe: return "gpipe";
    case ScheduleKind::one_f_one_b: return "1f1b";
    case ScheduleKind::interleaved: return "interleaved";
    case ScheduleKind::zero_bubble_h1: return "zb1";
  }
  return "?";
}

bool is_compute(Op op) {
  return op == Op::forward || op == Op::backward || op == Op::backward_input || op == Op::backward_weight;
}

bool is_send(Op op) { return op == Op::send_activation || op == Op::send_gradient; }

std::string Action::str() const {
  const char* code = "";
  switch (op) {
    case Op::forward: code = "F"; break;
    case Op::backward: code = "B"; break;
    case Op::backward_input: code = "I"; break;
    case Op::backward_weight: code = "W"; break;
    case Op::send_activation: code = "sA"; break;
    case Op::recv_activation: code = "rA"; break;
    case Op::send_gradient: code = "sG"; break;
    case Op::recv_gradient: code = "rG"; break;
  }
  return code + std::to_string(microbatch) + "." + std::to_string(stage);
}

std::vector<int> Schedule::stages_of(int rank) const {
  std::vector<int> out;
  for (int s = rank; s < stages; s += ranks) out.push_back(s);
  return out;
}

bool Schedule::split_backward() const { return kind == ScheduleKind::zero_bubble_h1; }

std::string Schedule::table() const {
  std::ostringstream out;
  out << (forward_only ? "evaluation, forwards of " : "") << schedule_name(kind) << ": " << ranks << " ranks, "
      << stages << " stages, " << microbatches
      << " micro-batches (F forward, B backward, I input gradient, W weight gradient, sA/rA send/receive "
         "activation, sG/rG gradient; micro-batch.stage)\n";
  for (int r = 0; r < ranks; ++r) {
    out << "rank " << r << " |";
    int open_batch = -1;
    for (const Action& a : actions[size_t(r)]) {
      if (a.batch != open_batch) {
        out << (open_batch >= 0 ? " ]" : "") << (a.batch >= 0 ? " [" : "");
        open_batch = a.batch;
      }
      out << " " << a.str();
    }
    out << (open_batch >= 0 ? " ]" : "") << "\n";
  }
  return out.str();
}

// ---- building ----------------------------------------------------------------------------

namespace {

Action compute(Op op, int stage, int microbatch) { return {op, stage, microbatch, -1}; }

// GPipe: every forward, then every backward.
std::vector<Action> gpipe_order(int rank, int m) {
  std::vector<Action> out;
  for (int i = 0; i < m; ++i) out.push_back(compute(Op::forward, rank, i));
  for (int i = 0; i < m; ++i) out.push_back(compute(Op::backward, rank, i));
  return out;
}

// 1F1B: p - 1 - rank forwards to fill the pipeline, then one forward and one backward in
// turn, then the backwards left.
std::vector<Action> one_f_one_b_order(int rank, int p, int m) {
  std::vector<Action> out;
  const int warmup = std::min(p - 1 - rank, m);
  for (int i = 0; i < warmup; ++i) out.push_back(compute(Op::forward, rank, i));
  for (int i = 0; i < m - warmup; ++i) {
    out.push_back(compute(Op::forward, rank, warmup + i));
    out.push_back(compute(Op::backward, rank, i));
  }
  for (int i = m - warmup; i < m; ++i) out.push_back(compute(Op::backward, rank, i));
  return out;
}

// Interleaved 1F1B, in Megatron's order: the k-th forward of a rank runs virtual stage
// (k mod pv) / p of micro-batch (k div pv) p + k mod p, so groups of p micro-batches go
// through one virtual stage before the next; backwards mirror it from the last virtual stage.
// The forwards rank `rank` runs before its first backward in the interleaved order.
int interleaved_warmup(int rank, int p, int m, int v) { return std::min((p - rank - 1) * 2 + (v - 1) * p, m * v); }

std::vector<Action> interleaved_order(int rank, int p, int m, int v) {
  const int total = m * v;
  auto forward = [&](int k) {
    int chunk = (k % (p * v)) / p, mb = (k / (p * v)) * p + k % p;
    return compute(Op::forward, chunk * p + rank, mb);
  };
  auto backward = [&](int k) {
    int chunk = v - 1 - (k % (p * v)) / p, mb = (k / (p * v)) * p + k % p;
    return compute(Op::backward, chunk * p + rank, mb);
  };
  const int warmup = interleaved_warmup(rank, p, m, v);
  std::vector<Action> out;
  for (int k = 0; k < warmup; ++k) out.push_back(forward(k));
  for (int k = 0; k < total - warmup; ++k) {
    out.push_back(forward(warmup + k));
    out.push_back(backward(k));
  }
  for (int k = total - warmup; k < total; ++k) out.push_back(backward(k));
  return out;
}

// ZB-H1: 1F1B with backward split in two. The order comes from a unit-time simulation in
// which each rank runs the first thing ready of: a forward, while it has fewer than p - rank
// micro-batches between forward and input gradient (1F1B's limit) and fewer than p between
// forward and weight gradient (1F1B's peak, on rank 0); an input gradient (the rank before
// waits for it); a weight gradient (nobody waits for it). The weight gradients so fill what
// would be 1F1B's bubbles: at equal costs the bubble is (p - 1) / (3m + p - 1) once m >= p. The
// executor follows the order, whatever the real costs.
std::vector<std::vector<Action>> zero_bubble_h1_orders(int p, int m) {
  auto out = std::vector<std::vector<Action>>(size_t(p));
  constexpr int kNotYet = 1 << 30;
  // Finish times of F and I per (rank = stage, micro-batch).
  std::vector<std::vector<int>> f_done(size_t(p), std::vector<int>(size_t(m), kNotYet));
  std::vector<std::vector<int>> i_done = f_done;
  std::vector<int> next_f(size_t(p), 0), next_i(size_t(p), 0), next_w(size_t(p), 0), busy_until(size_t(p), 0);
  int finished = 0;
  for (int t = 0; finished < p; ++t) {
    for (int r = 0; r < p; ++r) {
      if (busy_until[size_t(r)] > t) continue;
      const int fi = next_f[size_t(r)], ii = next_i[size_t(r)], wi = next_w[size_t(r)];
      const bool i_ready = ii < fi && (r == p - 1 ? f_done[size_t(r)][size_t(ii)] <= t
                                                  : i_done[size_t(r + 1)][size_t(ii)] <= t);
      const bool f_ready =
          fi < m && fi - ii < p - r && fi - wi < p && (r == 0 || f_done[size_t(r - 1)][size_t(fi)] <= t);
      if (f_ready) {
        out[size_t(r)].push_back(compute(Op::forward, r, fi));
        f_done[size_t(r)][size_t(fi)] = t + 1;
        next_f[size_t(r)]++;
      } else if (i_ready) {
        out[size_t(r)].push_back(compute(Op::backward_input, r, ii));
        i_done[size_t(r)][size_t(ii)] = t + 1;
        next_i[size_t(r)]++;
      } else if (wi < ii) {
        out[size_t(r)].push_back(compute(Op::backward_weight, r, wi));
        if (++next_w[size_t(r)] == m) finished++;
      } else {
        continue;
      }
      busy_until[size_t(r)] = t + 1;
    }
  }
  return out;
}

// Where the input of `a` comes from: the stage that produced it (or -1: the data, or the loss).
int producer_stage(const Schedule& s, const Action& a) {
  if (a.op == Op::forward) return a.stage > 0 ? a.stage - 1 : -1;
  if (a.op == Op::backward || a.op == Op::backward_input) return a.stage < s.stages - 1 ? a.stage + 1 : -1;
  return -1;
}

}  // namespace

void add_transfers(Schedule& schedule) {
  const bool paired = schedule.transfers == Transfers::paired;
  // Megatron's ticks: the interleaved training schedule's paired placement
  // (pipeline_schedule.h). An evaluation's forwards pair as the other schedules' do.
  const bool ticked = paired && schedule.kind == ScheduleKind::interleaved && !schedule.forward_only;
  for (int r = 0; r < schedule.ranks; ++r) {
    std::vector<Action> compute_only = std::move(schedule.actions[size_t(r)]);
    std::vector<Action>& out = schedule.actions[size_t(r)];
    out.clear();
    std::vector<Action> sends, recvs;
    int batch = 0;
    auto flush = [&] {
      if (sends.empty() && recvs.empty()) return;
      for (auto* list : {&sends, &recvs})
        for (Action& a : *list) {
          a.batch = batch;
          out.push_back(a);
        }
      sends.clear();
      recvs.clear();
      batch++;
    };
    auto receive_input_of = [&](const Action& a) {
      const int from = producer_stage(schedule, a);
      if (from >= 0 && schedule.rank_of(from) != r)
        recvs.push_back({a.op == Op::forward ? Op::recv_activation : Op::recv_gradient, a.stage, a.microbatch, -1});
    };
    // Ticks: the warm-up's forwards alone, then (forward, backward) pairs, then backwards alone.
    const size_t warmup =
        ticked ? size_t(interleaved_warmup(r, schedule.ranks, schedule.microbatches, schedule.stages_per_rank())) : 0;
    const size_t paired_end = compute_only.size() - warmup;
    size_t tick_left = 0;  // computes left in the current tick
    for (size_t i = 0; i < compute_only.size(); ++i) {
      const Action& a = compute_only[i];
      LOOM_CHECK(is_compute(a.op), "add_transfers: rank ", r, "'s list already holds the transfer ", a.str());
      if (ticked) {
        // The tick's receives, and the sends of the tick before, form the batch in front of it.
        if (tick_left == 0) {
          tick_left = i >= warmup && i < paired_end ? 2 : 1;
          for (size_t j = i; j < i + tick_left; ++j) receive_input_of(compute_only[j]);
          flush();
        }
        --tick_left;
      } else {
        receive_input_of(a);
        // Eager sends go out before the next compute; paired ones wait for a receive.
        if (!paired || !recvs.empty()) flush();
      }
      out.push_back(a);
      if (a.op == Op::forward && a.stage < schedule.stages - 1 && schedule.rank_of(a.stage + 1) != r)
        sends.push_back({Op::send_activation, a.stage, a.microbatch, -1});
      if ((a.op == Op::backward || a.op == Op::backward_input) && a.stage > 0 && schedule.rank_of(a.stage - 1) != r)
        sends.push_back({Op::send_gradient, a.stage, a.microbatch, -1});
    }
    flush();
  }
}

Schedule build_schedule(ScheduleKind kind, int ranks, int microbatches, int stages_per_rank, Transfers transfers) {
  LOOM_CHECK(ranks >= 1, "pipeline: ", ranks, " ranks; expected at least 1");
  LOOM_CHECK(microbatches >= 1, "pipeline: ", microbatches, " micro-batches; expected at least 1");
  Schedule s;
  s.kind = kind;
  s.ranks = ranks;
  s.microbatches = microbatches;
  s.transfers = transfers;
  s.stages = ranks;
  s.actions.resize(size_t(ranks));
  switch (kind) {
    case ScheduleKind::gpipe:
      for (int r = 0; r < ranks; ++r) s.actions[size_t(r)] = gpipe_order(r, microbatches);
      break;
    case ScheduleKind::one_f_one_b:
      for (int r = 0; r < ranks; ++r) s.actions[size_t(r)] = one_f_one_b_order(r, ranks, microbatches);
      break;
    case ScheduleKind::interleaved:
      LOOM_CHECK(stages_per_rank >= 2, "pipeline: the interleaved schedule needs at least 2 stages per rank, got ",
                 stages_per_rank);
      LOOM_CHECK(microbatches % ranks == 0, "pipeline: the interleaved schedule needs the micro-batches (",
                 microbatches, ") to be a multiple of the pipeline ranks (", ranks, ")");
      s.stages = ranks * stages_per_rank;
      for (int r = 0; r < ranks; ++r)
        s.actions[size_t(r)] = interleaved_order(r, ranks, microbatches, stages_per_rank);
      break;
    case ScheduleKind::zero_bubble_h1:
      s.actions = zero_bubble_h1_orders(ranks, microbatches);
      break;
  }
  add_transfers(s);
  return s;
}

Schedule build_forward_schedule(const Schedule& training, int microbatches) {
  LOOM_CHECK(microbatches >= 1, "pipeline: ", microbatches, " micro-batches to evaluate; expected at least 1");
  Schedule s;
  s.kind = training.kind;
  s.ranks = training.ranks;
  s.stages = training.stages;
  s.microbatches = microbatches;
  s.transfers = training.transfers;
  s.forward_only = true;
  s.actions.resize(size_t(s.ranks));
  for (int r = 0; r < s.ranks; ++r)
    for (int first = 0; first < microbatches; first += s.ranks)
      for (int stage : s.stages_of(r))
        for (int i = first; i < std::min(first + s.ranks, microbatches); ++i)
          s.actions[size_t(r)].push_back(compute(Op::forward, stage, i));
  add_transfers(s);
  return s;
}

// ---- checking and simulating -------------------------------------------------------------

double Simulation::bubble() const {
  if (makespan <= 0 || busy.empty()) return 0;
  double idle = 0;
  for (double b : busy) idle += makespan - b;
  return idle / (makespan * double(busy.size()));
}

double bubble_floor(const Schedule& s, const std::vector<Costs>& stage_costs) {
  LOOM_CHECK(int(stage_costs.size()) == s.stages, "bubble_floor: ", stage_costs.size(), " stage costs for ", s.stages,
             " stages");
  const bool split = s.split_backward();
  auto work = [&](const Costs& c) {
    if (s.forward_only) return c.forward;
    return c.forward + (split ? c.backward_input + c.backward_weight : c.backward);
  };
  double total = 0, floor = 0, head = 0;  // head: the first micro-batch's forwards before rank r's first stage
  for (int r = 0; r < s.ranks; ++r) {
    double share = 0;
    for (int stage : s.stages_of(r)) share += double(s.microbatches) * work(stage_costs[size_t(stage)]);
    total += share;
    floor = std::max(floor, head + share);
    head += stage_costs[size_t(r)].forward;
  }
  return floor > 0 ? 1 - total / (floor * double(s.ranks)) : 0;
}

double formula_bubble(ScheduleKind kind, int ranks, int microbatches, int stages_per_rank) {
  const double p = ranks, m = microbatches;
  const double v = kind == ScheduleKind::interleaved ? stages_per_rank : 1;
  return (p - 1) / (v * m + p - 1);
}

namespace {

// A transfer's channel: sender rank, receiver rank, activation or gradient.
struct Channel {
  int from, to;
  bool gradient;
  auto operator<=>(const Channel&) const = default;
};

// The key of the data a transfer carries, which its partner must carry too.
struct Payload {
  int stage;  // the sending stage
  int microbatch;
  bool operator==(const Payload&) const = default;
};

std::string describe(const Schedule& s, int rank, const Action& a) {
  std::ostringstream out;
  switch (a.op) {
    case Op::send_activation:
      out << "send the activation of micro-batch " << a.microbatch << " from stage " << a.stage << " to stage "
          << a.stage + 1 << " (rank " << s.rank_of(a.stage + 1) << ")";
      break;
    case Op::recv_activation:
      out << "receive the activation of micro-batch " << a.microbatch << " for stage " << a.stage << " from stage "
          << a.stage - 1 << " (rank " << s.rank_of(a.stage - 1) << ")";
      break;
    case Op::send_gradient:
      out << "send the input gradient of micro-batch " << a.microbatch << " from stage " << a.stage << " to stage "
          << a.stage - 1 << " (rank " << s.rank_of(a.stage - 1) << ")";
      break;
    case Op::recv_gradient:
      out << "receive the output gradient of micro-batch " << a.microbatch << " for stage " << a.stage
          << " from stage " << a.stage + 1 << " (rank " << s.rank_of(a.stage + 1) << ")";
      break;
    default: out << a.str() << " on rank " << rank;
  }
  return out.str();
}

}  // namespace

Simulation check_schedule(const Schedule& s, const Costs& costs) {
  return check_schedule(s, std::vector<Costs>(size_t(std::max(s.stages, 0)), costs));
}

Simulation check_schedule(const Schedule& s, const std::vector<Costs>& stage_costs) {
  const int p = s.ranks;
  LOOM_CHECK(int(s.actions.size()) == p, "pipeline schedule: ", s.actions.size(), " action lists for ", p, " ranks");
  LOOM_CHECK(s.stages >= p && s.stages % p == 0, "pipeline schedule: ", s.stages, " stages on ", p,
             " ranks; expected a multiple of the ranks");
  const bool split = s.split_backward();
  // Every stage's compute, each exactly once, on its own rank.
  {
    std::map<std::tuple<int, int, int>, int> count;  // (op, stage, mb)
    for (int r = 0; r < p; ++r)
      for (const Action& a : s.actions[size_t(r)]) {
        LOOM_CHECK(a.stage >= 0 && a.stage < s.stages && a.microbatch >= 0 && a.microbatch < s.microbatches,
                   "pipeline schedule: rank ", r, "'s ", a.str(), " names stage ", a.stage, " and micro-batch ",
                   a.microbatch, "; expected stage < ", s.stages, " and micro-batch < ", s.microbatches);
        LOOM_CHECK(s.rank_of(a.stage) == r, "pipeline schedule: rank ", r, " holds ", a.str(), " but stage ", a.stage,
                   " lives on rank ", s.rank_of(a.stage));
        if (is_compute(a.op)) {
          LOOM_CHECK(a.batch < 0, "pipeline schedule: compute action ", a.str(), " on rank ", r, " sits in a batch");
          LOOM_CHECK(!s.forward_only || a.op == Op::forward, "pipeline schedule: rank ", r, " has ", a.str(),
                     ", but an evaluation schedule runs forwards only");
          LOOM_CHECK(split ? a.op != Op::backward : (a.op != Op::backward_input && a.op != Op::backward_weight),
                     "pipeline schedule: rank ", r, " has ", a.str(), ", but a ", schedule_name(s.kind),
                     " schedule's backward is ", split ? "split (I and W)" : "whole (B)");
          count[{int(a.op), a.stage, a.microbatch}]++;
        }
      }
    std::vector<Op> ops = s.forward_only ? std::vector<Op>{Op::forward}
                          : split    ? std::vector<Op>{Op::forward, Op::backward_input, Op::backward_weight}
                                     : std::vector<Op>{Op::forward, Op::backward};
    for (int st = 0; st < s.stages; ++st)
      for (int mb = 0; mb < s.microbatches; ++mb)
        for (Op op : ops) {
          int n = count[{int(op), st, mb}];
          Action a{op, st, mb, -1};
          LOOM_CHECK(n == 1, "pipeline schedule: ", a.str(), " appears ", n, " times on rank ", s.rank_of(st),
                     "; expected once");
        }
  }

  // The walk. Each rank has a position and a clock; compute runs when its input is there;
  // a batch is posted when reached and done when each of its transfers has met its partner.
  Simulation sim;
  sim.busy.assign(size_t(p), 0);
  sim.peak_in_flight.assign(size_t(p), 0);
  std::vector<size_t> pos(size_t(p), 0);
  std::vector<double> clock(size_t(p), 0);
  std::vector<int> in_flight(size_t(p), 0);
  std::vector<int> posted_batch(size_t(p), -1);
  // Per channel, the posted transfers not yet paired: the sends' payloads, the receives' payloads.
  struct Posted {
    Payload payload;
    int rank;
    size_t index;  // position of the transfer in its rank's list
    double time;
  };
  std::map<Channel, std::deque<Posted>> sends, recvs;
  auto paired = std::vector<std::vector<bool>>(size_t(p));
  auto paired_at = std::vector<std::vector<double>>(size_t(p));
  for (int r = 0; r < p; ++r) {
    paired[size_t(r)].assign(s.actions[size_t(r)].size(), false);
    paired_at[size_t(r)].assign(s.actions[size_t(r)].size(), 0);
  }
  // What each rank has: (op-kind, stage, mb) facts: forward done, input there, output gradient there.
  std::set<std::tuple<int, int, int>> have;  // ('F' forward done / 'A' input activation / 'G' output grad / 'I' backward-input done)
  LOOM_CHECK(stage_costs.size() == size_t(s.stages), "pipeline schedule: costs for ", stage_costs.size(),
             " stages; the schedule has ", s.stages);
  auto cost = [&](const Action& a) {
    const Costs& costs = stage_costs[size_t(a.stage)];
    switch (a.op) {
      case Op::forward: return costs.forward;
      case Op::backward: return costs.backward;
      case Op::backward_input: return costs.backward_input;
      default: return costs.backward_weight;
    }
  };
  auto channel_of = [&](int r, const Action& a) {
    switch (a.op) {
      case Op::send_activation: return Channel{r, s.rank_of(a.stage + 1), false};
      case Op::recv_activation: return Channel{s.rank_of(a.stage - 1), r, false};
      case Op::send_gradient: return Channel{r, s.rank_of(a.stage - 1), true};
      default: return Channel{s.rank_of(a.stage + 1), r, true};
    }
  };
  auto payload_of = [&](const Action& a) {
    bool sending_stage_is_own = is_send(a.op);
    int sender = sending_stage_is_own ? a.stage : (a.op == Op::recv_activation ? a.stage - 1 : a.stage + 1);
    return Payload{sender, a.microbatch};
  };
  auto post = [&](int r, size_t i) {
    const Action& a = s.actions[size_t(r)][i];
    LOOM_CHECK((a.op == Op::send_activation || a.op == Op::recv_gradient) ? a.stage < s.stages - 1 : a.stage > 0,
               "pipeline schedule: rank ", r, "'s ", a.str(), " has no peer stage");
    const Channel ch = channel_of(r, a);
    LOOM_CHECK(ch.from != ch.to, "pipeline schedule: rank ", r, "'s ", a.str(),
               " is a transfer to itself; neighbouring stages on one rank pass tensors without one");
    if (is_send(a.op)) {
      LOOM_CHECK(have.count({a.op == Op::send_activation ? 'F' : 'I', a.stage, a.microbatch}), "pipeline schedule: rank ",
                 r, " would ", describe(s, r, a), " before computing it");
    }
    Posted mine{payload_of(a), r, i, clock[size_t(r)]};
    auto& partners = is_send(a.op) ? recvs[ch] : sends[ch];
    if (!partners.empty()) {
      Posted other = partners.front();
      partners.pop_front();
      if (!(other.payload == mine.payload)) {
        const Action& oa = s.actions[size_t(other.rank)][other.index];
        LOOM_FAIL("pipeline schedule: rank ", r, " would ", describe(s, r, a), " while rank ", other.rank,
                  " posted, in that place, ", describe(s, other.rank, oa),
                  ": transfers between two ranks must come in the same order on both");
      }
      double t = std::max(mine.time, other.time);
      paired[size_t(r)][i] = paired[size_t(other.rank)][other.index] = true;
      paired_at[size_t(r)][i] = paired_at[size_t(other.rank)][other.index] = t;
    } else {
      (is_send(a.op) ? sends[ch] : recvs[ch]).push_back(mine);
    }
  };

  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      const auto& list = s.actions[size_t(r)];
      while (pos[size_t(r)] < list.size()) {
        const Action& a = list[pos[size_t(r)]];
        if (is_compute(a.op)) {
          // Its input must be on this rank by now.
          const bool split_half = a.op == Op::backward_weight;
          bool ready = true;
          if (a.op == Op::forward) {
            ready = a.stage == 0 || have.count({'A', a.stage, a.microbatch}) ||
                    (s.rank_of(a.stage - 1) == r && have.count({'F', a.stage - 1, a.microbatch}));
          } else if (split_half) {
            ready = have.count({'I', a.stage, a.microbatch}) > 0;
          } else {
            ready = have.count({'F', a.stage, a.microbatch}) &&
                    (a.stage == s.stages - 1 || have.count({'G', a.stage, a.microbatch}) ||
                     (s.rank_of(a.stage + 1) == r && have.count({'I', a.stage + 1, a.microbatch})));
          }
          LOOM_CHECK(ready, "pipeline schedule: rank ", r, " reaches ", a.str(), " (action ", pos[size_t(r)],
                     ") before its input is there");
          clock[size_t(r)] += cost(a);
          sim.busy[size_t(r)] += cost(a);
          if (a.op == Op::forward) {
            have.insert({'F', a.stage, a.microbatch});
            sim.peak_in_flight[size_t(r)] = std::max(sim.peak_in_flight[size_t(r)], ++in_flight[size_t(r)]);
          } else {
            if (a.op != Op::backward_weight) have.insert({'I', a.stage, a.microbatch});
            if (a.op != Op::backward_input) in_flight[size_t(r)]--;
          }
          pos[size_t(r)]++;
          progress = true;
          continue;
        }
        // A batch: post every transfer of it once, then finish it when all are paired.
        const int batch = a.batch;
        size_t end = pos[size_t(r)];
        while (end < list.size() && !is_compute(list[end].op) && list[end].batch == batch) end++;
        if (posted_batch[size_t(r)] != batch) {
          posted_batch[size_t(r)] = batch;
          for (size_t i = pos[size_t(r)]; i < end; ++i) post(r, i);
          progress = true;
        }
        // Eager sends do not hold the rank; paired ones do.
        const bool sends_hold = s.transfers == Transfers::paired;
        bool done = true;
        double t = clock[size_t(r)];
        for (size_t i = pos[size_t(r)]; i < end; ++i) {
          if (is_send(list[i].op) && !sends_hold) continue;
          done = done && paired[size_t(r)][i];
          t = std::max(t, paired_at[size_t(r)][i]);
        }
        if (!done) break;
        for (size_t i = pos[size_t(r)]; i < end; ++i) {
          const Action& x = list[i];
          if (x.op == Op::recv_activation) have.insert({'A', x.stage, x.microbatch});
          if (x.op == Op::recv_gradient) have.insert({'G', x.stage, x.microbatch});
        }
        clock[size_t(r)] = t;
        pos[size_t(r)] = end;
        progress = true;
      }
    }
  }
  std::ostringstream stuck;
  for (int r = 0; r < p; ++r) {
    const auto& list = s.actions[size_t(r)];
    if (pos[size_t(r)] >= list.size()) continue;
    stuck << "\n  rank " << r << " waits in batch " << list[pos[size_t(r)]].batch << " to";
    for (size_t i = pos[size_t(r)]; i < list.size() && list[i].batch == list[pos[size_t(r)]].batch; ++i)
      if (!paired[size_t(r)][i] && (s.transfers == Transfers::paired || !is_send(list[i].op)))
        stuck << " [" << describe(s, r, list[i]) << "]";
  }
  LOOM_CHECK(stuck.str().empty(), "pipeline schedule ", schedule_name(s.kind),
             " would deadlock: no rank can go on.", stuck.str());
  for (int r = 0; r < p; ++r)
    for (size_t i = 0; i < s.actions[size_t(r)].size(); ++i)
      LOOM_CHECK(is_compute(s.actions[size_t(r)][i].op) || paired[size_t(r)][i], "pipeline schedule: rank ", r, " would ",
                 describe(s, r, s.actions[size_t(r)][i]), " but no rank receives it");
  for (double c : clock) sim.makespan = std::max(sim.makespan, c);
  return sim;
}

}  // namespace loom::dist::pipeline
