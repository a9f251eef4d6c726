// A client of torch.distributed's TCPStore, without LibTorch or Python
// (strata/comm/store.h ConnectTcpStore).
//
// The wire protocol of torch's TCPStore servers (the libuv daemon and the
// older one speak the same): a client first sends VALIDATE and a magic
// number; then each request is a one-byte query type and its arguments;
// integers are in host byte order; a string or byte vector is its length as
// a uint64 and its bytes; torch's client sends every key with "/" before
// it. SET sends no answer. GET of a missing key answers
// an empty value (so a look without waiting asks CHECK first). WAIT answers
// one byte once every key exists; a waiter that gives up sends CANCEL_WAIT
// and reads until the server's WAIT_CANCELED (a STOP_WAITING may come
// first), so that no late answer is read as the next request's.
//
// One connection per client, one request at a time (a mutex), so a client
// used by two threads serialises them: give a thread that waits long its
// own client. A request whose answer does not come before its deadline, or
// a broken connection, drops the connection; the next request connects
// again.
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "strata/base/status.h"
#include "strata/comm/store.h"

namespace strata {
namespace {

// torch/csrc/distributed/c10d/TCPStoreBackend.hpp
constexpr uint32_t kValidationMagic = 0x3C85F7CE;
enum Query : uint8_t {
  kValidate = 0,
  kSet = 1,
  kCompareSet = 2,
  kGet = 3,
  kAdd = 4,
  kCheck = 5,
  kWait = 6,
  kCancelWait = 12,
};
constexpr uint8_t kReady = 0;        // CheckResponseType::READY
constexpr uint8_t kStopWaiting = 0;  // WaitResponseType::STOP_WAITING
constexpr uint8_t kWaitCanceled = 1;

// A request is sent and its answer read by its deadline or, when that is
// sooner, within this of the call: a look at a passed deadline (a Get at
// InfinitePast) still takes a round trip, and a busy server may take a
// while. (torch's own client waits its whole store timeout.)
constexpr absl::Duration kAnswerGrace = absl::Seconds(10);

absl::Time AnswerBy(absl::Time deadline) { return std::max(deadline, absl::Now() + kAnswerGrace); }

// How long a client that was connected tries to connect again.
constexpr absl::Duration kReconnectWithin = absl::Seconds(2);

// How long data sent may stay unacknowledged by the server's host before
// the connection counts as broken (TCP_USER_TIMEOUT).
constexpr absl::Duration kDeadPeer = absl::Seconds(8);

// A request being built.
class Request {
 public:
  explicit Request(uint8_t query) { bytes_.push_back(static_cast<char>(query)); }
  template <typename T>
  Request& Value(T v) {
    bytes_.append(reinterpret_cast<const char*>(&v), sizeof(v));
    return *this;
  }
  Request& Bytes(absl::string_view s) {
    Value<uint64_t>(s.size());
    bytes_.append(s.data(), s.size());
    return *this;
  }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

class TcpStoreClient final : public Store {
 public:
  explicit TcpStoreClient(TcpStoreOptions options) : options_(std::move(options)) {}
  ~TcpStoreClient() override { Drop(); }

  absl::Status Set(absl::string_view key, absl::string_view value, absl::Time deadline) override {
    std::lock_guard<std::mutex> lock(mu_);
    return Send(Request(kSet).Bytes(Key(key)).Bytes(value), AnswerBy(deadline), "set", key);
  }

  absl::StatusOr<std::string> Get(absl::string_view key, absl::Time deadline) override {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string keys[] = {Key(key)};
    STRATA_RETURN_IF_ERROR(WaitLocked(keys, deadline, "get", key));
    const absl::Time by = AnswerBy(deadline);
    STRATA_RETURN_IF_ERROR(Send(Request(kGet).Bytes(keys[0]), by, "get", key));
    return ReadBytes(by, "get", key);
  }

