// The commit protocol's steps and the layout of a checkpoint root:
//
//   <root>/step-<N>.tmp/   a save in progress (never read by loads)
//   <root>/step-<N>/       a complete checkpoint (has manifest.json)
//   <root>/latest          "step-<N>\n", replaced atomically: the commit point
//   <root>/*.deleting      a checkpoint being removed by retention
//
// Order of a save (rank 0 of the checkpoint communicator coordinates):
//   1. rank 0 removes a stale step-<N>.tmp and creates it       agree
//   2. every rank writes and fsyncs its files and its fragment   agree
//   3. rank 0 merges the fragments into manifest.json, fsyncs it and the
//      directory, renames step-<N>.tmp to step-<N>, fsyncs the root, writes
//      latest.tmp, fsyncs it, renames it over latest, fsyncs the root   agree
//   4. rank 0 applies retention (failures there are warnings)
// A crash before the rename of `latest` leaves `latest` naming the previous
// checkpoint, which is untouched.
//
// Thread-safety: free functions; one save per root at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "strata/checkpoint/manifest.h"

namespace strata::checkpoint_internal {

inline constexpr char kLatestFileName[] = "latest";

std::string TmpDirectoryName(int64_t step);  // "step-<N>.tmp"
// N for "step-<N>" (digits only, no sign, no leading zeros except "0").
std::optional<int64_t> ParseStepDirectoryName(absl::string_view name);
// The step `latest` names; nullopt when there is no `latest`. DataLoss if
// its content is not "step-<N>".
absl::StatusOr<std::optional<int64_t>> ReadLatest(const std::string& root);
// Steps with a complete directory (step-<N>/manifest.json), ascending.
absl::StatusOr<std::vector<int64_t>> ListCompleteSteps(const std::string& root);

using Hook = std::function<absl::Status(absl::string_view point)>;

// Step 1 (rank 0). AlreadyExists if step-<N> is committed.
absl::Status PrepareStepDirectory(const std::string& root, int64_t step);

// Merges the fragments of ranks 0..n-1 (index = rank) into a manifest.
// InvalidArgument when ranks disagree on a tensor's dtype or shape, the
// shards overlap or leave part of a tensor uncovered.
absl::StatusOr<Manifest> MergeFragments(std::vector<Manifest> fragments);

// Step 3 (rank 0): reads the fragments of `world_size` ranks from the tmp
// directory, writes the manifest, renames, replaces latest.
absl::Status CommitStep(const std::string& root, int64_t step, int world_size, const Hook& hook);

// Step 4 (rank 0): keeps the newest `keep_last` complete checkpoints (all
// when 0) and the one `latest` names; removes stale *.tmp and *.deleting
// directories. Returns the problems it met (not fatal).
std::vector<absl::Status> ApplyRetention(const std::string& root, int keep_last);

}  // namespace strata::checkpoint_internal
