// This process's identity as the heartbeat publishes it, and a probe of
// another process of the same host through /proc: is it still there?
//
// A process is named by (boot id, pid, start time): the boot id tells
// whether it is on this host (two containers may share a hostname but not
// a kernel), the start time whether the pid was reused.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace strata::elastic::internal {

struct ProcessId {
  std::string host;     // hostname, for messages
  std::string boot_id;  // /proc/sys/kernel/random/boot_id
  int64_t pid = 0;
  uint64_t start_ticks = 0;  // /proc/<pid>/stat field 22

  std::string Encode() const;  // "host boot pid start"
  static absl::StatusOr<ProcessId> Decode(absl::string_view text);
};

// This process.
const ProcessId& Self();

enum class ProbeResult : uint8_t {
  kAlive,      // running (or sleeping)
  kStopped,    // stopped by a signal or traced (SIGSTOP)
  kGone,       // exited, a zombie, or its pid now names another process
  kOtherHost,  // cannot be probed from here
};

const char* ProbeResultName(ProbeResult r);

// Looks at `process` through /proc when it is on this host.
ProbeResult Probe(const ProcessId& process);

// Sends SIGKILL to `process` when it is on this host and still the same
// process. True when a signal was sent.
bool Fence(const ProcessId& process);

}  // namespace strata::elastic::internal
