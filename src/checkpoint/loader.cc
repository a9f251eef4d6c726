#include "strata/checkpoint/loader.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/internal/agreement.h"
#include "checkpoint/internal/commit.h"
#include "checkpoint/internal/file_util.h"
#include "strata/base/status.h"
#include "strata/checkpoint/checkpointer.h"
#include "strata/checkpoint/reshard.h"

namespace strata {

namespace ci = checkpoint_internal;

namespace {

std::string Dims(const std::vector<int64_t>& d) {
  return absl::StrCat("[", absl::StrJoin(d, ", "), "]");
}

// "a, b, c and 7 more"
std::string KeyList(const std::vector<std::string>& keys, size_t max = 8) {
  std::vector<std::string> shown(keys.begin(), keys.begin() + std::min(keys.size(), max));
  std::string s = absl::StrJoin(shown, ", ", [](std::string* out, const std::string& k) {
    absl::StrAppend(out, "'", k, "'");
  });
  if (keys.size() > max) absl::StrAppend(&s, " and ", keys.size() - max, " more");
  return s;
}

std::vector<std::string> TensorsInFile(const Manifest& m, int file) {
  std::vector<std::string> keys;
  for (const ManifestTensor& t : m.tensors) {
    for (const ManifestShard& s : t.shards) {
      if (s.file == file) {
        keys.push_back(t.key);
        break;
      }
    }
  }
  return keys;
}

absl::Status ValidateLoadOptions(const LoadOptions& o) {
  if (o.version != LoadOptions::kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoadOptions version ", o.version,
                     " is not supported (this build: ", LoadOptions::kVersion, ")"));
  }
  if (o.directory.empty()) return absl::InvalidArgumentError("checkpoint directory is empty");
  if (o.step < -1) return absl::InvalidArgumentError(absl::StrCat("step ", o.step, " is negative"));
  if (o.read_buffer_bytes < 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("read_buffer_bytes ", o.read_buffer_bytes, " is below 4096"));
  }
  if (o.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoadOptions timeout ", absl::FormatDuration(o.timeout), " is not positive"));
  }
  return absl::OkStatus();
}

// Open data files of one Load, with their sizes checked once.
class FileCache {
 public:
  FileCache(const std::string& dir, const Manifest& m) : dir_(dir), m_(m) {}

  absl::StatusOr<const ci::File*> Get(int index, LoadReport* report) {
    auto it = files_.find(index);
    if (it != files_.end()) return &it->second;
    const ManifestFile& mf = m_.files[static_cast<size_t>(index)];
    const std::string path = ci::JoinPath(dir_, mf.name);
    absl::StatusOr<ci::File> f = ci::File::OpenForRead(path);
    if (!f.ok()) {
      if (absl::IsNotFound(f.status())) {
        return absl::NotFoundError(absl::StrCat("data file '", path, "' of step ", m_.step,
                                                " is missing (it holds ",
                                                KeyList(TensorsInFile(m_, index)), ")"));
      }
      return f.status();
    }
    STRATA_ASSIGN_OR_RETURN(uint64_t size, f->Size());
    if (size != mf.size) {
      return absl::DataLossError(absl::StrCat(
          "data file '", path, "' is ", size, " bytes but the manifest records ", mf.size,
          size < mf.size ? " (truncated)" : "", "; it holds ", KeyList(TensorsInFile(m_, index))));
    }
    ++report->files_opened;
    return &files_.emplace(index, std::move(*f)).first->second;
  }

 private:
  const std::string& dir_;
  const Manifest& m_;
  std::map<int, ci::File> files_;
};

struct Interval {
  uint64_t begin;
  uint64_t end;
};

