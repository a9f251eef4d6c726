#include "strata/checkpoint/checksum.h"

#include <openssl/evp.h>
#include <xxhash.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "strata/base/status.h"

namespace strata {

const char* ChecksumAlgorithmName(ChecksumAlgorithm algorithm) {
  switch (algorithm) {
    case ChecksumAlgorithm::kXxh3_128:
      return "xxh3-128";
    case ChecksumAlgorithm::kSha256:
      return "sha256";
  }
  return "invalid";
}

absl::StatusOr<ChecksumAlgorithm> ParseChecksumAlgorithm(absl::string_view name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "xxh3-128" || n == "xxh3" || n == "xxh128" || n == "xxh3_128") {
    return ChecksumAlgorithm::kXxh3_128;
  }
  if (n == "sha256" || n == "sha-256") return ChecksumAlgorithm::kSha256;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown checksum algorithm '", name, "' (known: xxh3-128, sha256)"));
}

size_t ChecksumHexLength(ChecksumAlgorithm algorithm) {
  return algorithm == ChecksumAlgorithm::kSha256 ? 64 : 32;
}

struct Hasher::State {
  XXH3_state_t* xxh = nullptr;
  EVP_MD_CTX* sha = nullptr;
  ~State() {
    if (xxh != nullptr) XXH3_freeState(xxh);
    if (sha != nullptr) EVP_MD_CTX_free(sha);
  }
};

Hasher::Hasher(ChecksumAlgorithm algorithm)
    : algorithm_(algorithm), state_(std::make_unique<State>()) {
  if (algorithm_ == ChecksumAlgorithm::kSha256) {
    state_->sha = EVP_MD_CTX_new();
    STRATA_CHECK(state_->sha != nullptr, "EVP_MD_CTX_new failed (out of memory)");
  } else {
    state_->xxh = XXH3_createState();
    STRATA_CHECK(state_->xxh != nullptr, "XXH3_createState failed (out of memory)");
  }
  Reset();
}

Hasher::~Hasher() = default;

void Hasher::Reset() {
  if (state_->sha != nullptr) {
    STRATA_CHECK(EVP_DigestInit_ex(state_->sha, EVP_sha256(), nullptr) == 1,
                 "EVP_DigestInit_ex(sha256) failed");
  } else {
    XXH3_128bits_reset(state_->xxh);
  }
}

void Hasher::Update(const void* data, size_t size) {
  if (size == 0) return;
  if (state_->sha != nullptr) {
    STRATA_CHECK(EVP_DigestUpdate(state_->sha, data, size) == 1, "EVP_DigestUpdate failed");
  } else {
    XXH3_128bits_update(state_->xxh, data, size);
  }
}

namespace {

std::string Hex(const unsigned char* bytes, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = kDigits[bytes[i] >> 4];
    out[2 * i + 1] = kDigits[bytes[i] & 15];
  }
  return out;
}

}  // namespace

std::string Hasher::HexDigest() const {
  if (state_->sha != nullptr) {
    // Finalizing consumes the context, so finalize a copy.
    EVP_MD_CTX* copy = EVP_MD_CTX_new();
    STRATA_CHECK(copy != nullptr, "EVP_MD_CTX_new failed (out of memory)");
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int len = 0;
    const bool ok =
        EVP_MD_CTX_copy_ex(copy, state_->sha) == 1 && EVP_DigestFinal_ex(copy, md, &len) == 1;
    EVP_MD_CTX_free(copy);
    STRATA_CHECK(ok, "EVP_DigestFinal_ex failed");
    return Hex(md, len);
  }
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(state_->xxh));
  return Hex(canonical.digest, sizeof(canonical.digest));
}

std::string ChecksumHex(ChecksumAlgorithm algorithm, const void* data, size_t size) {
  Hasher h(algorithm);
  h.Update(data, size);
  return h.HexDigest();
}

}  // namespace strata
