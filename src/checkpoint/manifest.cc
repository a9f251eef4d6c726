#include "strata/checkpoint/manifest.h"

#include <algorithm>
#include <limits>
#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/internal/json_util.h"
#include "checkpoint/internal/manifest_internal.h"
#include "strata/base/status.h"
#include "strata/checkpoint/safetensors.h"
#include "strata/checkpoint/sharded_tensor.h"

namespace strata {

using checkpoint_internal::AsInt;
using checkpoint_internal::AsUInt;
using checkpoint_internal::FieldError;
using checkpoint_internal::GetArray;
using checkpoint_internal::GetDims;
using checkpoint_internal::GetInt;
using checkpoint_internal::GetObject;
using checkpoint_internal::GetString;
using checkpoint_internal::GetUInt;
using checkpoint_internal::Json;
using checkpoint_internal::JsonContext;
using checkpoint_internal::OrderedJson;

namespace {

std::string Dims(const std::vector<int64_t>& d) {
  return absl::StrCat("[", absl::StrJoin(d, ", "), "]");
}

bool IsHex(absl::string_view s) {
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// Elements of a box; boxes were checked against their int64 global shape.
uint64_t Volume(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

bool BoxesOverlap(const ManifestShard& a, const ManifestShard& b) {
  for (size_t d = 0; d < a.offset.size(); ++d) {
    if (a.offset[d] >= b.offset[d] + b.shape[d] || b.offset[d] >= a.offset[d] + a.shape[d]) {
      return false;
    }
  }
  return Volume(a.shape) != 0 && Volume(b.shape) != 0;
}

}  // namespace

bool IsSafeFileName(absl::string_view name) {
  if (name.empty() || name.size() > 255 || name[0] == '.') return false;
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

const ManifestTensor* Manifest::FindTensor(absl::string_view key) const {
  auto it =
      std::lower_bound(tensors.begin(), tensors.end(), key,
                       [](const ManifestTensor& t, absl::string_view k) { return t.key < k; });
  if (it == tensors.end() || it->key != key) return nullptr;
  return &*it;
}

TrainingState Manifest::StateForRank(int rank) const {
  TrainingState s = state;
  s.step = step;
  s.mesh = mesh;
  s.library_version = library_version;
  s.rng_states.clear();
  s.data_loader.clear();
  for (const RankState& r : ranks) {
    if (r.rank == rank) {
      s.rng_states = r.rng_states;
      s.data_loader = r.data_loader;
    }
  }
  return s;
}

namespace checkpoint_internal {

absl::Status ValidateManifestWithCode(const Manifest& m, const ManifestLimits& limits,
                                      absl::StatusCode code) {
  auto err = [&](auto&&... parts) {
    return absl::Status(code, absl::StrCat("manifest of step ", m.step, ": ", parts...));
  };
  if (m.version != Manifest::kVersion)
    return err("version ", m.version, " is not ", Manifest::kVersion);
  if (m.step < 0) return err("step is negative");
  if (m.world_size < 1) return err("world_size ", m.world_size, " < 1");
  if (m.chunk_bytes < kMinChunkBytes || m.chunk_bytes > kMaxChunkBytes) {
    return err("chunk_bytes ", m.chunk_bytes, " is outside [", kMinChunkBytes, ", ", kMaxChunkBytes,
               "]");
  }
  const size_t hex_len = ChecksumHexLength(m.checksum);
  auto check_digest = [&](absl::string_view d, absl::string_view where) -> absl::Status {
    if (d.size() != hex_len || !IsHex(d)) {
      return err(where, " has checksum '", d.substr(0, 80), "', not ", hex_len,
                 " lowercase hex digits (", ChecksumAlgorithmName(m.checksum), ")");
    }
    return absl::OkStatus();
  };
  std::set<absl::string_view> names;
  for (size_t i = 0; i < m.files.size(); ++i) {
    const ManifestFile& f = m.files[i];
    if (!IsSafeFileName(f.name) || f.name == kManifestFileName) {
      return err("file ", i, " has the name '", absl::CHexEscape(f.name.substr(0, 80)),
                 "', which is not a plain file name ([A-Za-z0-9._-], not starting with '.')");
    }
    if (!names.insert(f.name).second) return err("file '", f.name, "' is listed twice");
    if (f.rank < 0 || f.rank >= m.world_size) {
      return err("file '", f.name, "' has rank ", f.rank, " outside [0, ", m.world_size, ")");
    }
    STRATA_RETURN_IF_ERROR(check_digest(f.checksum, absl::StrCat("file '", f.name, "'")));
  }
  std::set<int> ranks;
  for (const RankState& r : m.ranks) {
    if (r.rank < 0 || r.rank >= m.world_size) {
      return err("rank state for rank ", r.rank, " outside [0, ", m.world_size, ")");
    }
    if (!ranks.insert(r.rank).second) return err("rank ", r.rank, " has two rank states");
  }
  // Byte ranges per file, to check no two shards share bytes.
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> used(m.files.size());
  std::vector<std::vector<const std::string*>> used_by(m.files.size());
  for (size_t ti = 0; ti < m.tensors.size(); ++ti) {
    const ManifestTensor& t = m.tensors[ti];
    if (ti > 0 && !(m.tensors[ti - 1].key < t.key)) {
      return err("tensors are not sorted by key or key '", t.key, "' appears twice");
    }
    if (t.shards.size() > limits.max_shards_per_tensor) {
      return err("tensor '", t.key, "' has ", t.shards.size(), " shards, more than ",
                 limits.max_shards_per_tensor);
    }
    ShardedTensor whole = ShardedTensor::Whole(t.key, t.dtype, t.shape);
    if (absl::Status s = ValidateShard(whole); !s.ok()) return err(s.message());
    uint64_t covered = 0;
    for (size_t si = 0; si < t.shards.size(); ++si) {
      const ManifestShard& sh = t.shards[si];
      ShardedTensor st = whole;
      st.local_shape = sh.shape;
      st.global_offset = sh.offset;
      if (absl::Status s = ValidateShard(st); !s.ok()) return err("shard ", si, ": ", s.message());
      const std::string where =
          absl::StrCat("tensor '", t.key, "' shard at offset ", Dims(sh.offset));
      if (sh.file < 0 || static_cast<size_t>(sh.file) >= m.files.size()) {
        return err(where, " names file ", sh.file, " of ", m.files.size());
      }
      const ManifestFile& f = m.files[static_cast<size_t>(sh.file)];
      const uint64_t bytes = st.local_bytes();
      if (sh.begin > sh.end || sh.end - sh.begin != bytes) {
        return err(where, " has byte range [", sh.begin, ", ", sh.end, ") but ",
                   DataTypeSafetensorsName(t.dtype), " of shape ", Dims(sh.shape), " is ", bytes,
                   " bytes");
      }
      if (sh.end > f.size || sh.begin < kSafetensorsPrefixBytes) {
        return err(where, " has byte range [", sh.begin, ", ", sh.end, ") outside the data of '",
                   f.name, "' (", f.size, " bytes)");
      }
      const uint64_t chunks = (bytes + m.chunk_bytes - 1) / m.chunk_bytes;
      if (sh.chunk_checksums.size() != chunks) {
        return err(where, " has ", sh.chunk_checksums.size(), " chunk checksums; ", bytes,
                   " bytes in chunks of ", m.chunk_bytes, " need ", chunks);
      }
      for (const std::string& c : sh.chunk_checksums)
        STRATA_RETURN_IF_ERROR(check_digest(c, where));
      if (bytes > 0) {
        used[static_cast<size_t>(sh.file)].emplace_back(sh.begin, sh.end);
        used_by[static_cast<size_t>(sh.file)].push_back(&t.key);
      }
      for (size_t sj = 0; sj < si; ++sj) {
        if (BoxesOverlap(sh, t.shards[sj])) {
          return err("tensor '", t.key, "': shards at offsets ", Dims(t.shards[sj].offset), " and ",
                     Dims(sh.offset), " overlap");
        }
      }
      covered += Volume(sh.shape);
    }
    const uint64_t total = Volume(t.shape);
    if (covered != total) {
      return err("tensor '", t.key, "' of shape ", Dims(t.shape), " has ", total,
                 " elements but its shards cover ", covered);
    }
  }
  for (size_t fi = 0; fi < used.size(); ++fi) {
    std::vector<std::pair<uint64_t, uint64_t>>& r = used[fi];
    std::sort(r.begin(), r.end());
    for (size_t i = 1; i < r.size(); ++i) {
      if (r[i].first < r[i - 1].second) {
        return err("two shards share bytes [", r[i].first, ", ",
                   std::min(r[i].second, r[i - 1].second), ") of file '", m.files[fi].name, "'");
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace checkpoint_internal

absl::Status ValidateManifest(const Manifest& m, const ManifestLimits& limits) {
  return checkpoint_internal::ValidateManifestWithCode(m, limits, absl::StatusCode::kDataLoss);
}

// ---- serialization ------------------------------------------------------------

namespace {

absl::StatusOr<OrderedJson> EmbedJsonText(const std::string& text, absl::string_view field) {
  if (text.empty()) return OrderedJson(nullptr);
  const JsonContext ctx{absl::StrCat("TrainingState.", field), absl::StatusCode::kInvalidArgument};
  return checkpoint_internal::ParseJson(text, uint64_t{1} << 30, kMaxStateJsonDepth, ctx);
}

OrderedJson MeshToJson(const MeshSpec& s) {
  OrderedJson j;
  j["version"] = s.version;
  j["world_size"] = s.world_size;
  j["tp"] = s.tp;
  j["pp"] = s.pp;
  j["cp"] = s.cp;
  j["ep"] = s.ep;
  j["etp"] = s.etp;
  j["dp"] = s.dp;
  j["order"] = s.order;
  j["ranks_per_node"] = s.ranks_per_node;
  return j;
}

}  // namespace

namespace checkpoint_internal {

absl::StatusOr<std::string> SerializeManifestUnvalidated(const Manifest& m) {
  OrderedJson j;
  j["format"] = kManifestFormat;
  j["version"] = m.version;
  j["step"] = m.step;
  j["created"] = m.created;
  j["library_version"] = m.library_version;
  j["checksum"] = {{"algorithm", ChecksumAlgorithmName(m.checksum)},
                   {"chunk_bytes", m.chunk_bytes}};
  j["world_size"] = m.world_size;
  j["mesh"] = MeshToJson(m.mesh);
  OrderedJson st;
  st["version"] = m.state.version;
  st["step"] = m.step;
  st["optimizer_step"] = m.state.optimizer_step;
  STRATA_ASSIGN_OR_RETURN(st["lr_schedule"], EmbedJsonText(m.state.lr_schedule, "lr_schedule"));
  STRATA_ASSIGN_OR_RETURN(st["extra"], EmbedJsonText(m.state.extra, "extra"));
  j["state"] = std::move(st);
  OrderedJson ranks = OrderedJson::array();
  for (const RankState& r : m.ranks) {
    OrderedJson rj;
    rj["rank"] = r.rank;
    OrderedJson rng = OrderedJson::object();
    for (const auto& [name, bytes] : r.rng_states) rng[name] = absl::Base64Escape(bytes);
    rj["rng_states"] = std::move(rng);
    STRATA_ASSIGN_OR_RETURN(rj["data_loader"], EmbedJsonText(r.data_loader, "data_loader"));
    ranks.push_back(std::move(rj));
  }
  j["ranks"] = std::move(ranks);
  OrderedJson files = OrderedJson::array();
  for (const ManifestFile& f : m.files) {
    files.push_back(
        {{"name", f.name}, {"rank", f.rank}, {"size", f.size}, {"checksum", f.checksum}});
  }
  j["files"] = std::move(files);
  OrderedJson tensors = OrderedJson::array();
  for (const ManifestTensor& t : m.tensors) {
    OrderedJson tj;
    tj["key"] = t.key;
    tj["dtype"] = DataTypeSafetensorsName(t.dtype);
    tj["shape"] = t.shape;
    OrderedJson shards = OrderedJson::array();
    for (const ManifestShard& s : t.shards) {
      OrderedJson sj;
      sj["offset"] = s.offset;
      sj["shape"] = s.shape;
      sj["file"] = s.file;
      sj["byte_range"] = {s.begin, s.end};
      sj["chunk_checksums"] = s.chunk_checksums;
      shards.push_back(std::move(sj));
    }
    tj["shards"] = std::move(shards);
    tensors.push_back(std::move(tj));
  }
  j["tensors"] = std::move(tensors);
  STRATA_ASSIGN_OR_RETURN(std::string out, checkpoint_internal::DumpJson(j, 1));
  out += '\n';
  return out;
}

}  // namespace checkpoint_internal

absl::StatusOr<std::string> SerializeManifest(const Manifest& m) {
  STRATA_RETURN_IF_ERROR(ValidateManifest(m));
  return checkpoint_internal::SerializeManifestUnvalidated(m);
}

// ---- parsing --------------------------------------------------------------------

namespace {

absl::StatusOr<std::string> JsonTextField(const Json& obj, const char* key, absl::string_view path,
                                          const JsonContext& ctx) {
  STRATA_ASSIGN_OR_RETURN(const Json* v, checkpoint_internal::GetField(obj, key, path, ctx));
  if (v->is_null()) return std::string();
  return checkpoint_internal::DumpJson(*v);
}

absl::StatusOr<int> GetSmallInt(const Json& obj, const char* key, absl::string_view path,
                                const JsonContext& ctx) {
  STRATA_ASSIGN_OR_RETURN(int64_t v, GetInt(obj, key, path, ctx));
  if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max()) {
    return FieldError(ctx, absl::StrCat(path, ".", key), absl::StrCat("is ", v, ", out of range"));
  }
  return static_cast<int>(v);
}

absl::StatusOr<MeshSpec> ParseMesh(const Json& j, const JsonContext& ctx) {
  const std::string p = "mesh";
  STRATA_RETURN_IF_ERROR(checkpoint_internal::CheckKeys(
      j, {"version", "world_size", "tp", "pp", "cp", "ep", "etp", "dp", "order", "ranks_per_node"},
      p, ctx));
  MeshSpec s;
  STRATA_ASSIGN_OR_RETURN(s.version, GetSmallInt(j, "version", p, ctx));
  if (s.version > MeshSpec::kVersion) {
    return absl::UnimplementedError(absl::StrCat(ctx.what, ": mesh version ", s.version,
                                                 " is newer than this build reads (",
                                                 MeshSpec::kVersion, ")"));
  }
  if (s.version != MeshSpec::kVersion) {
    return FieldError(ctx, "mesh.version", absl::StrCat("is ", s.version));
  }
  STRATA_ASSIGN_OR_RETURN(s.world_size, GetSmallInt(j, "world_size", p, ctx));
  STRATA_ASSIGN_OR_RETURN(s.tp, GetSmallInt(j, "tp", p, ctx));
  STRATA_ASSIGN_OR_RETURN(s.pp, GetSmallInt(j, "pp", p, ctx));
  STRATA_ASSIGN_OR_RETURN(s.cp, GetSmallInt(j, "cp", p, ctx));
  STRATA_ASSIGN_OR_RETURN(s.ep, GetSmallInt(j, "ep", p, ctx));
  STRATA_ASSIGN_OR_RETURN(s.etp, GetSmallInt(j, "etp", p, ctx));
  STRATA_ASSIGN_OR_RETURN(s.dp, GetSmallInt(j, "dp", p, ctx));
  STRATA_ASSIGN_OR_RETURN(s.order, GetString(j, "order", p, ctx));
  STRATA_ASSIGN_OR_RETURN(s.ranks_per_node, GetSmallInt(j, "ranks_per_node", p, ctx));
  if (s.world_size < 1 || s.tp < 1 || s.pp < 1 || s.cp < 1 || s.ep < 1 || s.etp < 0 || s.dp < 0 ||
      s.ranks_per_node < 0 || s.order.size() > 64) {
    return FieldError(ctx, "mesh", "has a size out of range");
  }
  return s;
}

absl::StatusOr<ManifestShard> ParseShard(const Json& j, const std::string& p,
                                         const JsonContext& ctx) {
  if (!j.is_object()) return FieldError(ctx, p, "is not an object");
  STRATA_RETURN_IF_ERROR(checkpoint_internal::CheckKeys(
      j, {"offset", "shape", "file", "byte_range", "chunk_checksums"}, p, ctx));
  ManifestShard s;
  STRATA_ASSIGN_OR_RETURN(s.offset, GetDims(j, "offset", p, kMaxTensorDims, ctx));
  STRATA_ASSIGN_OR_RETURN(s.shape, GetDims(j, "shape", p, kMaxTensorDims, ctx));
  STRATA_ASSIGN_OR_RETURN(s.file, GetSmallInt(j, "file", p, ctx));
  STRATA_ASSIGN_OR_RETURN(const Json* range, GetArray(j, "byte_range", p, ctx));
  if (range->size() != 2) return FieldError(ctx, p + ".byte_range", "does not have 2 entries");
  STRATA_ASSIGN_OR_RETURN(s.begin, AsUInt((*range)[0], p + ".byte_range[0]", ctx));
  STRATA_ASSIGN_OR_RETURN(s.end, AsUInt((*range)[1], p + ".byte_range[1]", ctx));
  STRATA_ASSIGN_OR_RETURN(const Json* sums, GetArray(j, "chunk_checksums", p, ctx));
  s.chunk_checksums.reserve(sums->size());
  for (size_t i = 0; i < sums->size(); ++i) {
    if (!(*sums)[i].is_string()) {
      return FieldError(ctx, absl::StrCat(p, ".chunk_checksums[", i, "]"), "is not a string");
    }
    s.chunk_checksums.push_back((*sums)[i].get<std::string>());
  }
  return s;
}

}  // namespace

namespace checkpoint_internal {

absl::StatusOr<Manifest> ParseManifestUnvalidated(absl::string_view text, absl::string_view what,
                                                  const ManifestLimits& limits) {
  const JsonContext ctx{std::string(what), absl::StatusCode::kDataLoss};
  STRATA_ASSIGN_OR_RETURN(
      Json j, checkpoint_internal::ParseJson(text, limits.max_bytes, kMaxManifestDepth, ctx));
  if (!j.is_object()) return absl::DataLossError(absl::StrCat(what, " is not a JSON object"));
  const std::string p = "manifest";
  STRATA_ASSIGN_OR_RETURN(std::string format, GetString(j, "format", p, ctx));
  if (format != kManifestFormat) {
    return absl::DataLossError(absl::StrCat(what, " has format '", format.substr(0, 80), "', not '",
                                            kManifestFormat, "'"));
  }
  Manifest m;
  STRATA_ASSIGN_OR_RETURN(m.version, GetSmallInt(j, "version", p, ctx));
  if (m.version > Manifest::kVersion) {
    return absl::UnimplementedError(
        absl::StrCat(what, " has format version ", m.version,
                     ", written by a newer strata; this build reads version ", Manifest::kVersion));
  }
  if (m.version < 1) return FieldError(ctx, "manifest.version", absl::StrCat("is ", m.version));
  STRATA_RETURN_IF_ERROR(checkpoint_internal::CheckKeys(
      j,
      {"format", "version", "step", "created", "library_version", "checksum", "world_size", "mesh",
       "state", "ranks", "files", "tensors"},
      p, ctx));
  STRATA_ASSIGN_OR_RETURN(m.step, GetInt(j, "step", p, ctx));
  STRATA_ASSIGN_OR_RETURN(m.created, GetString(j, "created", p, ctx));
  STRATA_ASSIGN_OR_RETURN(m.library_version, GetString(j, "library_version", p, ctx));
  STRATA_ASSIGN_OR_RETURN(const Json* cs, GetObject(j, "checksum", p, ctx));
  STRATA_RETURN_IF_ERROR(
      checkpoint_internal::CheckKeys(*cs, {"algorithm", "chunk_bytes"}, "checksum", ctx));
  STRATA_ASSIGN_OR_RETURN(std::string alg, GetString(*cs, "algorithm", "checksum", ctx));
  absl::StatusOr<ChecksumAlgorithm> parsed_alg = ParseChecksumAlgorithm(alg);
  if (!parsed_alg.ok()) return FieldError(ctx, "checksum.algorithm", parsed_alg.status().message());
  m.checksum = *parsed_alg;
  STRATA_ASSIGN_OR_RETURN(m.chunk_bytes, GetUInt(*cs, "chunk_bytes", "checksum", ctx));
  STRATA_ASSIGN_OR_RETURN(m.world_size, GetSmallInt(j, "world_size", p, ctx));
  STRATA_ASSIGN_OR_RETURN(const Json* mesh, GetObject(j, "mesh", p, ctx));
  STRATA_ASSIGN_OR_RETURN(m.mesh, ParseMesh(*mesh, ctx));

  STRATA_ASSIGN_OR_RETURN(const Json* st, GetObject(j, "state", p, ctx));
  STRATA_RETURN_IF_ERROR(checkpoint_internal::CheckKeys(
      *st, {"version", "step", "optimizer_step", "lr_schedule", "extra"}, "state", ctx));
  STRATA_ASSIGN_OR_RETURN(m.state.version, GetSmallInt(*st, "version", "state", ctx));
  if (m.state.version > TrainingState::kVersion) {
    return absl::UnimplementedError(absl::StrCat(what, ": state version ", m.state.version,
                                                 " is newer than this build reads (",
                                                 TrainingState::kVersion, ")"));
  }
  if (m.state.version != TrainingState::kVersion) {
    return FieldError(ctx, "state.version", absl::StrCat("is ", m.state.version));
  }
  STRATA_ASSIGN_OR_RETURN(int64_t state_step, GetInt(*st, "step", "state", ctx));
  if (state_step != m.step) {
    return FieldError(ctx, "state.step",
                      absl::StrCat("is ", state_step, " but the manifest's step is ", m.step));
  }
  STRATA_ASSIGN_OR_RETURN(m.state.optimizer_step, GetInt(*st, "optimizer_step", "state", ctx));
  if (m.state.optimizer_step < -1) return FieldError(ctx, "state.optimizer_step", "is negative");
  STRATA_ASSIGN_OR_RETURN(m.state.lr_schedule, JsonTextField(*st, "lr_schedule", "state", ctx));
  STRATA_ASSIGN_OR_RETURN(m.state.extra, JsonTextField(*st, "extra", "state", ctx));
  m.state.step = m.step;
  m.state.mesh = m.mesh;
  m.state.library_version = m.library_version;

  STRATA_ASSIGN_OR_RETURN(const Json* ranks, GetArray(j, "ranks", p, ctx));
  for (size_t i = 0; i < ranks->size(); ++i) {
    const Json& rj = (*ranks)[i];
    const std::string rp = absl::StrCat("ranks[", i, "]");
    if (!rj.is_object()) return FieldError(ctx, rp, "is not an object");
    STRATA_RETURN_IF_ERROR(
        checkpoint_internal::CheckKeys(rj, {"rank", "rng_states", "data_loader"}, rp, ctx));
    RankState r;
    STRATA_ASSIGN_OR_RETURN(r.rank, GetSmallInt(rj, "rank", rp, ctx));
    STRATA_ASSIGN_OR_RETURN(const Json* rng, GetObject(rj, "rng_states", rp, ctx));
    for (auto it = rng->begin(); it != rng->end(); ++it) {
      std::string bytes;
      if (!it.value().is_string() || !absl::Base64Unescape(it.value().get<std::string>(), &bytes)) {
        return FieldError(ctx, absl::StrCat(rp, ".rng_states.", it.key()),
                          "is not a base64 string");
      }
      r.rng_states[it.key()] = std::move(bytes);
    }
    STRATA_ASSIGN_OR_RETURN(r.data_loader, JsonTextField(rj, "data_loader", rp, ctx));
    m.ranks.push_back(std::move(r));
  }
  std::sort(m.ranks.begin(), m.ranks.end(),
            [](const RankState& a, const RankState& b) { return a.rank < b.rank; });

  STRATA_ASSIGN_OR_RETURN(const Json* files, GetArray(j, "files", p, ctx));
  m.files.reserve(files->size());
  for (size_t i = 0; i < files->size(); ++i) {
    const Json& fj = (*files)[i];
    const std::string fp = absl::StrCat("files[", i, "]");
    if (!fj.is_object()) return FieldError(ctx, fp, "is not an object");
    STRATA_RETURN_IF_ERROR(
        checkpoint_internal::CheckKeys(fj, {"name", "rank", "size", "checksum"}, fp, ctx));
    ManifestFile f;
    STRATA_ASSIGN_OR_RETURN(f.name, GetString(fj, "name", fp, ctx));
    STRATA_ASSIGN_OR_RETURN(f.rank, GetSmallInt(fj, "rank", fp, ctx));
    STRATA_ASSIGN_OR_RETURN(f.size, GetUInt(fj, "size", fp, ctx));
    STRATA_ASSIGN_OR_RETURN(f.checksum, GetString(fj, "checksum", fp, ctx));
    m.files.push_back(std::move(f));
  }

  STRATA_ASSIGN_OR_RETURN(const Json* tensors, GetArray(j, "tensors", p, ctx));
  m.tensors.reserve(tensors->size());
  for (size_t i = 0; i < tensors->size(); ++i) {
    const Json& tj = (*tensors)[i];
    std::string tp = absl::StrCat("tensors[", i, "]");
    if (!tj.is_object()) return FieldError(ctx, tp, "is not an object");
    STRATA_RETURN_IF_ERROR(
        checkpoint_internal::CheckKeys(tj, {"key", "dtype", "shape", "shards"}, tp, ctx));
    ManifestTensor t;
    STRATA_ASSIGN_OR_RETURN(t.key, GetString(tj, "key", tp, ctx));
    tp = absl::StrCat("tensor '", t.key, "'");
    STRATA_ASSIGN_OR_RETURN(std::string dtype, GetString(tj, "dtype", tp, ctx));
    absl::StatusOr<DataType> dt = ParseSafetensorsDataType(dtype);
    if (!dt.ok()) return FieldError(ctx, tp + ".dtype", dt.status().message());
    t.dtype = *dt;
    STRATA_ASSIGN_OR_RETURN(t.shape, GetDims(tj, "shape", tp, kMaxTensorDims, ctx));
    STRATA_ASSIGN_OR_RETURN(const Json* shards, GetArray(tj, "shards", tp, ctx));
    if (shards->size() > limits.max_shards_per_tensor) {
      return FieldError(ctx, tp + ".shards",
                        absl::StrCat("has ", shards->size(), " entries, more than ",
                                     limits.max_shards_per_tensor));
    }
    t.shards.reserve(shards->size());
    for (size_t k = 0; k < shards->size(); ++k) {
      STRATA_ASSIGN_OR_RETURN(ManifestShard s,
                              ParseShard((*shards)[k], absl::StrCat(tp, ".shards[", k, "]"), ctx));
      t.shards.push_back(std::move(s));
    }
    m.tensors.push_back(std::move(t));
  }
  return m;
}

}  // namespace checkpoint_internal

absl::StatusOr<Manifest> ParseManifest(absl::string_view text, absl::string_view what,
                                       const ManifestLimits& limits) {
  STRATA_ASSIGN_OR_RETURN(Manifest m,
                          checkpoint_internal::ParseManifestUnvalidated(text, what, limits));
  absl::Status valid = ValidateManifest(m, limits);
  if (!valid.ok()) return internal::Annotate(valid, what);
  return m;
}

}  // namespace strata
