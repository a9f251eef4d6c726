// strata::torch::WrapC10dStore / ConnectC10dStore over a real c10d TCPStore
// served in this process: every operation, deadlines, many clients, Gloo
// root communicators bootstrapped through it (ranks as threads, with
// LibTorch's own gloo:: symbols in the process), and an unreachable store.
#include "strata/torch/c10d_store.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <thread>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "strata/comm/backend.h"

namespace strata::torch {
namespace {

c10::intrusive_ptr<c10d::TCPStore> Serve() {
  c10d::TCPStoreOptions opts;
  opts.port = 0;  // the OS picks
  opts.isServer = true;
  opts.waitWorkers = false;
  opts.timeout = std::chrono::seconds(30);
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
}

c10::intrusive_ptr<c10d::TCPStore> Client(uint16_t port) {
  c10d::TCPStoreOptions opts;
  opts.port = port;
  opts.timeout = std::chrono::seconds(30);
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
}

absl::Time In(absl::Duration d) { return absl::Now() + d; }

TEST(C10dStoreTest, EveryOperationRoundTripsUnderAPrefix) {
  auto server = Serve();
  std::shared_ptr<Store> s = WrapC10dStore(server, "test store");
  const std::string binary(
      "\0\xff"
      "x",
      3);
  ASSERT_TRUE(s->Set("k", binary, In(absl::Seconds(5))).ok());
  absl::StatusOr<std::string> got = s->Get("k", In(absl::Seconds(5)));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, binary);
  EXPECT_TRUE(server->check({"strata/k"}));
  EXPECT_FALSE(server->check({"k"}));
  EXPECT_TRUE(s->Wait({"k"}, In(absl::Seconds(5))).ok());
  EXPECT_EQ(*s->Add("n", 5, In(absl::Seconds(5))), 5);
  EXPECT_EQ(*s->Add("n", -7, In(absl::Seconds(5))), -2);
  EXPECT_EQ(*s->CompareSet("c", "", "one", In(absl::Seconds(5))), "one");
  EXPECT_EQ(*s->CompareSet("c", "one", "two", In(absl::Seconds(5))), "two");
  EXPECT_EQ(*s->CompareSet("c", "zz", "three", In(absl::Seconds(5))), "two");
  absl::StatusOr<std::string> absent = s->CompareSet("absent", "x", "y", In(absl::Seconds(5)));
  EXPECT_EQ(absent.status().code(), absl::StatusCode::kNotFound) << absent.status();
  EXPECT_EQ(s->Describe(), "test store");
}

TEST(C10dStoreTest, GetAndWaitFailAtTheirDeadlineNamingTheKeys) {
  auto server = Serve();
  std::shared_ptr<Store> s = WrapC10dStore(server, "test store");
  for (absl::Duration d : {absl::Milliseconds(300), absl::ZeroDuration()}) {
    const absl::Time start = absl::Now();
    absl::StatusOr<std::string> v = s->Get("never", In(d));
    EXPECT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded) << v.status();
    EXPECT_TRUE(absl::StrContains(v.status().message(), "never")) << v.status();
    EXPECT_TRUE(absl::StrContains(v.status().message(), "test store")) << v.status();
    EXPECT_LT(absl::Now() - start, d + absl::Seconds(2));
  }
  absl::Status w = s->Wait({"a", "b"}, In(absl::Milliseconds(200)));
  EXPECT_EQ(w.code(), absl::StatusCode::kDeadlineExceeded) << w;
  EXPECT_TRUE(absl::StrContains(w.message(), "a, b")) << w;
}

