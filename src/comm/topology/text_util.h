// Small text helpers shared by the topology readers (internal).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace strata {
namespace topology_internal {

// Largest file any reader accepts; sysfs attributes are tiny, topology dumps
// and configuration files a few hundred KiB at most.
inline constexpr size_t kMaxTextFileBytes = 16u << 20;

// Reads `path` whole. NotFound / PermissionDenied / InvalidArgument (a
// directory, or larger than kMaxTextFileBytes), naming the path.
absl::StatusOr<std::string> ReadFile(const std::string& path);

// The first line of a sysfs attribute, trimmed, in *value; false when the
// file cannot be read (many attributes are optional).
bool ReadAttr(const std::string& path, std::string* value);

// Removes ANSI escape sequences (ESC [ ... letter), as nvidia-smi prints in
// terminals.
std::string StripAnsi(absl::string_view text);

// Splits on '\n', dropping a trailing '\r' on each line.
std::vector<absl::string_view> Lines(absl::string_view text);

// Parses a decimal int; false when `text` is not one (no partial parses).
bool ParseInt(absl::string_view text, int* value);

// "0000:17:00.0" from "00000000:17:00.0" or "0000:17:00.0", lower case.
std::string NormalizeBusId(absl::string_view bus_id);

}  // namespace topology_internal
}  // namespace strata
