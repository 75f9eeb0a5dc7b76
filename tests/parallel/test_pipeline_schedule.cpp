// Pipeline schedules as data: every built-in schedule passes the checker on 1 to 8 ranks and
// 1 to 16 micro-batches, with the bubble of the formula at unit costs; hand-made tables that
// would hang, that pair the wrong micro-batches or that compute before their input are
// rejected naming what is wrong; ZB-H1 keeps 1F1B's memory and at most half its bubble; no
// schedule falls below bubble_floor.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/core/error.h"
#include "parallel/pipeline_schedule.h"

namespace loom::dist::pipeline {
namespace {

void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning " << parts.front();
  } catch (const loom::Error& e) {
    std::string what = e.what();
    for (const auto& part : parts) EXPECT_NE(what.find(part), std::string::npos) << "'" << part << "' not in: " << what;
  }
}

Action F(int s, int m) { return {Op::forward, s, m, -1}; }
Action B(int s, int m) { return {Op::backward, s, m, -1}; }

TEST(PipelineSchedule, EveryBuiltInScheduleChecks) {
  for (auto kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved,
                    ScheduleKind::zero_bubble_h1})
    for (int p = 1; p <= 8; ++p)
      for (int m = 1; m <= 16; ++m)
        for (int v : {2, 3}) {
          if (kind == ScheduleKind::interleaved && m % p != 0) continue;
          if (kind != ScheduleKind::interleaved && v != 2) continue;
          for (auto transfers : {Transfers::eager, Transfers::paired}) {
          Schedule s = build_schedule(kind, p, m, v, transfers);
          SCOPED_TRACE(s.table());
          Simulation sim;
          ASSERT_NO_THROW(sim = check_schedule(s, {.forward = 1, .backward = 2, .backward_input = 1,
                                                   .backward_weight = 1}));
          // Paired sends wait for their partners, which costs the other schedules time; the
          // interleaved one's ticks cost nothing.
          if (kind == ScheduleKind::zero_bubble_h1 ||
              (transfers == Transfers::paired && kind != ScheduleKind::interleaved))
            continue;
          // Equal stages, B = 2F: the bubble of the formula exactly.
          EXPECT_NEAR(sim.bubble(), formula_bubble(kind, p, m, v), 1e-12) << schedule_name(kind) << " p=" << p
                                                                          << " m=" << m << " v=" << v;
          }
        }
}

// Pipeline::evaluate's schedules: forwards only, of any micro-batch count (a last batch may
// be short), on every layout a training schedule has, under both placements of sends (the
// interleaved layout's paired placement included).
TEST(PipelineSchedule, EveryEvaluationScheduleChecks) {
  for (auto kind : {ScheduleKind::one_f_one_b, ScheduleKind::interleaved, ScheduleKind::zero_bubble_h1})
    for (int p = 1; p <= 6; ++p)
      for (int v : {2, 3}) {
        if (kind != ScheduleKind::interleaved && v != 2) continue;
        for (auto transfers : {Transfers::eager, Transfers::paired}) {
          const Schedule training = build_schedule(kind, p, p, v, transfers);
          for (int m = 1; m <= 9; ++m) {
            const Schedule s = build_forward_schedule(training, m);
            SCOPED_TRACE(s.table());
            ASSERT_EQ(s.stages, training.stages);
            ASSERT_NO_THROW(check_schedule(s));
          }
        }
      }
  // Two ranks, 1F1B's layout: each rank forwards its micro-batches in turn, sends after; two
  // stages a rank: a group of two micro-batches through stage 0, then stage 2.
  EXPECT_EQ(build_forward_schedule(build_schedule(ScheduleKind::one_f_one_b, 2, 4), 2).table(),
            "evaluation, forwards of 1f1b: 2 ranks, 2 stages, 2 micro-batches (F forward, B backward, I input "
            "gradient, W weight gradient, sA/rA send/receive activation, sG/rG gradient; micro-batch.stage)\n"
            "rank 0 | F0.0 [ sA0.0 ] F1.0 [ sA1.0 ]\n"
            "rank 1 | [ rA0.1 ] F0.1 [ rA1.1 ] F1.1\n");
  const std::string interleaved = build_forward_schedule(build_schedule(ScheduleKind::interleaved, 2, 2), 2).table();
  EXPECT_NE(interleaved.find("rank 0 | F0.0 [ sA0.0 ] F1.0 [ sA1.0 rA0.2 ] F0.2 [ sA0.2 rA1.2 ] F1.2"), std::string::npos)
      << interleaved;
  Schedule with_backward = build_forward_schedule(build_schedule(ScheduleKind::one_f_one_b, 1, 1), 1);
  with_backward.actions[0].push_back(B(0, 0));
  expect_error([&] { check_schedule(with_backward); }, {"rank 0 has B0.0", "evaluation schedule runs forwards only"});
}

