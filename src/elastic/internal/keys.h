// The store keys of the elastic layer. Every key carries the epoch, so that
// a late write of an old epoch is never read as one of the current epoch:
//
//   strata/elastic/<job>/<epoch>/hb/<rank>       heartbeat (Set by its rank)
//   strata/elastic/<job>/<epoch>/alarm           first cause (CompareSet)
//   strata/elastic/<job>/<epoch>/alive/<rank>    check-in after the alarm
//   strata/elastic/<job>/<epoch>/checkins        how many checked in (Add)
//   strata/elastic/<job>/<epoch>/suspect/<rank>  evidence that a rank failed
//   strata/elastic/<job>/<epoch>/leader          the deciding rank (CompareSet)
//   strata/elastic/<job>/<epoch>/decision        the next membership (CompareSet)
//   strata/elastic/<job>/<epoch>/done            per-step votes (Add)
//   strata/elastic/<job>/<epoch>/step/<n>        step n: commit or abort (CompareSet)
//   strata/elastic/<job>/<epoch>/regroup/done    members past their shrink (Add)
//   strata/elastic/<job>/<epoch>/regroup/failed  members whose shrink failed (Add)
//   strata/elastic/<job>/<epoch>/comm/...        a fresh job communicator's rendezvous
//                                                (a regroup that admits joiners)
//   strata/elastic/<job>/finished                the epoch whose members finished (Set):
//                                                spares standing by end
//   strata/elastic/<job>/info                    the job: size, config, whether it admits
//                                                joiners (CompareSet at the start)
//   strata/elastic/<job>/joins                   join requests so far (Add)
//   strata/elastic/<job>/join/<n>                request n: the joiner's config and process
//   strata/elastic/<job>/join/<n>/answer         the epoch that admitted it, or why not
//
// Ranks are job ranks (stable across epochs).
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"

namespace strata::elastic::internal {

class Keys {
 public:
  Keys(std::string job, uint64_t epoch)
      : job_prefix_(absl::StrCat("strata/elastic/", job, "/")),
        prefix_(absl::StrCat(job_prefix_, epoch, "/")) {}

  std::string Heartbeat(int rank) const { return absl::StrCat(prefix_, "hb/", rank); }
  std::string Alarm() const { return absl::StrCat(prefix_, "alarm"); }
  std::string Alive(int rank) const { return absl::StrCat(prefix_, "alive/", rank); }
  std::string CheckIns() const { return absl::StrCat(prefix_, "checkins"); }
  std::string Suspect(int rank) const { return absl::StrCat(prefix_, "suspect/", rank); }
  std::string Leader() const { return absl::StrCat(prefix_, "leader"); }
  std::string Decision() const { return absl::StrCat(prefix_, "decision"); }
  std::string Done() const { return absl::StrCat(prefix_, "done"); }
  std::string Step(int64_t step) const { return absl::StrCat(prefix_, "step/", step); }
  std::string Regrouped() const { return absl::StrCat(prefix_, "regroup/done"); }
  std::string RegroupFailed() const { return absl::StrCat(prefix_, "regroup/failed"); }
  std::string Finished() const { return absl::StrCat(job_prefix_, "finished"); }
  std::string Rendezvous() const { return absl::StrCat(prefix_, "comm/"); }
  std::string Info() const { return absl::StrCat(job_prefix_, "info"); }
  std::string Joins() const { return absl::StrCat(job_prefix_, "joins"); }
  std::string Join(int64_t n) const { return absl::StrCat(job_prefix_, "join/", n); }
  std::string JoinAnswer(int64_t n) const {
    return absl::StrCat(job_prefix_, "join/", n, "/answer");
  }
  const std::string& prefix() const { return prefix_; }

 private:
  std::string job_prefix_;
  std::string prefix_;
};

}  // namespace strata::elastic::internal
