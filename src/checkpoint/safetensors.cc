#include "strata/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <limits>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/internal/file_util.h"
#include "checkpoint/internal/json_util.h"
#include "strata/base/status.h"
#include "strata/checkpoint/sharded_tensor.h"

namespace strata {

using checkpoint_internal::FieldError;
using checkpoint_internal::Json;
using checkpoint_internal::JsonContext;
using checkpoint_internal::OrderedJson;

namespace {

// The header is an object of objects holding a shape array: 3 levels.
constexpr int kMaxHeaderDepth = 3;

// Bytes of a tensor, or an error when the count overflows uint64.
absl::StatusOr<uint64_t> TensorBytes(const std::vector<int64_t>& shape, DataType dtype,
                                     absl::string_view name, absl::StatusCode code) {
  uint64_t n = DataTypeSize(dtype);
  for (int64_t d : shape) {
    const uint64_t u = static_cast<uint64_t>(d);
    if (u != 0 && n > std::numeric_limits<uint64_t>::max() / u) {
      return absl::Status(code,
                          absl::StrCat("tensor '", name, "' of shape [", absl::StrJoin(shape, ", "),
                                       "] has a byte size that overflows 64 bits"));
    }
    n *= u;
  }
  // Dims are also limited so that the element count fits in int64.
  if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::Status(code, absl::StrCat("tensor '", name, "' of shape [",
                                           absl::StrJoin(shape, ", "), "] is too large"));
  }
  return n;
}

}  // namespace

