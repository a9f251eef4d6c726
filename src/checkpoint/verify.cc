// VerifyCheckpoint: the full check behind `strata-ckpt verify`.
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/internal/file_util.h"
#include "strata/base/status.h"
#include "strata/checkpoint/loader.h"
#include "strata/checkpoint/safetensors.h"

namespace strata {

namespace ci = checkpoint_internal;

namespace {

constexpr uint64_t kReadPiece = uint64_t{16} << 20;

std::string Dims(const std::vector<int64_t>& d) {
  return absl::StrCat("[", absl::StrJoin(d, ", "), "]");
}

struct Chunk {
  uint64_t begin;
  uint64_t end;
  const std::string* expected;
  const ManifestTensor* tensor;
  const ManifestShard* shard;
  size_t index;
};

// Compares the file's safetensors header with the manifest's shards in it.
void CheckHeader(const std::string& path, const Manifest& m, int file_index,
                 std::vector<absl::Status>* problems) {
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::Open(path);
  if (!f.ok()) {
    problems->push_back(f.status());
    return;
  }
  const SafetensorsHeader& h = f->header();
  size_t expected_entries = 0;
  for (const ManifestTensor& t : m.tensors) {
    for (const ManifestShard& s : t.shards) {
      if (s.file != file_index) continue;
      ++expected_entries;
      const SafetensorsEntry* e = h.Find(t.key);
      if (e == nullptr) {
        problems->push_back(absl::DataLossError(absl::StrCat("'", path, "' has no tensor '", t.key,
                                                             "' but the manifest says it does")));
        continue;
      }
      if (e->dtype != t.dtype || e->shape != s.shape || h.data_start + e->begin != s.begin ||
          h.data_start + e->end != s.end) {
        problems->push_back(absl::DataLossError(absl::StrCat(
            "'", path, "' holds tensor '", t.key, "' as ", DataTypeSafetensorsName(e->dtype), " ",
            Dims(e->shape), " at bytes [", h.data_start + e->begin, ", ", h.data_start + e->end,
            ") but the manifest says ", DataTypeSafetensorsName(t.dtype), " ", Dims(s.shape),
            " at [", s.begin, ", ", s.end, ")")));
      }
    }
  }
  if (h.entries.size() != expected_entries) {
    problems->push_back(
        absl::DataLossError(absl::StrCat("'", path, "' holds ", h.entries.size(),
                                         " tensors but the manifest lists ", expected_entries)));
  }
}

}  // namespace

VerifyReport VerifyCheckpoint(const std::string& step_dir, const Manifest& m) {
  VerifyReport report;
  std::vector<uint8_t> buf;
  Hasher file_hash(m.checksum);
  Hasher chunk_hash(m.checksum);
  for (size_t fi = 0; fi < m.files.size(); ++fi) {
    const ManifestFile& mf = m.files[fi];
    const std::string path = ci::JoinPath(step_dir, mf.name);
    std::vector<Chunk> chunks;
    std::vector<std::string> keys;
    for (const ManifestTensor& t : m.tensors) {
      for (const ManifestShard& s : t.shards) {
        if (s.file != static_cast<int>(fi)) continue;
        keys.push_back(t.key);
        for (size_t k = 0; k < s.chunk_checksums.size(); ++k) {
          const uint64_t b = s.begin + k * m.chunk_bytes;
          chunks.push_back(
              {b, std::min(s.end, b + m.chunk_bytes), &s.chunk_checksums[k], &t, &s, k});
        }
      }
    }
    std::sort(chunks.begin(), chunks.end(),
              [](const Chunk& a, const Chunk& b) { return a.begin < b.begin; });
    const std::string holds = absl::StrCat(" (it holds ", absl::StrJoin(keys, ", "), ")");
    absl::StatusOr<ci::File> f = ci::File::OpenForRead(path);
    if (!f.ok()) {
      report.problems.push_back(
          absl::IsNotFound(f.status())
              ? absl::NotFoundError(absl::StrCat("data file '", path, "' is missing", holds))
              : f.status());
      continue;
    }
    ++report.files_checked;
    absl::StatusOr<uint64_t> size = f->Size();
    if (!size.ok()) {
      report.problems.push_back(size.status());
      continue;
    }
    if (*size != mf.size) {
      report.problems.push_back(absl::DataLossError(
          absl::StrCat("data file '", path, "' is ", *size, " bytes but the manifest records ",
                       mf.size, *size < mf.size ? " (truncated)" : "", holds)));
      continue;
    }
    CheckHeader(path, m, static_cast<int>(fi), &report.problems);
    file_hash.Reset();
    size_t next = 0;  // next chunk not yet finished
    bool read_failed = false;
    buf.resize(static_cast<size_t>(std::min<uint64_t>(kReadPiece, std::max<uint64_t>(mf.size, 1))));
    for (uint64_t p = 0; p < mf.size && !read_failed; p += kReadPiece) {
      const uint64_t q = std::min(mf.size, p + kReadPiece);
      if (absl::Status s = f->ReadAt(buf.data(), q - p, p); !s.ok()) {
        report.problems.push_back(s);
        read_failed = true;
        break;
      }
      report.bytes_checked += q - p;
      file_hash.Update(buf.data(), q - p);
      // Feed the chunks overlapping [p, q); they are disjoint and sorted.
      for (; next < chunks.size() && chunks[next].begin < q;) {
        const Chunk& c = chunks[next];
        if (c.begin >= p) chunk_hash.Reset();  // starts in this piece
        const uint64_t a = std::max(c.begin, p), b = std::min(c.end, q);
        chunk_hash.Update(buf.data() + (a - p), b - a);
        if (c.end > q) break;  // continues in the next piece
        const std::string got = chunk_hash.HexDigest();
        if (got != *c.expected) {
          report.problems.push_back(absl::DataLossError(absl::StrCat(
              "checksum mismatch in '", path, "' bytes [", c.begin, ", ", c.end, "), chunk ",
              c.index, " of tensor '", c.tensor->key, "' (shard at offset ", Dims(c.shard->offset),
              "): expected ", *c.expected, ", got ", got)));
        }
        ++next;
      }
    }
    if (read_failed) continue;
    const std::string got = file_hash.HexDigest();
    if (got != mf.checksum) {
      report.problems.push_back(absl::DataLossError(
          absl::StrCat("checksum mismatch in file '", path, "': expected ",
                       ChecksumAlgorithmName(m.checksum), " ", mf.checksum, ", got ", got, holds)));
    }
  }
  return report;
}

}  // namespace strata
