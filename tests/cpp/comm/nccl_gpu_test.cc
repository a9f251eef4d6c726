// What is the NCCL backend's own, on real GPUs: ranks are threads of this
// process, one per visible device, bootstrapped through a memory store.
// Every test skips (with the reason) where no GPU is visible; the device
// machine runs them. What every backend must do (every collective and dtype
// against a reference, split, shrink, misuse, recording) is the conformance
// suite, on NCCL in comm_conformance_nccl_test.
#include <cuda_runtime_api.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/half.h"
#include "comm/nccl/nccl_communicator.h"
#include "strata/base/dtype.h"
#include "strata/comm/backend.h"

namespace strata::nccl {
namespace {

using ::testing::HasSubstr;

#define SKIP_WITHOUT_GPUS(n)                                                               \
  do {                                                                                     \
    if (VisibleDeviceCount() < (n)) {                                                      \
      GTEST_SKIP() << "needs " << (n) << " CUDA device(s); " << VisibleDeviceCount()       \
                   << " visible (the NCCL backend's GPU tests run on the device machine)"; \
    }                                                                                      \
  } while (0)

int Ranks() { return std::min(VisibleDeviceCount(), 8); }

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

// Runs fn(rank, comm) on `n` ranks, each a thread with its own device.
void RunRanks(int n, const std::function<void(int, Communicator&)>& fn,
              absl::Duration timeout = absl::Seconds(60)) {
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
  SKIP_WITHOUT_GPUS(1);
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

// Completion through events on the caller's stream: work queued behind a
// memset on that stream sees the memset's value.
TEST(NcclGpu, WorkOnANonDefaultStreamCompletesInStreamOrder) {
  SKIP_WITHOUT_GPUS(1);
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
  SKIP_WITHOUT_GPUS(1);
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
  SKIP_WITHOUT_GPUS(2);
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

// Each root has a watchdog of its own, at its own interval, which its
// splits share and which outlives the root while a split holds it.
TEST(NcclGpu, EachRootHasAWatchdogOfItsOwnAtItsInterval) {
  SKIP_WITHOUT_GPUS(1);
  cudaSetDevice(0);
  auto make = [](absl::Duration interval) {
    RootOptions options;
    options.backend = "nccl";
    options.store = MakeMemoryStore();
    options.comm.timeout = absl::Seconds(60);
    options.nccl.device = 0;
    options.nccl.watchdog_interval = interval;
    return CreateRootCommunicator(LaunchEnv{}, options);
  };
  absl::StatusOr<std::unique_ptr<Communicator>> a = make(absl::Milliseconds(5));
  absl::StatusOr<std::unique_ptr<Communicator>> b = make(absl::Milliseconds(50));
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  const Watchdog& wa = static_cast<NcclCommunicator&>(**a).watchdog();
  const Watchdog& wb = static_cast<NcclCommunicator&>(**b).watchdog();
  EXPECT_NE(&wa, &wb);
  EXPECT_EQ(wa.interval(), absl::Milliseconds(5));
  EXPECT_EQ(wb.interval(), absl::Milliseconds(50));
  CommOptions child_options;
  child_options.name = "child";
  absl::StatusOr<std::unique_ptr<Communicator>> child = (*a)->Split(0, 0, child_options);
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(&static_cast<NcclCommunicator&>(**child).watchdog(), &wa);
  a->reset();  // the root goes; its split keeps the family and its watchdog
  DeviceBuffer x(DataType::kFloat32, std::vector<double>(4, 2));
  ExpectOk((*child)->AllReduce(x.buffer(), x.buffer(), ReduceOp::kSum), "child allreduce");
  EXPECT_EQ(x.Read()[0], 2);
  ExpectOk((*b)->Barrier(), "the other root's barrier");
}

}  // namespace
}  // namespace strata::nccl
