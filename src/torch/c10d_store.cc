#include "strata/torch/c10d_store.h"

#include <chrono>
#include <cstdlib>
#include <exception>
#include <string>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace strata::torch {
namespace {

// The first line of a c10d message (they carry a C++ backtrace after it).
std::string FirstLine(const char* what) {
  std::string s(what);
  const size_t nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

// c10d raises DistStoreError ("wait timeout after ...") when a wait times
// out and DistNetworkError when the connection fails.
absl::Status FromC10d(const std::exception& e, absl::string_view what, const std::string& store) {
  const std::string message = absl::StrCat(what, " on ", store, ": ", FirstLine(e.what()));
  if (dynamic_cast<const c10::DistStoreError*>(&e) != nullptr &&
      absl::StrContains(absl::AsciiStrToLower(message), "timeout")) {
    return absl::DeadlineExceededError(message);
  }
  return absl::UnavailableError(message);
}

class C10dStore final : public Store {
 public:
  C10dStore(c10::intrusive_ptr<c10d::Store> store, std::string describe, std::string prefix)
      : store_(std::move(store)), describe_(std::move(describe)), prefix_(std::move(prefix)) {}

  absl::Status Set(absl::string_view key, absl::string_view value, absl::Time) override {
    try {
      store_->set(Key(key), std::vector<uint8_t>(value.begin(), value.end()));
      return absl::OkStatus();
    } catch (const std::exception& e) {
      return FromC10d(e, absl::StrCat("set '", key, "'"), describe_);
    }
  }

  absl::StatusOr<std::string> Get(absl::string_view key, absl::Time deadline) override {
    const std::string k = Key(key);
    try {
      absl::Status waited = WaitUntil({k}, deadline, absl::StrCat("get '", key, "'"));
      if (!waited.ok()) return waited;
      std::vector<uint8_t> v = store_->get(k);
      return std::string(v.begin(), v.end());
    } catch (const std::exception& e) {
      return FromC10d(e, absl::StrCat("get '", key, "'"), describe_);
    }
  }

  absl::Status Wait(absl::Span<const std::string> keys, absl::Time deadline) override {
    std::vector<std::string> ks;
    for (const std::string& k : keys) ks.push_back(Key(k));
    try {
      return WaitUntil(ks, deadline, absl::StrCat("wait for ", absl::StrJoin(keys, ", ")));
    } catch (const std::exception& e) {
      return FromC10d(e, absl::StrCat("wait for ", absl::StrJoin(keys, ", ")), describe_);
    }
  }

  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta, absl::Time) override {
    try {
      return store_->add(Key(key), delta);
    } catch (const std::exception& e) {
      return FromC10d(e, absl::StrCat("add to '", key, "'"), describe_);
    }
  }

  absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                         absl::string_view desired, absl::Time) override {
    const std::string k = Key(key);
    try {
      std::vector<uint8_t> v =
          store_->compareSet(k, std::vector<uint8_t>(expected.begin(), expected.end()),
                             std::vector<uint8_t>(desired.begin(), desired.end()));
      std::string out(v.begin(), v.end());
      // c10d answers `expected` for an absent key; strata says NotFound.
      if (!expected.empty() && out == expected && !store_->check({k})) {
        return absl::NotFoundError(
            absl::StrCat("compare_set '", key, "' on ", describe_, ": the key is absent"));
      }
      return out;
    } catch (const std::exception& e) {
      return FromC10d(e, absl::StrCat("compare_set '", key, "'"), describe_);
    }
  }

  std::string Describe() const override { return describe_; }

 private:
  std::string Key(absl::string_view key) const { return absl::StrCat(prefix_, key); }

  // Waits for `keys` until `deadline`. c10d reads a zero timeout as "wait
  // forever", so a deadline that has passed is one look (check) instead.
  absl::Status WaitUntil(const std::vector<std::string>& keys, absl::Time deadline,
                         const std::string& what) {
    const absl::Duration left = deadline - absl::Now();
    if (left < absl::Milliseconds(1)) {
      if (store_->check(keys)) return absl::OkStatus();
      return absl::DeadlineExceededError(absl::StrCat(what, " on ", describe_,
                                                      ": the deadline passed before the keys ",
                                                      absl::StrJoin(keys, ", "), " existed"));
    }
    const int64_t ms = deadline == absl::InfiniteFuture() ? int64_t{365} * 24 * 3600 * 1000
                                                          : absl::ToInt64Milliseconds(left);
    store_->wait(keys, std::chrono::milliseconds(ms));
    return absl::OkStatus();
  }

  c10::intrusive_ptr<c10d::Store> store_;
  const std::string describe_;
  const std::string prefix_;
};

}  // namespace

std::shared_ptr<Store> WrapC10dStore(c10::intrusive_ptr<c10d::Store> store, std::string describe,
                                     std::string prefix) {
  return std::make_shared<C10dStore>(std::move(store), std::move(describe), std::move(prefix));
}

absl::StatusOr<std::shared_ptr<Store>> ConnectC10dStore(const LaunchEnv& env,
                                                        const C10dStoreOptions& options) {
  if (options.version != C10dStoreOptions::kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("C10dStoreOptions version ", options.version,
                     " is not supported (this build: ", C10dStoreOptions::kVersion, ")"));
  }
  if (options.connect_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("C10dStoreOptions::connect_timeout must be "
                     "positive, got ",
                     absl::FormatDuration(options.connect_timeout)));
  }
  if (env.master_addr.empty() || env.master_port <= 0 || env.master_port > 65535) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", env.rank, " of ", env.world_size, " (", LauncherName(env.launcher),
                     ") needs a store to bootstrap and MASTER_ADDR/MASTER_PORT are not set (got '",
                     env.master_addr, "', ", env.master_port, ")"));
  }
  const std::string where = absl::StrCat(env.master_addr, ":", env.master_port);
  // As torch's env:// rendezvous: the agent's store when torchrun says it
  // serves one at exactly this address, else rank 0 serves.
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  const char* addr = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  const bool agent_serves = agent != nullptr && std::string(agent) == "True" && addr != nullptr &&
                            env.master_addr == addr && port != nullptr &&
                            std::to_string(env.master_port) == port;
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(env.master_port);
  opts.isServer = !agent_serves && env.rank == 0;
  opts.multiTenant = opts.isServer;
  opts.waitWorkers = false;
  opts.numWorkers = static_cast<size_t>(env.world_size);
  opts.timeout = std::chrono::milliseconds(absl::ToInt64Milliseconds(options.connect_timeout));
  try {
    auto store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
    return WrapC10dStore(std::move(store), absl::StrCat("c10d TCPStore ", where), options.prefix);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(
        "rank ", env.rank, " of ", env.world_size, ": cannot ", opts.isServer ? "serve" : "reach",
        " the rendezvous store (c10d TCPStore at MASTER_ADDR:MASTER_PORT = ", where, ") within ",
        absl::FormatDuration(options.connect_timeout), ": ", FirstLine(e.what())));
  }
}

}  // namespace strata::torch
