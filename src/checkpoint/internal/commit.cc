#include "checkpoint/internal/commit.h"

#include <algorithm>
#include <limits>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "checkpoint/internal/file_util.h"
#include "checkpoint/internal/manifest_internal.h"
#include "checkpoint/internal/rank_writer.h"
#include "strata/base/status.h"
#include "strata/checkpoint/checkpointer.h"
#include "strata/version.h"

namespace strata::checkpoint_internal {

namespace {

std::string Dims(const std::vector<int64_t>& d) {
  return absl::StrCat("[", absl::StrJoin(d, ", "), "]");
}

absl::Status RunHook(const Hook& hook, absl::string_view point) {
  return hook ? hook(point) : absl::OkStatus();
}

// Upper bound on a fragment file (one rank's shards and state).
constexpr uint64_t kMaxFragmentBytes = uint64_t{1} << 30;

}  // namespace

std::string TmpDirectoryName(int64_t step) { return absl::StrCat(StepDirectoryName(step), ".tmp"); }

std::optional<int64_t> ParseStepDirectoryName(absl::string_view name) {
  if (!absl::ConsumePrefix(&name, "step-") || name.empty() || name.size() > 19) return std::nullopt;
  for (char c : name) {
    if (c < '0' || c > '9') return std::nullopt;
  }
  if (name.size() > 1 && name[0] == '0') return std::nullopt;
  int64_t v = 0;
  if (!absl::SimpleAtoi(name, &v) || v < 0) return std::nullopt;
  return v;
}

absl::StatusOr<std::optional<int64_t>> ReadLatest(const std::string& root) {
  const std::string path = JoinPath(root, kLatestFileName);
  if (!PathExists(path)) return std::optional<int64_t>();
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, 4096));
  absl::string_view v = absl::StripAsciiWhitespace(text);
  std::optional<int64_t> step = ParseStepDirectoryName(v);
  if (!step) {
    return absl::DataLossError(absl::StrCat("the latest pointer '", path, "' holds '",
                                            absl::CHexEscape(v.substr(0, 64)),
                                            "', not 'step-<N>'"));
  }
  return step;
}

absl::StatusOr<std::vector<int64_t>> ListCompleteSteps(const std::string& root) {
  STRATA_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDirectory(root));
  std::vector<int64_t> steps;
  for (const std::string& n : names) {
    std::optional<int64_t> s = ParseStepDirectoryName(n);
    if (s && PathExists(JoinPath(JoinPath(root, n), kManifestFileName))) steps.push_back(*s);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

absl::Status PrepareStepDirectory(const std::string& root, int64_t step) {
  STRATA_RETURN_IF_ERROR(MakeDirectories(root));
  const std::string final_dir = JoinPath(root, StepDirectoryName(step));
  if (PathExists(final_dir)) {
    return absl::AlreadyExistsError(
        absl::StrCat("step ", step, " is already committed in '", root, "' (", final_dir, ")"));
  }
  const std::string tmp = JoinPath(root, TmpDirectoryName(step));
  STRATA_RETURN_IF_ERROR(RemoveTree(tmp));  // left by a crashed save
  STRATA_RETURN_IF_ERROR(MakeDirectory(tmp));
  return SyncDirectory(root);
}

absl::StatusOr<Manifest> MergeFragments(std::vector<Manifest> fragments) {
  STRATA_CHECK(!fragments.empty(), "no fragments to merge");
  Manifest m;
  const Manifest& first = fragments[0];
  m.step = first.step;
  m.library_version = STRATA_VERSION_STRING;
  m.checksum = first.checksum;
  m.chunk_bytes = first.chunk_bytes;
  m.world_size = static_cast<int>(fragments.size());
  m.mesh = first.mesh;
  m.state = first.state;
  m.created = absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(), absl::UTCTimeZone());
  std::map<std::string, ManifestTensor> tensors;
  std::map<std::string, int> tensor_rank;  // first rank that saved each key
  for (size_t r = 0; r < fragments.size(); ++r) {
    Manifest& f = fragments[r];
    if (f.step != m.step || f.checksum != m.checksum || f.chunk_bytes != m.chunk_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", r, " saved step ", f.step, " with ", ChecksumAlgorithmName(f.checksum),
          " chunks of ", f.chunk_bytes, " but rank 0 saved step ", m.step, " with ",
          ChecksumAlgorithmName(m.checksum), " chunks of ", m.chunk_bytes,
          " (every rank must use the same step and checkpoint options)"));
    }
    if (f.ranks.size() != 1 || f.ranks[0].rank != static_cast<int>(r)) {
      return absl::DataLossError(
          absl::StrCat("the fragment of rank ", r, " is not rank ", r, "'s"));
    }
    const int base = static_cast<int>(m.files.size());
    for (ManifestFile& file : f.files) m.files.push_back(std::move(file));
    for (ManifestTensor& t : f.tensors) {
      for (ManifestShard& s : t.shards) s.file += base;
      auto [it, inserted] = tensors.try_emplace(t.key, t);
      if (inserted) {
        tensor_rank[t.key] = static_cast<int>(r);
        continue;
      }
      ManifestTensor& have = it->second;
      if (have.dtype != t.dtype || have.shape != t.shape) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", t.key, "': rank ", tensor_rank[t.key], " saved ",
                         DataTypeSafetensorsName(have.dtype), " ", Dims(have.shape), " but rank ",
                         r, " saved ", DataTypeSafetensorsName(t.dtype), " ", Dims(t.shape)));
      }
      for (ManifestShard& s : t.shards) have.shards.push_back(std::move(s));
    }
    m.ranks.push_back(std::move(f.ranks[0]));
  }
  for (auto& [key, t] : tensors) {
    std::sort(t.shards.begin(), t.shards.end(),
              [](const ManifestShard& a, const ManifestShard& b) { return a.offset < b.offset; });
    m.tensors.push_back(std::move(t));
  }
  STRATA_RETURN_IF_ERROR_CTX(
      ValidateManifestWithCode(m, ManifestLimits{}, absl::StatusCode::kInvalidArgument),
      "the shards the ranks saved do not form a checkpoint");
  return m;
}