TEST(PipelineSchedule, OneFOneBHoldsFewerMicrobatchesThanGPipe) {
  Simulation gpipe = check_schedule(build_schedule(ScheduleKind::gpipe, 4, 16));
  Simulation ofob = check_schedule(build_schedule(ScheduleKind::one_f_one_b, 4, 16));
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(gpipe.peak_in_flight[size_t(r)], 16);
    EXPECT_EQ(ofob.peak_in_flight[size_t(r)], 4 - r);
  }
}

TEST(PipelineSchedule, ZeroBubbleH1HalvesTheBubbleAtOneFOneBsMemory) {
  for (int p : {2, 3, 4})
    for (int m : {4, 8, 16}) {
      Costs unit{.forward = 1, .backward = 2, .backward_input = 1, .backward_weight = 1};
      Simulation zb = check_schedule(build_schedule(ScheduleKind::zero_bubble_h1, p, m), unit);
      Simulation ofob = check_schedule(build_schedule(ScheduleKind::one_f_one_b, p, m), unit);
      EXPECT_LE(zb.bubble(), 0.5 * ofob.bubble() + 1e-12) << "p=" << p << " m=" << m << " makespan " << zb.makespan
                                                           << " busy " << zb.busy[0] << "\n"
                                                           << build_schedule(ScheduleKind::zero_bubble_h1, p, m).table();
      // The most micro-batches any rank holds: 1F1B's (rank 0's p).
      EXPECT_EQ(*std::max_element(zb.peak_in_flight.begin(), zb.peak_in_flight.end()),
                *std::max_element(ofob.peak_in_flight.begin(), ofob.peak_in_flight.end()));
      if (m >= p) {
        EXPECT_NEAR(zb.bubble(), (p - 1.0) / (3.0 * m + p - 1), 1e-12) << "p=" << p << " m=" << m;
      }
    }
}

// Per-stage costs: equal ones give the uniform walk; GPipe over 2 ranks and one micro-batch
// is the chain F0 F1 B1 B0, so its makespan is the sum of the four stages' own costs.
TEST(PipelineSchedule, EachStageCanHaveItsOwnCosts) {
  const Schedule gpipe = build_schedule(ScheduleKind::gpipe, 2, 1);
  const Costs first{.forward = 1, .backward = 3}, last{.forward = 2, .backward = 5};
  EXPECT_DOUBLE_EQ(check_schedule(gpipe, std::vector<Costs>{first, last}).makespan, 1 + 2 + 5 + 3);
  const Schedule zb = build_schedule(ScheduleKind::zero_bubble_h1, 4, 8);
  const Costs unit{.forward = 1, .backward = 2, .backward_input = 1, .backward_weight = 1};
  EXPECT_DOUBLE_EQ(check_schedule(zb, std::vector<Costs>(4, unit)).bubble(), check_schedule(zb, unit).bubble());
  // Input halves heavier than the weight halves (the chain of input gradients from the last
  // stage back grows, the weight halves that fill the bubbles shrink): ZB-H1's bubble grows
  // past its unit-cost figure. Stage 0's empty input half alone leaves it as it is.
  std::vector<Costs> skewed(4, {.forward = 1, .backward = 2, .backward_input = 1.5, .backward_weight = 0.5});
  skewed[0] = {.forward = 1, .backward = 2, .backward_input = 0, .backward_weight = 2};
  EXPECT_GT(check_schedule(zb, skewed).bubble(), check_schedule(zb, unit).bubble() + 0.05);
  std::vector<Costs> first_only(4, unit);
  first_only[0] = skewed[0];
  EXPECT_DOUBLE_EQ(check_schedule(zb, first_only).bubble(), check_schedule(zb, unit).bubble());
  EXPECT_THROW(check_schedule(zb, std::vector<Costs>(3, unit)), loom::Error);
}

