// Bus bandwidth of strata's collectives, in the format of nccl-tests.
//
//   mpirun -np 4 build/benchmarks/comm_busbw --op allreduce --min-bytes 4K --max-bytes 64M
//
// For each size (doubling from --min-bytes to --max-bytes) every rank runs
// --warmup untimed and then `iters` timed operations, one after another
// (start, wait), on the same buffers; the time of a size is the slowest
// rank's mean. Columns follow nccl-tests:
//   size   bytes of the largest buffer per rank (allgather: the output,
//          reduce_scatter: the input, alltoall: one rank's send buffer)
//   count  elements in that buffer
//   algbw  size / time
//   busbw  algbw x factor: 2(n-1)/n for allreduce, (n-1)/n for allgather,
//          reduce_scatter and alltoall, 1 for broadcast and sendrecv
//          (each rank sends to the next and receives from the previous).
// With --check, the first iteration of each size is checked against a
// reference (small integers, exact in fp32).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "strata/comm/backend.h"
#include "strata/comm/communicator.h"
#include "strata/comm/launch_env.h"

namespace {

using strata::Buffer;
using strata::Communicator;
using strata::ConstBuffer;
using strata::Work;

struct Args {
  std::vector<std::string> ops = {"allreduce", "allgather", "reduce_scatter",
                                  "broadcast", "alltoall",  "sendrecv"};
  size_t min_bytes = 4096;
  size_t max_bytes = size_t{64} << 20;
  int warmup = 2;
  int iters = 0;  // 0: by size
  bool check = false;
};

bool ParseBytes(absl::string_view s, size_t* out) {
  size_t mult = 1;
  if (!s.empty()) {
    switch (s.back()) {
      case 'K':
      case 'k':
        mult = size_t{1} << 10;
        s.remove_suffix(1);
        break;
      case 'M':
      case 'm':
        mult = size_t{1} << 20;
        s.remove_suffix(1);
        break;
      case 'G':
      case 'g':
        mult = size_t{1} << 30;
        s.remove_suffix(1);
        break;
      default:
        break;
    }
  }
  uint64_t v = 0;
  if (!absl::SimpleAtoi(s, &v)) return false;
  *out = static_cast<size_t>(v) * mult;
  return true;
}

[[noreturn]] void Usage(const char* msg) {
  std::fprintf(stderr,
               "comm_busbw: %s\nusage: comm_busbw [--op allreduce,allgather,...|all] "
               "[--min-bytes 4K] [--max-bytes 64M] [--iters N] [--warmup N] [--check]\n",
               msg);
  std::exit(2);
}

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) Usage(("missing value for " + k).c_str());
      return argv[++i];
    };
    if (k == "--op") {
      std::string v = next();
      if (v != "all") a.ops = absl::StrSplit(v, ',');
    } else if (k == "--min-bytes") {
      if (!ParseBytes(next(), &a.min_bytes)) Usage("bad --min-bytes");
    } else if (k == "--max-bytes") {
      if (!ParseBytes(next(), &a.max_bytes)) Usage("bad --max-bytes");
    } else if (k == "--iters") {
      if (!absl::SimpleAtoi(next(), &a.iters)) Usage("bad --iters");
    } else if (k == "--warmup") {
      if (!absl::SimpleAtoi(next(), &a.warmup)) Usage("bad --warmup");
    } else if (k == "--check") {
      a.check = true;
    } else {
      Usage(("unknown option " + k).c_str());
    }
  }
  return a;
}

// Iterations per size: about 256 MiB moved per rank, between 5 and 100.
int ItersFor(size_t bytes, const Args& a) {
  if (a.iters > 0) return a.iters;
  return static_cast<int>(
      std::clamp<size_t>((size_t{256} << 20) / std::max<size_t>(bytes, 1), 5, 100));
}

double BusFactor(const std::string& op, int n) {
  if (op == "allreduce") return 2.0 * (n - 1) / n;
  if (op == "allgather" || op == "reduce_scatter" || op == "alltoall") return double(n - 1) / n;
  return 1.0;
}

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "comm_busbw: %s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

template <typename T>
T Check(absl::StatusOr<T> v, const char* what) {
  Check(v.status(), what);
  return std::move(v).value();
}

// Runs one operation of `op` on `count` fp32 elements (size of the largest
// buffer) and waits for it.
void RunOnce(Communicator& c, const std::string& op, std::vector<float>& a, std::vector<float>& b) {
  const int n = c.size();
  const absl::Time deadline = absl::Now() + absl::Minutes(5);
  std::vector<std::unique_ptr<Work>> works;
  if (op == "allreduce") {
    works.push_back(Check(c.AllReduce(Buffer::Of(a.data(), a.size()),
                                      Buffer::Of(b.data(), b.size()), strata::ReduceOp::kSum),
                          "allreduce"));
  } else if (op == "allgather") {
    const size_t per = b.size() / n;
    works.push_back(
        Check(c.AllGather(Buffer::Of(a.data(), per), Buffer::Of(b.data(), per * n)), "allgather"));
  } else if (op == "reduce_scatter") {
    const size_t per = a.size() / n;
    works.push_back(Check(c.ReduceScatter(Buffer::Of(a.data(), per * n), Buffer::Of(b.data(), per),
                                          strata::ReduceOp::kSum),
                          "reduce_scatter"));
  } else if (op == "broadcast") {
    works.push_back(Check(c.Broadcast(Buffer::Of(b.data(), b.size()), 0), "broadcast"));
  } else if (op == "alltoall") {
    const size_t per = a.size() / n;
    works.push_back(Check(c.AllToAll(Buffer::Of(a.data(), per * n), Buffer::Of(b.data(), per * n)),
                          "alltoall"));
  } else if (op == "sendrecv") {
    const int next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
    works.push_back(Check(c.Recv(Buffer::Of(b.data(), b.size()), prev), "recv"));
    works.push_back(Check(c.Send(Buffer::Of(a.data(), a.size()), next), "send"));
  } else {
    Usage(("unknown op " + op).c_str());
  }
  for (auto& w : works) Check(w->Wait(deadline), "wait");
}