  absl::Status Wait(absl::Span<const std::string> keys, absl::Time deadline) override {
    std::lock_guard<std::mutex> lock(mu_);
    return WaitLocked(Keys(keys), deadline, "wait", absl::StrJoin(keys, ", "));
  }

  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta, absl::Time deadline) override {
    std::lock_guard<std::mutex> lock(mu_);
    const absl::Time by = AnswerBy(deadline);
    STRATA_RETURN_IF_ERROR(Send(Request(kAdd).Bytes(Key(key)).Value(delta), by, "add", key));
    int64_t value = 0;
    STRATA_RETURN_IF_ERROR(Read(&value, sizeof(value), by, "add", key));
    return value;
  }

  absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                         absl::string_view desired, absl::Time deadline) override {
    std::lock_guard<std::mutex> lock(mu_);
    const std::string full = Key(key);
    const absl::Time by = AnswerBy(deadline);
    STRATA_RETURN_IF_ERROR(Send(Request(kCompareSet).Bytes(full).Bytes(expected).Bytes(desired), by,
                                "compare_set", key));
    STRATA_ASSIGN_OR_RETURN(std::string value, ReadBytes(by, "compare_set", key));
    // The server answers `expected` for an absent key (and leaves it
    // absent) when `expected` is not empty: tell that apart.
    if (!expected.empty() && value == expected) {
      const std::string keys[] = {full};
      STRATA_ASSIGN_OR_RETURN(bool present, CheckLocked(keys, by, "compare_set", key));
      if (!present) {
        return absl::NotFoundError(absl::StrCat(Describe(), ": compare_set on key '", key,
                                                "', which does not exist (expected '", expected,
                                                "')"));
      }
    }
    return value;
  }

  std::string Describe() const override {
    return absl::StrCat("torch TCPStore ", options_.host, ":", options_.port);
  }

  // On a connection of its own (made on first use, and again after a
  // cancel, which drops it), so that this client's other requests go on
  // while it waits; one such wait at a time.
  absl::Status CancellableWait(absl::Span<const std::string> keys, absl::Time deadline,
                               const WaitCancel& cancel) override {
    std::lock_guard<std::mutex> waiting(waiter_mu_);
    if (waiter_ == nullptr) {
      waiter_ = std::make_unique<TcpStoreClient>(options_);
      // This client reached the server: the waiter's connection is a
      // reconnection (given up after kReconnectWithin, a refusal final),
      // so that a cancel is not kept waiting for a server that is gone.
      waiter_->was_connected_ = true;
    }
    std::lock_guard<std::mutex> lock(waiter_->mu_);
    waiter_->cancel_ = &cancel;
    absl::Status s = waiter_->WaitLocked(Keys(keys), deadline, "wait", absl::StrJoin(keys, ", "));
    waiter_->cancel_ = nullptr;
    return s;
  }
  bool waits_without_polling() const override { return true; }

  absl::Status Connect(absl::Time deadline) {
    std::lock_guard<std::mutex> lock(mu_);
    return Connected(deadline);
  }

 private:
  // torch's TCPStore client puts "/" before every key it sends; so do we,
  // so that keys are the same for both.
  std::string Key(absl::string_view key) const { return absl::StrCat("/", options_.prefix, key); }
  std::vector<std::string> Keys(absl::Span<const std::string> keys) const {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const std::string& k : keys) full.push_back(Key(k));
    return full;
  }

  void Drop() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  absl::Status Broken(absl::Status s) {
    Drop();
    return s;
  }

  absl::Status Unavailable(absl::string_view op, absl::string_view key, absl::string_view why) {
    return Broken(absl::UnavailableError(
        absl::StrCat(Describe(), ": ", op, " '", key, "': ", why, " (the connection is dropped)")));
  }

