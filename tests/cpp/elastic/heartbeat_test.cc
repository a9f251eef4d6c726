// The heartbeat monitor on a store whose waits are served (strata's
// TCPStore client, against the test server of tests/cpp/comm): it waits
// for each epoch's alarm instead of looking at it every interval, reacts
// as soon as the alarm is set, follows Watch() to a new epoch, and stops
// at once while it waits. (The loop's tests run the monitor on a memory
// store, which it polls.)
#include "strata/elastic/heartbeat.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "elastic/internal/keys.h"
#include "fake_tcp_store.h"
#include "proc_counts.h"
#include "strata/comm/store.h"

namespace strata::elastic {
namespace {

using testing::CountEntries;

absl::Status SetAlarm(Store& store, const internal::Keys& keys, const std::string& why) {
  Detection d;
  d.source = DetectionSource::kRequest;
  d.reporter = 1;
  d.detail = why;
  d.found_at = d.failed_at = absl::Now();
  return store.Set(keys.Alarm(), EncodeDetection(d), absl::Now() + absl::Seconds(10));
}

std::shared_ptr<Store> Connect(int port) {
  TcpStoreOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  absl::StatusOr<std::shared_ptr<Store>> s = ConnectTcpStore(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : nullptr;
}

TEST(HeartbeatMonitorTest, OnAStoreThatServesWaitsTheAlarmIsWaitedForNotPolled) {
  strata::testing::FakeServer server;
  auto store = Connect(server.port());
  auto other = Connect(server.port());
  ASSERT_NE(store, nullptr);
  ASSERT_NE(other, nullptr);

  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<std::string, uint64_t>> alarms;  // detail, epoch
  std::vector<absl::Time> seen_at;
  HeartbeatMonitor::Config config;
  config.store = store;
  config.rank = 0;
  config.options.job = "wait";
  config.options.heartbeat_interval = absl::Milliseconds(20);
  // The monitor's fallback look at the alarm comes once a timeout: 10 s,
  // so that an alarm seen within a second was seen by the wait.
  config.options.heartbeat_timeout = absl::Seconds(10);
  config.options.rebuild_timeout = absl::Seconds(60);  // rank 1 never beats
  config.on_alarm = [&](const Detection& d, uint64_t epoch) {
    std::lock_guard<std::mutex> lock(mu);
    alarms.emplace_back(d.detail, epoch);
    seen_at.push_back(absl::Now());
    cv.notify_all();
  };
  auto monitor = std::make_unique<HeartbeatMonitor>(config);
  Membership m;
  m.members = {0, 1};
  m.epoch = 1;
  monitor->Watch(m);

  // Polling every 20 ms would be about 75 looks (CHECK) in 1.5 s. What
  // remains: the read of the successor's beat (a CHECK, then GET) with each
  // beat (every second here), the first pass's look at the alarm, and looks
  // every interval until the alarm thread has started its wait.
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_LE(server.queries(5), 10) << "the monitor looked at the alarm key every interval";
  EXPECT_GE(server.queries(6), 1) << "no WAIT reached the server";

  auto wait_for = [&](size_t n) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(5), [&] { return alarms.size() >= n; });
  };
  absl::Time set_at = absl::Now();
  ASSERT_TRUE(SetAlarm(*other, internal::Keys("wait", 1), "first").ok());
  ASSERT_TRUE(wait_for(1)) << "the alarm of epoch 1 was not seen";
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(alarms[0], std::make_pair(std::string("first"), uint64_t{1}));
    EXPECT_LT(seen_at[0] - set_at, absl::Seconds(2));
    std::printf("alarm of epoch 1 seen %.2f ms after it was set; %d looks (CHECK), %d WAITs\n",
                absl::ToDoubleMilliseconds(seen_at[0] - set_at), server.queries(5),
                server.queries(6));
  }
  // Reacting checks this rank in.
  EXPECT_TRUE(other->Get(internal::Keys("wait", 1).Alive(0), absl::Now() + absl::Seconds(5)).ok());