void MergeIntervals(std::vector<Interval>* iv, uint64_t gap) {
  std::sort(iv->begin(), iv->end(),
            [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  std::vector<Interval> out;
  for (const Interval& i : *iv) {
    if (!out.empty() && i.begin <= out.back().end + gap) {
      out.back().end = std::max(out.back().end, i.end);
    } else {
      out.push_back(i);
    }
  }
  *iv = std::move(out);
}

}  // namespace

CheckpointReader::CheckpointReader(LoadOptions options, std::string step_dir, Manifest manifest)
    : options_(std::move(options)),
      step_dir_(std::move(step_dir)),
      manifest_(std::move(manifest)) {}

absl::StatusOr<std::vector<int64_t>> ListCheckpointSteps(const std::string& directory) {
  return ci::ListCompleteSteps(directory);
}

absl::StatusOr<int64_t> LatestCheckpointStep(const std::string& directory) {
  if (!ci::IsDirectory(directory)) {
    return absl::NotFoundError(
        absl::StrCat("no committed checkpoint: directory '", directory, "' does not exist"));
  }
  STRATA_ASSIGN_OR_RETURN(std::optional<int64_t> latest, ci::ReadLatest(directory));
  if (!latest) {
    return absl::NotFoundError(
        absl::StrCat("no committed checkpoint in '", directory, "': there is no 'latest' pointer"));
  }
  return *latest;
}

namespace {

// The manifest of the step `options` names, as text, read by one rank.
absl::StatusOr<std::string> ReadManifestText(const LoadOptions& options) {
  int64_t step = options.step;
  if (step < 0) {
    STRATA_ASSIGN_OR_RETURN(step, LatestCheckpointStep(options.directory));
  }
  const std::string step_dir = ci::JoinPath(options.directory, StepDirectoryName(step));
  if (!ci::IsDirectory(step_dir)) {
    absl::StatusOr<std::vector<int64_t>> steps = ci::ListCompleteSteps(options.directory);
    return absl::NotFoundError(
        absl::StrCat("checkpoint step ", step, options.step < 0 ? " (named by 'latest')" : "",
                     " does not exist in '", options.directory, "' (complete steps: ",
                     steps.ok() && !steps->empty() ? absl::StrJoin(*steps, ", ") : "none", ")"));
  }
  const std::string path = ci::JoinPath(step_dir, kManifestFileName);
  if (!ci::PathExists(path)) {
    return absl::DataLossError(
        absl::StrCat("checkpoint directory '", step_dir,
                     "' has no manifest.json: it is not a complete checkpoint"));
  }
  STRATA_ASSIGN_OR_RETURN(std::string text, ci::ReadSmallFile(path, ManifestLimits{}.max_bytes));
  // The step travels inside the text: "<step>\n<manifest>".
  return absl::StrCat(step, "\n", text);
}

}  // namespace

absl::StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(
    const LoadOptions& options) {
  absl::Status valid = ValidateLoadOptions(options);
  std::string text;
  if (options.group.empty()) {
    STRATA_RETURN_IF_ERROR(valid);
    STRATA_ASSIGN_OR_RETURN(text, ReadManifestText(options));
  } else {
    absl::StatusOr<Communicator*> resolved = options.group.Resolve();
    STRATA_RETURN_IF_ERROR_CTX(resolved.status(), "opening a checkpoint of '", options.directory,
                               "'");
    Communicator& comm = **resolved;
    const absl::Duration timeout = valid.ok() ? options.timeout : absl::Minutes(1);
    STRATA_ASSIGN_OR_RETURN(ci::Agreement a,
                            ci::Agree(&comm, valid, absl::Now() + timeout, "open: options"));
    STRATA_RETURN_IF_ERROR(ci::AgreedFailure(a, comm.rank(), "was given bad LoadOptions"));
    absl::Status read = absl::OkStatus();
    if (comm.rank() == 0) {
      absl::StatusOr<std::string> t = ReadManifestText(options);
      read = t.status();
      if (t.ok()) text = std::move(*t);
    }
    STRATA_RETURN_IF_ERROR(ci::BroadcastStatusAndText(comm, 0, &read, &text, absl::Now() + timeout,
                                                      "open: the manifest from rank 0"));
    if (!read.ok()) {
      if (comm.rank() == 0) return read;
      return absl::Status(read.code(),
                          absl::StrCat("rank 0 could not open the checkpoint: ", read.message()));
    }
  }
  const size_t nl = text.find('\n');
  int64_t step = -1;
  if (nl == std::string::npos || !absl::SimpleAtoi(absl::string_view(text).substr(0, nl), &step)) {
    return absl::DataLossError("the manifest sent by rank 0 is garbled");
  }
  const std::string step_dir = ci::JoinPath(options.directory, StepDirectoryName(step));
  const std::string path = ci::JoinPath(step_dir, kManifestFileName);
  STRATA_ASSIGN_OR_RETURN(Manifest m,
                          ParseManifest(absl::string_view(text).substr(nl + 1),
                                        absl::StrCat("manifest '", path, "'"), ManifestLimits{}));
  if (m.step != step) {
    return absl::DataLossError(absl::StrCat("manifest '", path, "' says step ", m.step,
                                            " but lies in the directory of step ", step));
  }
  return std::unique_ptr<CheckpointReader>(new CheckpointReader(options, step_dir, std::move(m)));
}

struct CheckpointReader::Job {
  const TensorTarget* target;
  const ManifestTensor* saved;
  std::vector<CopySegment> segments;
};

absl::StatusOr<LoadReport> CheckpointReader::Load(absl::Span<const TensorTarget> targets) const {
  LoadReport report;
  report.step = manifest_.step;
  // Resolved now: a reader opened before a World rebuild loads over the
  // group of the current generation.
  Communicator* comm = nullptr;
  if (!options_.group.empty()) {
    absl::StatusOr<Communicator*> resolved = options_.group.Resolve();
    STRATA_RETURN_IF_ERROR_CTX(resolved.status(), "loading checkpoint step ", manifest_.step);
    comm = *resolved;
  }
  // asked[i]: some target is manifest_.tensors[i] (on any rank, after the
  // allreduce).
  std::vector<uint8_t> asked(manifest_.tensors.size(), 0);
  std::vector<Job> jobs;
  absl::Status matched = Match(targets, &jobs, &asked, &report);
  if (comm != nullptr) {
    // Every rank takes part even when its own matching failed, so the
    // sequence of collectives is the same everywhere.
    STRATA_RETURN_IF_ERROR(ci::AllReduceMaxBytes(*comm, &asked, absl::Now() + options_.timeout,
                                                 "load: the tensors the ranks ask for"));
  }
  for (size_t i = 0; i < asked.size(); ++i) {
    if (asked[i] == 0) report.unexpected.push_back(manifest_.tensors[i].key);
  }
  if (matched.ok() && options_.matching == KeyMatching::kStrict && !report.unexpected.empty()) {
    matched = absl::InvalidArgumentError(absl::StrCat(
        "checkpoint step ", manifest_.step, " has ", report.unexpected.size(), " tensor(s) ",
        comm != nullptr ? "no rank asked for: " : "nothing asked for: ", KeyList(report.unexpected),
        " (lenient matching ignores them)"));
  }
  if (comm != nullptr) {
    STRATA_ASSIGN_OR_RETURN(
        ci::Agreement a, ci::Agree(comm, matched, absl::Now() + options_.timeout, "load: match"));
    STRATA_RETURN_IF_ERROR(
        ci::AgreedFailure(a, comm->rank(), "could not match its targets with the checkpoint"));
  } else {
    STRATA_RETURN_IF_ERROR(matched);
  }
  absl::Status read = Read(jobs, &report);
  if (comm != nullptr) {
    STRATA_ASSIGN_OR_RETURN(ci::Agreement a,
                            ci::Agree(comm, read, absl::Now() + options_.timeout, "load: read"));
    STRATA_RETURN_IF_ERROR(ci::AgreedFailure(a, comm->rank(), "failed to load its shards"));
  } else {
    STRATA_RETURN_IF_ERROR(read);
  }
  return report;
}

absl::Status CheckpointReader::Match(absl::Span<const TensorTarget> targets, std::vector<Job>* jobs,
                                     std::vector<uint8_t>* asked, LoadReport* report) const {
  const bool strict = options_.matching == KeyMatching::kStrict;
  std::set<absl::string_view> wanted;
  for (const TensorTarget& t : targets) {
    STRATA_RETURN_IF_ERROR_CTX(ValidateShard(t.shard), "loading step ", manifest_.step);
    if (!wanted.insert(t.shard.key).second) {
      return absl::InvalidArgumentError(absl::StrCat("loading step ", manifest_.step, ": tensor '",
                                                     t.shard.key, "' is asked for twice"));
    }
    if (t.data == nullptr && t.shard.local_bytes() > 0) {
      return absl::InvalidArgumentError(absl::StrCat("loading step ", manifest_.step, ": tensor '",
                                                     t.shard.key, "' has no destination buffer"));
    }
    const ManifestTensor* saved = manifest_.FindTensor(t.shard.key);
    if (saved == nullptr) {
      report->missing.push_back(t.shard.key);
      continue;
    }
    (*asked)[static_cast<size_t>(saved - manifest_.tensors.data())] = 1;
    if (saved->dtype != t.shard.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.shard.key, "': dtype mismatch: the checkpoint (step ", manifest_.step,
          ") has ", DataTypeName(saved->dtype), ", the target is ", DataTypeName(t.shard.dtype)));
    }
    if (saved->shape != t.shard.global_shape) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.shard.key, "': shape mismatch: the checkpoint (step ",
                       manifest_.step, ") has global shape ", Dims(saved->shape),
                       ", the target has ", Dims(t.shard.global_shape)));
    }
    jobs->push_back({&t, saved, {}});
  }
  if (strict && !report->missing.empty()) {
    return absl::NotFoundError(absl::StrCat(
        report->missing.size(), " tensor(s) missing from checkpoint step ", manifest_.step, " in '",
        step_dir_, "': ", KeyList(report->missing), " (lenient matching skips them)"));
  }
  for (Job& j : *jobs) {
    std::vector<TensorBox> boxes;
    boxes.reserve(j.saved->shards.size());
    for (const ManifestShard& s : j.saved->shards) boxes.push_back({s.offset, s.shape});
    absl::StatusOr<std::vector<CopySegment>> plan =
        PlanReshard(j.saved->dtype, j.saved->shape, boxes,
                    {j.target->shard.global_offset, j.target->shard.local_shape});
    if (!plan.ok()) {
      return internal::Annotate(plan.status(), absl::StrCat("tensor '", j.saved->key, "'"));
    }
    j.segments = std::move(*plan);
  }
  return absl::OkStatus();
}

