// The NCCL fault path on real GPUs, with real processes: N ranks on NCCL,
// one of them SIGKILLed from outside (by this program's driver) while every
// rank is inside an allreduce, and each survivor checked:
//   - the allreduce fails, through the watchdog (NCCL's asynchronous error
//     or the operation's deadline), within a bound after the kill, naming
//     the operation; the communicator reports the error afterwards;
//   - scenario "abort": Abort() returns within its bound, and a fresh
//     communicator among the survivors (a new NCCL initialisation through
//     the store) computes a correct allreduce;
//   - scenario "shrink" (NCCL >= 2.27, ncclCommShrink): Revoke() succeeds
//     on NCCL >= 2.28.7 (ncclCommRevoke; refused with FailedPrecondition
//     below), Shrink(victim) (NCCL_SHRINK_ABORT when the communicator was
//     not revoked) gives a communicator of N-1 ranks whose allreduce is
//     correct, and the parent's Abort() returns within its bound. Below
//     2.27 the scenario is skipped, naming the version: the "abort" scenario
//     is then the way back.
// The victim's allreduce is queued behind a stalled stream, so it is inside
// the collective (posted, never completing) when it dies.
//
//   nccl_fault_test [--ranks 4] [--victim 1] [--scenario all|abort|shrink]
//                   [--op-timeout-ms 5000] [--backend nccl|gloo]
//
// `--backend gloo` rehearses the same driver, kill and recovery on CPU
// ranks (host memory; the victim posts nothing and sleeps until killed), so
// that the program is exercised in `make test` on machines without a GPU.
//
// Exit: 0 passed, 1 failed, 77 skipped (ctest's SKIP_RETURN_CODE) with the
// reason: no GPU visible, or more ranks than devices without NCCL's
// multi-rank-per-GPU mode (NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1;
// tools/dev/gpu_checks.sh sets it). The last line of stdout is a JSON
// summary (per scenario and survivor: the times measured).
//
// Ranks are processes of this program (`--rank r ...`, started by the
// driver with fork/exec), bootstrapped through a file store in a fresh
// directory; rank r uses the device r modulo the visible devices.
#include <cuda_runtime_api.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "strata/comm/backend.h"
#include "strata/comm/communicator.h"
#include "strata/comm/launch_env.h"
#include "strata/comm/nccl.h"
#include "strata/comm/nccl_settings.h"
#include "strata/comm/store.h"

namespace strata {
namespace {

using json = nlohmann::json;

constexpr int kSkip = 77;
// NCCL releases of the calls each scenario relies on (nccl.h of each tag).
constexpr NcclVersion kShrinkSince{2, 27, 0};  // ncclCommShrink, first released in 2.27.3
constexpr NcclVersion kRevokeSince{2, 28, 7};  // ncclCommRevoke
constexpr NcclVersion kMultiRankGpuSince{2, 30, 0};
// Bounds on the survivors' steps, beyond the operation's own deadline.
constexpr absl::Duration kDetectSlack = absl::Seconds(5);
constexpr absl::Duration kAbortBound = absl::Seconds(15);
constexpr absl::Duration kRevokeBound = absl::Seconds(30);

struct Args {
  int ranks = 4;
  int victim = 1;
  std::string scenario = "all";
  std::string backend = "nccl";
  absl::Duration op_timeout = absl::Seconds(5);
  // Rank mode.
  int rank = -1;
  std::string dir;
};

bool ParseArgs(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "nccl_fault_test: %s needs a value\n", k.c_str());
      return false;
    }
    const std::string v = argv[++i];
    if (k == "--ranks") {
      a->ranks = std::atoi(v.c_str());
    } else if (k == "--victim") {
      a->victim = std::atoi(v.c_str());
    } else if (k == "--scenario") {
      a->scenario = v;
    } else if (k == "--op-timeout-ms") {
      a->op_timeout = absl::Milliseconds(std::atoi(v.c_str()));
    } else if (k == "--backend") {
      a->backend = v;
    } else if (k == "--rank") {
      a->rank = std::atoi(v.c_str());
    } else if (k == "--dir") {
      a->dir = v;
    } else {
      std::fprintf(stderr, "nccl_fault_test: unknown option %s\n", k.c_str());
      return false;
    }
  }
  if (a->ranks < 2 || a->victim < 0 || a->victim >= a->ranks) {
    std::fprintf(stderr,
                 "nccl_fault_test: --ranks %d --victim %d: want ranks >= 2, victim in [0, ranks)\n",
                 a->ranks, a->victim);
    return false;
  }
  if (a->backend != "nccl" && a->backend != "gloo") {
    std::fprintf(stderr, "nccl_fault_test: --backend %s: want nccl or gloo\n", a->backend.c_str());
    return false;
  }
  if (a->scenario != "all" && a->scenario != "abort" && a->scenario != "shrink") {
    std::fprintf(stderr, "nccl_fault_test: --scenario %s: want all, abort or shrink\n",
                 a->scenario.c_str());
    return false;
  }
  return true;
}

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// ---- one rank -----------------------------------------------------------------

