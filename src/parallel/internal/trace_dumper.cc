#include "parallel/internal/trace_dumper.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "strata/base/status.h"

namespace strata::internal {
namespace {

constexpr char kQuit = 'q';
constexpr char kError = 'e';
constexpr char kSignal = 's';

// The store keys: the number of requests so far, and who made the last.
constexpr const char* kRequestCount = "dump_request";
constexpr const char* kRequestBy = "dump_request_by";

// SIGUSR1 is process-wide, so its handler's target is too: the write end of
// the pipe of the TraceDumper that installed it (-1: none). The handler
// only writes one byte there (async-signal-safe).
std::atomic<int> signal_fd{-1};
struct sigaction previous_action;

extern "C" void OnSigusr1(int /*signo*/) {
  const int saved = errno;
  const int fd = signal_fd.load(std::memory_order_acquire);
  if (fd >= 0) {
    const char c = kSignal;
    [[maybe_unused]] ssize_t n = write(fd, &c, 1);
  }
  errno = saved;
}

// Installs the handler when SIGUSR1 has its default disposition and no
// other TraceDumper holds it; returns whether it did.
bool InstallSignal(int fd) {
  struct sigaction current;
  if (sigaction(SIGUSR1, nullptr, &current) != 0) return false;
  if (current.sa_handler != SIG_DFL || (current.sa_flags & SA_SIGINFO) != 0) return false;
  int expected = -1;
  if (!signal_fd.compare_exchange_strong(expected, fd)) return false;
  struct sigaction action;
  std::memset(&action, 0, sizeof(action));
  action.sa_handler = OnSigusr1;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  if (sigaction(SIGUSR1, &action, &previous_action) != 0) {
    signal_fd.store(-1);
    return false;
  }
  return true;
}

void UninstallSignal() {
  sigaction(SIGUSR1, &previous_action, nullptr);
  signal_fd.store(-1, std::memory_order_release);
}

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::string(v) : std::string();
}

// A name for the job that every rank of it agrees on.
std::string JobId() {
  std::string id;
  if (std::string ns = Env("PMIX_NAMESPACE"); !ns.empty()) {
    id = ns;  // Open MPI 5 (PRRTE): "prterun-host-1234@1"
  } else if (std::string job = Env("OMPI_MCA_ess_base_jobid"); !job.empty()) {
    id = absl::StrCat("ompi-", job);
  } else if (std::string run = Env("TORCHELASTIC_RUN_ID"); !run.empty() && run != "none") {
    id = absl::StrCat("torchrun-", run);
  } else if (std::string port = Env("MASTER_PORT"); !Env("TORCHELASTIC_RUN_ID").empty()) {
    id = absl::StrCat("torchrun-", Env("MASTER_ADDR"), "-", port);
  } else if (std::string slurm = Env("SLURM_JOB_ID"); !slurm.empty()) {
    id = absl::StrCat("slurm-", slurm, "-", Env("SLURM_STEP_ID"));
  } else {
    id = absl::StrCat("pid-", getpid());
  }
  for (char& c : id) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') {
      c = '-';
    }
  }
  return id;
}

}  // namespace

std::string TraceDumper::DefaultDir() {
  std::string tmp = Env("TMPDIR");
  if (tmp.empty()) tmp = "/tmp";
  return (std::filesystem::path(tmp) / absl::StrCat("strata-trace-", JobId())).string();
}

TraceDumper::TraceDumper(TraceDumperOptions options) : options_(std::move(options)) {}

void TraceDumper::ErrorHook::Fire(const observe::OpRecord& record) {
  // The write is under the lock, so the dumper cannot close the pipe
  // meanwhile.
  std::lock_guard<std::mutex> lock(mu);
  if (!first_error.empty()) return;  // one dump for the first failure
  first_error = record.status.ToString();
  const int f = fd.load(std::memory_order_acquire);
  if (f >= 0) {
    const char c = kError;
    [[maybe_unused]] ssize_t n = write(f, &c, 1);
  }
}

absl::StatusOr<std::unique_ptr<TraceDumper>> TraceDumper::Start(
    std::shared_ptr<observe::FlightRecorder> recorder, std::shared_ptr<ErrorHook> hook,
    TraceDumperOptions options) {
  std::unique_ptr<TraceDumper> d(new TraceDumper(std::move(options)));
  d->recorder_ = std::move(recorder);
  d->hook_ = std::move(hook);
  STRATA_RETURN_IF_ERROR(d->Open());
  return d;
}

absl::StatusOr<std::shared_ptr<Store>> TraceDumper::RequestStore(bool create) {
  std::lock_guard<std::mutex> lock(store_mu_);
  if (store_ != nullptr) return store_;
  const std::filesystem::path path = std::filesystem::path(options_.dir) / ".requests";
  std::error_code ec;
  // Nothing is created until a request or a dump: a job that never fails
  // leaves no folder behind.
  if (!create && !std::filesystem::exists(path, ec)) return std::shared_ptr<Store>();
  FileStoreOptions so;
  so.path = path.string();
  absl::StatusOr<std::shared_ptr<Store>> store = OpenFileStore(so);
  if (!store.ok()) {
    return absl::Status(store.status().code(),
                        absl::StrCat("flight recorder: the trace directory ", options_.dir,
                                     " (STRATA_TRACE_DIR) cannot hold the dump requests: ",
                                     store.status().message()));
  }
  store_ = *std::move(store);
  return store_;
}

