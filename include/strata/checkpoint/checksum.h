// Checksums of checkpoint files and shards.
//
// Every checkpoint file and every chunk of every shard carries a checksum in
// the manifest. xxh3-128 is the default (fast enough to hash at memory speed
// while writing); SHA-256 is the option for those who want a cryptographic
// hash. Digests are lowercase hex: xxh3-128 in its canonical (big-endian)
// form, so `xxh128sum file` prints the same string; SHA-256 as `sha256sum`.
//
//   strata::Hasher h(strata::ChecksumAlgorithm::kXxh3_128);
//   h.Update(data, size);
//   std::string hex = h.HexDigest();   // 32 hex digits
//
// Thread-safety: a Hasher is thread-compatible (one thread at a time).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "strata/base/export.h"

namespace strata {

enum class ChecksumAlgorithm : uint8_t { kXxh3_128, kSha256 };

// "xxh3-128" or "sha256".
STRATA_EXPORT const char* ChecksumAlgorithmName(ChecksumAlgorithm algorithm);
// Parses the names above (case-insensitive; "xxh3", "xxh128", "sha-256" too).
STRATA_EXPORT absl::StatusOr<ChecksumAlgorithm> ParseChecksumAlgorithm(absl::string_view name);
// Number of hex digits of a digest: 32 (xxh3-128) or 64 (sha256).
STRATA_EXPORT size_t ChecksumHexLength(ChecksumAlgorithm algorithm);

// A streaming hash. Reset() starts over; HexDigest() does not change the
// state, so it may be called at any point.
class STRATA_EXPORT Hasher {
 public:
  explicit Hasher(ChecksumAlgorithm algorithm);
  ~Hasher();
  Hasher(const Hasher&) = delete;
  Hasher& operator=(const Hasher&) = delete;

  ChecksumAlgorithm algorithm() const { return algorithm_; }
  void Reset();
  void Update(const void* data, size_t size);
  std::string HexDigest() const;

 private:
  struct State;
  ChecksumAlgorithm algorithm_;
  std::unique_ptr<State> state_;
};

// One-shot digest of a buffer.
STRATA_EXPORT std::string ChecksumHex(ChecksumAlgorithm algorithm, const void* data, size_t size);

}  // namespace strata
