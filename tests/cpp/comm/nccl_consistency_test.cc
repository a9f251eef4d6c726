// CheckNcclConsistency over a test double: N threads, each with a
// Communicator that exchanges through shared memory. The logic (hashing,
// grouping, detail only for distinct configurations, the report) is tested
// here; the multi-rank test over the MPI backend comes with that backend.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "strata/comm/nccl_lint.h"

namespace strata {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Bytes = std::vector<uint8_t>;

// Rendezvous of N threads: each call blocks until all ranks have called,
// then every rank gets its slice of `combine(inputs)`. std::mutex, not
// absl::Mutex: Debian's shared abseil is not built for ThreadSanitizer, so
// TSan (label "threads") cannot see absl::Mutex's ordering.
class Hub {
 public:
  explicit Hub(int n) : n_(n) {}

  Bytes Exchange(int rank, Bytes in,
                 const std::function<std::vector<Bytes>(const std::vector<Bytes>&)>& combine) {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t gen = generation_;
    inputs_.resize(n_);
    inputs_[rank] = std::move(in);
    bytes_sent_ += inputs_[rank].size();
    if (++arrived_ == n_) {
      results_[gen] = combine(inputs_);
      arrived_ = 0;
      ++generation_;
      ++collectives_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != gen; });
    }
    Bytes out = results_[gen][rank];
    if (++taken_[gen] == n_) {
      results_.erase(gen);
      taken_.erase(gen);
    }
    return out;
  }
  int collectives() {
    std::lock_guard<std::mutex> lock(mu_);
    return collectives_;
  }
  size_t bytes_sent() {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_sent_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const int n_;
  int arrived_ = 0;
  int64_t generation_ = 0;
  int collectives_ = 0;
  size_t bytes_sent_ = 0;
  std::vector<Bytes> inputs_;
  std::map<int64_t, std::vector<Bytes>> results_;
  std::map<int64_t, int> taken_;
};

class DoneWork : public Work {
 public:
  absl::Status DoWait(absl::Time) override { return absl::OkStatus(); }
  absl::StatusOr<bool> Test() override { return true; }
  std::string Describe() const override { return "fake"; }
};

size_t Size(DataType t) { return t == DataType::kInt64 ? 8 : 1; }

bool Any(DataType) { return true; }

// Implements Communicator's hooks (Communicator validates first), with
// a hub that counts what the check costs.
class FakeComm : public Communicator {
 public:
  FakeComm(Hub* hub, int rank, int size)
      : Communicator(CommOptions{}, Membership{rank, size, rank}, CommCapabilities{&Any, &Any}),
        hub_(hub),
        rank_(rank) {}
  absl::string_view backend() const override { return "fake"; }
  MemoryKind memory() const override { return MemoryKind::kHost; }

  bool fail_ = false;

