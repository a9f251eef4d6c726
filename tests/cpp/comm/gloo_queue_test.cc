// The Gloo operation queue with fake transfers: who finishes an operation
// (the waiting thread or the completer), issue order, a waiter's deadline
// suspending a finish that then resumes, operations tested for, dropped or
// never waited for, and failures while a waiter holds its claim.
#include "comm/gloo/gloo_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace strata::gloo {
namespace {

using comm_internal::CommHealth;
using comm_internal::PendingOp;

// A transfer that arrives in `stages` parts, each when the test says so.
// Its finish waits for the parts in order, counts the ones seen (so a
// resumed finish does not wait for them again), and can be suspended or
// interrupted the way a Gloo transfer's can.
struct FakeTransfer {
  explicit FakeTransfer(int stages = 1) : stages(stages) {}

  void Arrive(int n = 1) {
    {
      std::lock_guard<std::mutex> lock(mu);
      arrived += n;
    }
    cv.notify_all();
  }
  void Suspend() {
    {
      std::lock_guard<std::mutex> lock(mu);
      suspend_asked = true;
    }
    cv.notify_all();
  }
  void Interrupt() {
    {
      std::lock_guard<std::mutex> lock(mu);
      interrupted = true;
    }
    cv.notify_all();
  }
  absl::Status Finish(absl::Time deadline) {
    std::unique_lock<std::mutex> lock(mu);
    finished_on.push_back(std::this_thread::get_id());
    while (seen < stages) {
      cv.wait_until(lock, absl::ToChronoTime(deadline),
                    [&] { return interrupted || suspend_asked || arrived > seen; });
      if (interrupted) return absl::AbortedError("interrupted");
      if (suspend_asked) {
        suspend_asked = false;
        ++suspensions;
        return Suspended();
      }
      if (arrived <= seen) return absl::DeadlineExceededError("the operation's timeout passed");
      ++seen;
      ++stage_waits;
    }
    return absl::OkStatus();
  }

  const int stages;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  int seen = 0;
  int stage_waits = 0;
  int suspensions = 0;
  bool suspend_asked = false;
  bool interrupted = false;
  std::vector<std::thread::id> finished_on;
};

class GlooQueueTest : public ::testing::Test {
 protected:
  GlooQueueTest()
      : health_("group test (rank 0 of 2, world rank 0)"),
        queue_(std::make_shared<GlooQueue>(&health_, [](const absl::Status& s) { return s; })) {}
  ~GlooQueueTest() override { queue_->Stop(absl::AbortedError("test over")); }

  // A point-to-point operation: posted inline, finished by whoever claims
  // it; `order` records the order of completions.
  std::unique_ptr<Work> Transfer(const std::shared_ptr<FakeTransfer>& t, const std::string& name,
                                 absl::Duration timeout = absl::Seconds(30)) {
    std::shared_ptr<QueuedOp> op = Op(t, name, timeout);
    op->suspend = [t] { t->Suspend(); };
    return queue_->Submit(std::move(op), /*inline_ok=*/true);
  }
  // A collective whose finish cannot be suspended (the completer's only).
  std::unique_ptr<Work> Collective(const std::shared_ptr<FakeTransfer>& t,
                                   const std::string& name) {
    return queue_->Submit(Op(t, name, absl::Seconds(30)));
  }
  std::shared_ptr<QueuedOp> Op(const std::shared_ptr<FakeTransfer>& t, const std::string& name,
                               absl::Duration timeout) {
    auto op = std::make_shared<QueuedOp>();
    op->pending = std::make_shared<PendingOp>(name, absl::Now() + timeout);
    op->run = [](absl::Duration) { return absl::OkStatus(); };
    op->finish = [this, t, name](absl::Time deadline) {
      absl::Status s = t->Finish(deadline);
      if (s.ok()) Record(name);
      return s;
    };
    op->interrupt = [t] { t->Interrupt(); };
    return op;
  }
  void Record(const std::string& name) {
    std::lock_guard<std::mutex> lock(order_mu_);
    order_.push_back(name);
  }
  std::vector<std::string> order() {
    std::lock_guard<std::mutex> lock(order_mu_);
    return order_;
  }
  // The peer's side: `t` arrives 30 ms from now.
  static std::thread ArriveLater(std::shared_ptr<FakeTransfer> t) {
    return std::thread([t] {
      absl::SleepFor(absl::Milliseconds(30));
      t->Arrive();
    });
  }
  // Polls without asking anyone to hurry.
  static bool DoneWithin(const std::shared_ptr<FakeTransfer>& t, absl::Duration limit) {
    const absl::Time end = absl::Now() + limit;
    while (absl::Now() < end) {
      {
        std::lock_guard<std::mutex> lock(t->mu);
        if (t->seen == t->stages) return true;
      }
      absl::SleepFor(absl::Milliseconds(1));
    }
    return false;
  }

