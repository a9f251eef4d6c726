// Process identity and /proc probes (process.h).
#include "elastic/internal/process.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace strata::elastic::internal {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// State letter and start time of /proc/<pid>/stat; false when absent. The
// command name (field 2) may hold spaces and parentheses: fields are counted
// after its last ')'.
bool ReadStat(int64_t pid, char* state, uint64_t* start) {
  const std::string stat = ReadFile(absl::StrCat("/proc/", pid, "/stat"));
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return false;
  std::vector<absl::string_view> fields =
      absl::StrSplit(absl::string_view(stat).substr(close + 1), ' ', absl::SkipEmpty());
  // fields[0] is field 3 (state); field 22 (starttime) is fields[19].
  if (fields.size() < 20) return false;
  *state = fields[0].empty() ? '?' : fields[0][0];
  return absl::SimpleAtoi(fields[19], start);
}

ProcessId MakeSelf() {
  ProcessId id;
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) == 0) id.host = host;
  if (id.host.empty()) id.host = "?";
  id.boot_id = std::string(absl::StripAsciiWhitespace(ReadFile("/proc/sys/kernel/random/boot_id")));
  if (id.boot_id.empty()) id.boot_id = "?";
  id.pid = getpid();
  char state = 0;
  if (!ReadStat(id.pid, &state, &id.start_ticks)) id.start_ticks = 0;
  return id;
}

}  // namespace

std::string ProcessId::Encode() const {
  return absl::StrCat(host, " ", boot_id, " ", pid, " ", start_ticks);
}

absl::StatusOr<ProcessId> ProcessId::Decode(absl::string_view text) {
  std::vector<std::string> parts = absl::StrSplit(text, ' ', absl::SkipEmpty());
  ProcessId id;
  if (parts.size() != 4 || !absl::SimpleAtoi(parts[2], &id.pid) ||
      !absl::SimpleAtoi(parts[3], &id.start_ticks)) {
    return absl::InvalidArgumentError(absl::StrCat("bad process record '", text, "'"));
  }
  id.host = parts[0];
  id.boot_id = parts[1];
  return id;
}

const ProcessId& Self() {
  // Computed once per process; the pid of a forked child differs, so the
  // record is rebuilt when it does.
  thread_local ProcessId cached;
  if (cached.pid != getpid()) cached = MakeSelf();
  return cached;
}

const char* ProbeResultName(ProbeResult r) {
  switch (r) {
    case ProbeResult::kAlive:
      return "alive";
    case ProbeResult::kStopped:
      return "stopped";
    case ProbeResult::kGone:
      return "gone";
    case ProbeResult::kOtherHost:
      return "on another host";
  }
  return "?";
}

ProbeResult Probe(const ProcessId& process) {
  const ProcessId& me = Self();
  if (process.boot_id != me.boot_id || process.boot_id == "?") return ProbeResult::kOtherHost;
  char state = 0;
  uint64_t start = 0;
  if (!ReadStat(process.pid, &state, &start)) return ProbeResult::kGone;
  if (start != process.start_ticks) return ProbeResult::kGone;  // the pid was reused
  if (state == 'Z' || state == 'X' || state == 'x') return ProbeResult::kGone;
  if (state == 'T' || state == 't') return ProbeResult::kStopped;
  return ProbeResult::kAlive;
}

bool Fence(const ProcessId& process) {
  const ProbeResult r = Probe(process);
  if (r != ProbeResult::kAlive && r != ProbeResult::kStopped) return false;
  if (process.pid == Self().pid) return false;
  return ::kill(static_cast<pid_t>(process.pid), SIGKILL) == 0;
}

}  // namespace strata::elastic::internal