  // Connects (when not connected) before `deadline`, retrying while the
  // server refuses (it may not listen yet). Once a connection was made, a
  // refusal is final: the server listened and no longer does, so its
  // process is gone (torch's TCPStore is not restarted on its port), and
  // retrying until the deadline (at least kAnswerGrace) would only keep a
  // caller that is stopping, e.g. a monitor being joined, waiting. A
  // reconnection that is neither refused nor accepted (the server's host
  // is down or cut off) is given up after kReconnectWithin, whatever the
  // request's deadline: the answer grace is for a server that is there.
  absl::Status Connected(absl::Time deadline) {
    if (fd_ >= 0) return absl::OkStatus();
    if (was_connected_) deadline = std::min(deadline, absl::Now() + kReconnectWithin);
    std::string last = "no address";
    bool refused = false;
    absl::Duration pause = absl::Milliseconds(10);
    while (true) {
      struct addrinfo hints;
      std::memset(&hints, 0, sizeof(hints));
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      struct addrinfo* found = nullptr;
      const int rc = ::getaddrinfo(options_.host.c_str(), std::to_string(options_.port).c_str(),
                                   &hints, &found);
      if (rc != 0) {
        last = absl::StrCat("cannot resolve the host: ", ::gai_strerror(rc));
      } else {
        refused = true;
        for (struct addrinfo* a = found; a != nullptr && fd_ < 0; a = a->ai_next) {
          int err = 0;
          last = TryConnect(a, deadline, &err);
          refused = refused && err == ECONNREFUSED;
        }
        ::freeaddrinfo(found);
      }
      if (fd_ >= 0) break;
      if (refused && was_connected_) {
        return absl::UnavailableError(absl::StrCat(
            Describe(), ": the server refuses connections after the last one was dropped (", last,
            "): the process that served the store is gone"));
      }
      const absl::Time now = absl::Now();
      if (now >= deadline) {
        return absl::UnavailableError(
            absl::StrCat(Describe(), ": cannot connect before the deadline: ", last));
      }
      absl::SleepFor(std::min(pause, deadline - now));
      pause = std::min(pause * 2, absl::Milliseconds(500));
    }
    was_connected_ = true;
    const int one = 1;
    (void)::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    // A server whose host went down or was cut off sends no reset: without
    // these, a request waits for its answer until its deadline (a commit's
    // is 10 minutes), and TCP retransmits for about 15. The kernel answers
    // keepalive probes however busy the server is, so these fire only when
    // its host does not answer: after kDeadPeer with a request unanswered
    // by TCP, or after an idle wait plus five unanswered probes.
    const int idle = 3, interval = 1, probes = 5;
    const unsigned int user_timeout_ms =
        static_cast<unsigned int>(absl::ToInt64Milliseconds(kDeadPeer));
    (void)::setsockopt(fd_, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    (void)::setsockopt(fd_, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
    (void)::setsockopt(fd_, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
    (void)::setsockopt(fd_, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
    (void)::setsockopt(fd_, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms,
                       sizeof(user_timeout_ms));
    Request validate(kValidate);
    validate.Value<uint32_t>(kValidationMagic);
    return Write(validate.bytes(), deadline, "connect", "");
  }

  // Connects fd_ to `a`; the reason when it could not, and its errno in
  // `*err` (0 for a connection not accepted in time).
  std::string TryConnect(const struct addrinfo* a, absl::Time deadline, int* err) {
    *err = 0;
    const int fd =
        ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      *err = errno;
      return absl::StrCat("socket: ", std::strerror(errno));
    }
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      *err = errno;
      const std::string why = std::strerror(errno);
      ::close(fd);
      return why;
    }
    struct pollfd p = {fd, POLLOUT, 0};
    const int64_t ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(deadline - absl::Now()));
    if (::poll(&p, 1, static_cast<int>(std::min<int64_t>(ms, 1000))) <= 0) {
      ::close(fd);
      return "the connection was not accepted in time";
    }
    socklen_t len = sizeof(*err);
    (void)::getsockopt(fd, SOL_SOCKET, SO_ERROR, err, &len);
    if (*err != 0) {
      ::close(fd);
      return std::strerror(*err);
    }
    fd_ = fd;
    return "";
  }

  // Waits for fd_ to be ready for `events` before `deadline`: OK,
  // DeadlineExceeded, or Cancelled once cancel_ (when set) is.
  absl::Status Ready(short events, absl::Time deadline) {
    while (true) {
      struct pollfd p[2] = {{fd_, events, 0}, {cancel_ == nullptr ? -1 : cancel_->fd(), POLLIN, 0}};
      if (cancel_ != nullptr && cancel_->cancelled()) return absl::CancelledError("");
      absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        // One look even at a passed deadline.
        if (::poll(p, 1, 0) > 0) return absl::OkStatus();
        return absl::DeadlineExceededError("");
      }
      // A cancel without a descriptor is looked at every 10 ms.
      if (cancel_ != nullptr && cancel_->fd() < 0) left = std::min(left, absl::Milliseconds(10));
      const struct timespec ts = absl::ToTimespec(left);
      const int n = ::ppoll(p, 2, &ts, nullptr);
      if (n > 0 && p[0].revents != 0) return absl::OkStatus();
      if (n < 0 && errno != EINTR) return absl::UnavailableError(std::strerror(errno));
    }
  }