std::atomic<bool> g_never{false};
void CUDART_CB StallForever(void*) {
  while (!g_never.load()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

// int32 values in device memory (NCCL) or host memory (Gloo).
class Ints {
 public:
  Ints(size_t count, bool device) : count_(count), device_(device) {
    if (!device) {
      host_.resize(count);
      data_ = host_.data();
    } else if (cudaMalloc(&data_, count * sizeof(int32_t)) != cudaSuccess) {
      data_ = nullptr;
    }
  }
  ~Ints() {
    if (device_ && data_ != nullptr) cudaFree(data_);
  }
  Ints(const Ints&) = delete;
  Ints& operator=(const Ints&) = delete;
  bool ok() const { return data_ != nullptr; }
  Buffer buffer() { return Buffer{data_, count_, DataType::kInt32}; }
  bool Fill(int32_t v) {
    std::vector<int32_t> values(count_, v);
    if (!device_) {
      host_ = values;
      return true;
    }
    return cudaMemcpy(data_, values.data(), count_ * sizeof(int32_t), cudaMemcpyHostToDevice) ==
           cudaSuccess;
  }
  // True when every element equals `want`.
  bool AllEqual(int32_t want, std::string* why) {
    std::vector<int32_t> values = host_;
    if (device_) {
      values.resize(count_);
      if (cudaMemcpy(values.data(), data_, count_ * sizeof(int32_t), cudaMemcpyDeviceToHost) !=
          cudaSuccess) {
        *why = "cudaMemcpy of the result failed";
        return false;
      }
    }
    for (size_t i = 0; i < count_; ++i) {
      if (values[i] != want) {
        *why = absl::StrCat("element ", i, " is ", values[i], ", want ", want);
        return false;
      }
    }
    return true;
  }

 private:
  size_t count_;
  bool device_;
  std::vector<int32_t> host_;
  void* data_ = nullptr;
};

// An allreduce of (rank + 1) over `comm`, checked against n(n+1)/2.
absl::Status CheckedAllReduce(Communicator& comm, absl::string_view what) {
  Ints x(4096, comm.memory() == MemoryKind::kCuda);
  if (!x.ok() || !x.Fill(comm.rank() + 1)) return absl::InternalError(absl::StrCat(what, ": cuda"));
  absl::StatusOr<std::unique_ptr<Work>> w = comm.AllReduce(x.buffer(), x.buffer(), ReduceOp::kSum);
  if (!w.ok()) return w.status();
  absl::Status s = (*w)->Wait(absl::Now() + absl::Seconds(60));
  if (!s.ok()) return s;
  const int n = comm.size();
  std::string why;
  if (!x.AllEqual(n * (n + 1) / 2, &why)) {
    return absl::DataLossError(absl::StrCat(what, " on ", n, " ranks: ", why));
  }
  return absl::OkStatus();
}

// Prints this rank's report (one JSON line) and returns the exit code.
int Report(json& report, const std::string& failure) {
  if (!failure.empty()) report["failed"] = failure;
  std::printf("%s\n", report.dump().c_str());
  std::fflush(stdout);
  return failure.empty() ? 0 : 1;
}

int RunRank(const Args& a) {
  json report = {{"rank", a.rank}, {"scenario", a.scenario}, {"backend", a.backend}};
  const bool gpu = a.backend == "nccl";
  const int devices = gpu ? DeviceCount() : 0;
  if (gpu && devices == 0) return Report(report, "no CUDA device visible to the rank");
  const int device = gpu ? a.rank % devices : -1;
  if (gpu) cudaSetDevice(device);
  FileStoreOptions so;
  so.path = a.dir + "/store";
  absl::StatusOr<std::shared_ptr<Store>> store = OpenFileStore(so);
  if (!store.ok()) return Report(report, store.status().ToString());
  LaunchEnv env;
  env.rank = env.local_rank = a.rank;
  env.world_size = env.local_world_size = a.ranks;
  RootOptions options;
  options.backend = a.backend;
  options.store = *store;
  options.comm.timeout = absl::Seconds(90);
  options.nccl.device = device;
  absl::Time t0 = absl::Now();
  absl::StatusOr<std::unique_ptr<Communicator>> root = CreateRootCommunicator(env, options);
  if (!root.ok()) return Report(report, absl::StrCat("init: ", root.status().ToString()));
  Communicator& comm = **root;
  report["init_s"] = Seconds(absl::Now() - t0);
  // The NCCL in use decides what the shrink scenario expects of Revoke;
  // Gloo revokes always.
  NcclVersion version = kRevokeSince;
  if (gpu) {
    absl::StatusOr<NcclLibraryInfo> lib = LoadNcclLibrary();
    if (!lib.ok()) return Report(report, lib.status().ToString());
    version = lib->version;
    report["nccl"] = version.ToString();
  }
  if (absl::Status s = CheckedAllReduce(comm, "warm-up allreduce"); !s.ok()) {
    return Report(report, s.ToString());
  }
  const absl::Time far = absl::Now() + absl::Minutes(3);

  // Every rank posts a large allreduce; on NCCL the victim's waits behind a
  // stalled stream (on Gloo the victim posts none), so nobody's completes.
  Ints big(size_t{16} << 20, gpu);  // 64 MiB
  if (!big.ok() || !big.Fill(1)) return Report(report, "allocating 64 MiB");
  cudaStream_t stream = nullptr;
  if (gpu && cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    return Report(report, "cudaStreamCreate");
  }
  OpOptions op;
  op.stream = stream;
  op.timeout = a.rank == a.victim ? absl::Minutes(3) : a.op_timeout;
  if (gpu && a.rank == a.victim) cudaLaunchHostFunc(stream, &StallForever, nullptr);
  absl::StatusOr<std::unique_ptr<Work>> work;
  if (gpu || a.rank != a.victim) {
    work = comm.AllReduce(big.buffer(), big.buffer(), ReduceOp::kSum, op);
    if (!work.ok()) {
      return Report(report, absl::StrCat("posting the allreduce: ", work.status().ToString()));
    }
  }
  if (absl::Status s = (*store)->Set(absl::StrCat("fault/posted/", a.rank), "1", far); !s.ok()) {
    return Report(report, s.ToString());
  }
  if (a.rank == a.victim) {
    // Killed by the driver; should it not come, say so.
    absl::SleepFor(absl::Minutes(2));
    return Report(report, "the victim was not killed within 2 minutes");
  }

  // The watchdog fails the allreduce (NCCL's error, or its deadline).
  absl::Status failed = (*work)->Wait(far);
  const absl::Time detected = absl::Now();
  absl::StatusOr<std::string> killed_at = (*store)->Get("fault/killed", far);
  if (!killed_at.ok()) return Report(report, killed_at.status().ToString());
  const absl::Time killed = absl::FromUnixMicros(std::stoll(*killed_at));
  report["error"] = failed.ToString();
  report["detected_after_kill_s"] = Seconds(detected - killed);
  if (failed.ok()) return Report(report, "the allreduce completed although a rank was killed");
  if (detected < killed) {
    return Report(report, "the allreduce failed before the victim was killed");
  }
  if (detected - killed > a.op_timeout + kDetectSlack) {
    return Report(report, absl::StrCat("the failure was reported ", Seconds(detected - killed),
                                       " s after the kill; bound ",
                                       Seconds(a.op_timeout + kDetectSlack), " s"));
  }
  if (failed.message().find("allreduce(sum") == std::string::npos) {
    return Report(report, "the error does not name the operation");
  }
  if (comm.AsyncError().ok()) return Report(report, "AsyncError() is OK after the failure");

  std::vector<int> excluded = {a.victim};
  const int new_rank = a.rank < a.victim ? a.rank : a.rank - 1;
  if (a.scenario == "abort") {
    t0 = absl::Now();
    absl::Status s = comm.Abort();
    report["abort_s"] = Seconds(absl::Now() - t0);
    if (!s.ok()) return Report(report, absl::StrCat("Abort: ", s.ToString()));
    if (absl::Now() - t0 > kAbortBound) return Report(report, "Abort took longer than its bound");
    // A fresh initialisation among the survivors (its own key space: the
    // store's id generations count ranks of one world size).
    LaunchEnv env2;
    env2.rank = env2.local_rank = new_rank;
    env2.world_size = env2.local_world_size = a.ranks - 1;
    RootOptions options2 = options;
    options2.store = MakePrefixStore(*store, "reinit");
    t0 = absl::Now();
    absl::StatusOr<std::unique_ptr<Communicator>> fresh = CreateRootCommunicator(env2, options2);
    if (!fresh.ok()) return Report(report, absl::StrCat("re-init: ", fresh.status().ToString()));
    report["reinit_s"] = Seconds(absl::Now() - t0);
    if (absl::Status r = CheckedAllReduce(**fresh, "allreduce after re-init"); !r.ok()) {
      return Report(report, r.ToString());
    }
    report["allreduce"] = "ok";
    if (stream != nullptr) cudaStreamDestroy(stream);
    return Report(report, "");
  }

  // scenario "shrink"
  if (!gpu || version >= kRevokeSince) {
    t0 = absl::Now();
    absl::Status s = comm.Revoke();
    report["revoke_s"] = Seconds(absl::Now() - t0);
    if (!s.ok()) return Report(report, absl::StrCat("Revoke: ", s.ToString()));
    if (absl::Now() - t0 > kRevokeBound) return Report(report, "Revoke took longer than its bound");
    report["revoke"] = "ok";
  } else {
    absl::Status s = comm.Revoke();
    if (s.code() != absl::StatusCode::kFailedPrecondition) {
      return Report(report, absl::StrCat("Revoke on NCCL ", version.ToString(),
                                         " should be refused (needs 2.28.7): ", s.ToString()));
    }
    report["revoke"] = absl::StrCat("refused on NCCL ", version.ToString(), " (needs 2.28.7)");
  }
  CommOptions shrunk_options;
  shrunk_options.name = "shrunk";
  shrunk_options.timeout = absl::Seconds(60);
  t0 = absl::Now();
  absl::StatusOr<std::unique_ptr<Communicator>> shrunk = comm.Shrink(excluded, shrunk_options);
  if (!shrunk.ok()) return Report(report, absl::StrCat("Shrink: ", shrunk.status().ToString()));
  report["shrink_s"] = Seconds(absl::Now() - t0);
  if (gpu) {
    report["shrink_flags"] =
        version >= kRevokeSince ? "NCCL_SHRINK_DEFAULT (after revoke)" : "NCCL_SHRINK_ABORT";
  }
  if ((*shrunk)->size() != a.ranks - 1 || (*shrunk)->rank() != new_rank) {
    return Report(report,
                  absl::StrCat("the shrunk communicator is rank ", (*shrunk)->rank(), " of ",
                               (*shrunk)->size(), ", want ", new_rank, " of ", a.ranks - 1));
  }
  if (absl::Status r = CheckedAllReduce(**shrunk, "allreduce after shrink"); !r.ok()) {
    return Report(report, r.ToString());
  }
  report["allreduce"] = "ok";
  t0 = absl::Now();
  absl::Status s = comm.Abort();  // the parent, released as the elastic layer does
  report["abort_s"] = Seconds(absl::Now() - t0);
  if (!s.ok()) return Report(report, absl::StrCat("Abort of the parent: ", s.ToString()));
  if (absl::Now() - t0 > kAbortBound) return Report(report, "Abort took longer than its bound");
  if (stream != nullptr) cudaStreamDestroy(stream);
  return Report(report, "");
}

// ---- the driver -----------------------------------------------------------------

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

pid_t Spawn(const Args& a, int rank, const std::string& dir) {
  const pid_t pid = fork();
  if (pid != 0) return pid;
  const std::string out = absl::StrCat(dir, "/rank", rank, ".out");
  const std::string err = absl::StrCat(dir, "/rank", rank, ".err");
  if (!freopen(out.c_str(), "w", stdout) || !freopen(err.c_str(), "w", stderr)) _exit(120);
  std::vector<std::string> args = {"/proc/self/exe",
                                   "--rank",
                                   std::to_string(rank),
                                   "--ranks",
                                   std::to_string(a.ranks),
                                   "--victim",
                                   std::to_string(a.victim),
                                   "--scenario",
                                   a.scenario,
                                   "--backend",
                                   a.backend,
                                   "--op-timeout-ms",
                                   std::to_string(absl::ToInt64Milliseconds(a.op_timeout)),
                                   "--dir",
                                   dir};
  std::vector<char*> argv;
  for (std::string& s : args) argv.push_back(s.data());
  argv.push_back(nullptr);
  execv("/proc/self/exe", argv.data());
  _exit(121);
}

// Waits for `pid` until `deadline`; returns its exit code, or -1 on timeout.
int WaitFor(pid_t pid, absl::Time deadline) {
  while (true) {
    int status = 0;
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      return 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    }
    if (absl::Now() > deadline) return -1;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// Runs one scenario; returns its summary (with "passed": bool).
json RunScenario(const Args& base, const std::string& scenario) {
  Args a = base;
  a.scenario = scenario;
  json summary = {{"scenario", scenario}, {"ranks", a.ranks}, {"victim", a.victim}};
  char tmpl[] = "/tmp/strata_nccl_fault.XXXXXX";
  const char* made = mkdtemp(tmpl);
  if (made == nullptr) {
    summary["passed"] = false;
    summary["failure"] = "mkdtemp failed";
    return summary;
  }
  const std::string dir = made;
  FileStoreOptions so;
  so.path = dir + "/store";
  absl::StatusOr<std::shared_ptr<Store>> store = OpenFileStore(so);
  std::vector<pid_t> pids(static_cast<size_t>(a.ranks), -1);
  std::vector<std::string> failures;
  auto fail = [&](std::string why) { failures.push_back(std::move(why)); };
  if (!store.ok()) fail(store.status().ToString());
  for (int r = 0; r < a.ranks && failures.empty(); ++r) pids[r] = Spawn(a, r, dir);
  // Every rank inside its allreduce.
  const absl::Time ready_by = absl::Now() + absl::Seconds(150);
  for (int r = 0; r < a.ranks && failures.empty(); ++r) {
    while (failures.empty()) {
      absl::StatusOr<std::string> v =
          (*store)->Get(absl::StrCat("fault/posted/", r), absl::Now() + absl::Milliseconds(200));
      if (v.ok()) break;
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        pids[r] = -1;
        fail(absl::StrCat("rank ", r, " exited before posting its allreduce"));
      } else if (absl::Now() > ready_by) {
        fail(absl::StrCat("rank ", r, " did not post its allreduce within 150 s"));
      }
    }
  }
  if (failures.empty()) {
    absl::SleepFor(absl::Milliseconds(500));  // the survivors' kernels wait on the victim
    // The time of the kill is taken before the signal: survivors may see
    // the victim gone before the driver has reaped it.
    const absl::Time killed = absl::Now();
    kill(pids[a.victim], SIGKILL);
    WaitFor(pids[a.victim], absl::Now() + absl::Seconds(30));
    pids[a.victim] = -1;
    summary["killed"] = absl::FormatTime(killed);
    absl::Status s = (*store)->Set("fault/killed", std::to_string(absl::ToUnixMicros(killed)),
                                   absl::Now() + absl::Seconds(10));
    if (!s.ok()) fail(s.ToString());
  }
  const absl::Time done_by = absl::Now() + absl::Seconds(180);
  json survivors = json::array();
  for (int r = 0; r < a.ranks; ++r) {
    if (pids[r] < 0) continue;
    const int code = failures.empty() ? WaitFor(pids[r], done_by) : -1;
    if (code < 0) {
      kill(pids[r], SIGKILL);
      WaitFor(pids[r], absl::Now() + absl::Seconds(30));
      if (failures.empty()) fail(absl::StrCat("rank ", r, " did not finish within 180 s"));
    }
    const std::string out = ReadFile(absl::StrCat(dir, "/rank", r, ".out"));
    // The rank's report is its last line that is a JSON object.
    json report = json::object();
    std::istringstream lines(out);
    for (std::string line; std::getline(lines, line);) {
      if (line.empty() || line[0] != '{') continue;
      json parsed = json::parse(line, nullptr, false);
      if (!parsed.is_discarded()) report = parsed;
    }
    report["exit"] = code;
    if (code != 0 && code >= 0) {
      fail(absl::StrCat("rank ", r, ": ",
                        report.value("failed", std::string("exit ") + std::to_string(code))));
      std::fprintf(stderr, "---- rank %d stderr ----\n%s\n", r,
                   ReadFile(absl::StrCat(dir, "/rank", r, ".err")).c_str());
    }
    survivors.push_back(report);
  }
  summary["survivors"] = survivors;
  summary["passed"] = failures.empty();
  if (!failures.empty()) summary["failure"] = absl::StrJoin(failures, "; ");
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return summary;
}

int RunAll(const Args& a, const NcclVersion& version, json* summary);

int Drive(const Args& a) {
  json summary = {{"test", "nccl_fault_test"},
                  {"backend", a.backend},
                  {"ranks", a.ranks},
                  {"victim", a.victim}};
  auto skip = [&](const std::string& why) {
    summary["skipped"] = why;
    std::printf("SKIPPED: %s\n%s\n", why.c_str(), summary.dump().c_str());
    return kSkip;
  };
  if (a.backend == "gloo") {
    const std::vector<std::string> built = AvailableBackends();
    if (std::find(built.begin(), built.end(), "gloo") == built.end()) {
      return skip("this build has no Gloo backend");
    }
    return RunAll(a, kRevokeSince, &summary);
  }
  const int devices = DeviceCount();
  if (devices == 0)
    return skip("no CUDA device visible (runs on the device machine: tools/dev/gpu_checks.sh)");
  absl::StatusOr<NcclLibraryInfo> lib = LoadNcclLibrary();
  if (!lib.ok()) {
    std::printf("FAILED: no usable NCCL: %s\n", lib.status().ToString().c_str());
    return 1;
  }
  summary["nccl"] = lib->version.ToString();
  summary["nccl_path"] = lib->path;
  summary["devices"] = devices;
  if (a.ranks > devices) {
    const char* enable = std::getenv("NCCL_MULTI_RANK_GPU_ENABLE");
    if (lib->version < kMultiRankGpuSince) {
      return skip(absl::StrCat("NCCL ", lib->version.ToString(), " < 2.30: one rank per GPU only; ",
                               a.ranks, " ranks need ", a.ranks, " GPUs, ", devices, " visible"));
    }
    if (enable == nullptr || std::string(enable) != "1") {
      return skip(absl::StrCat(a.ranks, " ranks on ", devices,
                               " GPU(s) need NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL ",
                               lib->version.ToString(), ")"));
    }
  }
  // The ranks use the library this process found.
  setenv("STRATA_NCCL_LIBRARY", lib->path.c_str(), 0);
  return RunAll(a, lib->version, &summary);
}

int RunAll(const Args& a, const NcclVersion& version, json* summary_out) {
  json& summary = *summary_out;
  std::vector<std::string> scenarios;
  if (a.scenario == "all" || a.scenario == "abort") scenarios.push_back("abort");
  if (a.scenario == "all" || a.scenario == "shrink") scenarios.push_back("shrink");
  json results = json::array();
  bool passed = true;
  for (const std::string& s : scenarios) {
    if (s == "shrink" && version < kShrinkSince) {
      results.push_back(
          {{"scenario", s},
           {"skipped", absl::StrCat("ncclCommShrink needs NCCL 2.27.3; NCCL ", version.ToString(),
                                    " is in use: the abort scenario is the way back")}});
      continue;
    }
    json r = RunScenario(a, s);
    std::printf("%s scenario: %s%s\n", s.c_str(), r["passed"].get<bool>() ? "passed" : "FAILED",
                r.contains("failure") ? (": " + r["failure"].get<std::string>()).c_str() : "");
    passed = passed && r["passed"].get<bool>();
    results.push_back(r);
  }
  summary["scenarios"] = results;
  summary["passed"] = passed;
  std::printf("%s\n", summary.dump().c_str());
  return passed ? 0 : 1;
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  strata::Args args;
  if (!strata::ParseArgs(argc, argv, &args)) return 2;
  if (args.rank >= 0) return strata::RunRank(args);
  return strata::Drive(args);
}