const SafetensorsEntry* SafetensorsHeader::Find(absl::string_view name) const {
  for (const SafetensorsEntry& e : entries) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

absl::StatusOr<DataType> ParseSafetensorsDataType(absl::string_view name) {
  for (DataType t : kAllDataTypes) {
    if (name == DataTypeSafetensorsName(t)) return t;
  }
  std::vector<std::string> known;
  for (DataType t : kAllDataTypes) known.push_back(DataTypeSafetensorsName(t));
  return absl::InvalidArgumentError(absl::StrCat("safetensors dtype '", name,
                                                 "' is not one strata reads (it reads ",
                                                 absl::StrJoin(known, ", "), ")"));
}

absl::StatusOr<SafetensorsLayout> BuildSafetensorsHeader(
    std::vector<SafetensorsEntry> entries,
    std::vector<std::pair<std::string, std::string>> metadata,
    const SafetensorsWriteOptions& options) {
  const uint64_t align = options.alignment;
  if (align < 8 || (align & (align - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors alignment ", align, " is not a power of two >= 8"));
  }
  // Largest elements first: every tensor then starts at a multiple of its
  // element size, because all sizes are powers of two.
  std::stable_sort(entries.begin(), entries.end(),
                   [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
                     const size_t sa = DataTypeSize(a.dtype), sb = DataTypeSize(b.dtype);
                     if (sa != sb) return sa > sb;
                     return a.name < b.name;
                   });
  OrderedJson j = OrderedJson::object();
  std::sort(metadata.begin(), metadata.end());
  if (!metadata.empty()) {
    OrderedJson m = OrderedJson::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    j["__metadata__"] = std::move(m);
  }
  std::set<absl::string_view> seen;
  uint64_t offset = 0;
  for (SafetensorsEntry& e : entries) {
    if (e.name.empty() || e.name == "__metadata__") {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors tensor name '", e.name, "' is empty or reserved"));
    }
    if (!seen.insert(e.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors tensor name '", e.name, "' appears twice"));
    }
    for (int64_t d : e.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", e.name, "' has a negative dimension ", d));
      }
    }
    STRATA_ASSIGN_OR_RETURN(
        uint64_t bytes, TensorBytes(e.shape, e.dtype, e.name, absl::StatusCode::kInvalidArgument));
    e.begin = offset;
    e.end = offset + bytes;
    offset = e.end;
    OrderedJson t = OrderedJson::object();
    t["dtype"] = DataTypeSafetensorsName(e.dtype);
    t["shape"] = e.shape;
    t["data_offsets"] = {e.begin, e.end};
    j[e.name] = std::move(t);
  }
  STRATA_ASSIGN_OR_RETURN(std::string json, checkpoint_internal::DumpJson(j));
  const uint64_t unpadded = kSafetensorsPrefixBytes + json.size();
  const uint64_t total = (unpadded + align - 1) / align * align;
  json.append(total - unpadded, ' ');
  SafetensorsLayout out;
  const uint64_t n = json.size();
  out.bytes.resize(kSafetensorsPrefixBytes);
  for (int i = 0; i < 8; ++i) out.bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out.bytes += json;
  out.header.entries = std::move(entries);
  out.header.metadata = std::move(metadata);
  out.header.data_start = total;
  out.header.data_bytes = offset;
  return out;
}

absl::StatusOr<uint64_t> ParseSafetensorsPrefix(absl::string_view prefix, uint64_t file_size,
                                                const SafetensorsLimits& limits) {
  if (prefix.size() < kSafetensorsPrefixBytes || file_size < kSafetensorsPrefixBytes) {
    return absl::DataLossError(absl::StrCat("not a safetensors file: ", file_size,
                                            " bytes, shorter than the 8-byte header length"));
  }
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i)
    n |= static_cast<uint64_t>(static_cast<unsigned char>(prefix[i])) << (8 * i);
  if (n > limits.max_header_bytes) {
    return absl::DataLossError(absl::StrCat("safetensors header length ", n,
                                            " exceeds the limit of ", limits.max_header_bytes,
                                            " bytes"));
  }
  if (n > file_size - kSafetensorsPrefixBytes) {
    return absl::DataLossError(absl::StrCat("safetensors header length ", n,
                                            " runs past the end of the ", file_size,
                                            "-byte file (truncated?)"));
  }
  if (n < 2) {
    return absl::DataLossError(
        absl::StrCat("safetensors header length ", n, " is too short for a JSON object"));
  }
  return n;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view json, uint64_t file_size,
                                                         const SafetensorsLimits& limits) {
  const JsonContext ctx{"safetensors header", absl::StatusCode::kDataLoss};
  if (json.empty() || json[0] != '{') {
    return absl::DataLossError("safetensors header does not start with '{'");
  }
  if (file_size < kSafetensorsPrefixBytes + json.size()) {
    return absl::DataLossError(absl::StrCat("safetensors header of ", json.size(),
                                            " bytes does not fit in a file of ", file_size,
                                            " bytes"));
  }
  STRATA_ASSIGN_OR_RETURN(
      Json j, checkpoint_internal::ParseJson(json, limits.max_header_bytes, kMaxHeaderDepth, ctx));
  if (!j.is_object()) return absl::DataLossError("safetensors header is not a JSON object");
  SafetensorsHeader h;
  h.data_start = kSafetensorsPrefixBytes + json.size();
  const uint64_t data_bytes = file_size - h.data_start;
  h.entries.reserve(j.size());
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const Json& v = it.value();
    const std::string path = absl::StrCat("tensor '", name, "'");
    if (name == "__metadata__") {
      if (!v.is_object()) return FieldError(ctx, "__metadata__", "is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return FieldError(ctx, absl::StrCat("__metadata__.", m.key()), "is not a string");
        }
        h.metadata.emplace_back(m.key(), m.value().get<std::string>());
      }
      continue;
    }
    if (!v.is_object()) return FieldError(ctx, path, "is not an object");
    STRATA_RETURN_IF_ERROR(
        checkpoint_internal::CheckKeys(v, {"dtype", "shape", "data_offsets"}, path, ctx));
    SafetensorsEntry e;
    e.name = name;
    STRATA_ASSIGN_OR_RETURN(std::string dtype,
                            checkpoint_internal::GetString(v, "dtype", path, ctx));
    absl::StatusOr<DataType> t = ParseSafetensorsDataType(dtype);
    if (!t.ok()) return absl::DataLossError(absl::StrCat(path, ": ", t.status().message()));
    e.dtype = *t;
    STRATA_ASSIGN_OR_RETURN(e.shape,
                            checkpoint_internal::GetDims(v, "shape", path, kMaxTensorDims, ctx));
    STRATA_ASSIGN_OR_RETURN(const Json* offsets,
                            checkpoint_internal::GetArray(v, "data_offsets", path, ctx));
    if (offsets->size() != 2) {
      return FieldError(ctx, path,
                        absl::StrCat("data_offsets has ", offsets->size(), " entries, not 2"));
    }
    STRATA_ASSIGN_OR_RETURN(
        e.begin, checkpoint_internal::AsUInt((*offsets)[0], path + ".data_offsets[0]", ctx));
    STRATA_ASSIGN_OR_RETURN(
        e.end, checkpoint_internal::AsUInt((*offsets)[1], path + ".data_offsets[1]", ctx));
    if (e.begin > e.end) {
      return FieldError(
          ctx, path,
          absl::StrCat("has data_offsets [", e.begin, ", ", e.end, "]: begin after end"));
    }
    if (e.end > data_bytes) {
      return FieldError(
          ctx, path,
          absl::StrCat("has data_offsets [", e.begin, ", ", e.end, "] past the end of the ",
                       data_bytes, "-byte data section (truncated file?)"));
    }
    STRATA_ASSIGN_OR_RETURN(uint64_t bytes,
                            TensorBytes(e.shape, e.dtype, name, absl::StatusCode::kDataLoss));
    if (bytes != e.end - e.begin) {
      return FieldError(ctx, path,
                        absl::StrCat("is ", dtype, " of shape [", absl::StrJoin(e.shape, ", "),
                                     "] = ", bytes, " bytes, but data_offsets [", e.begin, ", ",
                                     e.end, "] hold ", e.end - e.begin));
    }
    h.entries.push_back(std::move(e));
  }
  std::sort(h.metadata.begin(), h.metadata.end());
  std::sort(h.entries.begin(), h.entries.end(),
            [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
              return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
            });
  // The tensors must tile the data section.
  uint64_t expect = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const SafetensorsEntry& e : h.entries) {
    if (e.begin != expect) {
      return absl::DataLossError(
          e.begin > expect
              ? absl::StrCat("safetensors data has a hole: bytes [", expect, ", ", e.begin,
                             ") belong to no tensor (before tensor '", e.name, "')")
              : absl::StrCat("safetensors tensors '", prev->name, "' and '", e.name,
                             "' overlap at data offset ", e.begin));
    }
    expect = e.end;
    prev = &e;
  }
  if (expect != data_bytes) {
    return absl::DataLossError(absl::StrCat("safetensors data section is ", data_bytes,
                                            " bytes but the tensors cover ", expect,
                                            " (trailing bytes or a truncated file)"));
  }
  h.data_bytes = data_bytes;
  return h;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensors(absl::string_view head, uint64_t file_size,
                                                   const SafetensorsLimits& limits) {
  STRATA_ASSIGN_OR_RETURN(uint64_t n, ParseSafetensorsPrefix(head, file_size, limits));
  if (head.size() < kSafetensorsPrefixBytes + n) {
    return absl::DataLossError(absl::StrCat("safetensors header of ", n, " bytes but only ",
                                            head.size() - kSafetensorsPrefixBytes, " available"));
  }
  return ParseSafetensorsHeader(head.substr(kSafetensorsPrefixBytes, n), file_size, limits);
}

