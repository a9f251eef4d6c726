#include "checkpoint/internal/save_protocol.h"

#include "absl/strings/str_cat.h"
#include "checkpoint/internal/agreement.h"
#include "checkpoint/internal/commit.h"
#include "checkpoint/internal/file_util.h"
#include "checkpoint/internal/manifest_internal.h"
#include "strata/base/status.h"

namespace strata::checkpoint_internal {

namespace {

double Seconds(absl::Time since) { return absl::ToDoubleSeconds(absl::Now() - since); }

// The error a rank reports when another rank's failure ended the save: it
// did nothing wrong itself, so Aborted, with the other rank's reason.
// A rank that failed itself reports its own error.
absl::Status AbortedBy(const Agreement& a, const absl::Status& local, const std::string& doing,
                       const std::string& then) {
  if (!local.ok()) return local;
  return absl::AbortedError(absl::StrCat("rank ", a.first_failed_rank, " ", doing, " (",
                                         absl::StatusCodeToString(a.first_failure.code()), ": ",
                                         a.first_failure.message(), ")", then));
}

class Run {
 public:
  Run(const ProtocolContext& ctx, int64_t step) : ctx_(ctx), step_(step) {}

  // An agreement; a failure of the collective itself (not a rank voting
  // "failed") is remembered, for the caller to poison the communicator.
  absl::StatusOr<Agreement> Agree(const absl::Status& local, absl::string_view phase) {
    absl::StatusOr<Agreement> a =
        checkpoint_internal::Agree(ctx_.comm, local, absl::Now() + ctx_.commit_timeout, phase);
    if (!a.ok()) comm_failed_ = true;
    return a;
  }

  absl::Status Hook(absl::string_view point) const {
    if (ctx_.cancel != nullptr && ctx_.cancel->load()) {
      return absl::CancelledError(absl::StrCat("save cancelled (at ", point, ")"));
    }
    return ctx_.hook ? ctx_.hook(point) : absl::OkStatus();
  }

  bool coordinator() const { return ctx_.rank == 0; }
  std::string tmp() const { return JoinPath(ctx_.root, TmpDirectoryName(step_)); }

  // Phase 1. `local` is this rank's readiness (an error when it cannot take
  // part); rank 0 creates the directory first.
  absl::Status Prepare(absl::Status local) {
    if (local.ok() && coordinator()) local = PrepareStepDirectory(ctx_.root, step_);
    STRATA_ASSIGN_OR_RETURN(Agreement a, Agree(local, "prepare"));
    if (a.all_ok) return absl::OkStatus();
    // Nothing of this save stays (rank 0 may have created the directory).
    if (coordinator() && local.ok()) (void)RemoveTree(tmp());
    return AbortedBy(a, local, absl::StrCat("could not start the save of step ", step_), "");
  }

  ProtocolResult Finish(absl::Status s) const { return ProtocolResult{std::move(s), comm_failed_}; }

  const ProtocolContext& ctx_;
  const int64_t step_;
  bool comm_failed_ = false;
};

}  // namespace

ProtocolResult RunSaveProtocol(const ProtocolContext& ctx, const SavePlan& plan,
                               const uint8_t* arena, SaveStats* stats) {
  Run run(ctx, plan.step);
  const absl::Time start = absl::Now();
  if (absl::Status s = run.Prepare(absl::OkStatus()); !s.ok()) return run.Finish(s);

  // Phase 2: every rank writes its files and its fragment of the manifest.
  const std::string tmp = run.tmp();
  absl::Status wrote = run.Hook("prepared");
  if (wrote.ok()) {
    WriteControl control;
    control.hook = [&run](absl::string_view p) { return run.Hook(p); };
    control.cancel = ctx.cancel;
    absl::StatusOr<Manifest> frag = WriteRankFiles(plan, arena, tmp, control);
    wrote = frag.status();
    if (frag.ok()) {
      for (const ManifestFile& f : frag->files) stats->bytes_written += f.size;
      stats->files_written = static_cast<int>(frag->files.size());
      absl::StatusOr<std::string> text = SerializeManifestUnvalidated(*frag);
      wrote = text.ok() ? WriteNewFile(JoinPath(tmp, FragmentFileName(ctx.rank)), *text)
                        : text.status();
    }
  }
  stats->write_seconds = Seconds(start);
  const absl::Time commit_start = absl::Now();
  absl::StatusOr<Agreement> a = run.Agree(wrote, "write");
  if (!a.ok()) return run.Finish(a.status());
  if (!a->all_ok) {
    if (run.coordinator()) (void)RemoveTree(tmp);  // nothing of this save stays
    return run.Finish(AbortedBy(*a, wrote,
                                absl::StrCat("failed to write its shards of step ", plan.step),
                                "; the save was abandoned"));
  }

  // Phase 3: rank 0 commits.
  absl::Status committed = absl::OkStatus();
  if (run.coordinator()) {
    committed = run.Hook("agreed");
    if (committed.ok()) {
      committed = CommitStep(ctx.root, plan.step, ctx.world_size,
                             [&run](absl::string_view p) { return run.Hook(p); });
    }
    if (!committed.ok() && !PathExists(JoinPath(ctx.root, StepDirectoryName(plan.step)))) {
      (void)RemoveTree(tmp);
    }
  }
  a = run.Agree(committed, "commit");
  if (!a.ok()) return run.Finish(a.status());
  if (!a->all_ok) {
    return run.Finish(
        AbortedBy(*a, committed, absl::StrCat("could not commit step ", plan.step), ""));
  }
  if (run.coordinator()) {
    for (const absl::Status& s : ApplyRetention(ctx.root, ctx.keep_last)) {
      if (ctx.warn) ctx.warn(s);
    }
  }
  stats->commit_seconds = Seconds(commit_start);
  return run.Finish(absl::OkStatus());
}

ProtocolResult CastFailureVote(const ProtocolContext& ctx, int64_t step,
                               const absl::Status& reason) {
  if (ctx.comm == nullptr) return ProtocolResult{reason, false};
  Run run(ctx, step);
  return run.Finish(run.Prepare(reason.ok() ? absl::UnknownError("save not started") : reason));
}

}  // namespace strata::checkpoint_internal
