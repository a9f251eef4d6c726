// A small XML reader for NCCL's topology files (internal): elements and
// attributes only; text, comments, processing instructions and DOCTYPE are
// skipped. Bounded (depth, element count, attribute count) so hostile input
// cannot exhaust memory or the stack; fuzzed (tests/fuzz/topology.cmake).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace strata {
namespace topology_internal {

struct XmlNode {
  std::string name;
  std::vector<std::pair<std::string, std::string>> attrs;  // entity references decoded
  std::vector<XmlNode> children;
  int line = 0;  // where the start tag begins, 1-based

  // The attribute's value, or nullptr.
  const std::string* Attr(absl::string_view key) const;
};

inline constexpr int kMaxXmlDepth = 64;
inline constexpr int kMaxXmlElements = 200000;
inline constexpr int kMaxXmlAttributes = 256;

// Parses a document; the result is a node named "" whose children are the
// top-level elements. InvalidArgument names the line and what was expected.
absl::StatusOr<XmlNode> ParseXml(absl::string_view text);

}  // namespace topology_internal
}  // namespace strata
