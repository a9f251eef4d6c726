// The NCCL backend on real GPUs, in one of two modes:
//   - alone (ctest): ranks are threads of this process, one per visible
//     device, bootstrapped through a memory store;
//   - under a launcher (tests/tools/run_torchrun.sh --np N, which sets
//     RANK/WORLD_SIZE and STRATA_STORE=file:...): this process is one rank
//     of N, on the device of its local rank modulo the visible devices, so N
//     ranks may share one GPU (NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1;
//     NCCL does not support ranks of one GPU as threads of one process).
//     tools/dev/gpu_checks.sh runs it so with 2, 4 and 8 ranks on one GPU.
// Every test skips (with the reason) where no GPU is visible or it needs
// more ranks than there are; the device machine runs them. Results are
// compared with a reference computed on the host in the test.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/half.h"
#include "comm/nccl/nccl_communicator.h"
#include "strata/base/dtype.h"
#include "strata/comm/backend.h"
#include "strata/comm/launch_env.h"

namespace strata::nccl {
namespace {

using ::testing::HasSubstr;

// This process's rank of a launched job, when a launcher started more than
// one process (process mode); nullopt when it runs alone (thread mode).
const std::optional<LaunchEnv>& Launched() {
  static const std::optional<LaunchEnv> launched = []() -> std::optional<LaunchEnv> {
    absl::StatusOr<LaunchEnv> env = LaunchEnv::Detect();
    if (!env.ok() || env->world_size < 2) return std::nullopt;
    return *env;
  }();
  return launched;
}

// The number of ranks the tests run on: the launched job's, else one thread
// per visible device (at most 8).
int Ranks() {
  if (Launched()) return Launched()->world_size;
  return std::min(VisibleDeviceCount(), 8);
}

#define SKIP_WITHOUT_RANKS(n)                                                                   \
  do {                                                                                          \
    if (VisibleDeviceCount() < 1) {                                                             \
      GTEST_SKIP() << "no CUDA device visible (the NCCL backend's GPU tests run on the device " \
                      "machine: tools/dev/gpu_checks.sh)";                                      \
    }                                                                                           \
    if (Ranks() < (n)) {                                                                        \
      GTEST_SKIP()                                                                              \
          << "needs " << (n) << " ranks; " << Ranks()                                           \
          << (Launched() ? " launched" : " visible device(s), one thread each")                 \
          << " (run under tests/tools/run_torchrun.sh --np N for ranks that share a GPU)";      \
    }                                                                                           \
  } while (0)

// Host bytes <-> values, per dtype.
std::vector<uint8_t> Encode(DataType t, const std::vector<double>& v) {
  std::vector<uint8_t> out(v.size() * DataTypeSize(t));
  for (size_t i = 0; i < v.size(); ++i) {
    uint8_t* p = out.data() + i * DataTypeSize(t);
    auto put = [&](auto x) { std::memcpy(p, &x, sizeof(x)); };
    switch (t) {
      case DataType::kFloat32:
        put(static_cast<float>(v[i]));
        break;
      case DataType::kFloat64:
        put(v[i]);
        break;
      case DataType::kFloat16:
        put(FloatToHalfScalar(static_cast<float>(v[i])));
        break;
      case DataType::kBFloat16:
        put(FloatToBFloat16Scalar(static_cast<float>(v[i])));
        break;
      case DataType::kInt8:
        put(static_cast<int8_t>(v[i]));
        break;
      case DataType::kUInt8:
        put(static_cast<uint8_t>(v[i]));
        break;
      case DataType::kInt32:
        put(static_cast<int32_t>(v[i]));
        break;
      case DataType::kInt64:
        put(static_cast<int64_t>(v[i]));
        break;
      case DataType::kInt16:
        put(static_cast<int16_t>(v[i]));
        break;
      case DataType::kBool:
        put(static_cast<uint8_t>(v[i] != 0));
        break;
    }
  }
  return out;
}

std::vector<double> Decode(DataType t, const std::vector<uint8_t>& bytes) {
  const size_t n = bytes.size() / DataTypeSize(t);
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* p = bytes.data() + i * DataTypeSize(t);
    auto get = [&](auto x) {
      std::memcpy(&x, p, sizeof(x));
      return x;
    };
    switch (t) {
      case DataType::kFloat32:
        out[i] = get(float{});
        break;
      case DataType::kFloat64:
        out[i] = get(double{});
        break;
      case DataType::kFloat16:
        out[i] = HalfToFloatScalar(get(uint16_t{}));
        break;
      case DataType::kBFloat16:
        out[i] = BFloat16ToFloatScalar(get(uint16_t{}));
        break;
      case DataType::kInt8:
        out[i] = get(int8_t{});
        break;
      case DataType::kUInt8:
        out[i] = get(uint8_t{});
        break;
      case DataType::kInt32:
        out[i] = get(int32_t{});
        break;
      case DataType::kInt64:
        out[i] = static_cast<double>(get(int64_t{}));
        break;
      case DataType::kInt16:
        out[i] = get(int16_t{});
        break;
      case DataType::kBool:
        out[i] = get(uint8_t{});
        break;
    }
  }
  return out;
}

// A device buffer holding `values` of dtype t.
struct DeviceBuffer {
  DataType dtype;
  size_t count;
  void* data = nullptr;
  DeviceBuffer(DataType t, const std::vector<double>& values) : dtype(t), count(values.size()) {
    std::vector<uint8_t> bytes = Encode(t, values);
    EXPECT_EQ(cudaMalloc(&data, std::max<size_t>(bytes.size(), 1)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceBuffer() { cudaFree(data); }
  Buffer buffer() { return Buffer{data, count, dtype}; }
  std::vector<double> Read() {
    std::vector<uint8_t> bytes(count * DataTypeSize(dtype));
    EXPECT_EQ(cudaMemcpy(bytes.data(), data, bytes.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    return Decode(dtype, bytes);
  }
};

// Runs fn(rank, comm) on `n` ranks. Thread mode: each a thread of this
// process with its own device. Process mode: n is the job's size (this
// process runs its own rank, through the launcher's store), or 1 (every
// process runs a world of its own).
void RunRanks(int n, const std::function<void(int, Communicator&)>& fn,
              absl::Duration timeout = absl::Seconds(60)) {
  if (Launched()) {
    const LaunchEnv& job = *Launched();
    ASSERT_TRUE(n == 1 || n == job.world_size)
        << "a launched test runs on 1 or all " << job.world_size << " ranks, not " << n;
    LaunchEnv env = job;
    RootOptions options;
    options.backend = "nccl";
    options.comm.timeout = timeout;
    if (n == 1) {
      env.rank = env.local_rank = 0;
      env.world_size = env.local_world_size = 1;
      options.store = MakeMemoryStore();
    }  // else the launcher's store ($STRATA_STORE)
    const int device = job.local_rank % VisibleDeviceCount();
    cudaSetDevice(device);
    options.nccl.device = device;
    absl::StatusOr<std::unique_ptr<Communicator>> comm = CreateRootCommunicator(env, options);
    ASSERT_TRUE(comm.ok()) << "rank " << env.rank << ": " << comm.status();
    fn(env.rank, **comm);
    return;
  }
  std::shared_ptr<Store> store = MakeMemoryStore();
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      cudaSetDevice(r);
      LaunchEnv env;
      env.rank = r;
      env.world_size = n;
      env.local_rank = r;
      env.local_world_size = n;
      RootOptions options;
      options.backend = "nccl";
      options.store = store;
      options.comm.timeout = timeout;
      options.nccl.device = r;
      absl::StatusOr<std::unique_ptr<Communicator>> comm = CreateRootCommunicator(env, options);
      ASSERT_TRUE(comm.ok()) << "rank " << r << ": " << comm.status();
      fn(r, **comm);
    });
  }
  for (auto& t : threads) t.join();
}

double Value(int rank, size_t i) {
  return static_cast<double>((rank + static_cast<int>(i)) % 5 + 1);
}

std::vector<double> RankValues(int rank, size_t n) {
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = Value(rank, i);
  return v;
}

void ExpectOk(absl::StatusOr<std::unique_ptr<Work>> work, const std::string& what) {
  ASSERT_TRUE(work.ok()) << what << ": " << work.status();
  absl::Status s = (*work)->Wait(absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(s.ok()) << what << ": " << s;
}

TEST(NcclGpu, InitReportsRankSizeAndBackend) {
  SKIP_WITHOUT_RANKS(1);
  const int n = Ranks();
  RunRanks(n, [&](int r, Communicator& c) {
    EXPECT_EQ(c.rank(), r);
    EXPECT_EQ(c.size(), n);
    EXPECT_EQ(c.backend(), "nccl");
    EXPECT_EQ(c.memory(), MemoryKind::kCuda);
    EXPECT_TRUE(c.AsyncError().ok());
    // Host memory is refused before NCCL sees it, naming the buffer.
    std::vector<float> host(4, 1.0f);
    absl::StatusOr<std::unique_ptr<Work>> w = c.AllReduce(
        Buffer::Of(host.data(), host.size()), Buffer::Of(host.data(), host.size()), ReduceOp::kSum);
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(w.status().message(), HasSubstr("send buffer"));
    EXPECT_THAT(w.status().message(), HasSubstr("is host memory"));
    // int16 moves but does not reduce.
    DeviceBuffer i16(DataType::kInt16, std::vector<double>(4, 1));
    w = c.AllReduce(i16.buffer(), i16.buffer(), ReduceOp::kSum);
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  });
}

TEST(NcclGpu, EveryCollectiveAndDtypeMatchesTheHostReference) {
  SKIP_WITHOUT_RANKS(1);
  const int n = Ranks();
  const size_t kCount = 37;
  RunRanks(n, [&](int r, Communicator& c) {
    for (DataType t : kAllDataTypes) {
      const std::string dt = DataTypeName(t);
      const bool reducible = NcclCanReduce(t);
      if (reducible) {
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax}) {
          DeviceBuffer x(t, RankValues(r, kCount));
          ExpectOk(c.AllReduce(x.buffer(), x.buffer(), op), "allreduce " + dt);
          std::vector<double> got = x.Read();
          for (size_t i = 0; i < kCount; ++i) {
            double want = Value(0, i);
            for (int q = 1; q < n; ++q) {
              want = op == ReduceOp::kSum   ? want + Value(q, i)
                     : op == ReduceOp::kMin ? std::min(want, Value(q, i))
                                            : std::max(want, Value(q, i));
            }
            ASSERT_EQ(got[i], want)
                << "allreduce " << ReduceOpName(op) << " " << dt << " [" << i << "] on rank " << r;
          }
        }
        // reduce_scatter: block r of the sum.
        DeviceBuffer send(t, RankValues(r, kCount * static_cast<size_t>(n)));
        DeviceBuffer recv(t, std::vector<double>(kCount, 0));
        ExpectOk(c.ReduceScatter(send.buffer(), recv.buffer(), ReduceOp::kSum),
                 "reduce_scatter " + dt);
        std::vector<double> got = recv.Read();
        for (size_t i = 0; i < kCount; ++i) {
          double want = 0;
          for (int q = 0; q < n; ++q) want += Value(q, static_cast<size_t>(r) * kCount + i);
          ASSERT_EQ(got[i], want) << "reduce_scatter " << dt;
        }
        // reduce to the last rank.
        DeviceBuffer rsend(t, RankValues(r, kCount));
        DeviceBuffer rrecv(t, std::vector<double>(kCount, 0));
        ExpectOk(c.Reduce(rsend.buffer(), rrecv.buffer(), ReduceOp::kSum, n - 1), "reduce " + dt);
        if (r == n - 1) {
          got = rrecv.Read();
          for (size_t i = 0; i < kCount; ++i) {
            double want = 0;
            for (int q = 0; q < n; ++q) want += Value(q, i);
            ASSERT_EQ(got[i], want) << "reduce " << dt;
          }
        }
      }
      // Moves: every dtype (int16 and bool as bytes).
      const double one = t == DataType::kBool ? 1 : 0;
      DeviceBuffer b(t, r == 0 ? RankValues(7, kCount) : std::vector<double>(kCount, one));
      ExpectOk(c.Broadcast(b.buffer(), 0), "broadcast " + dt);
      std::vector<double> got = b.Read();
      for (size_t i = 0; i < kCount; ++i) {
        ASSERT_EQ(got[i], t == DataType::kBool ? 1 : Value(7, i)) << "broadcast " << dt;
      }
      DeviceBuffer g(t, RankValues(r, kCount));
      DeviceBuffer all(t, std::vector<double>(kCount * static_cast<size_t>(n), 0));
      ExpectOk(c.AllGather(g.buffer(), all.buffer()), "allgather " + dt);
      got = all.Read();
      for (int q = 0; q < n; ++q) {
        for (size_t i = 0; i < kCount; ++i) {
          const double want = t == DataType::kBool ? 1 : Value(q, i);
          ASSERT_EQ(got[static_cast<size_t>(q) * kCount + i], want) << "allgather " << dt;
        }
      }
      // alltoall: block q of rank r's send holds 100*r + q (bool: 1).
      std::vector<double> a2a(kCount * static_cast<size_t>(n));
      for (size_t k = 0; k < a2a.size(); ++k) {
        a2a[k] = t == DataType::kBool
                     ? 1
                     : static_cast<double>((r * 10 + static_cast<int>(k / kCount)) % 100);
      }
      DeviceBuffer s(t, a2a);
      DeviceBuffer d(t, std::vector<double>(a2a.size(), 0));
      ExpectOk(c.AllToAll(s.buffer(), d.buffer()), "alltoall " + dt);
      got = d.Read();
      for (int q = 0; q < n; ++q) {
        const double want = t == DataType::kBool ? 1 : static_cast<double>((q * 10 + r) % 100);
        ASSERT_EQ(got[static_cast<size_t>(q) * kCount], want) << "alltoall " << dt;
      }
    }
    // Averages of floating-point values, variable all-to-all, p2p, barrier.
    DeviceBuffer avg(DataType::kFloat32, RankValues(r, kCount));
    ExpectOk(c.AllReduce(avg.buffer(), avg.buffer(), ReduceOp::kAvg), "allreduce avg");
    std::vector<double> got = avg.Read();
    for (size_t i = 0; i < kCount; ++i) {
      double want = 0;
      for (int q = 0; q < n; ++q) want += Value(q, i);
      ASSERT_NEAR(got[i], want / n, 1e-5);
    }
    AllToAllCounts counts;
    for (int q = 0; q < n; ++q) {
      counts.send_counts.push_back(static_cast<size_t>(q + 1));  // rank q gets q+1 from each
      counts.recv_counts.push_back(static_cast<size_t>(r + 1));
    }
    size_t total_send = 0;
    for (size_t k : counts.send_counts) total_send += k;
    DeviceBuffer vs(DataType::kInt32, std::vector<double>(total_send, r + 1));
    DeviceBuffer vr(DataType::kInt32, std::vector<double>(static_cast<size_t>(n * (r + 1)), 0));
    ExpectOk(c.AllToAllV(vs.buffer(), vr.buffer(), counts), "alltoallv");
    got = vr.Read();
    for (int q = 0; q < n; ++q) {
      for (int k = 0; k <= r; ++k) ASSERT_EQ(got[static_cast<size_t>(q * (r + 1) + k)], q + 1);
    }
    if (n > 1) {
      DeviceBuffer out(DataType::kFloat64, RankValues(r, kCount));
      DeviceBuffer in(DataType::kFloat64, std::vector<double>(kCount, 0));
      const int next = (r + 1) % n;
      const int prev = (r + n - 1) % n;
      // Sends on a stream of their own: on one stream every rank's send
      // would wait for a receive queued behind its neighbour's send.
      cudaStream_t send_stream = nullptr;
      ASSERT_EQ(cudaStreamCreateWithFlags(&send_stream, cudaStreamNonBlocking), cudaSuccess);
      OpOptions on_send_stream;
      on_send_stream.stream = send_stream;
      absl::StatusOr<std::unique_ptr<Work>> sent = c.Send(out.buffer(), next, on_send_stream);
      ExpectOk(c.Recv(in.buffer(), prev), "recv");
      ExpectOk(std::move(sent), "send");
      EXPECT_EQ(in.Read(), RankValues(prev, kCount));
      cudaStreamDestroy(send_stream);
    }
    ExpectOk(c.Barrier(), "barrier");
  });
}

// Completion through events on the caller's stream: work queued behind a
// memset on that stream sees the memset's value.
TEST(NcclGpu, WorkOnANonDefaultStreamCompletesInStreamOrder) {
  SKIP_WITHOUT_RANKS(1);
  const int n = Ranks();
  RunRanks(n, [&](int r, Communicator& c) {
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    const size_t count = size_t{16} << 20;  // 64 MiB of int32: takes a while
    DeviceBuffer x(DataType::kInt32, std::vector<double>(count, 0));
    ASSERT_EQ(cudaMemsetAsync(x.data, 1, count * 4, stream), cudaSuccess);  // 0x01010101
    OpOptions o;
    o.stream = stream;
    absl::StatusOr<std::unique_ptr<Work>> work =
        c.AllReduce(x.buffer(), x.buffer(), ReduceOp::kMax, o);
    ASSERT_TRUE(work.ok()) << work.status();
    ASSERT_TRUE((*work)->Wait(absl::Now() + absl::Seconds(30)).ok());
    absl::StatusOr<bool> done = (*work)->Test();
    ASSERT_TRUE(done.ok());
    EXPECT_TRUE(*done);
    // The event fired, so the stream has passed the collective.
    EXPECT_EQ(cudaStreamQuery(stream), cudaSuccess);
    int32_t first = 0;
    ASSERT_EQ(cudaMemcpy(&first, x.data, 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(first, 0x01010101);
    cudaStreamDestroy(stream);
  });
}

std::atomic<bool> g_release{false};
void CUDART_CB Stall(void*) {
  while (!g_release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

// A collective stuck behind a stalled stream passes its deadline: the
// watchdog fails it, naming the operation, without anyone waiting.
TEST(NcclGpu, AStuckCollectiveFailsAtItsDeadline) {
  SKIP_WITHOUT_RANKS(1);
  RunRanks(
      1,
      [&](int, Communicator& c) {
        cudaStream_t stream = nullptr;
        ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
        g_release = false;
        ASSERT_EQ(cudaLaunchHostFunc(stream, &Stall, nullptr), cudaSuccess);
        DeviceBuffer x(DataType::kFloat32, std::vector<double>(4, 1));
        OpOptions o;
        o.stream = stream;
        o.timeout = absl::Milliseconds(300);
        absl::StatusOr<std::unique_ptr<Work>> work =
            c.AllReduce(x.buffer(), x.buffer(), ReduceOp::kSum, o);
        ASSERT_TRUE(work.ok()) << work.status();
        const absl::Time start = absl::Now();
        absl::Status s = (*work)->Wait(absl::Now() + absl::Seconds(20));
        EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
        EXPECT_THAT(s.message(), HasSubstr("allreduce(sum, 4 x fp32) on group world"));
        EXPECT_LT(absl::Now() - start, absl::Seconds(5));
        EXPECT_FALSE(c.AsyncError().ok());
        // Should NCCL's abort wait for the queued kernel, the stall ends after
        // 3 s, so the test cannot hang; the abort must still return in bounded
        // time.
        std::thread releaser([] {
          absl::SleepFor(absl::Seconds(3));
          g_release = true;
        });
        const absl::Time abort_start = absl::Now();
        EXPECT_TRUE(c.Abort().ok());
        EXPECT_LT(absl::Now() - abort_start, absl::Seconds(10));
        releaser.join();
        cudaStreamSynchronize(stream);
        cudaStreamDestroy(stream);
      },
      absl::Seconds(30));
}

// Abort while a collective is in flight (rank 0 never joins it): the
// others' waits end promptly with Aborted, well within their deadline.
TEST(NcclGpu, AbortDuringAnInFlightCollectiveReturnsWithinItsDeadline) {
  SKIP_WITHOUT_RANKS(2);
  const int n = Ranks();
  RunRanks(n, [&](int r, Communicator& c) {
    DeviceBuffer x(DataType::kFloat32, std::vector<double>(1 << 20, 1));
    if (r == 0) {
      absl::SleepFor(absl::Seconds(2));
      EXPECT_TRUE(c.Abort().ok());
      return;
    }
    absl::StatusOr<std::unique_ptr<Work>> work =
        c.AllReduce(x.buffer(), x.buffer(), ReduceOp::kSum);
    ASSERT_TRUE(work.ok()) << work.status();
    std::thread aborter([&] {
      absl::SleepFor(absl::Milliseconds(500));
      EXPECT_TRUE(c.Abort().ok());
    });
    const absl::Time start = absl::Now();
    absl::Status s = (*work)->Wait(absl::Now() + absl::Seconds(30));
    aborter.join();
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    absl::StatusOr<std::unique_ptr<Work>> after = c.Barrier();
    EXPECT_EQ(after.status().code(), absl::StatusCode::kFailedPrecondition);
  });
}

TEST(NcclGpu, SplitAndShrinkMakeWorkingChildren) {
  SKIP_WITHOUT_RANKS(1);
  const int n = Ranks();
  RunRanks(n, [&](int r, Communicator& c) {
    {
      CommOptions half;
      half.name = "half";
      absl::StatusOr<std::unique_ptr<Communicator>> child = c.Split(r % 2, r, half);
      ASSERT_TRUE(child.ok()) << child.status();
      ASSERT_NE(*child, nullptr);
      EXPECT_EQ((*child)->size(), (n + 1 - r % 2) / 2);
      DeviceBuffer x(DataType::kFloat32, std::vector<double>(8, r));
      ExpectOk((*child)->AllReduce(x.buffer(), x.buffer(), ReduceOp::kSum), "child allreduce");
      double want = 0;
      for (int q = r % 2; q < n; q += 2) want += q;
      EXPECT_EQ(x.Read()[0], want);
      absl::StatusOr<std::unique_ptr<Communicator>> none = c.Split(-1, 0, half);
      ASSERT_TRUE(none.ok()) << none.status();
      EXPECT_EQ(*none, nullptr);
    }  // the children are finalized and destroyed here, on every rank
    CommOptions shrunk_options;
    shrunk_options.name = "shrunk";
    std::vector<int> excluded;
    if (n > 1) excluded.push_back(n - 1);
    if (r == n - 1 && n > 1) {  // the excluded rank takes no part
      EXPECT_TRUE(c.Abort().ok());
      return;
    }
    absl::StatusOr<std::unique_ptr<Communicator>> shrunk = c.Shrink(excluded, shrunk_options);
    if (shrunk.status().code() == absl::StatusCode::kFailedPrecondition) {
      GTEST_SKIP() << shrunk.status();  // an NCCL older than 2.27
    }
    ASSERT_TRUE(shrunk.ok()) << shrunk.status();
    EXPECT_EQ((*shrunk)->size(), n > 1 ? n - 1 : 1);
    EXPECT_EQ((*shrunk)->rank(), r);
    DeviceBuffer y(DataType::kInt32, std::vector<double>(8, 1));
    ExpectOk((*shrunk)->AllReduce(y.buffer(), y.buffer(), ReduceOp::kSum), "shrunk allreduce");
    EXPECT_EQ(y.Read()[0], (*shrunk)->size());
    // The parent is abandoned after a shrink, as the elastic layer does: it
    // is released with abort (its excluded rank is gone).
    EXPECT_TRUE(c.Abort().ok());
  });
}

}  // namespace
}  // namespace strata::nccl
