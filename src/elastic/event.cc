// Recovery events as JSON (event.h).
#include "strata/elastic/event.h"

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "strata/elastic/membership.h"

namespace strata::elastic {
namespace {

double Unix(absl::Time t) {
  return t == absl::InfinitePast() ? 0.0 : absl::ToDoubleSeconds(t - absl::UnixEpoch());
}

nlohmann::json Mesh(const MeshSpec& spec) {
  return {{"world", spec.world_size},
          {"dp", spec.dp},
          {"tp", spec.tp},
          {"pp", spec.pp},
          {"cp", spec.cp},
          {"ep", spec.ep},
          {"order", spec.order},
          {"describe", DescribeMesh(spec)}};
}

}  // namespace

const char* DetectionSourceName(DetectionSource source) {
  switch (source) {
    case DetectionSource::kBackend:
      return "backend";
    case DetectionSource::kHeartbeat:
      return "heartbeat";
    case DetectionSource::kProbe:
      return "probe";
    case DetectionSource::kCommit:
      return "commit";
    case DetectionSource::kRequest:
      return "request";
    case DetectionSource::kJoin:
      return "join";
  }
  return "?";
}

std::string Detection::ToString() const {
  std::string who = suspect >= 0 ? absl::StrCat(" naming rank ", suspect) : "";
  return absl::StrCat(DetectionSourceName(source), who, ", found by rank ", reporter, ": ", detail);
}

std::string RecoveryEvent::ToJson() const {
  nlohmann::json j;
  j["event"] = "recovery";
  j["rank"] = rank;
  j["epoch_before"] = epoch_before;
  j["epoch"] = epoch_after;
  j["failed"] = failed;
  j["failed_why"] = failed_why;
  j["leaving"] = leaving;
  j["members"] = members;
  j["replaced"] = replaced;
  j["spares"] = spares;
  j["joined"] = joined;
  j["grown"] = grown;
  j["leaves"] = leaves;
  j["placed"] = placed;
  j["cause"] = {{"source", DetectionSourceName(cause.source)},
                {"reporter", cause.reporter},
                {"suspect", cause.suspect},
                {"evict", cause.evict},
                {"detail", cause.detail},
                {"found_at", Unix(cause.found_at)},
                {"failed_at", Unix(cause.failed_at)}};
  j["detect_s"] = absl::ToDoubleSeconds(detect);
  j["agree_s"] = absl::ToDoubleSeconds(agree);
  j["rebuild_s"] = absl::ToDoubleSeconds(rebuild);
  j["restore_s"] = absl::ToDoubleSeconds(restore);
  j["first_collective_s"] = absl::ToDoubleSeconds(first_collective);
  j["known_by_all_at"] = Unix(known_by_all_at);
  j["decided_at"] = Unix(decided_at);
  j["rebuilt_at"] = Unix(rebuilt_at);
  j["restored_at"] = Unix(restored_at);
  j["attempts"] = attempts;
  j["step"] = step;
  j["restored_from"] = restored_from;
  j["world"] = mesh_after.world_size;
  j["dp"] = mesh_after.dp;
  j["mesh_before"] = Mesh(mesh_before);
  j["mesh_after"] = Mesh(mesh_after);
  return j.dump();
}

}  // namespace strata::elastic
