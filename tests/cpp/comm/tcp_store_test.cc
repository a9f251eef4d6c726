// strata's TCPStore client (strata/comm/store.h ConnectTcpStore) against a
// small server written here from the protocol, so that it is tested (and
// sanitized) without LibTorch; tests/cpp/torch/c10d_store_test.cc checks it
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
#include "gtest/gtest.h"
#include "strata/comm/store.h"

namespace strata {
namespace {

absl::Time In(absl::Duration d) { return absl::Now() + d; }

// A TCPStore server for the tests: one thread, poll(2) over its clients,
// the queries the client sends (VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK,
// WAIT, CANCEL_WAIT). `Close()` drops every client and stops listening.
class FakeServer {
 public:
  FakeServer() {
    listen_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a;
    std::memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(listen_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    EXPECT_EQ(::listen(listen_, 64), 0);
    socklen_t len = sizeof(a);
    ::getsockname(listen_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { Run(); });
  }
  ~FakeServer() { Close(); }
  int port() const { return port_; }
  void Close() {
    if (stop_.exchange(true)) return;
    thread_.join();
  }

 private:
  struct Client {
    std::string in;
    bool validated = false;
    std::set<std::string> waiting;
  };

  void Run() {
    std::map<int, Client> clients;
    while (!stop_) {
      std::vector<pollfd> fds = {{listen_, POLLIN, 0}};
      for (auto& [fd, c] : clients) fds.push_back({fd, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 20) <= 0) continue;
      if (fds[0].revents & POLLIN) clients[::accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC)];
      for (size_t i = 1; i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP))) continue;
        char buf[4096];
        const ssize_t n = ::recv(fds[i].fd, buf, sizeof(buf), 0);
        if (n <= 0) {
          ::close(fds[i].fd);
          clients.erase(fds[i].fd);
          continue;
        }
        Client& c = clients[fds[i].fd];
        c.in.append(buf, static_cast<size_t>(n));
        while (Serve(fds[i].fd, c, clients)) {
        }
      }
    }
    for (auto& [fd, c] : clients) ::close(fd);
    ::close(listen_);
  }

  // Takes one whole query off c.in and answers it; false when c.in holds
  // no whole query.
  bool Serve(int fd, Client& c, std::map<int, Client>& clients) {
    size_t at = 1;
    auto u64 = [&](uint64_t* v) {
      if (c.in.size() < at + 8) return false;
      std::memcpy(v, c.in.data() + at, 8);
      at += 8;
      return true;
    };
    auto bytes = [&](std::string* s) {
      uint64_t n = 0;
      if (!u64(&n) || c.in.size() < at + n) return false;
      *s = c.in.substr(at, n);
      at += n;
      return true;
    };
    auto keys = [&](std::vector<std::string>* out) {
      uint64_t n = 0;
      if (!u64(&n)) return false;
      out->resize(n);
      for (auto& k : *out) {
        if (!bytes(&k)) return false;
      }
      return true;
    };
    auto reply = [&](int to, const std::string& s) { (void)::send(to, s.data(), s.size(), 0); };
    auto with_size = [](const std::string& s) {
      const uint64_t n = s.size();
      return std::string(reinterpret_cast<const char*>(&n), 8) + s;
    };
    if (c.in.empty()) return false;
    const uint8_t q = static_cast<uint8_t>(c.in[0]);
    std::string key, a, b;
    std::vector<std::string> ks;
    if (!c.validated) {
      if (q != 0 || c.in.size() < 5) return false;
      uint32_t magic = 0;
      std::memcpy(&magic, c.in.data() + 1, 4);
      EXPECT_EQ(magic, 0x3C85F7CEu);
      c.validated = true;
      at = 5;
    } else if (q == 1) {  // SET
      if (!bytes(&key) || !bytes(&a)) return false;
      data_[key] = a;
      Wake(key, clients, reply);
    } else if (q == 2) {  // COMPARE_SET
      if (!bytes(&key) || !bytes(&a) || !bytes(&b)) return false;
      auto it = data_.find(key);
      if (it == data_.end()) {
        if (a.empty()) data_[key] = b;
        reply(fd, with_size(a.empty() ? b : a));
      } else {
        if (it->second == a) it->second = b;
        reply(fd, with_size(it->second));
      }
      Wake(key, clients, reply);
    } else if (q == 3) {  // GET
      if (!bytes(&key)) return false;
      reply(fd, with_size(data_.count(key) ? data_[key] : ""));
    } else if (q == 4) {  // ADD
      uint64_t delta = 0;
      if (!bytes(&key) || !u64(&delta)) return false;
      int64_t v = data_.count(key) ? std::stoll(data_[key]) : 0;
      v += static_cast<int64_t>(delta);
      data_[key] = std::to_string(v);
      reply(fd, std::string(reinterpret_cast<const char*>(&v), 8));
      Wake(key, clients, reply);
    } else if (q == 5 || q == 6) {  // CHECK, WAIT
      if (!keys(&ks)) return false;
      std::set<std::string> missing;
      for (const auto& k : ks) {
        if (!data_.count(k)) missing.insert(k);
      }
      if (q == 5) {
        reply(fd, std::string(1, missing.empty() ? 0 : 1));
      } else if (missing.empty()) {
        reply(fd, std::string(1, 0));
      } else {
        c.waiting = missing;
      }
    } else if (q == 12) {  // CANCEL_WAIT
      c.waiting.clear();
      reply(fd, std::string(1, 1));
    } else {
      ADD_FAILURE() << "query " << int(q);
      return false;
    }
    c.in.erase(0, at);
    return true;
  }

  template <typename Reply>
  void Wake(const std::string& key, std::map<int, Client>& clients, Reply reply) {
    for (auto& [fd, c] : clients) {
      if (c.waiting.erase(key) && c.waiting.empty()) reply(fd, std::string(1, 0));
    }
  }

  int listen_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::map<std::string, std::string> data_;
  std::thread thread_;
};

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

}  // namespace
}  // namespace strata