absl::Status CheckpointReader::Read(const std::vector<Job>& jobs, LoadReport* report) const {
  const bool verify = options_.verify == ChecksumVerification::kVerify;
  // Read what each target needs, shard by shard.
  FileCache files(step_dir_, manifest_);
  const uint64_t chunk = manifest_.chunk_bytes;
  uint64_t piece_bytes = options_.read_buffer_bytes;
  if (verify) piece_bytes = std::max<uint64_t>(chunk, piece_bytes / chunk * chunk);
  std::vector<uint8_t> scratch;
  Hasher hasher(manifest_.checksum);
  for (const Job& j : jobs) {
    uint8_t* target = static_cast<uint8_t*>(j.target->data);
    for (size_t lo = 0; lo < j.segments.size();) {
      size_t hi = lo;
      while (hi < j.segments.size() && j.segments[hi].source == j.segments[lo].source) ++hi;
      const absl::Span<const CopySegment> segs(&j.segments[lo], hi - lo);
      const ManifestShard& sh = j.saved->shards[segs[0].source];
      lo = hi;
      const uint64_t shard_bytes = sh.end - sh.begin;
      STRATA_ASSIGN_OR_RETURN(const ci::File* file, files.Get(sh.file, report));
      // Byte ranges of the shard this target needs.
      std::vector<Interval> iv;
      for (const CopySegment& s : segs) {
        if (s.count == 1 || s.source_stride - s.length <= options_.merge_gap_bytes) {
          iv.push_back({s.source_offset, s.source_offset + s.source_span()});
        } else {
          for (uint64_t i = 0; i < s.count; ++i) {
            const uint64_t b = s.source_offset + i * s.source_stride;
            iv.push_back({b, b + s.length});
          }
        }
      }
      MergeIntervals(&iv, options_.merge_gap_bytes);
      if (verify) {
        for (Interval& i : iv) {
          i.begin = i.begin / chunk * chunk;
          i.end = std::min(shard_bytes, (i.end + chunk - 1) / chunk * chunk);
        }
        MergeIntervals(&iv, 0);
      }
      size_t first = 0;  // first segment whose source span ends after the piece start
      for (const Interval& range : iv) {
        for (uint64_t p = range.begin; p < range.end;) {
          const uint64_t q = std::min(range.end, p + piece_bytes);
          while (first < segs.size() && segs[first].source_offset + segs[first].source_span() <= p)
            ++first;
          const CopySegment* direct = nullptr;
          if (first < segs.size() && segs[first].count == 1 && segs[first].source_offset <= p &&
              q <= segs[first].source_offset + segs[first].length) {
            direct = &segs[first];
          }
          uint8_t* buf;
          if (direct != nullptr) {
            buf = target + direct->target_offset + (p - direct->source_offset);
          } else {
            if (scratch.size() < piece_bytes) scratch.resize(piece_bytes);
            buf = scratch.data();
          }
          STRATA_RETURN_IF_ERROR(ci::ReadFully(file->fd(), file->path(), buf, q - p, sh.begin + p));
          report->bytes_read += q - p;
          if (verify) {
            for (uint64_t c = p; c < q; c += chunk) {
              const uint64_t n = std::min(chunk, q - c);
              hasher.Reset();
              hasher.Update(buf + (c - p), n);
              const std::string got = hasher.HexDigest();
              const std::string& want = sh.chunk_checksums[c / chunk];
              if (got != want) {
                return absl::DataLossError(
                    absl::StrCat("checksum mismatch in '", file->path(), "' bytes [", sh.begin + c,
                                 ", ", sh.begin + c + n, "), chunk ", c / chunk, " of tensor '",
                                 j.saved->key, "' (shard at offset ", Dims(sh.offset),
                                 "): expected ", ChecksumAlgorithmName(manifest_.checksum), " ",
                                 want, ", got ", got, "; the file is corrupt"));
              }
              report->bytes_verified += n;
            }
          }
          if (direct == nullptr) {
            for (size_t k = first; k < segs.size() && segs[k].source_offset < q; ++k) {
              const CopySegment& s = segs[k];
              uint64_t i =
                  p > s.source_offset && s.count > 1 ? (p - s.source_offset) / s.source_stride : 0;
              for (; i < s.count; ++i) {
                const uint64_t rb = s.source_offset + i * s.source_stride;
                if (rb >= q) break;
                const uint64_t a = std::max(rb, p), b = std::min(rb + s.length, q);
                if (a < b)
                  std::memcpy(target + s.target_offset + i * s.target_stride + (a - rb),
                              buf + (a - p), b - a);
              }
            }
          }
          p = q;
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace strata
