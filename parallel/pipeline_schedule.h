// Pipeline schedules as data. A schedule is, for every rank of a pipeline, the list of what
// it does in order: compute actions (forward, backward, or backward split into its input half
// and its weight half) and the transfers between stages, for one stage and one micro-batch
// each. The executor (parallel/pipeline.h) walks its rank's list and does nothing else, so a
// schedule can be printed, simulated and checked before the first step. The essay in
// parallel/pipeline.h draws each schedule; this file builds them.
//
// Stages and ranks. A model cut into S stages runs on p ranks; stage s lives on rank s % p.
// With one stage per rank S = p; the interleaved schedule gives each rank v > 1 "virtual"
// stages (rank r holds stages r, r + p, r + 2p, ...), so a micro-batch visits every rank v
// times.
//
// Transfers are derived, never written by hand: a forward of stage s whose input comes from
// another rank is preceded by a receive of that activation; a forward whose output goes to
// another rank is followed by a send; backward likewise for the gradient going the other
// way. All the transfers a rank meets between two compute actions form one batch, posted
// together with batch_isend_irecv, so that two neighbours that send to each other at once
// (1F1B's steady state) do not wait on each other.
//
// Two ways to place and wait for sends, as the backend allows:
//   eager   a send is posted right after the compute that made its tensor, in a batch of its
//           own, and the rank goes on without waiting for it (its Work is checked later):
//           only receives hold a rank. Gloo's sends run so, on its own threads.
//   paired  a send waits for the next batch that receives something and goes with it, and a
//           batch finishes only when every transfer in it, sends included, has met its
//           partner: NCCL's point-to-point calls behave so, one group call at a time on the
//           group's stream, as Megatron-LM pairs them. The interleaved schedule places them
//           by ticks instead, as Megatron-LM does: a rank's computes form ticks (a forward
//           alone while the pipeline fills, a forward and a backward in the steady state, a
//           backward alone while it drains), and one batch stands between two ticks, holding
//           what the tick before sends and what the tick after receives. Every rank posts its
//           k-th batch at the same turn of the schedule, so the neighbours' batches meet. (The
//           placement above would hang there: with several stages per rank, two neighbours
//           each hold a send the other receives only after a send of its own.)
//
// Checking. check() runs every rank's list against the others under the rule of its
// placement; partners pair up in the order they are posted. A table that would hang, that pairs a send
// with a receive of another micro-batch, or that computes something before its input exists
// is rejected with the ranks, the actions and the batch at fault named. The same walk with
// a cost per action gives the schedule's timeline, its theoretical bubble and the most
// micro-batches each rank holds at once.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom::dist::pipeline {

enum class ScheduleKind { gpipe, one_f_one_b, interleaved, zero_bubble_h1 };

// How sends are placed and waited for (see the header comment).
enum class Transfers { eager, paired };

// "gpipe", "1f1b", "interleaved", "zb1" (as train_gpt's --schedule takes them); anything
// else throws naming the value and the four names.
ScheduleKind parse_schedule(const std::string& name);
const char* schedule_name(ScheduleKind kind);

enum class Op : uint8_t {
  forward,
  backward,         // the whole backward of a stage: input and weight gradients
  backward_input,   // split backward: the gradient of the stage's input only (sent at once)
  backward_weight,  // split backward: the weight gradients, left for later
  send_activation,  // this stage's output to stage + 1
  recv_activation,  // this stage's input from stage - 1
  send_gradient,    // the gradient of this stage's input to stage - 1
  recv_gradient,    // the gradient of this stage's output from stage + 1
};

bool is_compute(Op op);
bool is_send(Op op);

struct Action {
  Op op = Op::forward;
  int stage = 0;
  int microbatch = 0;
  // Transfers: the index of the batch they are posted in (one count per rank); -1 for compute.
  int batch = -1;

  // "F3.1" (forward of micro-batch 3 on stage 1), "B", "I" (backward-input), "W"; transfers
  // "sA", "rA", "sG", "rG" (send/receive activation/gradient).
  std::string str() const;
  bool operator==(const Action&) const = default;
};

