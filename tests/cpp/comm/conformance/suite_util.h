// Helpers shared by the files of the conformance suite (suite*.cc).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "conformance.h"

namespace strata::testing::conformance_internal {

inline bool Valid(ReduceOp op, DataType t) { return !(op == ReduceOp::kAvg && IsInteger(t)); }

// MoveValue as a buffer of `t` holds it (exact but for bool).
inline double Moved(int rank, size_t i, DataType t) {
  const double v = MoveValue(rank, i, t);
  return t == DataType::kBool ? (v != 0) : v;
}

inline std::string Where(const Communicator& c) {
  return absl::StrCat("group ", c.name(), " (rank ", c.rank(), " of ", c.size(), ", world rank ",
                      c.world_rank(), ")");
}

// A fresh communicator of every rank, for tests that break theirs.
inline std::unique_ptr<Communicator> Fresh(Communicator& world, const std::string& name,
                                           std::shared_ptr<observe::OpSink> sink = nullptr) {
  CommOptions options;
  options.name = name;
  options.timeout = absl::Seconds(120);
  options.sink = std::move(sink);
  absl::StatusOr<std::unique_ptr<Communicator>> c = world.Split(0, world.rank(), options);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(c).value() : nullptr;
}

// Every rank gets here before any goes on: the peers of a rank still using
// a fresh communicator must not destroy theirs before it is done (on Gloo a
// destroyed peer closes the connections).
inline void AllHere(Communicator& world) {
  absl::StatusOr<std::unique_ptr<Work>> barrier = world.Barrier();
  ASSERT_TRUE(barrier.ok()) << barrier.status();
  STRATA_EXPECT_OK((*barrier)->Wait(absl::Now() + absl::Seconds(120)));
}

// Starts a send of `out` to `to` and a receive into `in` from `from` on
// every rank, in an order that also suits transports that run a rank's
// operations in issue order (progresses_independently() false): there, even
// ranks send first and odd ranks receive first, which cannot deadlock on a
// ring of an even size.
inline absl::Status Exchange(Communicator& c, Buffer out, int to, Buffer in, int from,
                             std::vector<std::unique_ptr<Work>>* works) {
  const bool send_first = !c.progresses_independently() && c.rank() % 2 == 0;
  for (int step = 0; step < 2; ++step) {
    const bool send = (step == 0) == send_first;
    absl::StatusOr<std::unique_ptr<Work>> w = send ? c.Send(out, to) : c.Recv(in, from);
    if (!w.ok()) return w.status();
    works->push_back(std::move(w).value());
  }
  return absl::OkStatus();
}

}  // namespace strata::testing::conformance_internal
