// The communicator conformance suite: one set of tests every backend passes
// (suite.cc), run on an environment that gives each rank a root
// communicator:
//
//   in-process (ranks as threads)   the fake (tests/cpp/parallel), 1 2 4 8 ranks
//                                   Gloo through a memory store, 2 and 4 ranks
//                                   NCCL, one GPU per rank (skips without them)
//                                   MPI's singleton world of one
//   launched (one rank a process)   MPI under mpirun, Gloo under torchrun, 2 4 8
//
// A test is a body every rank runs with its root communicator:
//
//   TEST_P(Conformance, Something) {
//     OnEveryRank([&](Communicator& world) {
//       Tensor x(memory(), DataType::kFloat32, 4);  // in the backend's memory
//       ...
//     });
//   }
//
// Like the multirank harness, a test checks data with non-fatal
// expectations, so that a rank that finds a mismatch keeps issuing the same
// operations as the others; a launched environment then votes after each
// test, so every rank agrees it failed.
//
// Thread-safety: an Env runs a body on several threads at once (one per
// rank); its memory may be used from all of them.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "strata/base/status.h"
#include "strata/comm/communicator.h"
#include "strata/observe/op_record.h"
#include "typed.h"

namespace strata::testing {

// Where the backend's buffers live, and how the host reads and writes them.
class Memory {
 public:
  virtual ~Memory() = default;
  // True when buffers are host memory (Allocate is never called then).
  virtual bool host() const = 0;
  virtual void* Allocate(size_t bytes) = 0;
  virtual void Free(void* data) = 0;
  virtual void Upload(void* device, const void* host, size_t bytes) = 0;
  virtual void Download(void* host, const void* device, size_t bytes) = 0;
};

// Host memory (MPI, Gloo, the fake).
Memory& HostMemory();

// A typed buffer the test reads and writes on the host (Set, Get) and the
// communicator reads and writes in its memory (buffer, slice); Upload and
// Download copy between the two (no-ops in host memory).
class Tensor {
 public:
  Tensor(Memory& memory, DataType dtype, size_t count);
  ~Tensor();
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  size_t count() const { return host_.count(); }
  void Set(size_t i, double v) { host_.Set(i, v); }
  double Get(size_t i) const { return host_.Get(i); }
  Buffer buffer() { return slice(0, host_.count()); }
  // Elements [offset, offset + n).
  Buffer slice(size_t offset, size_t n);
  void Upload();
  void Download();

 private:
  Memory& memory_;
  TypedBuffer host_;
  void* device_ = nullptr;  // null in host memory
};

// A world of ranks, each with a root communicator.
class Env {
 public:
  virtual ~Env() = default;
  // Runs body(root) on every rank this process holds (every rank when
  // ranks are threads, the one rank of this process when launched) and
  // returns when all are done.
  virtual void OnEveryRank(const std::function<void(Communicator& world)>& body) = 0;
  virtual Memory& memory() = 0;
  // The count the suite uses for its large cases (elements).
  virtual size_t large() const = 0;
  // After each test, with whether it failed here; a launched environment
  // makes every rank agree (and fails the test where it passed).
  virtual void AfterTest(bool failed) {}
};

// Ranks as threads of this process: each thread makes its root with
// `make_root(rank)` (null fails the test), runs the body, and waits for the
// other threads before destroying its root, so that no rank tears down a
// communicator its peers still use.
class ThreadEnv : public Env {
 public:
  using RootFactory = std::function<std::unique_ptr<Communicator>(int rank)>;
  ThreadEnv(int size, RootFactory make_root, Memory& memory, size_t large);
  void OnEveryRank(const std::function<void(Communicator& world)>& body) override;
  Memory& memory() override { return memory_; }
  size_t large() const override { return large_; }

  // Runs before each rank's root is made, on its thread (NCCL: the device).
  std::function<void(int rank)> on_thread;

 private:
  const int size_;
  const RootFactory make_root_;
  Memory& memory_;
  const size_t large_;
};

// One environment the suite is instantiated with.
struct EnvFactory {
  std::string name;  // the test-name suffix: "fake2", "gloo4", ...
  std::function<std::unique_ptr<Env>()> make;
  // Why it cannot run here (no GPU, ...); empty when it can.
  std::function<std::string()> unavailable;
};

std::string EnvName(const ::testing::TestParamInfo<EnvFactory>& info);
// For GoogleTest's messages: the name.
void PrintTo(const EnvFactory& factory, std::ostream* os);

class Conformance : public ::testing::TestWithParam<EnvFactory> {
 protected:
  void SetUp() override;
  void TearDown() override;

  void OnEveryRank(const std::function<void(Communicator& world)>& body) {
    env_->OnEveryRank(body);
  }
  Memory& memory() { return env_->memory(); }
  size_t large() const { return env_->large(); }

  static absl::Time Deadline(absl::Duration d = absl::Seconds(120)) { return absl::Now() + d; }
  static absl::Status Wait(Work& work) { return work.Wait(Deadline()); }

 private:
  std::unique_ptr<Env> env_;
};

// A sink that keeps every call it gets, for the recording tests.
class RecordingSink : public observe::OpSink {
 public:
  struct Call {
    enum Kind { kScheduled, kStarted, kCompleted } kind;
    observe::OpRecord record;
  };
  void OnScheduled(const observe::OpRecord& record) override;
  void OnStarted(const observe::OpRecord& record) override;
  void OnCompleted(const observe::OpRecord& record) override;
  struct Waited {
    std::string group;
    observe::OpKind kind;
    int64_t ns;
  };
  void OnWaited(const observe::CommRecord& comm, observe::OpKind kind, int64_t ns) override;

  std::vector<Call> calls() const;
  std::vector<Waited> waits() const;
  // The records as last seen (completed where they completed), in the
  // order they were scheduled.
  std::vector<observe::OpRecord> records() const;

 private:
  mutable std::mutex mu_;
  std::vector<Call> calls_;
  std::vector<Waited> waits_;
};

}  // namespace strata::testing

// As in tests/multirank/harness.h (which launched environments also use).
#ifndef STRATA_ASSERT_OK
#define STRATA_ASSERT_OK(expr)                           \
  do {                                                   \
    const ::absl::Status strata_s_ = (expr);             \
    ASSERT_TRUE(strata_s_.ok()) << strata_s_.ToString(); \
  } while (0)
#define STRATA_EXPECT_OK(expr)                           \
  do {                                                   \
    const ::absl::Status strata_s_ = (expr);             \
    EXPECT_TRUE(strata_s_.ok()) << strata_s_.ToString(); \
  } while (0)
#define STRATA_ASSERT_OK_AND_ASSIGN(lhs, rexpr) \
  STRATA_ASSERT_OK_AND_ASSIGN_IMPL(STRATA_INTERNAL_CONCAT(strata_or_, __LINE__), lhs, rexpr)
#define STRATA_ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                     \
  ASSERT_TRUE(tmp.ok()) << tmp.status().ToString();       \
  lhs = std::move(tmp).value()
#endif