// `clients` threads, each with a client of its own from `connect`, add to
// one counter and race on one compare_set per round: no error, one winner
// per round, and the counter (read by the last client) holds every add.
void ExpectEveryAddCountedAndOneWinnerPerRound(
    const std::function<std::shared_ptr<Store>()>& connect, int clients, int rounds) {
  std::vector<std::thread> threads;
  std::atomic<int> wins{0}, errors{0};
  for (int i = 0; i < clients; ++i) {
    threads.emplace_back([&, i] {
      std::shared_ptr<Store> s = connect();
      if (s == nullptr) {
        errors++;
        return;
      }
      for (int r = 0; r < rounds; ++r) {
        if (!s->Add("counter", 1, In(absl::Seconds(30))).ok()) errors++;
        absl::StatusOr<std::string> v =
            s->CompareSet(absl::StrCat("round", r), "", absl::StrCat(i), In(absl::Seconds(30)));
        if (!v.ok()) errors++;
        if (v.ok() && *v == absl::StrCat(i)) wins++;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(wins.load(), rounds);
  EXPECT_EQ(*connect()->Add("counter", 0, In(absl::Seconds(5))), clients * rounds);
}

TEST(C10dStoreTest, ManyClientsCountOnceAndOneWinsEachRace) {
  auto server = Serve();
  ExpectEveryAddCountedAndOneWinnerPerRound(
      [&] { return WrapC10dStore(Client(server->getPort()), "client"); }, 16, 20);
}

// strata's own client of the protocol (strata/comm/store.h ConnectTcpStore)
// against LibTorch's server, side by side with LibTorch's client.
std::shared_ptr<Store> Native(uint16_t port) {
  TcpStoreOptions options;
  options.host = "127.0.0.1";
  options.port = port;
  options.connect_timeout = absl::Seconds(10);
  absl::StatusOr<std::shared_ptr<Store>> s = ConnectTcpStore(options);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : nullptr;
}

TEST(C10dStoreTest, TheNativeClientSpeaksTheProtocolAndSharesTheKeys) {
  auto server = Serve();
  std::shared_ptr<Store> native = Native(server->getPort());
  ASSERT_NE(native, nullptr);
  std::shared_ptr<Store> wrapped = WrapC10dStore(Client(server->getPort()), "torch client");
  const std::string binary("\0\xff\n", 3);
  ASSERT_TRUE(native->Set("k", binary, In(absl::Seconds(5))).ok());
  EXPECT_EQ(*wrapped->Get("k", In(absl::Seconds(5))), binary);
  EXPECT_TRUE(server->check({"strata/k"}));
  ASSERT_TRUE(wrapped->Set("w", "from torch", In(absl::Seconds(5))).ok());
  EXPECT_EQ(*native->Get("w", In(absl::Seconds(5))), "from torch");
  EXPECT_EQ(*native->Add("n", 5, In(absl::Seconds(5))), 5);
  EXPECT_EQ(*wrapped->Add("n", -7, In(absl::Seconds(5))), -2);
  EXPECT_EQ(*native->CompareSet("c", "", "one", In(absl::Seconds(5))), "one");
  EXPECT_EQ(*native->CompareSet("c", "one", "two", In(absl::Seconds(5))), "two");
  EXPECT_EQ(*native->CompareSet("c", "zz", "three", In(absl::Seconds(5))), "two");
  EXPECT_EQ(native->CompareSet("absent", "x", "y", In(absl::Seconds(5))).status().code(),
            absl::StatusCode::kNotFound);
  // A look at a passed deadline, a wait that ends at its deadline (then the
  // connection is still in step), a wait that a later write ends.
  EXPECT_EQ(native->Get("never", absl::InfinitePast()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(*native->Get("k", absl::InfinitePast()), binary);
  absl::Status w = native->Wait({"a", "b"}, In(absl::Milliseconds(200)));
  EXPECT_EQ(w.code(), absl::StatusCode::kDeadlineExceeded) << w;
  EXPECT_TRUE(absl::StrContains(w.message(), "a, b")) << w;
  EXPECT_TRUE(absl::StrContains(w.message(), "127.0.0.1")) << w;
  EXPECT_EQ(*native->Add("n", 0, In(absl::Seconds(5))), -2);
  std::thread late([&] {
    absl::SleepFor(absl::Milliseconds(200));
    EXPECT_TRUE(wrapped->Set("late", "v", In(absl::Seconds(5))).ok());
  });
  absl::StatusOr<std::string> v = native->Get("late", In(absl::Seconds(10)));
  late.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "v");
}

TEST(C10dStoreTest, NativeClientsCountOnceAndOneWinsEachRace) {
  auto server = Serve();
  ExpectEveryAddCountedAndOneWinnerPerRound([&] { return Native(server->getPort()); }, 8, 20);
}

TEST(C10dStoreTest, GlooRootsBootstrapThroughIt) {
  const std::vector<std::string> backends = AvailableBackends();
  if (std::find(backends.begin(), backends.end(), "gloo") == backends.end()) {
    GTEST_SKIP() << "built without Gloo";
  }
  auto server = Serve();
  constexpr int kRanks = 4;
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(kRanks);
  std::vector<std::vector<float>> outputs(kRanks);
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      LaunchEnv env;
      env.launcher = Launcher::kTorchrun;
      env.rank = r;
      env.world_size = kRanks;
      RootOptions options;
      options.backend = "gloo";
      options.memory = RootMemory::kHost;
      options.comm.timeout = absl::Seconds(60);
      options.store = WrapC10dStore(Client(server->getPort()), "c10d store");
      absl::StatusOr<std::unique_ptr<Communicator>> comm = CreateRootCommunicator(env, options);
      if (!comm.ok()) {
        results[r] = comm.status();
        return;
      }
      std::vector<float> x(1000);
      for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i * (r + 1));
      absl::StatusOr<std::unique_ptr<Work>> w = (*comm)->AllReduce(
          Buffer::Of(x.data(), x.size()), Buffer::Of(x.data(), x.size()), ReduceOp::kSum);
      results[r] = w.ok() ? (*w)->Wait(In(absl::Seconds(60))) : w.status();
      outputs[r] = x;
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r];
    for (size_t i = 0; i < outputs[r].size(); ++i) {
      ASSERT_EQ(outputs[r][i], static_cast<float>(i * kRanks * (kRanks + 1) / 2))
          << "rank " << r << " element " << i;
    }
  }
}

int FreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

TEST(C10dStoreTest, AnUnreachableStoreFailsClearlyWithinItsDeadline) {
  LaunchEnv env;
  env.launcher = Launcher::kTorchrun;
  env.rank = 1;  // a client: rank 0 would serve
  env.world_size = 2;
  env.master_addr = "127.0.0.1";
  env.master_port = FreePort();  // nothing listens there
  C10dStoreOptions options;
  options.connect_timeout = absl::Seconds(2);
  const absl::Time start = absl::Now();
  absl::StatusOr<std::shared_ptr<Store>> s = ConnectC10dStore(env, options);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable) << s.status();
  EXPECT_TRUE(absl::StrContains(
      s.status().message(), absl::StrCat("MASTER_ADDR:MASTER_PORT = 127.0.0.1:", env.master_port)))
      << s.status();
  EXPECT_TRUE(absl::StrContains(s.status().message(), "rank 1 of 2")) << s.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2 * 2 + 5));
}

TEST(C10dStoreTest, MissingAddressAndBadOptionsAreRejected) {
  LaunchEnv env;
  env.rank = 0;
  env.world_size = 2;
  absl::StatusOr<std::shared_ptr<Store>> s = ConnectC10dStore(env);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
  EXPECT_TRUE(absl::StrContains(s.status().message(), "MASTER_ADDR/MASTER_PORT")) << s.status();
  env.master_addr = "127.0.0.1";
  env.master_port = 29500;
  C10dStoreOptions bad;
  bad.connect_timeout = absl::Seconds(-1);
  s = ConnectC10dStore(env, bad);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
  EXPECT_TRUE(absl::StrContains(s.status().message(), "connect_timeout must be positive, got -1s"))
      << s.status();
  bad = C10dStoreOptions();
  bad.version = 99;
  s = ConnectC10dStore(env, bad);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
}

}  // namespace
}  // namespace strata::torch