// bubble_floor lies under every built-in schedule's simulated bubble, at equal and at
// uneven stage costs; its value on one small case is worked out by hand.
TEST(PipelineSchedule, NoScheduleFallsBelowTheBubbleFloor) {
  const Schedule gpipe = build_schedule(ScheduleKind::gpipe, 2, 1);
  // Rank 1 waits F0 = 1, then works 3: a step of at least 4, 6 units of work on 2 ranks.
  EXPECT_DOUBLE_EQ(bubble_floor(gpipe, std::vector<Costs>(2, Costs{.forward = 1, .backward = 2})), 1 - 6.0 / 8);
  // One rank: no wait, no bubble.
  EXPECT_DOUBLE_EQ(bubble_floor(build_schedule(ScheduleKind::one_f_one_b, 1, 4), {Costs{}}), 0.0);
  uint64_t seed = 7;
  auto draw = [&seed] {  // a uniform value in [0.2, 2.2)
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    return 0.2 + 2.0 * double(seed >> 11) / double(1ull << 53);
  };
  for (auto kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::interleaved,
                    ScheduleKind::zero_bubble_h1})
    for (int p = 2; p <= 5; ++p)
      for (int m : {1, 2, 4, 8, 16}) {
        if (kind == ScheduleKind::interleaved && m % p != 0) continue;
        const Schedule s = build_schedule(kind, p, m);
        SCOPED_TRACE(std::string(schedule_name(kind)) + " p=" + std::to_string(p) + " m=" + std::to_string(m));
        for (int trial = 0; trial < 4; ++trial) {
          std::vector<Costs> costs;
          for (int st = 0; st < s.stages; ++st) {
            const double f = draw(), i = trial == 0 ? 1.0 : draw(), w = trial == 0 ? 1.0 : draw();
            costs.push_back({.forward = trial == 0 ? 1.0 : f, .backward = i + w, .backward_input = i,
                             .backward_weight = w});
          }
          const double floor = bubble_floor(s, costs);
          EXPECT_GE(floor, 0.0);
          EXPECT_LE(floor, check_schedule(s, costs).bubble() + 1e-12) << "trial " << trial;
        }
      }
  const Schedule evaluation = build_forward_schedule(build_schedule(ScheduleKind::one_f_one_b, 3, 4), 5);
  EXPECT_LE(bubble_floor(evaluation, std::vector<Costs>(3, Costs{})), check_schedule(evaluation).bubble() + 1e-12);
  EXPECT_THROW(bubble_floor(gpipe, {Costs{}}), loom::Error);
}

TEST(PipelineSchedule, TransfersAreDerivedAndBatched) {
  Schedule s = build_schedule(ScheduleKind::one_f_one_b, 2, 3);
  // Rank 0: one warm-up forward, then sends and receives paired around each compute.
  EXPECT_EQ(s.table(),
            "1f1b: 2 ranks, 2 stages, 3 micro-batches (F forward, B backward, I input gradient, W weight gradient, "
            "sA/rA send/receive activation, sG/rG gradient; micro-batch.stage)\n"
            "rank 0 | F0.0 [ sA0.0 ] F1.0 [ sA1.0 rG0.0 ] B0.0 F2.0 [ sA2.0 rG1.0 ] B1.0 [ rG2.0 ] B2.0\n"
            "rank 1 | [ rA0.1 ] F0.1 B0.1 [ sG0.1 rA1.1 ] F1.1 B1.1 [ sG1.1 rA2.1 ] F2.1 B2.1 [ sG2.1 ]\n");
}

