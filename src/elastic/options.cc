// ElasticOptions::Validate (options.h).
#include "strata/elastic/options.h"

#include "absl/strings/str_cat.h"

namespace strata::elastic {
namespace {

absl::Status Positive(absl::string_view name, absl::Duration d) {
  if (d > absl::ZeroDuration() && d < absl::InfiniteDuration()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("ElasticOptions::", name, " is ",
                                                 absl::FormatDuration(d),
                                                 "; want a positive, finite duration"));
}

}  // namespace

const char* AgreementKindName(AgreementKind kind) {
  switch (kind) {
    case AgreementKind::kAuto:
      return "auto";
    case AgreementKind::kStore:
      return "store";
    case AgreementKind::kUlfm:
      return "ulfm";
  }
  return "?";
}

absl::Status ElasticOptions::Validate() const {
  if (version != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ElasticOptions version ", version, " is not supported (this build: ", kVersion, ")"));
  }
  if (job.empty() || job.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("ElasticOptions::job is '", job, "'; want a non-empty name without '/'"));
  }
  for (auto [name, d] :
       {std::pair<const char*, absl::Duration>{"heartbeat_interval", heartbeat_interval},
        {"heartbeat_timeout", heartbeat_timeout},
        {"settle_timeout", settle_timeout},
        {"decision_timeout", decision_timeout},
        {"rebuild_timeout", rebuild_timeout},
        {"commit_timeout", commit_timeout},
        {"join_timeout", join_timeout}}) {
    if (absl::Status s = Positive(name, d); !s.ok()) return s;
  }
  if (heartbeat_timeout < 3 * heartbeat_interval) {
    return absl::InvalidArgumentError(
        absl::StrCat("ElasticOptions::heartbeat_timeout ", absl::FormatDuration(heartbeat_timeout),
                     " is less than 3 heartbeat intervals (heartbeat_interval ",
                     absl::FormatDuration(heartbeat_interval),
                     "): a rank that is merely slow to be scheduled would be taken as hung"));
  }
  if (max_leader_takeovers < 0) {
    return absl::InvalidArgumentError(absl::StrCat("ElasticOptions::max_leader_takeovers is ",
                                                   max_leader_takeovers, "; want >= 0"));
  }
  if (max_attempts < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("ElasticOptions::max_attempts is ", max_attempts, "; want >= 1"));
  }
  return absl::OkStatus();
}

}  // namespace strata::elastic