struct Schedule {
  ScheduleKind kind = ScheduleKind::one_f_one_b;
  int ranks = 1;         // p
  int stages = 1;        // S: p times the virtual stages per rank
  int microbatches = 1;  // m
  Transfers transfers = Transfers::eager;
  std::vector<std::vector<Action>> actions;  // per rank, in order
  // An evaluation's schedule (Pipeline::evaluate): forwards and their transfers, no backward.
  bool forward_only = false;

  int rank_of(int stage) const { return stage % ranks; }
  int stages_per_rank() const { return stages / ranks; }
  // This rank's stages, in increasing order.
  std::vector<int> stages_of(int rank) const;
  // True when backward is split into backward_input and backward_weight.
  bool split_backward() const;

  // One line per rank: "rank 0 | F0.0 sA0.0 | F1.0 ..." with batches between bars.
  std::string table() const;
};

// The built-in schedules on `ranks` ranks and `microbatches` micro-batches; the interleaved
// one with `stages_per_rank` virtual stages per rank (at least 2, and microbatches a multiple
// of ranks, as Megatron requires), the others with one. Throws naming what is out of range.
Schedule build_schedule(ScheduleKind kind, int ranks, int microbatches, int stages_per_rank = 2,
                        Transfers transfers = Transfers::eager);

// The evaluation schedule of a pipeline laid out as `training` (its ranks, stages and
// placement of sends) over `microbatches` micro-batches, any number from 1: forwards only, the
// micro-batches in groups of p (the ranks), each group through a rank's stages in increasing
// order before the next group, with the transfers add_transfers derives. Under either
// placement no rank then holds a send that a neighbour receives only after a send of its own
// (the checker proves it: tests/parallel/test_pipeline_schedule.cpp).
Schedule build_forward_schedule(const Schedule& training, int microbatches);

// Adds the transfers (and their batch numbers) to per-rank lists of compute actions, placed
// as schedule.transfers says; what build_schedule does after ordering the compute. Lists that
// already hold transfers throw.
void add_transfers(Schedule& schedule);

// Costs per action, in any time unit, for simulate().
struct Costs {
  double forward = 1, backward = 2, backward_input = 1, backward_weight = 1;
};

struct Simulation {
  double makespan = 0;                 // time until the last rank finishes
  std::vector<double> busy;            // per rank: time spent computing
  std::vector<int> peak_in_flight;     // per rank: most micro-batches forwarded whose backward
                                       // (weight half, when split) is not done yet
  // Idle over total rank-time: the fraction of the pipeline's time lost to bubbles.
  double bubble() const;
};

// Checks the schedule (see the header comment) and returns its timeline under `costs`, with
// transfers taking no time. Throws loom::Error describing the fault.
Simulation check_schedule(const Schedule& schedule, const Costs& costs = {});
// The same with each stage's own costs (stage_costs[stage], one per stage): stages whose costs
// differ, as stage 0's empty input half and the last stage's loss make them.
Simulation check_schedule(const Schedule& schedule, const std::vector<Costs>& stage_costs);

// A floor under the bubble of every schedule of these stages on these ranks, the way
// check_schedule counts it (transfers free): rank r can compute nothing before the first
// micro-batch's forward has been through the stages before its first (stage r), and then has
// its whole share to do, so no step is shorter than the longest of those sums. Not tight (it
// ignores the wait at the end for the last micro-batch's gradient), but no order reaches
// below it: a target under it needs other stages, not another schedule. stage_costs as for
// check_schedule; the work counted is each schedule's own (F + B, or F + I + W when split;
// forwards alone for an evaluation).
double bubble_floor(const Schedule& schedule, const std::vector<Costs>& stage_costs);

// The bubble fraction of GPipe and 1F1B with equal stages, (p - 1) / (m + p - 1); for the
// interleaved schedule (p - 1) / (v m + p - 1).
double formula_bubble(ScheduleKind kind, int ranks, int microbatches, int stages_per_rank = 1);

}  // namespace loom::dist::pipeline
