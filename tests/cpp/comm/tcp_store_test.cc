// strata's TCPStore client (strata/comm/store.h ConnectTcpStore) against a
// small server written from the protocol (fake_tcp_store.h), so that it is
// tested (and sanitized) without LibTorch; tests/cpp/torch/c10d_store_test.cc checks it
// against LibTorch's own server and client.
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "fake_tcp_store.h"
#include "gtest/gtest.h"
#include "strata/comm/store.h"

namespace strata {
namespace {

using ::strata::testing::FakeServer;

absl::Time In(absl::Duration d) { return absl::Now() + d; }

std::shared_ptr<Store> Connect(int port, absl::Duration timeout = absl::Seconds(10)) {
  TcpStoreOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.connect_timeout = timeout;
  absl::StatusOr<std::shared_ptr<Store>> s = ConnectTcpStore(o);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : nullptr;
}

TEST(TcpStoreTest, EveryOperationRoundTripsWithTorchsKeyPrefix) {
  FakeServer server;
  auto s = Connect(server.port());
  ASSERT_NE(s, nullptr);
  const std::string binary("\0\xff\n", 3);
  ASSERT_TRUE(s->Set("k", binary, In(absl::Seconds(5))).ok());
  EXPECT_EQ(*s->Get("k", In(absl::Seconds(5))), binary);
  EXPECT_EQ(*s->Get("k", absl::InfinitePast()), binary);  // one look
  EXPECT_TRUE(s->Wait({"k"}, In(absl::Seconds(5))).ok());
  EXPECT_EQ(*s->Add("n", 5, In(absl::Seconds(5))), 5);
  EXPECT_EQ(*s->Add("n", -7, In(absl::Seconds(5))), -2);
  EXPECT_EQ(*s->CompareSet("c", "", "one", In(absl::Seconds(5))), "one");
  EXPECT_EQ(*s->CompareSet("c", "one", "two", In(absl::Seconds(5))), "two");
  EXPECT_EQ(*s->CompareSet("c", "zz", "three", In(absl::Seconds(5))), "two");
  EXPECT_EQ(s->CompareSet("absent", "x", "y", In(absl::Seconds(5))).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StrContains(s->Describe(), absl::StrCat("127.0.0.1:", server.port())));
  // The keys on the wire are torch's: "/" + prefix + key.
  TcpStoreOptions raw;
  raw.host = "127.0.0.1";
  raw.port = server.port();
  raw.prefix = "";
  auto unprefixed = *ConnectTcpStore(raw);
  EXPECT_EQ(*unprefixed->Get("strata/k", In(absl::Seconds(5))), binary);
}

TEST(TcpStoreTest, AWaitPastItsDeadlineIsCancelledAndTheConnectionGoesOn) {
  FakeServer server;
  auto s = Connect(server.port());
  auto other = Connect(server.port());
  for (absl::Duration d : {absl::Milliseconds(200), absl::ZeroDuration()}) {
    absl::StatusOr<std::string> v = s->Get("never", In(d));
    EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded) << v.status();
    EXPECT_TRUE(absl::StrContains(v.status().message(), "never")) << v.status();
  }
  absl::Status w = s->Wait({"a", "b"}, In(absl::Milliseconds(200)));
  EXPECT_EQ(w.code(), absl::StatusCode::kDeadlineExceeded) << w;
  EXPECT_TRUE(absl::StrContains(w.message(), "a, b")) << w;
  // Still in step: the next answers are this request's.
  EXPECT_EQ(*s->Add("n", 1, In(absl::Seconds(5))), 1);
  std::thread late([&] {
    absl::SleepFor(absl::Milliseconds(100));
    EXPECT_TRUE(other->Set("late", "v", In(absl::Seconds(5))).ok());
  });
  EXPECT_EQ(*s->Get("late", In(absl::Seconds(10))), "v");
  late.join();
}

TEST(TcpStoreTest, ThreadsShareAClientAndEachAddCountsOnce) {
  FakeServer server;
  auto s = Connect(server.port());
  std::vector<std::thread> threads;
  std::atomic<int> errors{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 100; ++i) {
        if (!s->Add("n", 1, In(absl::Seconds(10))).ok()) errors++;
        if (!s->Get("n", absl::InfinitePast()).ok()) errors++;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(*s->Add("n", 0, In(absl::Seconds(5))), 400);
}

TEST(TcpStoreTest, ALostServerIsUnavailableNamingItsAddress) {
  auto server = std::make_unique<FakeServer>();
  const int port = server->port();
  auto s = Connect(port);
  ASSERT_TRUE(s->Set("k", "v", In(absl::Seconds(5))).ok());
  server.reset();
  absl::Status st;
  for (int i = 0; i < 3 && st.ok(); ++i) st = s->Get("k", In(absl::Seconds(1))).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), absl::StrCat("127.0.0.1:", port))) << st;

  // The server listened and no longer does: the next request does not
  // retry the refused connection until its deadline (a monitor thread being
  // joined waited that long).
  const absl::Time start = absl::Now();
  st = s->Set("k", "v", In(absl::Seconds(60)));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "refuses connections")) << st;
  EXPECT_LT(absl::Now() - start, absl::Seconds(20)) << st;

  TcpStoreOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.connect_timeout = absl::Milliseconds(300);
  absl::StatusOr<std::shared_ptr<Store>> none = ConnectTcpStore(o);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kUnavailable) << none.status();
  o.port = 0;
  EXPECT_EQ(ConnectTcpStore(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.port = port;
  o.connect_timeout = absl::ZeroDuration();
  EXPECT_EQ(ConnectTcpStore(o).status().code(), absl::StatusCode::kInvalidArgument);
}

// A cancellable wait has a connection of its own: the client's other
// requests go on while it waits; a cancel from another thread ends it at
// once (Cancelled), one made before it starts too, and after Reset() it
// returns when the key is set (on a new connection). Nothing is polled.
TEST(TcpStoreTest, ACancellableWaitEndsOnACancelAndLeavesTheClientFree) {
  FakeServer server;
  auto s = Connect(server.port());
  auto other = Connect(server.port());
  EXPECT_TRUE(s->waits_without_polling());
  WaitCancel cancel;
  absl::Status waited;
  absl::Time ended;
  std::thread waiter([&] {
    waited = s->CancellableWait({"alarm"}, In(absl::Seconds(60)), cancel);
    ended = absl::Now();
  });
  absl::SleepFor(absl::Milliseconds(200));
  // Meanwhile on the same client:
  ASSERT_TRUE(s->Set("x", "1", In(absl::Seconds(5))).ok());
  EXPECT_EQ(*s->Get("x", In(absl::Seconds(5))), "1");
  const absl::Time cancelled_at = absl::Now();
  cancel.Cancel();
  waiter.join();
  EXPECT_EQ(waited.code(), absl::StatusCode::kCancelled) << waited;
  EXPECT_TRUE(absl::StrContains(waited.message(), "alarm")) << waited;
  EXPECT_LT(ended - cancelled_at, absl::Seconds(2));
  EXPECT_EQ(server.queries(5), 0) << "the wait looked at the key (CHECK)";
  // Ended by dropping the wait's connection: no CANCEL_WAIT round trip,
  // which a server cut off would keep waiting.
  EXPECT_EQ(server.queries(12), 0);

  // Still cancelled: the next wait ends at once.
  EXPECT_EQ(s->CancellableWait({"alarm"}, In(absl::Seconds(60)), cancel).code(),
            absl::StatusCode::kCancelled);
  cancel.Reset();
  EXPECT_FALSE(cancel.cancelled());
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(100));
    EXPECT_TRUE(other->Set("alarm", "up", In(absl::Seconds(5))).ok());
  });
  EXPECT_TRUE(s->CancellableWait({"alarm"}, In(absl::Seconds(60)), cancel).ok());
  setter.join();
  EXPECT_EQ(*s->Get("alarm", In(absl::Seconds(5))), "up");
  // A deadline still ends it.
  EXPECT_EQ(s->CancellableWait({"never"}, In(absl::Milliseconds(100)), cancel).code(),
            absl::StatusCode::kDeadlineExceeded);
}

}  // namespace
}  // namespace strata