  CommHealth health_;
  std::shared_ptr<GlooQueue> queue_;
  std::mutex order_mu_;
  std::vector<std::string> order_;
};

TEST_F(GlooQueueTest, TheWaitingThreadFinishesItsOwnTransfer) {
  auto t = std::make_shared<FakeTransfer>();
  std::unique_ptr<Work> work = Transfer(t, "recv");
  std::thread peer = ArriveLater(t);
  EXPECT_TRUE(work->Wait(absl::Now() + absl::Seconds(10)).ok());
  peer.join();
  ASSERT_EQ(t->finished_on.size(), 1u);
  EXPECT_EQ(t->finished_on[0], std::this_thread::get_id());
  EXPECT_EQ(*work->Test(), true);
}

TEST_F(GlooQueueTest, WaitingForALaterTransferFinishesTheEarlierOnesFirst) {
  auto a = std::make_shared<FakeTransfer>(), b = std::make_shared<FakeTransfer>();
  std::unique_ptr<Work> wa = Transfer(a, "a"), wb = Transfer(b, "b");
  b->Arrive();
  std::thread peer = ArriveLater(a);
  EXPECT_TRUE(wb->Wait(absl::Now() + absl::Seconds(10)).ok());
  peer.join();
  EXPECT_EQ(*wa->Test(), true);  // done before b
  EXPECT_EQ(order(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(a->finished_on.at(0), std::this_thread::get_id());
}

TEST_F(GlooQueueTest, AWaitsDeadlineSuspendsTheFinishWhichResumesWhereItStopped) {
  auto t = std::make_shared<FakeTransfer>(/*stages=*/2);
  std::unique_ptr<Work> work = Transfer(t, "recv");
  t->Arrive();  // the first part; the second comes later
  absl::Status s = work->Wait(absl::Now() + absl::Milliseconds(60));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("may be waited for again"), std::string::npos) << s;
  EXPECT_EQ(*work->Test(), false);
  t->Arrive();
  EXPECT_TRUE(work->Wait(absl::Now() + absl::Seconds(10)).ok());
  std::lock_guard<std::mutex> lock(t->mu);
  EXPECT_EQ(t->stage_waits, 2);  // the first part was not waited for twice
  EXPECT_GE(t->suspensions, 1);
}

TEST_F(GlooQueueTest, ATransferNobodyWaitsForIsFinishedByTheCompleter) {
  auto t = std::make_shared<FakeTransfer>();
  std::unique_ptr<Work> work = Transfer(t, "send");
  t->Arrive();
  EXPECT_TRUE(DoneWithin(t, absl::Seconds(10)));
  ASSERT_EQ(t->finished_on.size(), 1u);
  EXPECT_NE(t->finished_on[0], std::this_thread::get_id());
  EXPECT_TRUE(work->Wait(absl::Now() + absl::Seconds(10)).ok());
}

TEST_F(GlooQueueTest, TestedAndDroppedTransfersAreFinished) {
  auto tested = std::make_shared<FakeTransfer>(), dropped = std::make_shared<FakeTransfer>();
  std::unique_ptr<Work> work = Transfer(tested, "tested");
  Transfer(dropped, "dropped").reset();
  EXPECT_EQ(*work->Test(), false);
  tested->Arrive();
  dropped->Arrive();
  const absl::Time end = absl::Now() + absl::Seconds(10);
  bool done = false;
  while (!done && absl::Now() < end) {
    absl::StatusOr<bool> d = work->Test();
    ASSERT_TRUE(d.ok()) << d.status();
    done = *d;
    absl::SleepFor(absl::Microseconds(200));
  }
  EXPECT_TRUE(done);
  EXPECT_TRUE(DoneWithin(dropped, absl::Seconds(10)));
  EXPECT_EQ(order(), (std::vector<std::string>{"tested", "dropped"}));
}

TEST_F(GlooQueueTest, ACollectiveBeforeTheTransferIsFinishedByTheCompleterInOrder) {
  auto c = std::make_shared<FakeTransfer>(), t = std::make_shared<FakeTransfer>();
  std::unique_ptr<Work> wc = Collective(c, "collective");
  std::unique_ptr<Work> wt = Transfer(t, "recv");
  t->Arrive();
  std::thread peer = ArriveLater(c);
  EXPECT_TRUE(wt->Wait(absl::Now() + absl::Seconds(10)).ok());
  peer.join();
  EXPECT_EQ(order(), (std::vector<std::string>{"collective", "recv"}));
  EXPECT_NE(c->finished_on.at(0), std::this_thread::get_id());
  EXPECT_TRUE(wc->Wait(absl::Now()).ok());
}

TEST_F(GlooQueueTest, FailAllEndsAClaimedWait) {
  auto t = std::make_shared<FakeTransfer>();
  std::unique_ptr<Work> work = Transfer(t, "recv");
  std::thread aborter([this] {
    absl::SleepFor(absl::Milliseconds(50));
    queue_->FailAll(absl::AbortedError("the communicator was aborted by this rank"));
  });
  const absl::Status s = work->Wait(absl::Now() + absl::Seconds(20));
  aborter.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("recv: the communicator was aborted"), std::string::npos) << s;
  // The queue goes on: a later transfer completes.
  auto next = std::make_shared<FakeTransfer>();
  std::unique_ptr<Work> w2 = Transfer(next, "next");
  next->Arrive();
  EXPECT_TRUE(w2->Wait(absl::Now() + absl::Seconds(10)).ok());
}

TEST_F(GlooQueueTest, AnOperationsOwnTimeoutFailsAClaimedWait) {
  auto t = std::make_shared<FakeTransfer>();
  std::unique_ptr<Work> work = Transfer(t, "recv", absl::Milliseconds(80));
  const absl::Status s = work->Wait(absl::InfiniteFuture());
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("timeout passed"), std::string::npos) << s;
}

