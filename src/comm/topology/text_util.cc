#include "comm/topology/text_util.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace strata {
namespace topology_internal {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) {
    int err = errno;
    std::string what = absl::StrCat("cannot open ", path, ": ", std::strerror(err));
    if (err == ENOENT || err == ENOTDIR) return absl::NotFoundError(what);
    if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(what);
    return absl::InvalidArgumentError(what);
  }
  struct stat st;
  if (fstat(fileno(f.get()), &st) == 0 && S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is a directory, not a file"));
  }
  std::string out;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f.get())) > 0) {
    if (out.size() + n > kMaxTextFileBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, " is larger than ", kMaxTextFileBytes >> 20, " MiB"));
    }
    out.append(buf, n);
  }
  if (std::ferror(f.get())) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read ", path, ": ", std::strerror(errno)));
  }
  return out;
}

bool ReadAttr(const std::string& path, std::string* value) {
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) return false;
  char buf[4096];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f.get());
  // Reading an unused sysfs entry (a GID slot) fails with EINVAL.
  if (std::ferror(f.get())) return false;
  absl::string_view text(buf, n);
  text = text.substr(0, text.find('\n'));
  *value = std::string(absl::StripAsciiWhitespace(text));
  return true;
}

std::string StripAnsi(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\x1b' && i + 1 < text.size() && text[i + 1] == '[') {
      size_t j = i + 2;
      while (j < text.size() && !absl::ascii_isalpha(static_cast<unsigned char>(text[j]))) ++j;
      i = j;  // skips the final letter too
      continue;
    }
    out.push_back(text[i]);
  }
  return out;
}

std::vector<absl::string_view> Lines(absl::string_view text) {
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
  for (absl::string_view& l : lines) {
    if (!l.empty() && l.back() == '\r') l.remove_suffix(1);
  }
  if (!lines.empty() && lines.back().empty()) lines.pop_back();
  return lines;
}

bool ParseInt(absl::string_view text, int* value) {
  return absl::SimpleAtoi(absl::StripAsciiWhitespace(text), value);
}

std::string NormalizeBusId(absl::string_view bus_id) {
  std::string id = absl::AsciiStrToLower(absl::StripAsciiWhitespace(bus_id));
  // NVML prints an 8-digit domain; sysfs and NCCL use 4.
  size_t colon = id.find(':');
  if (colon == 8 && id.compare(0, 4, "0000") == 0) id.erase(0, 4);
  return id;
}

}  // namespace topology_internal
}  // namespace strata