// ---- SafetensorsFile --------------------------------------------------------

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept
    : fd_(o.fd_),
      path_(std::move(o.path_)),
      file_size_(o.file_size_),
      header_(std::move(o.header_)) {
  o.fd_ = -1;
}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    path_ = std::move(o.path_);
    file_size_ = o.file_size_;
    header_ = std::move(o.header_);
    o.fd_ = -1;
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path,
                                                      const SafetensorsLimits& limits) {
  STRATA_ASSIGN_OR_RETURN(checkpoint_internal::File f,
                          checkpoint_internal::File::OpenForRead(path));
  STRATA_ASSIGN_OR_RETURN(uint64_t size, f.Size());
  char prefix[kSafetensorsPrefixBytes] = {};
  if (size >= kSafetensorsPrefixBytes) {
    STRATA_RETURN_IF_ERROR(f.ReadAt(prefix, sizeof(prefix), 0));
  }
  const absl::string_view pv(prefix, size >= kSafetensorsPrefixBytes ? sizeof(prefix) : 0);
  absl::StatusOr<uint64_t> n = ParseSafetensorsPrefix(pv, size, limits);
  if (!n.ok()) return internal::Annotate(n.status(), path);
  std::string json(*n, '\0');
  STRATA_RETURN_IF_ERROR(f.ReadAt(json.data(), json.size(), kSafetensorsPrefixBytes));
  absl::StatusOr<SafetensorsHeader> h = ParseSafetensorsHeader(json, size, limits);
  if (!h.ok()) return internal::Annotate(h.status(), path);
  SafetensorsFile out;
  out.fd_ = ::dup(f.fd());
  if (out.fd_ < 0) return checkpoint_internal::ErrnoError(errno, "cannot dup", path);
  out.path_ = path;
  out.file_size_ = size;
  out.header_ = std::move(*h);
  return out;
}

absl::Status SafetensorsFile::ReadBytes(uint64_t offset, void* dst, uint64_t size) const {
  if (offset > file_size_ || size > file_size_ - offset) {
    return absl::OutOfRangeError(absl::StrCat("bytes [", offset, ", ", offset + size,
                                              ") are outside '", path_, "' (", file_size_,
                                              " bytes)"));
  }
  return checkpoint_internal::ReadFully(fd_, path_, dst, size, offset);
}

absl::Status SafetensorsFile::Read(absl::string_view name, void* dst, uint64_t size) const {
  const SafetensorsEntry* e = header_.Find(name);
  if (e == nullptr) {
    return absl::NotFoundError(absl::StrCat("tensor '", name, "' is not in '", path_, "'"));
  }
  if (size != e->end - e->begin) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' in '", path_, "' is ",
                                                   e->end - e->begin, " bytes, not ", size));
  }
  return ReadBytes(header_.data_start + e->begin, dst, size);
}

}  // namespace strata