  absl::Status Write(const std::string& bytes, absl::Time deadline, absl::string_view op,
                     absl::string_view key) {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n > 0) {
        done += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return Unavailable(op, key, absl::StrCat("send: ", std::strerror(errno)));
      }
      absl::Status ready = Ready(POLLOUT, deadline);
      if (!ready.ok()) {
        return Unavailable(op, key, "the server took no more bytes before the deadline");
      }
    }
    return absl::OkStatus();
  }

  absl::Status Send(const Request& r, absl::Time deadline, absl::string_view op,
                    absl::string_view key) {
    STRATA_RETURN_IF_ERROR(Connected(deadline));
    return Write(r.bytes(), deadline, op, key);
  }

  // Reads exactly `size` bytes before `deadline`. DeadlineExceeded leaves
  // the connection as it is (the caller decides); anything else drops it.
  absl::Status Read(void* out, size_t size, absl::Time deadline, absl::string_view op,
                    absl::string_view key, bool keep_on_deadline = false) {
    char* p = static_cast<char*>(out);
    size_t done = 0;
    while (done < size) {
      const ssize_t n = ::recv(fd_, p + done, size - done, 0);
      if (n > 0) {
        done += static_cast<size_t>(n);
        continue;
      }
      if (n == 0) return Unavailable(op, key, "the server closed the connection");
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return Unavailable(op, key, absl::StrCat("recv: ", std::strerror(errno)));
      }
      absl::Status ready = Ready(POLLIN, deadline);
      if ((absl::IsDeadlineExceeded(ready) || absl::IsCancelled(ready)) && keep_on_deadline &&
          done == 0) {
        return ready;
      }
      if (!ready.ok()) return Unavailable(op, key, "no answer before the deadline");
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> ReadBytes(absl::Time deadline, absl::string_view op,
                                        absl::string_view key) {
    uint64_t size = 0;
    STRATA_RETURN_IF_ERROR(Read(&size, sizeof(size), deadline, op, key));
    if (size > (uint64_t{1} << 32)) {
      return Unavailable(op, key, absl::StrCat("an answer of ", size, " bytes: not a TCPStore?"));
    }
    std::string value(size, '\0');
    STRATA_RETURN_IF_ERROR(Read(value.data(), size, deadline, op, key));
    return value;
  }

  absl::StatusOr<bool> CheckLocked(absl::Span<const std::string> keys, absl::Time deadline,
                                   absl::string_view op, absl::string_view what) {
    Request r(kCheck);
    r.Value<uint64_t>(keys.size());
    for (const std::string& k : keys) r.Bytes(k);
    STRATA_RETURN_IF_ERROR(Send(r, deadline, op, what));
    uint8_t answer = 0;
    STRATA_RETURN_IF_ERROR(Read(&answer, 1, deadline, op, what));
    return answer == kReady;
  }

  // Waits until every key (prefixed) exists. At a passed deadline, one
  // look (CHECK); else WAIT, cancelled at the deadline.
  absl::Status WaitLocked(absl::Span<const std::string> keys, absl::Time deadline,
                          absl::string_view op, absl::string_view what) {
    auto missing = [&] {
      return absl::DeadlineExceededError(absl::StrCat(
          Describe(), ": key(s) '", what, "' did not appear before the deadline (", op, ")"));
    };
    if (deadline <= absl::Now()) {
      STRATA_ASSIGN_OR_RETURN(bool ready, CheckLocked(keys, AnswerBy(deadline), op, what));
      return ready ? absl::OkStatus() : missing();
    }
    Request r(kWait);
    r.Value<uint64_t>(keys.size());
    for (const std::string& k : keys) r.Bytes(k);
    STRATA_RETURN_IF_ERROR(Send(r, AnswerBy(deadline), op, what));
    uint8_t answer = 0;
    absl::Status got = Read(&answer, 1, deadline, op, what, /*keep_on_deadline=*/true);
    if (got.ok()) {
      if (answer != kStopWaiting) return Unavailable(op, what, "unexpected answer to WAIT");
      return absl::OkStatus();
    }
    if (absl::IsCancelled(got)) {
      // Dropping the connection ends the server's wait too, without a
      // round trip that a server cut off would keep waiting (up to
      // kDeadPeer): a cancel is often a monitor being stopped.
      Drop();
      return absl::CancelledError(
          absl::StrCat(Describe(), ": a wait for key(s) '", what, "' was cancelled"));
    }
    if (!absl::IsDeadlineExceeded(got)) return got;
    // Give up the wait; the server may have answered meanwhile.
    cancel_ = nullptr;
    const absl::Time grace = absl::Now() + kAnswerGrace;
    STRATA_RETURN_IF_ERROR(Send(Request(kCancelWait), grace, op, what));
    bool stopped = false;
    while (true) {
      STRATA_RETURN_IF_ERROR(Read(&answer, 1, grace, op, what));
      if (answer == kWaitCanceled) break;
      if (answer != kStopWaiting) return Unavailable(op, what, "unexpected answer to CANCEL_WAIT");
      stopped = true;
    }
    return stopped ? absl::OkStatus() : missing();
  }

  const TcpStoreOptions options_;
  std::mutex mu_;
  int fd_ = -1;
  bool was_connected_ = false;  // a connection was made once
  // Under mu_, during a CancellableWait of this (waiter) client: what ends it.
  const WaitCancel* cancel_ = nullptr;
  std::mutex waiter_mu_;
  std::unique_ptr<TcpStoreClient> waiter_;  // CancellableWait's connection
};

}  // namespace

absl::StatusOr<std::shared_ptr<Store>> ConnectTcpStore(const TcpStoreOptions& options) {
  if (options.version != TcpStoreOptions::kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("TcpStoreOptions version ", options.version,
                     " is not supported (this build: ", TcpStoreOptions::kVersion, ")"));
  }
  if (options.host.empty() || options.port <= 0 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("TCPStore address '", options.host, ":",
                                                   options.port,
                                                   "': want a host and a port in 1..65535"));
  }
  if (options.connect_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("TCPStore ", options.host, ":", options.port, ": connect_timeout ",
                     absl::FormatDuration(options.connect_timeout), " must be positive"));
  }
  auto client = std::make_shared<TcpStoreClient>(options);
  STRATA_RETURN_IF_ERROR(client->Connect(absl::Now() + options.connect_timeout));
  return std::shared_ptr<Store>(std::move(client));
}

}  // namespace strata
