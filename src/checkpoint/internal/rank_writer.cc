#include "checkpoint/internal/rank_writer.h"

#include <fcntl.h>

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/internal/file_util.h"
#include "checkpoint/internal/staging.h"
#include "strata/base/status.h"
#include "strata/checkpoint/safetensors.h"
#include "strata/version.h"

namespace strata::checkpoint_internal {

namespace {

constexpr uint64_t kPage = 4096;
// Bytes per write() call; after each, writeback of that range is started so
// the disk works while the next piece is hashed and written.
constexpr uint64_t kWritePiece = uint64_t{16} << 20;

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

absl::Status Hook(const WriteControl& c, absl::string_view point) {
  if (c.cancel != nullptr && c.cancel->load()) {
    return absl::CancelledError(absl::StrCat("save cancelled (at ", point, ")"));
  }
  if (c.hook) return c.hook(point);
  return absl::OkStatus();
}

}  // namespace

std::string DataFileName(int rank, int index) {
  return absl::StrFormat("rank%05d-%03d.safetensors", rank, index);
}

std::string FragmentFileName(int rank) { return absl::StrFormat("fragment-%05d.json", rank); }

absl::StatusOr<SavePlan> PlanRankSave(const SaveRequest& request, const PlanOptions& options) {
  if (request.step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("step ", request.step, " is negative"));
  }
  SavePlan plan;
  plan.step = request.step;
  plan.rank = options.rank;
  plan.world_size = options.world_size;
  plan.checksum = options.checksum;
  plan.chunk_bytes = options.chunk_bytes;
  plan.state = request.state;
  plan.state.step = request.step;
  plan.state.library_version = STRATA_VERSION_STRING;
  STRATA_RETURN_IF_ERROR_CTX(ValidateTrainingState(plan.state), "saving step ", request.step);

  std::vector<ShardedTensor> metas;
  metas.reserve(request.tensors.size());
  std::set<absl::string_view> keys;
  for (const TensorData& t : request.tensors) {
    STRATA_RETURN_IF_ERROR_CTX(ValidateShard(t.shard), "saving step ", request.step);
    if (!keys.insert(t.shard.key).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("saving step ", request.step, ": tensor '", t.shard.key,
                       "' is given twice (a rank saves at most one shard of each tensor)"));
    }
    if (t.data == nullptr && t.shard.local_bytes() > 0) {
      return absl::InvalidArgumentError(absl::StrCat("saving step ", request.step, ": tensor '",
                                                     t.shard.key, "' has no data pointer"));
    }
    metas.push_back(t.shard);
  }
  const std::vector<int> writers = AssignWriters(metas);
  std::vector<size_t> mine;
  for (size_t i = 0; i < metas.size(); ++i) {
    if (writers[i] == metas[i].replica.index) mine.push_back(i);
    plan.any_device = plan.any_device || (writers[i] == metas[i].replica.index &&
                                          request.tensors[i].memory == MemoryKind::kCuda);
  }
  // Same order as the safetensors layout: larger elements first, then key.
  std::sort(mine.begin(), mine.end(), [&](size_t a, size_t b) {
    const size_t sa = DataTypeSize(metas[a].dtype), sb = DataTypeSize(metas[b].dtype);
    if (sa != sb) return sa > sb;
    return metas[a].key < metas[b].key;
  });
  // Greedy split into files of at most max_file_bytes of data.
  std::vector<std::vector<size_t>> groups;
  uint64_t group_bytes = 0;
  for (size_t i : mine) {
    const uint64_t b = metas[i].local_bytes();
    if (groups.empty() || (options.max_file_bytes > 0 && group_bytes > 0 &&
                           group_bytes + b > options.max_file_bytes)) {
      groups.emplace_back();
      group_bytes = 0;
    }
    groups.back().push_back(i);
    group_bytes += b;
  }
  uint64_t arena = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<SafetensorsEntry> entries;
    for (size_t i : groups[g]) {
      SafetensorsEntry e;
      e.name = metas[i].key;
      e.dtype = metas[i].dtype;
      e.shape = metas[i].local_shape;
      entries.push_back(std::move(e));
    }
    STRATA_ASSIGN_OR_RETURN(
        SafetensorsLayout layout,
        BuildSafetensorsHeader(std::move(entries), {{"format", "pt"},
                                                    {"strata.step", absl::StrCat(request.step)},
                                                    {"strata.rank", absl::StrCat(options.rank)}}));
    PlannedFile f;
    f.name = DataFileName(options.rank, static_cast<int>(g));
    f.arena_offset = arena;
    f.size = layout.header.data_start + layout.header.data_bytes;
    // The header sorts its entries the same way; match them by name.
    for (const SafetensorsEntry& e : layout.header.entries) {
      auto it = std::find_if(groups[g].begin(), groups[g].end(),
                             [&](size_t i) { return metas[i].key == e.name; });
      STRATA_CHECK(it != groups[g].end(), "safetensors entry '", e.name, "' not planned");
      PlannedShard s;
      s.meta = metas[*it];
      s.request_index = *it;
      s.file = static_cast<int>(g);
      s.begin = layout.header.data_start + e.begin;
      plan.shards.push_back(std::move(s));
    }
    f.header = std::move(layout.bytes);
    arena = AlignUp(arena + f.size, kPage);
    plan.files.push_back(std::move(f));
  }
  plan.arena_bytes = arena;
  return plan;
}

