#include "ckpt_tool.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "strata/base/status.h"
#include "strata/checkpoint/checkpointer.h"

namespace strata::ckpt_tool {

namespace {

std::string Dims(const std::vector<int64_t>& d) {
  return absl::StrCat("[", absl::StrJoin(d, ", "), "]");
}

std::string DirName(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const size_t slash = p.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : p.substr(0, slash);
}

std::string BaseName(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const size_t slash = p.rfind('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

bool Exists(const std::string& p) { return ::access(p.c_str(), F_OK) == 0; }

absl::Status Errno(absl::string_view what, const std::string& path) {
  return absl::Status(absl::ErrnoToStatusCode(errno),
                      absl::StrCat(what, " '", path, "': ", strerror(errno)));
}

absl::Status WriteAll(int fd, const void* data, size_t size, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t w = ::write(fd, p, std::min<size_t>(size, size_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      return Errno("cannot write", path);
    }
    p += w;
    size -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

}  // namespace

std::string HumanBytes(uint64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? absl::StrCat(b, " B") : absl::StrFormat("%.2f %s", v, units[u]);
}

absl::StatusOr<std::unique_ptr<CheckpointReader>> OpenCheckpoint(const std::string& path,
                                                                 int64_t step, bool verify) {
  LoadOptions lo;
  lo.directory = path;
  lo.step = step;
  lo.verify = verify ? ChecksumVerification::kVerify : ChecksumVerification::kSkip;
  lo.matching = KeyMatching::kLenient;  // the tool loads tensors one at a time
  if (Exists(absl::StrCat(path, "/", kManifestFileName))) {
    const std::string name = BaseName(path);
    absl::string_view digits = name;
    int64_t n = -1;
    if (!absl::ConsumePrefix(&digits, "step-") || !absl::SimpleAtoi(digits, &n) || n < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", path, "' holds a manifest.json but is not named step-<N>"));
    }
    if (step >= 0 && step != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", path, "' is the directory of step ", n, ", not of step ", step));
    }
    lo.directory = DirName(path);
    lo.step = n;
  }
  return CheckpointReader::Open(lo);
}

std::string DescribeCheckpoint(const CheckpointReader& reader, bool all_shards) {
  const Manifest& m = reader.manifest();
  std::string out;
  uint64_t total = 0;
  for (const ManifestFile& f : m.files) total += f.size;
  absl::StrAppendFormat(&out, "checkpoint %s\n", reader.step_directory());
  absl::StrAppendFormat(&out, "  step %d, manifest version %d, written by strata %s at %s\n",
                        m.step, m.version, m.library_version, m.created);
  absl::StrAppendFormat(&out, "  %d rank(s); mesh tp=%d pp=%d cp=%d ep=%d dp=%d order %s\n",
                        m.world_size, m.mesh.tp, m.mesh.pp, m.mesh.cp, m.mesh.ep, m.mesh.dp,
                        m.mesh.order);
  absl::StrAppendFormat(&out, "  %d tensor(s) in %d file(s), %s; %s checksums in chunks of %s\n",
                        m.tensors.size(), m.files.size(), HumanBytes(total),
                        ChecksumAlgorithmName(m.checksum), HumanBytes(m.chunk_bytes));
  int rng_ranks = 0;
  for (const RankState& r : m.ranks) rng_ranks += r.rng_states.empty() ? 0 : 1;
  absl::StrAppendFormat(
      &out, "  state: optimizer step %d, lr schedule %s, extra %s, RNG states of %d rank(s)\n",
      m.state.optimizer_step, m.state.lr_schedule.empty() ? "no" : "yes",
      m.state.extra.empty() ? "no" : "yes", rng_ranks);
  size_t key_width = 6;
  for (const ManifestTensor& t : m.tensors) key_width = std::max(key_width, t.key.size());
  key_width = std::min<size_t>(key_width, 60);
  absl::StrAppendFormat(&out, "\n%-*s  %-5s  %-20s  %6s  %12s\n", key_width, "tensor", "dtype",
                        "shape", "shards", "bytes");
  for (const ManifestTensor& t : m.tensors) {
    uint64_t bytes = 0;
    for (const ManifestShard& s : t.shards) bytes += s.end - s.begin;
    absl::StrAppendFormat(&out, "%-*s  %-5s  %-20s  %6d  %12s\n", key_width, t.key,
                          DataTypeSafetensorsName(t.dtype), Dims(t.shape), t.shards.size(),
                          HumanBytes(bytes));
    const size_t shown = all_shards ? t.shards.size() : std::min<size_t>(t.shards.size(), 4);
    if (t.shards.size() == 1 && t.shards[0].shape == t.shape) continue;  // whole: nothing to add
    for (size_t i = 0; i < shown; ++i) {
      const ManifestShard& s = t.shards[i];
      absl::StrAppendFormat(&out, "%*s  offset %s shape %s in %s bytes [%d, %d)\n", key_width, "",
                            Dims(s.offset), Dims(s.shape),
                            m.files[static_cast<size_t>(s.file)].name, s.begin, s.end);
    }
    if (shown < t.shards.size()) {
      absl::StrAppendFormat(&out, "%*s  ... %d more (--all-shards)\n", key_width, "",
                            t.shards.size() - shown);
    }
  }
  absl::StrAppendFormat(&out, "\n%-28s  %5s  %12s  %s\n", "file", "rank", "bytes", "checksum");
  for (const ManifestFile& f : m.files) {
    absl::StrAppendFormat(&out, "%-28s  %5d  %12s  %s\n", f.name, f.rank, HumanBytes(f.size),
                          f.checksum);
  }
  return out;
}

std::string DescribeSafetensors(const SafetensorsFile& file) {
  std::string out;
  const SafetensorsHeader& h = file.header();
  absl::StrAppendFormat(&out, "safetensors file %s: %s, %d tensor(s), data at byte %d\n",
                        file.path(), HumanBytes(file.file_size()), h.entries.size(), h.data_start);
  for (const auto& [k, v] : h.metadata) absl::StrAppendFormat(&out, "  metadata %s = %s\n", k, v);
  absl::StrAppendFormat(&out, "\n%-40s  %-5s  %-20s  %12s\n", "tensor", "dtype", "shape", "bytes");
  for (const SafetensorsEntry& e : h.entries) {
    absl::StrAppendFormat(&out, "%-40s  %-5s  %-20s  %12s\n", e.name,
                          DataTypeSafetensorsName(e.dtype), Dims(e.shape),
                          HumanBytes(e.end - e.begin));
  }
  return out;
}

absl::StatusOr<uint64_t> ConvertToSafetensors(const CheckpointReader& reader,
                                              const std::string& out) {
  const Manifest& m = reader.manifest();
  std::vector<SafetensorsEntry> entries;
  for (const ManifestTensor& t : m.tensors) {
    SafetensorsEntry e;
    e.name = t.key;
    e.dtype = t.dtype;
    e.shape = t.shape;
    entries.push_back(std::move(e));
  }
  STRATA_ASSIGN_OR_RETURN(
      SafetensorsLayout layout,
      BuildSafetensorsHeader(std::move(entries),
                             {{"format", "pt"},
                              {"strata.step", absl::StrCat(m.step)},
                              {"strata.converted_from", reader.step_directory()}}));
  const std::string tmp = absl::StrCat(out, ".tmp");
  const int fd = ::open(tmp.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("cannot create", tmp);
  auto fail = [&](absl::Status s) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return s;
  };
  if (absl::Status s = WriteAll(fd, layout.bytes.data(), layout.bytes.size(), tmp); !s.ok())
    return fail(s);
  std::vector<uint8_t> buf;
  for (const SafetensorsEntry& e : layout.header.entries) {
    buf.resize(e.end - e.begin);
    TensorTarget t{ShardedTensor::Whole(e.name, e.dtype, e.shape), buf.data()};
    absl::StatusOr<LoadReport> rep = reader.Load({t});
    if (!rep.ok()) return fail(rep.status());
    if (absl::Status s = WriteAll(fd, buf.data(), buf.size(), tmp); !s.ok()) return fail(s);
  }
  if (::fsync(fd) != 0) return fail(Errno("cannot fsync", tmp));
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    return Errno("cannot close", tmp);
  }
  if (::rename(tmp.c_str(), out.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return Errno("cannot rename to", out);
  }
  return layout.header.data_start + layout.header.data_bytes;
}

}  // namespace strata::ckpt_tool
