// Generating pipeline schedules: GPipe, 1F1B, interleaved 1F1B and
// zero-bubble H1, as a compute order and then with communication inserted.
//
//   strata::pipeline::ScheduleOptions options;
//   options.kind = strata::pipeline::ScheduleKind::kInterleaved1F1B;
//   options.num_ranks = 4;           // p
//   options.num_microbatches = 8;    // m
//   options.virtual_stages = 2;      // v: stage c*p + r lives on rank r
//   absl::StatusOr<strata::pipeline::Schedule> s =
//       strata::pipeline::GenerateSchedule(options);
//   std::puts(s->ToText().c_str());
//
// The generators (p ranks, m microbatches; rank r):
//
//   GPipe   F of every microbatch, then B of every microbatch (0..m-1).
//           Holds m activations.
//   1F1B    warmup w = min(p - r - 1, m) forwards, then one forward / one
//           backward until the forwards run out, then the remaining
//           backwards. Holds at most min(p - r, m) activations.
//   interleaved 1F1B (Megatron-Core's order) with v virtual stages per rank
//           and microbatch group size N (default p): forwards run N
//           microbatches on one chunk, then the same N on the next chunk, and
//           so on; backwards in the same order over the chunks reversed.
//           Warmup w = min(2 (p - r - 1) + (v - 1) N, m v) forwards, then
//           1F1B. Holds at most min(w + 1, m v) activations. With v = 1 it
//           is exactly 1F1B.
//   ZB-H1   zero bubble, H1 (Qi et al., "Zero Bubble Pipeline Parallelism",
//           2023): the backward split into I (input gradient, which the
//           previous stage waits for) and W (weight gradient, which nobody
//           waits for). F and I run in 1F1B's order; a rank runs its oldest
//           pending W where its next F or I would wait for its input, or
//           where another forward would hold more than min(p, m)
//           activations (1F1B's peak, on rank 0; an activation lives until
//           its W; the schedule's activation limit is what each rank's
//           order holds). The order comes from simulating the ranks under
//           `costs` (F, I, W). With equal F, I and W costs and m >= p each
//           rank idles p - 1 (1F1B with B = I + W: 3 (p - 1)), a bubble of
//           (p - 1) / (3 m + p - 1).
//
// Interleaving is refused, with the reason, where it would stall on its own
// dependencies (a "dependency bubble"): N < p (rank 0 would need microbatch
// 0 back for chunk 1 after N forwards, before it can have crossed the p
// ranks), N > m, and a last group of m mod N microbatches with
// 0 < m mod N < p (the same stall at the end; Megatron-Core refuses these
// too). So with the default N = p, m must be a multiple of p. p = 2 is
// allowed, unlike in Megatron-Core without p2p overlap: there the two
// directions between one pair of ranks are batched into one exchange whose
// messages cannot be told apart, while here every transfer is a separate,
// ordered action (see InsertCommunication).
//
// Thread-safety: plain functions over values.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "strata/base/export.h"
#include "strata/parallel/pipeline/schedule.h"
#include "strata/parallel/pipeline/simulate.h"

namespace strata::pipeline {

enum class ScheduleKind : uint8_t { kGPipe, k1F1B, kInterleaved1F1B, kZeroBubbleH1 };

// "gpipe", "1f1b", "interleaved-1f1b", "zb-h1".
STRATA_EXPORT const char* ScheduleKindName(ScheduleKind kind);
// Parses the names above (any case; "interleaved" and "interleaved1f1b",
// "zbh1" and "zero-bubble" too).
STRATA_EXPORT absl::StatusOr<ScheduleKind> ParseScheduleKind(absl::string_view name);

struct STRATA_EXPORT ScheduleOptions {
  static constexpr int kVersion = 1;
  int version = kVersion;
  ScheduleKind kind = ScheduleKind::k1F1B;
  int num_ranks = 1;         // p
  int num_microbatches = 1;  // m
  // v: stages per rank, interleaved 1F1B only (1 otherwise).
  int virtual_stages = 1;
  // N: interleaved 1F1B with v > 1 only; 0 means p.
  int microbatch_group_size = 0;
  // Costs the inserted communication is ordered by (see InsertCommunication),
  // and that ZB-H1 places its W actions by: any positive costs give a
  // deadlock-free order; costs close to the real ones give the best overlap.
  CostModel costs;
};

// InvalidArgument, with the reason, for options no generator accepts.
STRATA_EXPORT absl::Status CheckScheduleOptions(const ScheduleOptions& options);

// The compute actions only (F, B; I and W for ZB-H1), transfers implied. The schedule's name
// says what it is ("1F1B p=4 m=8") and its activation limit is set.
STRATA_EXPORT absl::StatusOr<Schedule> GenerateComputeOrder(const ScheduleOptions& options);

// GenerateComputeOrder followed by InsertCommunication.
STRATA_EXPORT absl::StatusOr<Schedule> GenerateSchedule(const ScheduleOptions& options);

struct STRATA_EXPORT InsertOptions {
  CostModel costs;
};

// Adds the SEND and RECV actions to a compute order (a schedule without
// communication actions), in an order that cannot deadlock.
//
// How: the compute order is simulated with implied transfers under
// `costs`; each transfer gets the key (t, sending stage, microbatch, kind)
// where t is when its producer ends. On each rank the send goes right after
// its producer, the receive after the computes that start before t (so
// before its consumer, which starts at t or later), and the rank's
// communication actions are in increasing key order (the positions above are
// monotone in the key).
//
// Why it cannot deadlock, even when a send blocks until its receive is
// reached (rendezvous) and each rank completes its communication in issue
// order: suppose some ranks are stuck. Take the smallest key k among the
// transfers not done. A rank that has not reached its end of k is stuck at
// an earlier action, which is either a communication action (key < k, so
// done: a contradiction) or a compute, which waits only for receives before
// it (keys < k, done) or for nothing. So both ranks reach k, everything
// before k on both is done, and k completes: a contradiction. The same
// argument holds for any transport that orders messages between a pair of
// ranks, since both ends list them in key order.
//
// InvalidArgument when the schedule already has communication actions, is
// not a valid compute order, or deadlocks with implied transfers.
STRATA_EXPORT absl::StatusOr<Schedule> InsertCommunication(const Schedule& compute_order,
                                                           const InsertOptions& options = {});

}  // namespace strata::pipeline