absl::Status StageRankSave(const SaveRequest& request, const SavePlan& plan, uint8_t* arena,
                           int threads) {
  std::vector<StagingCopy> copies;
  copies.reserve(plan.files.size() + plan.shards.size());
  for (const PlannedFile& f : plan.files) {
    copies.push_back({f.header.data(), arena + f.arena_offset, f.header.size(), false});
  }
  for (const PlannedShard& s : plan.shards) {
    const TensorData& t = request.tensors[s.request_index];
    const PlannedFile& f = plan.files[static_cast<size_t>(s.file)];
    copies.push_back({t.data, arena + f.arena_offset + s.begin, s.meta.local_bytes(),
                      t.memory == MemoryKind::kCuda});
  }
  return RunStagingCopies(copies, threads, request.cuda_stream);
}

absl::StatusOr<Manifest> WriteRankFiles(const SavePlan& plan, const uint8_t* arena,
                                        const std::string& dir, const WriteControl& control) {
  Manifest frag;
  frag.step = plan.step;
  frag.checksum = plan.checksum;
  frag.chunk_bytes = plan.chunk_bytes;
  frag.world_size = plan.world_size;
  frag.mesh = plan.state.mesh;
  frag.library_version = STRATA_VERSION_STRING;
  frag.state = plan.state;
  frag.state.rng_states.clear();
  frag.state.data_loader.clear();
  RankState rs;
  rs.rank = plan.rank;
  rs.rng_states = plan.state.rng_states;
  rs.data_loader = plan.state.data_loader;
  frag.ranks.push_back(std::move(rs));

  bool partial_reported = false;
  for (size_t fi = 0; fi < plan.files.size(); ++fi) {
    const PlannedFile& pf = plan.files[fi];
    const std::string path = JoinPath(dir, pf.name);
    STRATA_ASSIGN_OR_RETURN(File f, File::Create(path));
    const uint8_t* bytes = arena + pf.arena_offset;
    Hasher hash(plan.checksum);
    for (uint64_t off = 0; off < pf.size; off += kWritePiece) {
      const uint64_t n = std::min(kWritePiece, pf.size - off);
      hash.Update(bytes + off, n);
      STRATA_RETURN_IF_ERROR(f.Write(bytes + off, n));
      // Start writeback of what was just written; errors surface at fsync.
      (void)::sync_file_range(f.fd(), static_cast<off_t>(off), static_cast<off_t>(n),
                              SYNC_FILE_RANGE_WRITE);
      if (!partial_reported) {
        partial_reported = true;
        STRATA_RETURN_IF_ERROR(Hook(control, "file_partial"));
      }
    }
    // Chunk checksums of this file's shards, from staging, while the disk
    // is busy with the writeback started above.
    for (const PlannedShard& s : plan.shards) {
      if (s.file != static_cast<int>(fi)) continue;
      ManifestTensor t;
      t.key = s.meta.key;
      t.dtype = s.meta.dtype;
      t.shape = s.meta.global_shape;
      ManifestShard sh;
      sh.offset = s.meta.global_offset;
      sh.shape = s.meta.local_shape;
      sh.file = static_cast<int>(fi);
      sh.begin = s.begin;
      sh.end = s.begin + s.meta.local_bytes();
      for (uint64_t c = sh.begin; c < sh.end; c += plan.chunk_bytes) {
        sh.chunk_checksums.push_back(
            ChecksumHex(plan.checksum, bytes + c, std::min(plan.chunk_bytes, sh.end - c)));
      }
      t.shards.push_back(std::move(sh));
      frag.tensors.push_back(std::move(t));
    }
    STRATA_RETURN_IF_ERROR(f.Sync());
    // The data is on disk; keep it from crowding training's page cache.
    (void)::posix_fadvise(f.fd(), 0, 0, POSIX_FADV_DONTNEED);
    STRATA_RETURN_IF_ERROR(f.Close());
    ManifestFile mf;
    mf.name = pf.name;
    mf.rank = plan.rank;
    mf.size = pf.size;
    mf.checksum = hash.HexDigest();
    frag.files.push_back(std::move(mf));
    if (control.cancel != nullptr && control.cancel->load()) {
      return absl::CancelledError("save cancelled while writing files");
    }
  }
  std::sort(frag.tensors.begin(), frag.tensors.end(),
            [](const ManifestTensor& a, const ManifestTensor& b) { return a.key < b.key; });
  STRATA_RETURN_IF_ERROR(Hook(control, "files_written"));
  return frag;
}

}  // namespace strata::checkpoint_internal
