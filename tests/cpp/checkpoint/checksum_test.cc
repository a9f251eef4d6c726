// Checksums: digests match the reference tools (xxh128sum's canonical form,
// sha256sum), streaming equals one-shot, and names parse.
#include "strata/checkpoint/checksum.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstdio>

#include "test_util.h"

namespace strata {
namespace {

std::string ReferenceXxh128(const std::string& data) {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH3_128bits(data.data(), data.size()));
  std::string hex;
  for (unsigned char b : c.digest) {
    char buf[3];
    std::snprintf(buf, sizeof(buf), "%02x", b);
    hex += buf;
  }
  return hex;
}

TEST(ChecksumTest, MatchesReferences) {
  EXPECT_EQ(ChecksumHex(ChecksumAlgorithm::kSha256, "abc", 3),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(ChecksumHex(ChecksumAlgorithm::kSha256, "", 0),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  const std::vector<uint8_t> bytes = testing_util::RandomBytes(100000, 3);
  const std::string data(bytes.begin(), bytes.end());
  EXPECT_EQ(ChecksumHex(ChecksumAlgorithm::kXxh3_128, data.data(), data.size()),
            ReferenceXxh128(data));
}

TEST(ChecksumTest, StreamingEqualsOneShotAndDigestDoesNotConsume) {
  const std::vector<uint8_t> bytes = testing_util::RandomBytes(70001, 4);
  for (ChecksumAlgorithm a : {ChecksumAlgorithm::kXxh3_128, ChecksumAlgorithm::kSha256}) {
    Hasher h(a);
    for (size_t off = 0; off < bytes.size(); off += 999) {
      h.Update(bytes.data() + off, std::min<size_t>(999, bytes.size() - off));
      if (off == 999 * 7) (void)h.HexDigest();
    }
    EXPECT_EQ(h.HexDigest(), ChecksumHex(a, bytes.data(), bytes.size()));
    EXPECT_EQ(h.HexDigest().size(), ChecksumHexLength(a));
    h.Reset();
    EXPECT_EQ(h.HexDigest(), ChecksumHex(a, nullptr, 0));
  }
}

TEST(ChecksumTest, Names) {
  EXPECT_EQ(*ParseChecksumAlgorithm("XXH3-128"), ChecksumAlgorithm::kXxh3_128);
  EXPECT_EQ(*ParseChecksumAlgorithm("sha-256"), ChecksumAlgorithm::kSha256);
  EXPECT_EQ(ParseChecksumAlgorithm("crc32").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_STREQ(ChecksumAlgorithmName(ChecksumAlgorithm::kSha256), "sha256");
}

}  // namespace
}  // namespace strata