absl::Status TraceDumper::Open() {
  // Requests made before this rank started are not for it.
  absl::StatusOr<std::shared_ptr<Store>> store = RequestStore(/*create=*/false);
  if (store.ok() && *store != nullptr) {
    absl::StatusOr<int64_t> seen = (*store)->Add(kRequestCount, 0, absl::Now() + absl::Seconds(10));
    if (seen.ok()) seen_ = *seen;
  }
  int fds[2];
  if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::UnavailableError(
        absl::StrCat("flight recorder: pipe2 failed: ", std::strerror(errno)));
  }
  read_fd_ = fds[0];
  write_fd_ = fds[1];
  owns_signal_ = InstallSignal(write_fd_);
  thread_ = std::thread([this] { Run(); });
  if (hook_ != nullptr) {
    hook_->fd.store(write_fd_, std::memory_order_release);
    std::lock_guard<std::mutex> lock(hook_->mu);
    if (!hook_->first_error.empty()) {  // failed before the dumper was attached
      const char c = kError;
      [[maybe_unused]] ssize_t n = write(write_fd_, &c, 1);
    }
  }
  return absl::OkStatus();
}

TraceDumper::~TraceDumper() {
  if (owns_signal_) UninstallSignal();
  if (hook_ != nullptr) {
    std::lock_guard<std::mutex> lock(hook_->mu);
    hook_->fd.store(-1, std::memory_order_release);
  }
  if (thread_.joinable()) {
    const char c = kQuit;
    [[maybe_unused]] ssize_t n = write(write_fd_, &c, 1);
    thread_.join();
  }
  if (write_fd_ >= 0) close(write_fd_);
  if (read_fd_ >= 0) close(read_fd_);
}

absl::StatusOr<std::string> TraceDumper::DumpNow(absl::string_view reason) {
  std::lock_guard<std::mutex> lock(dump_mu_);
  observe::DumpOptions o;
  o.world_rank = options_.world_rank;
  o.world_size = options_.world_size;
  o.reason = std::string(reason);
  o.group_ranks = options_.group_ranks;
  return recorder_->Dump(options_.dir, o);
}

absl::StatusOr<std::string> TraceDumper::RequestAll(absl::string_view reason) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  const std::string by = absl::StrCat("rank ", options_.world_rank, ": ", reason);
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Store> store, RequestStore(/*create=*/true));
  STRATA_RETURN_IF_ERROR(store->Set(kRequestBy, by, deadline));
  STRATA_ASSIGN_OR_RETURN(int64_t count, store->Add(kRequestCount, 1, deadline));
  {
    std::lock_guard<std::mutex> lock(dump_mu_);
    seen_ = std::max(seen_, count);  // this rank's own request: dumped below
  }
  return DumpNow(reason);
}

void TraceDumper::Handle(char why) {
  absl::StatusOr<std::string> path;
  std::string reason;
  if (why == kError) {
    {
      std::lock_guard<std::mutex> lock(hook_->mu);
      reason = absl::StrCat("an operation failed: ", hook_->first_error);
    }
    path = RequestAll(reason);
  } else if (why == kSignal) {
    reason = "SIGUSR1";
    path = RequestAll(reason);
  } else {
    absl::StatusOr<std::shared_ptr<Store>> store = RequestStore(/*create=*/false);
    if (!store.ok() || *store == nullptr) return;  // no request yet
    absl::StatusOr<int64_t> count = (*store)->Add(kRequestCount, 0, absl::Now() + absl::Seconds(5));
    if (!count.ok()) return;  // the store is unreachable for now: try at the next poll
    {
      std::lock_guard<std::mutex> lock(dump_mu_);
      if (*count <= seen_) return;
      seen_ = *count;
    }
    absl::StatusOr<std::string> by = (*store)->Get(kRequestBy, absl::Now() + absl::Seconds(5));
    reason = absl::StrCat("asked by ", by.ok() ? *by : std::string("another rank"));
    path = DumpNow(reason);
  }
  if (path.ok()) {
    std::fprintf(stderr,
                 "strata: rank %d wrote its flight recorder to %s (%s); `strata-trace %s` "
                 "merges the dumps of all ranks\n",
                 options_.world_rank, path->c_str(), reason.c_str(), options_.dir.c_str());
  } else {
    std::fprintf(stderr, "strata: rank %d could not dump its flight recorder (%s): %s\n",
                 options_.world_rank, reason.c_str(), path.status().ToString().c_str());
  }
}

void TraceDumper::Run() {
  const int poll_ms =
      static_cast<int>(std::max<int64_t>(1, absl::ToInt64Milliseconds(options_.request_poll)));
  for (;;) {
    pollfd p{read_fd_, POLLIN, 0};
    const int n = poll(&p, 1, poll_ms);
    bool error = false, signal = false;
    if (n > 0) {
      char buf[64];
      ssize_t got;
      while ((got = read(read_fd_, buf, sizeof(buf))) > 0) {
        for (ssize_t i = 0; i < got; ++i) {
          if (buf[i] == kQuit) return;
          error |= buf[i] == kError;
          signal |= buf[i] == kSignal;
        }
      }
    }
    if (error) Handle(kError);
    if (signal) Handle(kSignal);
    Handle(0);  // another rank's request?
  }
}

}  // namespace strata::internal
