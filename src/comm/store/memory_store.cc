// The memory store: a map under a mutex, with a condition variable for the
// waiters.
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "strata/comm/store.h"

namespace strata {
namespace {

class MemoryStore final : public Store {
 public:
  absl::Status Set(absl::string_view key, absl::string_view value, absl::Time) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      map_[std::string(key)] = std::string(value);
    }
    cv_.notify_all();
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> Get(absl::string_view key, absl::Time deadline) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!WaitFor(lock, {std::string(key)}, deadline)) {
      return absl::DeadlineExceededError(
          absl::StrCat(Describe(), ": key '", key, "' did not appear before the deadline (get)"));
    }
    return map_.at(std::string(key));
  }

  absl::Status Wait(absl::Span<const std::string> keys, absl::Time deadline) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (!WaitFor(lock, keys, deadline)) {
      return absl::DeadlineExceededError(
          absl::StrCat(Describe(), ": keys did not appear before the deadline (wait)"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta, absl::Time) override {
    int64_t value = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::string& slot = map_[std::string(key)];
      if (!slot.empty() && !absl::SimpleAtoi(slot, &value)) {
        return absl::InvalidArgumentError(absl::StrCat(Describe(), ": add to key '", key,
                                                       "', which holds '", slot,
                                                       "', not a decimal integer"));
      }
      value += delta;
      slot = absl::StrCat(value);
    }
    cv_.notify_all();
    return value;
  }

  absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                         absl::string_view desired, absl::Time) override {
    std::string result;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = map_.find(std::string(key));
      const bool matches = it != map_.end() ? it->second == expected : expected.empty();
      if (!matches) {
        if (it == map_.end()) {
          return absl::NotFoundError(
              absl::StrCat(Describe(), ": compare_set on key '", key, "', which does not exist"));
        }
        return it->second;
      }
      map_[std::string(key)] = std::string(desired);
      result = std::string(desired);
    }
    cv_.notify_all();
    return result;
  }

  std::string Describe() const override { return "memory store"; }

 private:
  bool WaitFor(std::unique_lock<std::mutex>& lock, absl::Span<const std::string> keys,
               absl::Time deadline) {
    auto all = [&] {
      for (const std::string& k : keys) {
        if (map_.count(k) == 0) return false;
      }
      return true;
    };
    while (!all()) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return false;
      cv_.wait_for(lock, absl::ToChronoNanoseconds(std::min(left, absl::Hours(1))));
    }
    return true;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> map_;
};

}  // namespace

std::shared_ptr<Store> MakeMemoryStore() { return std::make_shared<MemoryStore>(); }

}  // namespace strata