// Paired sends (NCCL's) under the interleaved schedule go by ticks: one batch between two
// ticks, holding what the tick before sends and what the tick after receives: rank 0 fills the
// pipeline with forwards alone; rank 1's steady ticks are a forward and a backward (F0.3 B0.3),
// and the gradient B0.3 makes leaves after the tick, as in Megatron-LM.
TEST(PipelineSchedule, InterleavedWithPairedSendsGoesByTicks) {
  Schedule s = build_schedule(ScheduleKind::interleaved, 2, 2, 2, Transfers::paired);
  EXPECT_EQ(s.table(),
            "interleaved: 2 ranks, 4 stages, 2 micro-batches (F forward, B backward, I input gradient, W weight "
            "gradient, sA/rA send/receive activation, sG/rG gradient; micro-batch.stage)\n"
            "rank 0 | F0.0 [ sA0.0 ] F1.0 [ sA1.0 rA0.2 ] F0.2 [ sA0.2 rA1.2 ] F1.2 [ sA1.2 rG0.2 ] B0.2 [ sG0.2 rG1.2 ] "
            "B1.2 [ sG1.2 rG0.0 ] B0.0 [ rG1.0 ] B1.0\n"
            "rank 1 | [ rA0.1 ] F0.1 [ sA0.1 rA1.1 ] F1.1 [ sA1.1 rA0.3 ] F0.3 B0.3 [ sG0.3 rA1.3 ] F1.3 B1.3 [ sG1.3 rG0.1 ] "
            "B0.1 [ sG0.1 rG1.1 ] B1.1 [ sG1.1 ]\n");
  EXPECT_NO_THROW(check_schedule(s));
}

TEST(PipelineSchedule, AHandMadeTableThatWouldHangIsRejected) {
  // Rank 0 runs backward first: it waits for a gradient rank 1 can only send after the
  // activation rank 0 never sends.
  Schedule s;
  s.kind = ScheduleKind::gpipe;
  s.ranks = 2;
  s.stages = 2;
  s.microbatches = 1;
  s.actions = {{B(0, 0), F(0, 0)}, {F(1, 0), B(1, 0)}};
  expect_error([&] {
    add_transfers(s);
    check_schedule(s);
  }, {"would deadlock", "rank 0 waits in batch 0", "rank 1 waits in batch 0"});

  // The last stage's backward before its forward.
  Schedule early;
  early.kind = ScheduleKind::gpipe;
  early.ranks = 2;
  early.stages = 2;
  early.microbatches = 1;
  early.actions = {{F(0, 0), B(0, 0)}, {B(1, 0), F(1, 0)}};
  add_transfers(early);
  expect_error([&] { check_schedule(early); }, {"rank 1 reaches B0.1", "before its input is there"});

  // Two micro-batches where rank 1 runs them in the other order: the pairs do not match.
  Schedule t;
  t.kind = ScheduleKind::gpipe;
  t.ranks = 2;
  t.stages = 2;
  t.microbatches = 2;
  t.actions = {{F(0, 0), F(0, 1), B(0, 0), B(0, 1)}, {F(1, 1), F(1, 0), B(1, 0), B(1, 1)}};
  add_transfers(t);
  expect_error([&] { check_schedule(t); }, {"micro-batch 1", "micro-batch 0", "same order on both"});

  // A deadlock proper: each rank receives before it sends, in separate batches.
  Schedule u;
  u.kind = ScheduleKind::gpipe;
  u.ranks = 2;
  u.stages = 2;
  u.microbatches = 1;
  u.actions = {{F(0, 0), {Op::recv_gradient, 0, 0, 0}, {Op::send_activation, 0, 0, 1}, B(0, 0)},
               {{Op::recv_activation, 1, 0, 0}, F(1, 0), B(1, 0), {Op::send_gradient, 1, 0, 1}}};
  expect_error([&] { check_schedule(u); }, {"would deadlock", "rank 0 waits in batch 0", "rank 1 waits in batch 0",
                                             "receive the output gradient of micro-batch 0 for stage 0"});
}

TEST(PipelineSchedule, BadArgumentsAreNamed) {
  expect_error([] { parse_schedule("pipedream"); }, {"'pipedream'", "gpipe, 1f1b, interleaved or zb1"});
  expect_error([] { build_schedule(ScheduleKind::interleaved, 4, 6); }, {"micro-batches (6)", "ranks (4)"});
  expect_error([] { build_schedule(ScheduleKind::interleaved, 2, 4, 1); }, {"at least 2 stages per rank"});
  expect_error([] { build_schedule(ScheduleKind::one_f_one_b, 2, 0); }, {"0 micro-batches"});
  Schedule s = build_schedule(ScheduleKind::one_f_one_b, 2, 2);
  std::erase(s.actions[1], Action{Op::backward, 1, 1, -1});
  expect_error([&] { check_schedule(s); }, {"B1.1", "appears 0 times", "rank 1"});
}

}  // namespace
}  // namespace loom::dist::pipeline
