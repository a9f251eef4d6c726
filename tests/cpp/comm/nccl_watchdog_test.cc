// The NCCL backend's failure detection and bootstrap, on CPU: the tracker
// and watchdog with fake events, a fake asynchronous error and a fake clock;
// the unique-id exchange through a store with ranks as threads; and the
// clear refusal to build an NCCL communicator where no GPU is visible.
#include "comm/nccl/nccl_watchdog.h"

#include <dirent.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "comm/nccl/nccl_bootstrap.h"
#include "comm/nccl/nccl_communicator.h"
#include "strata/comm/backend.h"

namespace strata::nccl {
namespace {

using comm_internal::PendingOp;
using comm_internal::PendingWork;
using ::testing::HasSubstr;

// Fake CUDA events (ints that a test "fires") and a fake NCCL async error.
struct Fakes {
  std::mutex mu;
  std::map<void*, bool> fired;
  std::set<void*> released;
  absl::Status async = absl::OkStatus();
  int async_calls = 0;
  int failures = 0;
  int next = 1;

  void* NewEvent() {
    std::lock_guard<std::mutex> lock(mu);
    void* e = reinterpret_cast<void*>(static_cast<intptr_t>(next++));
    fired[e] = false;
    return e;
  }
  void Fire(void* e) {
    std::lock_guard<std::mutex> lock(mu);
    fired[e] = true;
  }
  TrackerHooks Hooks() {
    TrackerHooks h;
    h.query_event = [this](void* e) -> absl::StatusOr<bool> {
      std::lock_guard<std::mutex> lock(mu);
      if (reinterpret_cast<intptr_t>(e) < 0) return absl::InternalError("cudaErrorLaunchFailure");
      return fired[e];
    };
    h.release_event = [this](void* e) {
      std::lock_guard<std::mutex> lock(mu);
      released.insert(e);
    };
    h.async_error = [this] {
      std::lock_guard<std::mutex> lock(mu);
      ++async_calls;
      return async;
    };
    h.on_failure = [this](const absl::Status&) { ++failures; };
    return h;
  }
};

const absl::Time kT0 = absl::FromUnixSeconds(1000000);
const char kWhere[] = "group tp (rank 1 of 2, world rank 3)";

std::shared_ptr<PendingOp> Op(const std::string& what, absl::Time deadline) {
  return std::make_shared<PendingOp>(absl::StrCat(what, " on ", kWhere), deadline);
}

TEST(CommTracker, OperationsCompleteInOrderWhenTheirEventsFire) {
  Fakes f;
  CommTracker t(kWhere, f.Hooks());
  void* e1 = f.NewEvent();
  void* e2 = f.NewEvent();
  auto a = Op("allreduce(sum, 4 x fp32)", kT0 + absl::Seconds(10));
  auto b = Op("allgather(4 x fp32)", kT0 + absl::Seconds(10));
  t.Add(a, e1);
  t.Add(b, e2);
  EXPECT_TRUE(t.Check(kT0).ok());
  EXPECT_FALSE(a->done());
  f.Fire(e2);  // the later one alone cannot complete first (issue order)
  EXPECT_TRUE(t.Check(kT0).ok());
  EXPECT_FALSE(b->done());
  f.Fire(e1);
  EXPECT_TRUE(t.Check(kT0).ok());
  EXPECT_TRUE(a->done());
  EXPECT_TRUE(b->done());
  EXPECT_TRUE(*a->Test());
  EXPECT_EQ(t.pending(), 0u);
  EXPECT_EQ(f.released, (std::set<void*>{e1, e2}));
  EXPECT_TRUE(t.health().healthy());
}

TEST(CommTracker, APassedDeadlineFailsTheCommunicatorOnceNamingTheOperation) {
  Fakes f;
  CommTracker t(kWhere, f.Hooks());
  auto a = Op("allreduce(sum, 4 x fp32)", kT0 + absl::Seconds(5));
  auto b = Op("broadcast(root 0, 8 x fp32)", kT0 + absl::Seconds(50));
  t.Add(a, f.NewEvent());
  t.Add(b, f.NewEvent());
  EXPECT_TRUE(t.Check(kT0 + absl::Seconds(5)).ok());  // at the deadline: not yet passed
  absl::Status s = t.Check(kT0 + absl::Seconds(6));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("allreduce(sum, 4 x fp32) on group tp (rank 1 of 2, world "
                                     "rank 3): did not complete by its deadline"));
  // Every pending operation fails with it; the communicator is unusable.
  EXPECT_EQ(a->Test().status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(b->Test().status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(b->Test().status().message(), HasSubstr("broadcast(root 0, 8 x fp32)"));
  EXPECT_FALSE(t.health().healthy());
  EXPECT_EQ(t.health().CheckUsable("allreduce").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(f.failures, 1);
  // Reported once: later checks find nothing new and do not ask NCCL.
  const int calls = f.async_calls;
  EXPECT_TRUE(t.Check(kT0 + absl::Seconds(60)).ok());
  EXPECT_EQ(f.async_calls, calls);
  EXPECT_EQ(f.failures, 1);
}

TEST(CommTracker, AnAsyncNcclErrorNamesTheGroupAndTheOperationInFlight) {
  Fakes f;
  CommTracker t(kWhere, f.Hooks());
  auto a = Op("reduce_scatter(sum, 2 x bf16)", kT0 + absl::Seconds(5));
  t.Add(a, f.NewEvent());
  f.async = absl::UnavailableError("ncclCommGetAsyncError: remote process exited");
  absl::Status s = t.Check(kT0);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr(kWhere));
  EXPECT_THAT(s.message(), HasSubstr("while reduce_scatter(sum, 2 x bf16)"));
  EXPECT_THAT(s.message(), HasSubstr("remote process exited"));
  EXPECT_EQ(a->Test().status().code(), absl::StatusCode::kUnavailable);
}

TEST(CommTracker, ACudaErrorOnAnEventFailsTheCommunicator) {
  Fakes f;
  CommTracker t(kWhere, f.Hooks());
  auto a = Op("send(to 1, 4 x fp32)", kT0 + absl::Seconds(5));
  t.Add(a, reinterpret_cast<void*>(intptr_t{-1}));
  absl::Status s = t.Check(kT0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("send(to 1, 4 x fp32)"));
  EXPECT_THAT(s.message(), HasSubstr("cudaErrorLaunchFailure"));
}

TEST(CommTracker, AbortAndCloseFailPendingWorkAndStopTheHooks) {
  Fakes f;
  auto t = std::make_shared<CommTracker>(kWhere, f.Hooks());
  auto a = Op("allreduce(sum, 4 x fp32)", kT0 + absl::Seconds(5));
  t->Add(a, f.NewEvent());
  t->AbortPending();
  EXPECT_EQ(a->Test().status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(t->health().CheckUsable("x").code(), absl::StatusCode::kFailedPrecondition);
  // Work added after the abort fails at once.
  auto b = Op("barrier()", kT0 + absl::Seconds(5));
  t->Add(b, f.NewEvent());
  EXPECT_TRUE(b->done());
  EXPECT_FALSE(b->Test().ok());

  Fakes g;
  CommTracker closed(kWhere, g.Hooks());
  auto c = Op("allgather(4 x fp32)", kT0 + absl::Seconds(5));
  closed.Add(c, g.NewEvent());
  closed.Close();
  EXPECT_EQ(c->Test().status().code(), absl::StatusCode::kCancelled);
  const int calls = g.async_calls;
  EXPECT_TRUE(closed.Check(kT0 + absl::Hours(1)).ok());
  EXPECT_EQ(g.async_calls, calls);
}

TEST(Watchdog, PollsEveryTrackerWithItsClockAndReportsEachFailureOnce) {
  absl::Time now = kT0;
  std::vector<absl::Status> reports;
  WatchdogOptions o;
  o.start_thread = false;
  o.now = [&] { return now; };
  o.report = [&](const absl::Status& s) { reports.push_back(s); };
  Watchdog w(o);
  Fakes f1, f2;
  auto healthy = std::make_shared<CommTracker>("group dp (rank 0 of 2, world rank 0)", f1.Hooks());
  auto stuck = std::make_shared<CommTracker>(kWhere, f2.Hooks());
  w.Add(healthy);
  w.Add(stuck);
  void* done = f1.NewEvent();
  healthy->Add(Op("allreduce(sum, 1 x fp32)", kT0 + absl::Seconds(1)), done);
  f1.Fire(done);
  stuck->Add(Op("allgather(4 x fp32)", kT0 + absl::Seconds(1)), f2.NewEvent());
  EXPECT_TRUE(w.PollOnce().empty());
  now = kT0 + absl::Seconds(2);
  std::vector<absl::Status> found = w.PollOnce();
  ASSERT_EQ(found.size(), 1u);
  EXPECT_THAT(found[0].message(), HasSubstr("allgather(4 x fp32) on group tp"));
  EXPECT_TRUE(healthy->health().healthy());
  EXPECT_TRUE(w.PollOnce().empty());
  EXPECT_EQ(reports.size(), 1u);
  // Trackers are watched only while their communicator owns them.
  EXPECT_EQ(w.watched(), 2u);
  stuck.reset();
  EXPECT_EQ(w.watched(), 1u);
}

TEST(Watchdog, ItsThreadFailsAStuckOperationThatNobodyWaitsFor) {
  WatchdogOptions o;
  o.interval = absl::Milliseconds(5);
  std::atomic<int> reported{0};
  o.report = [&](const absl::Status&) { ++reported; };
  Watchdog w(o);
  Fakes f;
  auto t = std::make_shared<CommTracker>(kWhere, f.Hooks());
  w.Add(t);
  auto op = Op("allreduce(sum, 4 x fp32)", absl::Now() + absl::Milliseconds(50));
  t->Add(op, f.NewEvent());
  PendingWork work(op);
  // The wait's own deadline is far; the operation's deadline ends it.
  const absl::Time start = absl::Now();
  absl::Status s = work.Wait(absl::Now() + absl::Seconds(30));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("did not complete by its deadline"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  // The report follows the failure on the watchdog's thread: wait for it.
  const absl::Time until = absl::Now() + absl::Seconds(10);
  while (reported.load() == 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
  absl::SleepFor(absl::Milliseconds(50));  // a second report would come within a few ticks
  EXPECT_EQ(reported.load(), 1);
}

// Waiters, the watchdog thread, events firing and an abort, all at once
// (the `threads` label runs this under TSan): every work ends, each with
// success, its deadline, or the abort.
TEST(Watchdog, ConcurrentWaitersFiringAndAbortEndEveryWork) {
  WatchdogOptions o;
  o.interval = absl::Milliseconds(1);
  o.report = [](const absl::Status&) {};
  Watchdog w(o);
  for (int round = 0; round < 30; ++round) {
    std::atomic<intptr_t> fired_upto{0};
    TrackerHooks h;
    h.query_event = [&](void* e) -> absl::StatusOr<bool> {
      return reinterpret_cast<intptr_t>(e) <= fired_upto.load();
    };
    h.release_event = [](void*) {};
    h.async_error = [] { return absl::OkStatus(); };
    auto t = std::make_shared<CommTracker>(kWhere, h);
    w.Add(t);
    std::vector<std::unique_ptr<PendingWork>> works;
    for (intptr_t i = 1; i <= 20; ++i) {
      // The last one never fires; in every third round it has a short deadline.
      const absl::Duration timeout =
          i == 20 && round % 3 == 0 ? absl::Milliseconds(5) : absl::Seconds(30);
      auto op = Op(absl::StrCat("op", i), absl::Now() + timeout);
      t->Add(op, reinterpret_cast<void*>(i));
      std::weak_ptr<CommTracker> weak = t;
      works.push_back(std::make_unique<PendingWork>(op, [weak] {
        if (auto s = weak.lock()) s->Check(absl::Now()).IgnoreError();
      }));
    }
    std::thread firer([&] {
      for (intptr_t i = 1; i <= 19; ++i) {
        fired_upto = i;
        absl::SleepFor(absl::Microseconds(100));
      }
    });
    std::thread aborter([&] {
      if (round % 3 == 1) {
        absl::SleepFor(absl::Milliseconds(1));
        t->AbortPending();
      }
    });
    for (auto& work : works) {
      // Round 2 mod 3: only the wait's own deadline ends the last work.
      const bool last_unended = round % 3 == 2 && work.get() == works.back().get();
      absl::Status s =
          work->Wait(absl::Now() + (last_unended ? absl::Milliseconds(20) : absl::Seconds(5)));
      if (last_unended) EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
    }
    firer.join();
    aborter.join();
    if (round % 3 == 0) EXPECT_FALSE(t->health().healthy());
    t->Close();
    EXPECT_EQ(t->pending(), 0u);
  }
}

// The threads of this process (Linux: the entries of /proc/self/task).
int Threads() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

// A tracker that counts how often its watchdog looks at it.
struct CountedTracker {
  std::atomic<int> checks{0};
  std::shared_ptr<CommTracker> tracker;
  explicit CountedTracker(Watchdog& watchdog) {
    TrackerHooks h;
    h.query_event = [](void*) -> absl::StatusOr<bool> { return true; };
    h.release_event = [](void*) {};
    h.async_error = [this] {
      ++checks;
      return absl::OkStatus();
    };
    tracker = std::make_shared<CommTracker>(kWhere, h);
    watchdog.Add(tracker);
  }
  // No hook runs after this (a check in progress is waited for).
  ~CountedTracker() { tracker->Close(); }
};

absl::StatusOr<std::shared_ptr<NcclFamily>> Family(absl::Duration interval, int world_rank = 0) {
  NcclOptions options;
  options.watchdog_interval = interval;
  return NcclFamily::Create(options, world_rank);
}

// Each root's family has a watchdog of its own at that root's interval
// (there used to be one per process, at the first caller's interval).
TEST(Watchdog, TwoRootsWithDifferentIntervalsEachGetTheirs) {
  absl::StatusOr<std::shared_ptr<NcclFamily>> fast = Family(absl::Milliseconds(5));
  absl::StatusOr<std::shared_ptr<NcclFamily>> slow = Family(absl::Hours(1));
  ASSERT_TRUE(fast.ok()) << fast.status();
  ASSERT_TRUE(slow.ok()) << slow.status();
  ASSERT_NE((*fast)->watchdog.get(), (*slow)->watchdog.get());
  EXPECT_EQ((*fast)->watchdog->interval(), absl::Milliseconds(5));
  EXPECT_EQ((*slow)->watchdog->interval(), absl::Hours(1));
  CountedTracker on_fast(*(*fast)->watchdog), on_slow(*(*slow)->watchdog);
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (on_fast.checks.load() < 5 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_GE(on_fast.checks.load(), 5);
  // An hour has not passed: the slow root's watchdog has not looked once.
  EXPECT_EQ(on_slow.checks.load(), 0);
}

TEST(Watchdog, DestroyingOneRootLeavesTheOthersWatchdogWorking) {
  absl::StatusOr<std::shared_ptr<NcclFamily>> a = Family(absl::Milliseconds(5));
  absl::StatusOr<std::shared_ptr<NcclFamily>> b = Family(absl::Milliseconds(5));
  ASSERT_TRUE(a.ok() && b.ok());
  CountedTracker on_b(*(*b)->watchdog);
  {
    CountedTracker on_a(*(*a)->watchdog);
    a->reset();  // the last owner of root a's family
  }
  const int before = on_b.checks.load();
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (on_b.checks.load() < before + 5 && absl::Now() < until) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_GE(on_b.checks.load(), before + 5);
}

TEST(Watchdog, NoThreadOutlivesItsOwner) {
  const int before = Threads();
  absl::StatusOr<std::shared_ptr<NcclFamily>> family = Family(absl::Milliseconds(1));
  ASSERT_TRUE(family.ok());
  EXPECT_EQ(Threads(), before + 1);  // the watchdog's
  // A split child holds the family too: the thread stays for it.
  std::shared_ptr<NcclFamily> child = *family;
  family->reset();
  EXPECT_EQ(Threads(), before + 1);
  child.reset();  // the last owner: the thread is joined now, not later
  EXPECT_EQ(Threads(), before);
}

TEST(Watchdog, AnIntervalThatCannotBeHonouredIsAnError) {
  for (absl::Duration bad : {absl::ZeroDuration(), absl::Milliseconds(-3)}) {
    absl::StatusOr<std::shared_ptr<NcclFamily>> family = Family(bad, 3);
    ASSERT_EQ(family.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(family.status().message(),
                HasSubstr(absl::StrCat("watchdog_interval ", absl::FormatDuration(bad),
                                       " must be positive")));
  }
}

TEST(UniqueIds, OneIdPerRanksPerIdWithScalableInit) {
  EXPECT_EQ(*UniqueIdCount(8, 1024, true), 1);
  EXPECT_EQ(*UniqueIdCount(16384, 1024, true), 16);
  EXPECT_EQ(*UniqueIdCount(16385, 1024, true), 17);
  EXPECT_EQ(*UniqueIdCount(16384, 1024, false), 1);
  EXPECT_EQ(*UniqueIdCount(8, 3, true), 3);
  absl::StatusOr<int> bad = UniqueIdCount(8, 0, true);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("ranks_per_unique_id 0"));
  // Owners are spread over the job and distinct.
  std::set<int> owners;
  for (int i = 0; i < 16; ++i) owners.insert(UniqueIdOwner(i, 16, 16384));
  EXPECT_EQ(owners.size(), 16u);
  EXPECT_EQ(UniqueIdOwner(0, 16, 16384), 0);
  EXPECT_EQ(UniqueIdOwner(15, 16, 16384), 15360);
}

// Ranks as threads over one memory store: every rank gets the owners' ids.
std::vector<std::vector<std::string>> Exchange(Store& store, int world, int count) {
  std::vector<std::vector<std::string>> got(static_cast<size_t>(world));
  std::vector<absl::Status> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      int made = 0;
      auto make = [&]() -> absl::StatusOr<std::string> {
        return absl::StrCat("id-of-rank-", r, "-", made++);
      };
      absl::StatusOr<std::vector<std::string>> ids =
          ExchangeUniqueIds(store, r, world, count, make, absl::Now() + absl::Seconds(20));
      if (ids.ok()) {
        got[static_cast<size_t>(r)] = *ids;
      } else {
        errors[static_cast<size_t>(r)] = ids.status();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : errors) EXPECT_TRUE(s.ok()) << s;
  return got;
}

TEST(UniqueIds, EveryRankGetsTheOwnersIdsThroughTheStore) {
  std::shared_ptr<Store> store = MakeMemoryStore();
  for (int count : {1, 3}) {
    std::vector<std::vector<std::string>> got = Exchange(*store, 8, count);
    std::vector<std::string> expected;
    for (int i = 0; i < count; ++i) {
      expected.push_back(absl::StrCat("id-of-rank-", UniqueIdOwner(i, count, 8), "-0"));
    }
    for (const auto& ids : got) EXPECT_EQ(ids, expected);
  }
}

TEST(UniqueIds, AMissingOwnerIsADeadlineNamingTheKeyAndTheStore) {
  std::shared_ptr<Store> store = MakeMemoryStore();
  absl::StatusOr<std::vector<std::string>> ids = ExchangeUniqueIds(
      *store, 3, 4, 1, [] { return absl::StatusOr<std::string>("x"); },
      absl::Now() + absl::Milliseconds(100));
  ASSERT_EQ(ids.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(ids.status().message(), HasSubstr("rank 3 of 4 waiting for NCCL unique id 0 from "
                                                "rank 0 (key 'strata/nccl/0/id/0' in "));
}

TEST(NcclRoot, WithoutAGpuTheBackendSaysSo) {
  if (VisibleDeviceCount() > 0) GTEST_SKIP() << "a GPU is visible; nccl_gpu_test covers it";
  LaunchEnv env;
  RootOptions options;
  options.backend = "nccl";
  absl::StatusOr<std::unique_ptr<Communicator>> c = CreateRootCommunicator(env, options);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(c.status().message(), HasSubstr("needs a CUDA device"));
  EXPECT_THAT(c.status().message(), HasSubstr("rank 0 of 1"));
  // "auto" without a GPU picks a host backend, and insisting on device
  // memory is refused.
  options.backend = "auto";
  absl::StatusOr<std::string> resolved = ResolveBackend(env, options);
  ASSERT_TRUE(resolved.ok());
  EXPECT_NE(*resolved, "nccl");
}

TEST(NcclRoot, BadOptionsAreNamed) {
  LaunchEnv env;
  RootOptions options;
  options.backend = "nccl";
  options.comm.timeout = absl::ZeroDuration();
  absl::StatusOr<std::unique_ptr<Communicator>> c = CreateRootCommunicator(env, options);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("timeout 0 must be positive"));
  options.comm.timeout = absl::Seconds(10);
  options.nccl.watchdog_interval = absl::ZeroDuration();
  c = CreateRootCommunicator(env, options);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("watchdog_interval 0 must be positive"));
  options.nccl.watchdog_interval = absl::Milliseconds(10);
  options.nccl.device = -2;
  c = CreateRootCommunicator(env, options);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("NcclOptions::device -2 on rank 0 of 1"));
  options.nccl.device = -1;
  options.nccl.ranks_per_unique_id = 0;
  c = CreateRootCommunicator(env, options);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("ranks_per_unique_id 0 must be at least 1"));
}

}  // namespace
}  // namespace strata::nccl