TEST_F(GlooQueueTest, StopEndsAClaimedWaitAndTheWorkOutlivesTheQueuesOwner) {
  auto t = std::make_shared<FakeTransfer>();
  std::unique_ptr<Work> work = Transfer(t, "recv");
  std::thread stopper([this] {
    absl::SleepFor(absl::Milliseconds(50));
    queue_->Stop(absl::AbortedError("the communicator was destroyed"));
    queue_.reset();
  });
  const absl::Status s = work->Wait(absl::Now() + absl::Seconds(20));
  stopper.join();
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_FALSE(work->Test().ok());
  queue_ = std::make_shared<GlooQueue>(&health_, [](const absl::Status& s) { return s; });
}

TEST_F(GlooQueueTest, ManyWaitersOnInterleavedTransfersAllComplete) {
  // Threads wait for their own transfers while others arrive: each wait
  // ends with its transfer done, every transfer is finished exactly once
  // and in issue order.
  constexpr int kOps = 200;
  std::vector<std::shared_ptr<FakeTransfer>> ts;
  std::vector<std::unique_ptr<Work>> works;
  for (int i = 0; i < kOps; ++i) {
    ts.push_back(std::make_shared<FakeTransfer>(1 + i % 3));
    works.push_back(Transfer(ts.back(), absl::StrCat(i)));
  }
  std::thread arrivals([&] {
    for (int i = kOps - 1; i >= 0; --i) {
      ts[i]->Arrive(ts[i]->stages);
      if (i % 17 == 0) absl::SleepFor(absl::Milliseconds(1));
    }
  });
  std::atomic<int> failures{0};
  std::vector<std::thread> waiters;
  for (int w = 0; w < 4; ++w) {
    waiters.emplace_back([&, w] {
      for (int i = w; i < kOps; i += 4) {
        absl::Status s;
        do {
          s = works[i]->Wait(absl::Now() + absl::Milliseconds(5));
        } while (s.code() == absl::StatusCode::kDeadlineExceeded);
        if (!s.ok()) ++failures;
      }
    });
  }
  arrivals.join();
  for (auto& w : waiters) w.join();
  EXPECT_EQ(failures.load(), 0);
  std::vector<std::string> expected;
  for (int i = 0; i < kOps; ++i) expected.push_back(absl::StrCat(i));
  EXPECT_EQ(order(), expected);
  for (const auto& t : ts) EXPECT_EQ(t->stage_waits, t->stages);
}

}  // namespace
}  // namespace strata::gloo
