// Stores made of functions, prefixed views of stores, and OpenStore.
#include "strata/comm/store.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "strata/base/status.h"

namespace strata {

WaitCancel::WaitCancel() : fd_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}

WaitCancel::~WaitCancel() {
  if (fd_ >= 0) ::close(fd_);
}

void WaitCancel::Cancel() {
  cancelled_.store(true);
  if (fd_ >= 0) {
    const uint64_t one = 1;
    (void)!::write(fd_, &one, sizeof(one));
  }
}

void WaitCancel::Reset() {
  cancelled_.store(false);
  if (fd_ >= 0) {
    uint64_t count = 0;
    (void)!::read(fd_, &count, sizeof(count));
  }
}

bool WaitCancel::cancelled() const { return cancelled_.load(); }

absl::Status Store::CancellableWait(absl::Span<const std::string> keys, absl::Time deadline,
                                    const WaitCancel& cancel) {
  while (true) {
    if (cancel.cancelled()) {
      return absl::CancelledError(absl::StrCat(Describe(), ": a wait for key(s) '",
                                               absl::StrJoin(keys, ", "), "' was cancelled"));
    }
    const absl::Time slice = std::min(deadline, absl::Now() + absl::Milliseconds(50));
    absl::Status s = Wait(keys, slice);
    if (!absl::IsDeadlineExceeded(s) || slice >= deadline) return s;
  }
}

namespace {

class CallbackStore final : public Store {
 public:
  explicit CallbackStore(StoreCallbacks callbacks) : cb_(std::move(callbacks)) {}

  absl::Status Set(absl::string_view key, absl::string_view value, absl::Time deadline) override {
    return cb_.set(key, value, deadline);
  }
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Time deadline) override {
    return cb_.get(key, deadline);
  }
  absl::Status Wait(absl::Span<const std::string> keys, absl::Time deadline) override {
    return cb_.wait(keys, deadline);
  }
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta, absl::Time deadline) override {
    return cb_.add(key, delta, deadline);
  }
  absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                         absl::string_view desired, absl::Time deadline) override {
    return cb_.compare_set(key, expected, desired, deadline);
  }
  std::string Describe() const override { return cb_.describe; }

 private:
  const StoreCallbacks cb_;
};

class PrefixStore final : public Store {
 public:
  PrefixStore(std::shared_ptr<Store> base, absl::string_view prefix)
      : base_(std::move(base)), prefix_(absl::StrCat(prefix, "/")) {}

  absl::Status Set(absl::string_view key, absl::string_view value, absl::Time deadline) override {
    return base_->Set(Key(key), value, deadline);
  }
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Time deadline) override {
    return base_->Get(Key(key), deadline);
  }
  absl::Status Wait(absl::Span<const std::string> keys, absl::Time deadline) override {
    return base_->Wait(Keys(keys), deadline);
  }
  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta, absl::Time deadline) override {
    return base_->Add(Key(key), delta, deadline);
  }
  absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                         absl::string_view desired, absl::Time deadline) override {
    return base_->CompareSet(Key(key), expected, desired, deadline);
  }
  std::string Describe() const override { return base_->Describe(); }
  absl::Status CancellableWait(absl::Span<const std::string> keys, absl::Time deadline,
                               const WaitCancel& cancel) override {
    return base_->CancellableWait(Keys(keys), deadline, cancel);
  }
  bool waits_without_polling() const override { return base_->waits_without_polling(); }

 private:
  std::vector<std::string> Keys(absl::Span<const std::string> keys) const {
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (const std::string& k : keys) full.push_back(Key(k));
    return full;
  }
  std::string Key(absl::string_view key) const { return absl::StrCat(prefix_, key); }

  const std::shared_ptr<Store> base_;
  const std::string prefix_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<Store>> MakeCallbackStore(StoreCallbacks callbacks) {
  if (callbacks.version != StoreCallbacks::kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("StoreCallbacks version ", callbacks.version,
                     " is not supported (this build: ", StoreCallbacks::kVersion, ")"));
  }
  const char* missing = !callbacks.set           ? "set"
                        : !callbacks.get         ? "get"
                        : !callbacks.wait        ? "wait"
                        : !callbacks.add         ? "add"
                        : !callbacks.compare_set ? "compare_set"
                                                 : nullptr;
  if (missing != nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("store callbacks '", callbacks.describe, "': no '", missing, "' function"));
  }
  if (callbacks.describe.empty()) callbacks.describe = "callback store";
  return std::shared_ptr<Store>(std::make_shared<CallbackStore>(std::move(callbacks)));
}

std::shared_ptr<Store> MakePrefixStore(std::shared_ptr<Store> base, absl::string_view prefix) {
  return std::make_shared<PrefixStore>(std::move(base), prefix);
}

absl::StatusOr<std::shared_ptr<Store>> OpenStore(absl::string_view url) {
  if (absl::StartsWith(url, "file:")) {
    absl::string_view path = url.substr(5);
    if (absl::StartsWith(path, "//")) path.remove_prefix(2);  // file:///abs/path
    FileStoreOptions options;
    options.path = std::string(path);
    return OpenFileStore(options);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("store URL '", url,
                   "' is not supported: use file:/path/to/shared/dir (a TCP store is reached "
                   "from Python, or from C++ through strata::torch::ConnectC10dStore)"));
}

}  // namespace strata