  // A new epoch: the wait moves to its key.
  m.epoch = 2;
  monitor->Watch(m);
  absl::SleepFor(absl::Milliseconds(200));
  set_at = absl::Now();
  ASSERT_TRUE(SetAlarm(*other, internal::Keys("wait", 2), "second").ok());
  ASSERT_TRUE(wait_for(2)) << "the alarm of epoch 2 was not seen";
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(alarms[1], std::make_pair(std::string("second"), uint64_t{2}));
    EXPECT_LT(seen_at[1] - set_at, absl::Seconds(2));
  }

  // Stopping ends a wait that has minutes left.
  m.epoch = 3;
  monitor->Watch(m);
  absl::SleepFor(absl::Milliseconds(200));
  const absl::Time stop = absl::Now();
  monitor.reset();
  EXPECT_LT(absl::Now() - stop, absl::Seconds(3)) << "the monitor's wait held its stop";
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(alarms.size(), 2u);
}

// 50 epochs, every other one ended by its alarm and the rest by the next
// Watch while the monitor waits for their alarm (the cancel drops the
// wait's connection; the next wait connects again), then the monitor
// stopped while it waits: as many threads and descriptors as before
// (counted after a first monitor of two epochs, so that what the library
// opens once, such as its process identity, is open already).
void RunEpochs(const strata::testing::FakeServer& server, Store& other, const std::string& job,
               uint64_t epochs) {
  auto store = Connect(server.port());
  ASSERT_NE(store, nullptr);
  std::mutex mu;
  std::condition_variable cv;
  uint64_t seen = 0;
  HeartbeatMonitor::Config config;
  config.store = store;
  config.options.job = job;
  config.options.heartbeat_interval = absl::Milliseconds(20);
  config.options.heartbeat_timeout = absl::Seconds(10);
  config.options.rebuild_timeout = absl::Seconds(60);
  config.on_alarm = [&](const Detection&, uint64_t epoch) {
    std::lock_guard<std::mutex> lock(mu);
    seen = epoch;
    cv.notify_all();
  };
  HeartbeatMonitor monitor(config);
  Membership m;
  m.members = {0, 1};
  for (uint64_t e = 1; e <= epochs; ++e) {
    const int waits = server.queries(6);
    m.epoch = e;
    monitor.Watch(m);
    if (e % 2 == 0) {
      // Left to the next Watch, once the monitor waits for this alarm.
      const absl::Time give_up = absl::Now() + absl::Seconds(5);
      while (server.queries(6) == waits && absl::Now() < give_up) {
        absl::SleepFor(absl::Milliseconds(1));
      }
      ASSERT_GT(server.queries(6), waits) << "no wait for the alarm of epoch " << e;
      continue;
    }
    ASSERT_TRUE(SetAlarm(other, internal::Keys(job, e), "next").ok());
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(5), [&] { return seen == e; }))
        << "the alarm of epoch " << e << " was not seen";
  }
}

TEST(HeartbeatMonitorTest, FiftyEpochsLeakNeitherThreadsNorConnections) {
  strata::testing::FakeServer server;
  auto other = Connect(server.port());
  ASSERT_NE(other, nullptr);
  RunEpochs(server, *other, "warm", 2);
  // The test server (in this process) closes its ends of the connections
  // once it sees them closed: give it a moment each time.
  auto fds = [](int at_most) {
    const absl::Time give_up = absl::Now() + absl::Seconds(5);
    while (CountEntries("/proc/self/fd") > at_most && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    return CountEntries("/proc/self/fd");
  };
  const int threads_before = CountEntries("/proc/self/task");
  absl::SleepFor(absl::Milliseconds(300));
  const int fds_before = CountEntries("/proc/self/fd");
  RunEpochs(server, *other, "fifty", 50);
  EXPECT_EQ(CountEntries("/proc/self/task"), threads_before);
  EXPECT_EQ(fds(fds_before), fds_before);
}

}  // namespace
}  // namespace strata::elastic