absl::Status CommitStep(const std::string& root, int64_t step, int world_size, const Hook& hook) {
  const std::string tmp = JoinPath(root, TmpDirectoryName(step));
  std::vector<Manifest> fragments;
  fragments.reserve(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) {
    const std::string path = JoinPath(tmp, FragmentFileName(r));
    STRATA_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, kMaxFragmentBytes));
    STRATA_ASSIGN_OR_RETURN(Manifest f, ParseManifestUnvalidated(text, path, ManifestLimits{}));
    fragments.push_back(std::move(f));
  }
  STRATA_ASSIGN_OR_RETURN(Manifest m, MergeFragments(std::move(fragments)));
  STRATA_ASSIGN_OR_RETURN(std::string text, SerializeManifest(m));
  STRATA_RETURN_IF_ERROR(WriteNewFile(JoinPath(tmp, kManifestFileName), text));
  for (int r = 0; r < world_size; ++r)
    STRATA_RETURN_IF_ERROR(RemoveTree(JoinPath(tmp, FragmentFileName(r))));
  STRATA_RETURN_IF_ERROR(SyncDirectory(tmp));
  STRATA_RETURN_IF_ERROR(RunHook(hook, "manifest_written"));
  STRATA_RETURN_IF_ERROR(RenamePath(tmp, JoinPath(root, StepDirectoryName(step))));
  STRATA_RETURN_IF_ERROR(SyncDirectory(root));
  STRATA_RETURN_IF_ERROR(RunHook(hook, "renamed"));
  STRATA_RETURN_IF_ERROR(WriteFileAtomically(JoinPath(root, kLatestFileName),
                                             absl::StrCat(StepDirectoryName(step), "\n")));
  return RunHook(hook, "latest_written");
}

std::vector<absl::Status> ApplyRetention(const std::string& root, int keep_last) {
  std::vector<absl::Status> problems;
  absl::StatusOr<std::optional<int64_t>> latest = ReadLatest(root);
  if (!latest.ok()) {
    // Without knowing what `latest` names, remove nothing.
    problems.push_back(latest.status());
    return problems;
  }
  absl::StatusOr<std::vector<std::string>> names = ListDirectory(root);
  if (!names.ok()) {
    problems.push_back(names.status());
    return problems;
  }
  std::vector<int64_t> complete;
  for (const std::string& n : *names) {
    const std::string path = JoinPath(root, n);
    // Leftovers of crashed saves and interrupted removals.
    if ((absl::EndsWith(n, ".tmp") && absl::StartsWith(n, "step-")) ||
        (absl::EndsWith(n, ".deleting") && absl::StartsWith(n, "step-"))) {
      if (absl::Status s = RemoveTree(path); !s.ok()) problems.push_back(s);
      continue;
    }
    std::optional<int64_t> s = ParseStepDirectoryName(n);
    if (s && PathExists(JoinPath(path, kManifestFileName))) complete.push_back(*s);
  }
  if (keep_last <= 0 || complete.size() <= static_cast<size_t>(keep_last)) return problems;
  std::sort(complete.begin(), complete.end());
  const size_t remove = complete.size() - static_cast<size_t>(keep_last);
  for (size_t i = 0; i < remove; ++i) {
    const int64_t step = complete[i];
    if (latest->has_value() && **latest == step) continue;  // never the one `latest` names
    const std::string dir = JoinPath(root, StepDirectoryName(step));
    const std::string doomed = absl::StrCat(dir, ".deleting");
    // Rename first: a half-removed directory is never mistaken for a checkpoint.
    absl::Status s = RenamePath(dir, doomed);
    if (s.ok()) s = RemoveTree(doomed);
    if (!s.ok())
      problems.push_back(internal::Annotate(s, absl::StrCat("retention of step ", step)));
  }
  if (absl::Status s = SyncDirectory(root); !s.ok()) problems.push_back(s);
  return problems;
}

}  // namespace strata::checkpoint_internal