 protected:
  absl::StatusOr<std::unique_ptr<Work>> DoAllReduce(ConstBuffer send, Buffer recv, ReduceOp op,
                                                    const ResolvedOptions&) override {
    if (fail_) return absl::DeadlineExceededError("allreduce timed out on rank 3");
    if (op != ReduceOp::kMin || send.dtype != DataType::kInt64)
      return absl::UnimplementedError("fake");
    Bytes in(static_cast<const uint8_t*>(send.data),
             static_cast<const uint8_t*>(send.data) + send.count * 8);
    Bytes out = hub_->Exchange(rank_, in, [&](const std::vector<Bytes>& all) {
      std::vector<int64_t> m(send.count, INT64_MAX);
      for (const Bytes& b : all) {
        for (size_t i = 0; i < send.count; ++i) {
          int64_t v;
          std::memcpy(&v, b.data() + 8 * i, 8);
          m[i] = std::min(m[i], v);
        }
      }
      Bytes r(send.count * 8);
      std::memcpy(r.data(), m.data(), r.size());
      return std::vector<Bytes>(all.size(), r);
    });
    std::memcpy(recv.data, out.data(), out.size());
    return std::unique_ptr<Work>(new DoneWork);
  }
  absl::StatusOr<std::unique_ptr<Work>> DoAllGather(ConstBuffer send, Buffer recv,
                                                    const ResolvedOptions&) override {
    const size_t bytes = send.count * Size(send.dtype);
    Bytes in(static_cast<const uint8_t*>(send.data),
             static_cast<const uint8_t*>(send.data) + bytes);
    Bytes out = hub_->Exchange(rank_, in, [](const std::vector<Bytes>& all) {
      Bytes cat;
      for (const Bytes& b : all) cat.insert(cat.end(), b.begin(), b.end());
      return std::vector<Bytes>(all.size(), cat);
    });
    std::memcpy(recv.data, out.data(), out.size());
    return std::unique_ptr<Work>(new DoneWork);
  }
  absl::StatusOr<std::unique_ptr<Work>> DoBroadcast(Buffer buffer, int root,
                                                    const ResolvedOptions&) override {
    const size_t bytes = buffer.count * Size(buffer.dtype);
    Bytes in;
    if (rank_ == root)
      in.assign(static_cast<uint8_t*>(buffer.data), static_cast<uint8_t*>(buffer.data) + bytes);
    Bytes out = hub_->Exchange(rank_, in, [root](const std::vector<Bytes>& all) {
      return std::vector<Bytes>(all.size(), all[root]);
    });
    if (out.size() != bytes) return absl::InvalidArgumentError("broadcast size mismatch");
    std::memcpy(buffer.data, out.data(), bytes);
    return std::unique_ptr<Work>(new DoneWork);
  }
#define STRATA_FAKE_UNIMPLEMENTED(sig) \
  sig override { return absl::UnimplementedError("fake"); }
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> DoReduce(ConstBuffer, Buffer,
                                                                           ReduceOp, int,
                                                                           const ResolvedOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> DoReduceScatter(
      ConstBuffer, Buffer, ReduceOp, const ResolvedOptions&))
  STRATA_FAKE_UNIMPLEMENTED(
      absl::StatusOr<std::unique_ptr<Work>> DoAllToAll(ConstBuffer, Buffer, const ResolvedOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> DoAllToAllV(
      ConstBuffer, Buffer, const AllToAllCounts&, const ResolvedOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> DoBarrier(const ResolvedOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> DoSend(ConstBuffer, int,
                                                                         const ResolvedOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Work>> DoRecv(Buffer, int,
                                                                         const ResolvedOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Communicator>> DoSplit(
      int, int, const CommOptions&, const ResolvedOptions&))
  STRATA_FAKE_UNIMPLEMENTED(absl::StatusOr<std::unique_ptr<Communicator>> DoShrink(
      const ShrinkPlan&, const CommOptions&, const ResolvedOptions&))
#undef STRATA_FAKE_UNIMPLEMENTED
  absl::Status DoAbort() override { return absl::OkStatus(); }
  absl::Status DoRevoke() override { return absl::OkStatus(); }
  absl::Status DoAsyncError() override { return absl::OkStatus(); }

 private:
  Hub* hub_;
  int rank_;
};

EffectiveSettings Settings(std::map<std::string, std::string> env) {
  EffectiveSettings s;
  for (auto& [k, v] : env) s.settings.push_back({k, v, SettingSource::kEnvironment, "environment"});
  return s;
}

// Runs the check on `n` threads; rank r uses settings_of(r).
std::vector<absl::StatusOr<ConsistencyReport>> RunRanks(
    int n, const std::function<EffectiveSettings(int)>& settings_of, Hub* hub,
    const ConsistencyOptions& options = {}) {
  std::vector<absl::StatusOr<ConsistencyReport>> out(n, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      FakeComm comm(hub, r, n);
      out[r] = CheckNcclConsistency(comm, settings_of(r), options);
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

TEST(NcclConsistency, AgreeingRanksCostOneSmallAllReduce) {
  Hub hub(8);
  auto reports = RunRanks(
      8,
      [](int) {
        return Settings({{"NCCL_IB_HCA", "=mlx5_0"}});
      },
      &hub);
  for (auto& r : reports) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->consistent);
    ASSERT_EQ(r->groups.size(), 1u);
    EXPECT_EQ(r->groups[0], std::vector<int>({0, 1, 2, 3, 4, 5, 6, 7}));
  }
  EXPECT_EQ(hub.collectives(), 1);
  EXPECT_EQ(hub.bytes_sent(), 8u * 16u);  // two int64 per rank
}

TEST(NcclConsistency, NamesTheRanksAndVariablesThatDiffer) {
  Hub hub(8);
  auto settings_of = [](int r) {
    std::map<std::string, std::string> env = {{"NCCL_IB_HCA", "=mlx5_0"}, {"NCCL_DEBUG", "WARN"}};
    if (r == 6) env["NCCL_IB_HCA"] = "mlx5";
    if (r == 3) env.erase("NCCL_DEBUG");
    return Settings(env);
  };
  auto reports = RunRanks(8, settings_of, &hub);
  for (auto& r : reports) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(r->consistent);
    EXPECT_THAT(r->groups,
                ElementsAre(ElementsAre(0, 1, 2, 4, 5, 7), ElementsAre(3), ElementsAre(6)));
    ASSERT_EQ(r->differences.size(), 2u);
    EXPECT_EQ(r->differences[0].name, "NCCL_DEBUG");
    EXPECT_THAT(r->differences[0].values, ElementsAre("WARN", "", "WARN"));
    EXPECT_THAT(r->differences[1].values, ElementsAre("=mlx5_0", "=mlx5_0", "mlx5"));
    EXPECT_EQ(r->ToString(), reports[0]->ToString());  // every rank reports the same
  }
  std::string text = reports[0]->ToString();
  EXPECT_THAT(text, HasSubstr("ranks 0-2,4-5,7 (most common) | ranks 3 | ranks 6"));
  EXPECT_THAT(text, HasSubstr("NCCL_DEBUG: 'WARN' vs unset vs 'WARN'"));
  // all-reduce, all-gather, then a length and a body broadcast per configuration
  EXPECT_EQ(hub.collectives(), 2 + 2 * 3);
}

TEST(NcclConsistency, DetailIsBoundedWhenEveryRankDiffers) {
  Hub hub(6);
  ConsistencyOptions o;
  o.max_detailed_configs = 2;
  auto reports = RunRanks(
      6,
      [](int r) {
        return Settings({{"NCCL_DEBUG_FILE", "/tmp/nccl." + std::to_string(r)}});
      },
      &hub, o);
  ASSERT_TRUE(reports[0].ok());
  EXPECT_EQ(reports[0]->groups.size(), 6u);
  ASSERT_EQ(reports[0]->differences.size(), 1u);
  EXPECT_EQ(reports[0]->differences[0].values.size(), 2u);
  EXPECT_EQ(hub.collectives(), 2 + 2 * 2);

  // Variables that may differ per rank can be ignored.
  Hub hub2(6);
  o.ignore = {"NCCL_DEBUG_FILE"};
  auto same = RunRanks(
      6,
      [](int r) {
        return Settings({{"NCCL_DEBUG_FILE", "/tmp/nccl." + std::to_string(r)}});
      },
      &hub2, o);
  EXPECT_TRUE(same[0]->consistent);
}

TEST(NcclConsistency, CommunicatorErrorsAreAnnotated) {
  Hub hub(1);
  FakeComm comm(&hub, 0, 1);
  comm.fail_ = true;
  absl::StatusOr<ConsistencyReport> r = CheckNcclConsistency(comm, Settings({}));
  EXPECT_TRUE(absl::IsDeadlineExceeded(r.status()));
  EXPECT_THAT(r.status().message(),
              HasSubstr("checking NCCL settings across ranks: allreduce timed out"));
}

}  // namespace
}  // namespace strata
