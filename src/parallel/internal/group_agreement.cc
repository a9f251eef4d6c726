// The agreement before a group is created on request (world_state.h):
// every rank must be asking for the same group at the same time, as
// torch.distributed.new_group requires; a mismatch becomes a clear error
// instead of a split that pairs up the wrong requests or hangs.
//
// Host roots: one allreduce(max) of {h, -h}, h a hash of the canonical
// name: every rank learns the largest and the smallest hash at O(1) cost;
// they are equal exactly when everybody agrees. Only on disagreement do the
// ranks gather every rank's name (fixed size) to say who asked for what.
// Device roots (NCCL), whose collectives need device memory: a probe split
// colored by the hash; the ranks agree when the probe has every rank.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "parallel/internal/world_state.h"
#include "strata/base/status.h"

namespace strata::internal {
namespace {

// Names travel in fixed-size slots on the error path.
constexpr size_t kNameSlot = 32;
// How much longer than the operation's own timeout a wait may last (the
// backend fails the operation at its timeout; this only bounds the wait if
// it does not).
constexpr absl::Duration kWaitSlack = absl::Seconds(5);

// FNV-1a, kept to 62 bits so that -h does not overflow and h is never 0.
int64_t NameHash(const std::string& name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return static_cast<int64_t>((h >> 2) | 1);
}

std::string Guidance() {
  return "every rank must request a new group at the same point, as torch.distributed.new_group";
}

absl::Status Late(const absl::Status& cause, const std::string& name, uint64_t generation,
                  absl::Duration timeout) {
  if (cause.code() != absl::StatusCode::kDeadlineExceeded) {
    return Annotate(
        cause, absl::StrCat("creating group '", name, "' (world generation ", generation, ")"));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("creating group '", name, "' (world generation ", generation,
                   "): not every rank requested it within ", absl::FormatDuration(timeout),
                   " (WorldOptions::group_creation_timeout); ", Guidance(),
                   ". The root communicator may now be unusable: rebuild or destroy the World. (",
                   cause.message(), ")"));
}

// "0-3, 6" for {0, 1, 2, 3, 6}.
std::string Ranges(const std::vector<int>& ranks) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    parts.push_back(j == i ? absl::StrCat(ranks[i]) : absl::StrCat(ranks[i], "-", ranks[j]));
    i = j + 1;
  }
  return absl::StrJoin(parts, ", ");
}

absl::Status Wait(absl::StatusOr<std::unique_ptr<Work>> work, absl::Duration timeout) {
  if (!work.ok()) return work.status();
  return (*work)->Wait(absl::Now() + timeout + kWaitSlack);
}

// Host roots, after a disagreement every rank saw: who asked for what.
absl::Status Disagreement(Communicator& root, const std::string& name, uint64_t generation,
                          absl::Duration timeout) {
  std::vector<uint8_t> mine(kNameSlot, 0);
  std::memcpy(mine.data(), name.data(), std::min(name.size(), kNameSlot - 1));
  std::vector<uint8_t> all(kNameSlot * static_cast<size_t>(root.size()), 0);
  OpOptions options;
  options.timeout = timeout;
  absl::Status gathered =
      Wait(root.AllGather(ConstBuffer(mine.data(), mine.size(), DataType::kUInt8),
                          Buffer::Of(all.data(), all.size()), options),
           timeout);
  std::string who;
  if (gathered.ok()) {
    // Name -> ranks, in the order of each name's first rank.
    std::vector<std::pair<std::string, std::vector<int>>> asked;
    for (int r = 0; r < root.size(); ++r) {
      const char* slot = reinterpret_cast<const char*>(all.data() + kNameSlot * r);
      std::string n(slot, strnlen(slot, kNameSlot));
      auto it =
          std::find_if(asked.begin(), asked.end(), [&](const auto& a) { return a.first == n; });
      if (it == asked.end()) {
        asked.push_back({n, {r}});
      } else {
        it->second.push_back(r);
      }
    }
    std::vector<std::string> parts;
    for (size_t i = 0; i < asked.size(); ++i) {
      const auto& [n, ranks] = asked[i];
      parts.push_back(absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ", Ranges(ranks),
                                   i == 0 ? " asked for '" : " for '", n, "'"));
    }
    who = absl::StrJoin(parts, ", ");
  } else {
    who = absl::StrCat("(who asked for what is unknown: ", gathered.message(), ")");
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "ranks disagree on the group to create: ", who, "; ", Guidance(), " (this rank, ",
      root.rank(), ", asked for '", name, "' at world generation ", generation, ")"));
}

}  // namespace

absl::Status AgreeOnGroup(Communicator& root, const std::string& name, uint64_t generation,
                          absl::Duration timeout) {
  const int64_t h = NameHash(name);
  if (root.memory() == MemoryKind::kHost) {
    int64_t mine[2] = {h, -h};
    int64_t max[2] = {0, 0};
    OpOptions options;
    options.timeout = timeout;
    absl::Status s = Wait(root.AllReduce(ConstBuffer(mine, 2, DataType::kInt64), Buffer::Of(max, 2),
                                         ReduceOp::kMax, options),
                          timeout);
    if (!s.ok()) return Late(s, name, generation, timeout);
    if (max[0] == h && -max[1] == h) return absl::OkStatus();
    return Disagreement(root, name, generation, timeout);
  }
  // Device memory: a probe split by the hash, which every rank must join.
  CommOptions probe_options;
  probe_options.name = absl::StrCat(name, "-probe");
  probe_options.timeout = timeout;
  const int color = static_cast<int>(h & 0x3fffffff);
  absl::StatusOr<std::unique_ptr<Communicator>> probe =
      root.Split(color, root.rank(), probe_options);
  if (!probe.ok()) return Late(probe.status(), name, generation, timeout);
  const int with = *probe == nullptr ? 0 : (*probe)->size();
  if (with == root.size()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "ranks disagree on the group to create: this rank (", root.rank(), ") asked for '", name,
      "' at world generation ", generation, " together with ", with, " of the ", root.size(),
      " ranks; the others asked for other groups; ", Guidance()));
}

}  // namespace strata::internal
