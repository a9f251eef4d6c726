// The safetensors file format: writer of headers, hardened parser, and a
// reader of whole files.
//
// A safetensors file is an 8-byte little-endian header length N, N bytes of
// JSON header, then the data section. The header maps each tensor name to
// {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the
// data section) plus an optional "__metadata__" object of strings. The
// tensors must tile the data section exactly: no holes, no overlaps.
//
// strata writes headers padded with spaces so the data section starts at a
// multiple of `alignment` (4096 by default, so staging buffers can be written
// page-aligned), and orders tensors by element size, largest first, so each
// tensor is aligned to its element size, as the reference writer does.
//
// The parser treats its input as hostile: the header length is bounded
// (SafetensorsLimits), the JSON nesting depth is checked before parsing,
// every integer is range-checked, byte sizes are computed with overflow
// checks and must match dtype x shape, and the offsets must tile the data
// section of the file. Any violation is a DataLoss error naming the tensor
// and the values; the parser never allocates more than a small multiple of
// the header length.
//
//   absl::StatusOr<strata::SafetensorsFile> f = strata::SafetensorsFile::Open(path);
//   for (const strata::SafetensorsEntry& e : f->header().entries) { ... }
//   std::vector<float> w(n);
//   STRATA_RETURN_IF_ERROR(f->Read("weight", w.data(), w.size() * sizeof(float)));
//
// Thread-safety: the functions are pure; a SafetensorsFile may be read from
// several threads at once (pread).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "strata/base/dtype.h"
#include "strata/base/export.h"

namespace strata {

// Bytes of the length prefix.
inline constexpr uint64_t kSafetensorsPrefixBytes = 8;

struct STRATA_EXPORT SafetensorsEntry {
  std::string name;
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;
  // [begin, end) relative to the start of the data section.
  uint64_t begin = 0;
  uint64_t end = 0;
};

struct STRATA_EXPORT SafetensorsHeader {
  // Sorted by begin offset.
  std::vector<SafetensorsEntry> entries;
  // The "__metadata__" object, sorted by key.
  std::vector<std::pair<std::string, std::string>> metadata;
  // Absolute file offset of the data section: 8 + header length.
  uint64_t data_start = 0;
  // Bytes of the data section (the sum of the entries' sizes).
  uint64_t data_bytes = 0;

  // The entry named `name`, or nullptr.
  const SafetensorsEntry* Find(absl::string_view name) const;
};

struct STRATA_EXPORT SafetensorsLimits {
  // Largest accepted header; the reference implementation uses 100 MB too.
  uint64_t max_header_bytes = uint64_t{100} << 20;
};

struct STRATA_EXPORT SafetensorsWriteOptions {
  // The data section starts at a multiple of this (a power of two >= 8).
  uint64_t alignment = 4096;
};

// A header ready to write: `bytes` is the length prefix, the JSON and the
// padding (so header.data_start == bytes.size()); the data follows.
struct STRATA_EXPORT SafetensorsLayout {
  std::string bytes;
  SafetensorsHeader header;
};

// Lays out `entries` (their begin/end are ignored and assigned here) in the
// order described above and serializes the header. InvalidArgument on an
// empty or duplicate name, the reserved name "__metadata__", a size that
// overflows, or a bad alignment.
STRATA_EXPORT absl::StatusOr<SafetensorsLayout> BuildSafetensorsHeader(
    std::vector<SafetensorsEntry> entries,
    std::vector<std::pair<std::string, std::string>> metadata,
    const SafetensorsWriteOptions& options = {});

// Reads the length prefix (the first 8 bytes) of a file of `file_size`
// bytes and returns the header length, checked against the limits and the
// file size.
STRATA_EXPORT absl::StatusOr<uint64_t> ParseSafetensorsPrefix(absl::string_view prefix,
                                                              uint64_t file_size,
                                                              const SafetensorsLimits& limits = {});

// Parses the JSON header (exactly the N bytes after the prefix) of a file of
// `file_size` bytes and checks it against that size.
STRATA_EXPORT absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(
    absl::string_view json, uint64_t file_size, const SafetensorsLimits& limits = {});

// Prefix and header from `head`, the first bytes of a file of `file_size`
// bytes (head may hold the whole file). DataLoss if head is too short.
STRATA_EXPORT absl::StatusOr<SafetensorsHeader> ParseSafetensors(
    absl::string_view head, uint64_t file_size, const SafetensorsLimits& limits = {});

// The safetensors dtype name for a DataType ("F32", "BF16", ...) and back;
// InvalidArgument for a name strata does not read ("U16", "F8_E4M3", ...).
STRATA_EXPORT absl::StatusOr<DataType> ParseSafetensorsDataType(absl::string_view name);

// An open safetensors file with its parsed header.
class STRATA_EXPORT SafetensorsFile {
 public:
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path,
                                              const SafetensorsLimits& limits = {});
  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  uint64_t file_size() const { return file_size_; }
  const SafetensorsHeader& header() const { return header_; }

  // Reads tensor `name` into `dst` (`size` must equal its byte size).
  absl::Status Read(absl::string_view name, void* dst, uint64_t size) const;
  // Reads `size` bytes at absolute file offset `offset`.
  absl::Status ReadBytes(uint64_t offset, void* dst, uint64_t size) const;

 private:
  SafetensorsFile() = default;
  int fd_ = -1;
  std::string path_;
  uint64_t file_size_ = 0;
  SafetensorsHeader header_;
};

}  // namespace strata
