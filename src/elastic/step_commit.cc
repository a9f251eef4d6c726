// The store protocol of the step commit (step_commit.h).
#include "strata/elastic/step_commit.h"

#include <mutex>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "elastic/internal/keys.h"
#include "strata/base/status.h"

namespace strata::elastic {
namespace {

constexpr char kCommit[] = "commit";
constexpr char kAbort[] = "abort";
constexpr char kCommitJoin[] = "commit+join";

class StoreStepCommit final : public StepCommit {
 public:
  StoreStepCommit(std::shared_ptr<Store> store, ElasticOptions options)
      : store_(std::move(store)), options_(std::move(options)) {}

  const char* name() const override { return "store"; }

  absl::Status Start(const Membership& membership) override {
    std::lock_guard<std::mutex> lock(mu_);
    keys_.emplace(options_.job, membership.epoch);
    epoch_ = membership.epoch;
    size_ = static_cast<int64_t>(membership.mesh.world_size);  // spares do not vote
    voted_ = 0;
    joins_seen_ = membership.joins_seen;
    joiners_waiting_ = false;
    return absl::OkStatus();
  }

  absl::StatusOr<bool> Vote(int64_t step, bool ok) override {
    std::optional<internal::Keys> keys;
    int64_t target;
    int64_t joins_seen;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!keys_.has_value()) return absl::FailedPreconditionError("StepCommit: Start() first");
      keys = keys_;
      target = size_ * ++voted_;
      joins_seen = joins_seen_;
    }
    const absl::Time deadline = absl::Now() + options_.commit_timeout;
    const std::string key = keys->Step(step);
    const std::string where = absl::StrCat("the commit of step ", step, " (epoch ", epoch_, ", ",
                                           size_, " ranks) on ", store_->Describe());
    if (!ok) {
      absl::StatusOr<std::string> v = store_->CompareSet(key, "", kAbort, deadline);
      if (!v.ok()) return strata::internal::Annotate(v.status(), where);
      return *v == kCommit;  // never: a commit needs this rank's vote
    }
    absl::StatusOr<int64_t> count = store_->Add(keys->Done(), 1, deadline);
    if (!count.ok()) return strata::internal::Annotate(count.status(), where);
    absl::StatusOr<std::string> v;
    if (*count == target) {
      // Joiners asked to come in since the last agreement answered.
      absl::StatusOr<int64_t> joins = store_->Add(keys->Joins(), 0, deadline);
      if (!joins.ok()) return strata::internal::Annotate(joins.status(), where);
      // The value after the call is the answer (this one, or an abort that
      // came first): the last voter need not read it again.
      v = store_->CompareSet(key, "", *joins > joins_seen ? kCommitJoin : kCommit, deadline);
      if (!v.ok()) return strata::internal::Annotate(v.status(), where);
    } else {
      v = store_->Get(key, deadline);
    }
    if (!v.ok()) {
      return strata::internal::Annotate(
          v.status(),
          absl::StrCat(where, ": waited ", absl::FormatDuration(options_.commit_timeout),
                       " for every rank's vote (key ", key, ", ", *count, " of ", target,
                       " votes when this rank voted)"));
    }
    const bool joining = *v == kCommitJoin;
    {
      std::lock_guard<std::mutex> lock(mu_);
      joiners_waiting_ = joining;
    }
    return *v == kCommit || joining;
  }

  bool joiners_waiting() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return joiners_waiting_;
  }

  void Abort(uint64_t epoch, int64_t step) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (epoch != epoch_) return;
    }
    // Keys of `epoch`: a late abort of an epoch that ended writes where
    // nobody reads.
    (void)store_->CompareSet(internal::Keys(options_.job, epoch).Step(step), "", kAbort,
                             absl::Now() + options_.heartbeat_timeout);
  }

 private:
  const std::shared_ptr<Store> store_;
  const ElasticOptions options_;
  mutable std::mutex mu_;
  std::optional<internal::Keys> keys_;
  int64_t joins_seen_ = 0;
  bool joiners_waiting_ = false;
  uint64_t epoch_ = 0;
  int64_t size_ = 0;
  int64_t voted_ = 0;
};

}  // namespace

std::unique_ptr<StepCommit> MakeStoreStepCommit(std::shared_ptr<Store> store,
                                                const ElasticOptions& options) {
  return std::make_unique<StoreStepCommit>(std::move(store), options);
}

}  // namespace strata::elastic
