// A TCPStore server for tests, written from the protocol
// (src/comm/store/tcp_store.cc describes it): strata's client is tested
// and sanitized against it without LibTorch, and tests of what uses the
// client count the queries it sends.
#pragma once

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

#include "gtest/gtest.h"

namespace strata::testing {

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
  // How many queries of type `q` (1 SET ... 5 CHECK, 6 WAIT, 12
  // CANCEL_WAIT) the server has taken.
  int queries(uint8_t q) const { return counts_[q & 15].load(); }
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
    const bool counted = c.validated;
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
    if (counted) ++counts_[q & 15];
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
  std::atomic<int> counts_[16] = {};
  std::map<std::string, std::string> data_;
  std::thread thread_;
};

}  // namespace strata::testing