bool Verify(Communicator& c, const std::string& op, const std::vector<float>& b) {
  const int n = c.size(), r = c.rank();
  auto input = [](int rank, size_t i) { return static_cast<float>((rank + i) % 5); };
  for (size_t i = 0; i < b.size(); ++i) {
    float want = 0;
    if (op == "allreduce") {
      for (int k = 0; k < n; ++k) want += input(k, i);
    } else if (op == "allgather") {
      const size_t per = b.size() / n;
      if (i >= per * n) break;
      want = input(static_cast<int>(i / per), i % per);
    } else if (op == "reduce_scatter") {
      const size_t per = b.size() / n;
      if (i >= per) break;
      for (int k = 0; k < n; ++k) want += input(k, r * per + i);
    } else if (op == "broadcast") {
      want = input(0, i);
    } else if (op == "alltoall") {
      const size_t per = b.size() / n;
      if (i >= per * n) break;
      want = input(static_cast<int>(i / per), r * per + i % per);
    } else if (op == "sendrecv") {
      want = input((r + n - 1) % n, i);
    }
    if (b[i] != want) {
      std::fprintf(stderr, "comm_busbw: %s wrong on rank %d at %zu: %g != %g\n", op.c_str(), r, i,
                   b[i], want);
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = Parse(argc, argv);
  strata::LaunchEnv env = Check(strata::LaunchEnv::Detect(), "launch environment");
  strata::RootOptions options;
  options.backend = "mpi";
  std::unique_ptr<Communicator> comm = Check(strata::CreateRootCommunicator(env, options), "root");
  const int n = comm->size();
  if (comm->rank() == 0) {
    std::printf("# strata comm_busbw: %d ranks, backend %s, dtype float, op sum, out-of-place\n", n,
                std::string(comm->backend()).c_str());
    std::printf("#%11s %12s %6s %15s %10s %10s %10s %6s\n", "size", "count", "type", "op", "time",
                "algbw", "busbw", "#wrong");
    std::printf("#%11s %12s %6s %15s %10s %10s %10s %6s\n", "(B)", "(elements)", "", "", "(us)",
                "(GB/s)", "(GB/s)", "");
  }
  int wrong_total = 0;
  for (const std::string& op : args.ops) {
    for (size_t bytes = args.min_bytes; bytes <= args.max_bytes; bytes *= 2) {
      // Element counts divisible by the rank count, as nccl-tests does.
      size_t count = bytes / sizeof(float);
      count -= count % static_cast<size_t>(n);
      std::vector<float> a(count), b(count, 0.0f);
      for (size_t i = 0; i < count; ++i) a[i] = static_cast<float>((comm->rank() + i) % 5);
      if (op == "broadcast" && comm->rank() == 0) b = a;
      int wrong = 0;
      if (args.check) {
        RunOnce(*comm, op, a, b);
        wrong = Verify(*comm, op, b) ? 0 : 1;
      }
      for (int i = 0; i < args.warmup; ++i) RunOnce(*comm, op, a, b);
      const int iters = ItersFor(bytes, args);
      auto barrier = Check(comm->Barrier(), "barrier");
      Check(barrier->Wait(absl::Now() + absl::Minutes(1)), "barrier");
      const absl::Time start = absl::Now();
      for (int i = 0; i < iters; ++i) RunOnce(*comm, op, a, b);
      double us = absl::ToDoubleMicroseconds(absl::Now() - start) / iters;
      double slowest = 0;
      int wrong_any = 0;
      auto t = Check(comm->AllReduce(ConstBuffer(&us, 1, strata::DataType::kFloat64),
                                     Buffer::Of(&slowest, 1), strata::ReduceOp::kMax),
                     "time");
      Check(t->Wait(absl::Now() + absl::Minutes(1)), "time");
      auto w = Check(comm->AllReduce(ConstBuffer(&wrong, 1, strata::DataType::kInt32),
                                     Buffer::Of(&wrong_any, 1), strata::ReduceOp::kSum),
                     "wrong");
      Check(w->Wait(absl::Now() + absl::Minutes(1)), "wrong");
      wrong_total += wrong_any;
      const size_t size = count * sizeof(float);
      const double algbw = static_cast<double>(size) / (slowest * 1e-6) / 1e9;
      if (comm->rank() == 0) {
        std::printf("%12zu %12zu %6s %15s %10.1f %10.3f %10.3f %6d\n", size, count, "float",
                    op.c_str(), slowest, algbw, algbw * BusFactor(op, n),
                    args.check ? wrong_any : -1);
        std::fflush(stdout);
      }
    }
  }
  return wrong_total == 0 ? 0 : 1;
}
