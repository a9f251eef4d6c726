// strata::nn::DataParallel on ranks-as-threads (FakeGroup): training at
// dp 1, 2 and 4 equals the unsharded model trained on the whole batch here
// (float64: the fake group reduces in double, in rank order); four
// microbatches under NoSync equal one batch; the first bucket's all-reduce
// starts before backward ends (the recorded order of events); shapes,
// unused parameters and bucket orders that differ across ranks are named;
// a failed reduction is raised from backward after every bucket, leaves
// the parameters untouched, and the step is abandoned with ZeroGrad and
// Rebuild onto a new group.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fake_communicator.h"
#include "strata/torch/data_parallel.h"

namespace strata {
namespace {

using ::torch::Tensor;

void RunRanks(testing::FakeGroup& group, int size,
              const std::function<void(int, Communicator&)>& fn) {
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < size; ++r) comms.push_back(group.Comm(r));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) threads.emplace_back([&, r] { fn(r, *comms[r]); });
  for (auto& t : threads) t.join();
}

void RunRanks(int size, const std::function<void(int, Communicator&)>& fn) {
  testing::FakeGroup group(size, testing::FakeOrdering::kMatchPosted, "dp");
  RunRanks(group, size, fn);
}

struct MLPImpl : ::torch::nn::Module {
  explicit MLPImpl(int64_t out = 4) {
    fc1 = register_module("fc1", ::torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", ::torch::nn::Linear(16, 16));
    fc3 = register_module("fc3", ::torch::nn::Linear(16, 16));
    head = register_module("head", ::torch::nn::Linear(16, out));
    to(::torch::kFloat64);
  }
  Tensor forward(Tensor x) {
    x = ::torch::tanh(fc1->forward(x));
    x = ::torch::tanh(fc2->forward(x));
    x = ::torch::tanh(fc3->forward(x));
    return head->forward(x);
  }
  ::torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr}, head{nullptr};
};
TORCH_MODULE(MLP);

// `n` identical models (made on this thread: the generator is global).
std::vector<MLP> Models(int n, uint64_t seed = 0) {
  std::vector<MLP> out;
  for (int i = 0; i < n; ++i) {
    ::torch::manual_seed(seed);
    out.emplace_back();
  }
  return out;
}

// The global batch of `step`, from a generator of its own (ranks are threads).
std::pair<Tensor, Tensor> Batch(int step, int64_t rows = 16) {
  ::at::Generator gen = ::at::make_generator<::at::CPUGeneratorImpl>(1000 + step);
  Tensor x = ::torch::randn({rows, 8}, gen, ::torch::kFloat64);
  return {x, ::torch::sin(2 * x.narrow(1, 0, 4))};
}

Tensor Part(const Tensor& t, int rank, int size) {
  return t.tensor_split(size).at(static_cast<size_t>(rank));
}

double RelDiff(const Tensor& a, const Tensor& b) {
  return ((a - b).norm() / b.norm()).item<double>();
}

class DataParallelTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { ::torch::set_num_threads(1); }
};

nn::DataParallelOptions SmallBuckets() {
  nn::DataParallelOptions o;
  o.bucket_bytes = 1024;
  o.record_events = true;
  return o;
}

TEST_P(DataParallelTest, TrainingEqualsTheUnshardedModel) {
  const int dp = GetParam();
  const int steps = 10;
  std::vector<MLP> models = Models(dp + 1);
  MLP ref = models.back();
  {
    ::torch::optim::Adam opt(ref->parameters(), 1e-2);
    for (int s = 0; s < steps; ++s) {
      auto [x, y] = Batch(s);
      opt.zero_grad();
      ::torch::mse_loss(ref->forward(x), y).backward();
      opt.step();
    }
  }
  std::vector<std::vector<Tensor>> got(static_cast<size_t>(dp));
  std::vector<int> buckets(static_cast<size_t>(dp));
  RunRanks(dp, [&](int rank, Communicator& comm) {
    MLP m = models[static_cast<size_t>(rank)];
    auto ddp =
        nn::DataParallel::Create(m->named_parameters(), GroupHandle::Fixed(&comm), SmallBuckets());
    ASSERT_TRUE(ddp.ok()) << ddp.status();
    ::torch::optim::Adam opt(m->parameters(), 1e-2);
    for (int s = 0; s < steps; ++s) {
      auto [x, y] = Batch(s);
      (*ddp)->ZeroGrad();
      ::torch::mse_loss(m->forward(Part(x, rank, dp)), Part(y, rank, dp)).backward();
      opt.step();
    }
    buckets[static_cast<size_t>(rank)] = (*ddp)->num_buckets();
    for (const Tensor& p : m->parameters()) got[static_cast<size_t>(rank)].push_back(p.detach());
  });
  std::vector<Tensor> want = ref->parameters();
  for (int r = 0; r < dp; ++r) {
    EXPECT_GE(buckets[static_cast<size_t>(r)], 3);
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_LE(RelDiff(got[static_cast<size_t>(r)][i], want[i]), 1e-12)
          << "rank " << r << " parameter " << i;
    }
  }
}

TEST_P(DataParallelTest, FourMicrobatchesUnderNoSyncEqualOneBatch) {
  const int dp = GetParam();
  std::vector<MLP> models = Models(2 * dp);
  std::vector<Tensor> one, four;
  std::vector<int64_t> launches(static_cast<size_t>(dp));
  RunRanks(dp, [&](int rank, Communicator& comm) {
    for (int micro : {1, 4}) {
      MLP m = models[static_cast<size_t>(rank + (micro == 4 ? dp : 0))];
      auto ddp =
          nn::DataParallel::Create(m->named_parameters(), GroupHandle::Fixed(&comm), SmallBuckets())
              .value();
      ::torch::optim::Adam opt(m->parameters(), 1e-2);
      for (int s = 0; s < 3; ++s) {
        auto [x, y] = Batch(s);
        Tensor xs = Part(x, rank, dp), ys = Part(y, rank, dp);
        ddp->ZeroGrad();
        for (int k = 0; k < micro; ++k) {
          Tensor loss =
              ::torch::mse_loss(m->forward(xs.tensor_split(micro)[k]), ys.tensor_split(micro)[k]) /
              micro;
          if (k + 1 < micro) {
            nn::DataParallel::NoSync no_sync(*ddp);
            loss.backward();
          } else {
            loss.backward();
          }
        }
        opt.step();
      }
      if (rank == 0) {
        for (const Tensor& p : m->parameters()) (micro == 1 ? one : four).push_back(p.detach());
      }
      if (micro == 4) {
        int64_t n = 0;
        for (const auto& e : ddp->events()) n += e.kind == nn::DataParallelEvent::Kind::kLaunch;
        launches[static_cast<size_t>(rank)] = n / ddp->num_buckets();
      }
    }
  });
  ASSERT_EQ(one.size(), four.size());
  for (size_t i = 0; i < one.size(); ++i) EXPECT_LE(RelDiff(four[i], one[i]), 1e-12) << i;
  for (int64_t l : launches) EXPECT_EQ(l, 3);  // once per step, not per microbatch
}

INSTANTIATE_TEST_SUITE_P(Dp, DataParallelTest, ::testing::Values(1, 2, 4));

TEST(DataParallelOverlap, FirstBucketStartsBeforeBackwardEnds) {
  ::torch::set_num_threads(1);
  std::vector<MLP> models = Models(2);
  RunRanks(2, [&](int rank, Communicator& comm) {
    MLP m = models[static_cast<size_t>(rank)];
    nn::DataParallelOptions o = SmallBuckets();
    o.bucket_bytes = 600;
    auto ddp =
        nn::DataParallel::Create(m->named_parameters(), GroupHandle::Fixed(&comm), o).value();
    for (int s = 0; s < 2; ++s) {  // the first backward sets the layout
      auto [x, y] = Batch(s);
      ddp->ZeroGrad();
      ::torch::mse_loss(m->forward(Part(x, rank, 2)), Part(y, rank, 2)).backward();
    }
    using K = nn::DataParallelEvent::Kind;
    const auto& ev = ddp->events();
    size_t i = 0;
    while (ev[i].kind != K::kLayout) ++i;
    size_t launch0 = 0, last_ready = 0, end = 0;
    for (size_t j = i + 1; j < ev.size() && end == 0; ++j) {
      if (ev[j].kind == K::kLaunch && ev[j].index == 0) launch0 = j;
      if (ev[j].kind == K::kReady) last_ready = j;
      if (ev[j].kind == K::kBackwardEnd) end = j;
    }
    EXPECT_GE(ddp->num_buckets(), 3);
    EXPECT_GT(launch0, i);
    EXPECT_LT(launch0, last_ready) << "bucket 0 started only after the last gradient";
    EXPECT_LT(last_ready, end);
  });
}

TEST(DataParallelErrors, ShapeThatDiffersAcrossRanksIsNamed) {
  ::torch::set_num_threads(1);
  std::vector<std::string> messages(4);
  RunRanks(4, [&](int rank, Communicator& comm) {
    ::torch::nn::Linear l(8, rank == 2 ? 5 : 4);
    auto ddp = nn::DataParallel::Create(l->named_parameters(), GroupHandle::Fixed(&comm));
    ASSERT_FALSE(ddp.ok());
    EXPECT_EQ(ddp.status().code(), absl::StatusCode::kInvalidArgument);
    messages[static_cast<size_t>(rank)] = std::string(ddp.status().message());
  });
  for (const std::string& m : messages) {
    EXPECT_NE(m.find("'weight'"), std::string::npos) << m;
    EXPECT_NE(m.find("shape [4, 8] Float on dp rank 0 but shape [5, 8] Float on dp rank 2"),
              std::string::npos)
        << m;
  }
}

struct TwoHeadsImpl : ::torch::nn::Module {
  TwoHeadsImpl() {
    body = register_module("body", ::torch::nn::Linear(4, 4));
    used = register_module("used", ::torch::nn::Linear(4, 2));
    spare = register_module("spare", ::torch::nn::Linear(4, 2));
  }
  Tensor forward(const Tensor& x) { return used->forward(body->forward(x)); }
  ::torch::nn::Linear body{nullptr}, used{nullptr}, spare{nullptr};
};
TORCH_MODULE(TwoHeads);

TEST(DataParallelErrors, UnusedParametersAreNamedOnEveryRank) {
  ::torch::set_num_threads(1);
  RunRanks(2, [&](int rank, Communicator& comm) {
    TwoHeads m;
    auto ddp = nn::DataParallel::Create(m->named_parameters(), GroupHandle::Fixed(&comm)).value();
    try {
      m->forward(::torch::ones({3, 4})).sum().backward();
      ADD_FAILURE() << "backward did not raise";
    } catch (const c10::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("unused parameters"), std::string::npos) << what;
      EXPECT_NE(what.find("'spare.weight'"), std::string::npos) << what;
      EXPECT_NE(what.find("find_unused_parameters"), std::string::npos) << what;
    }
  });
  RunRanks(2, [&](int rank, Communicator& comm) {
    TwoHeads m;
    nn::DataParallelOptions o;
    o.find_unused_parameters = true;
    auto ddp =
        nn::DataParallel::Create(m->named_parameters(), GroupHandle::Fixed(&comm), o).value();
    m->forward(::torch::ones({3, 4})).sum().backward();
    EXPECT_EQ(m->spare->weight.grad().abs().sum().item<float>(), 0.0f);
    EXPECT_GT(m->used->weight.grad().abs().sum().item<float>(), 0.0f);
  });
}

struct BranchesImpl : ::torch::nn::Module {
  explicit BranchesImpl(bool b_first) : b_first(b_first) {
    a = register_module("a", ::torch::nn::Linear(4, 4));
    b = register_module("b", ::torch::nn::Linear(4, 4));
  }
  Tensor forward(const Tensor& x) {
    if (b_first) {
      Tensor hb = b->forward(x);
      return a->forward(x) + hb;
    }
    Tensor ha = a->forward(x);
    return ha + b->forward(x);
  }
  bool b_first;
  ::torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Branches);

TEST(DataParallelErrors, BucketOrderThatDiffersAcrossRanksIsNamed) {
  ::torch::set_num_threads(1);
  RunRanks(2, [&](int rank, Communicator& comm) {
    Branches m(rank == 1);
    nn::DataParallelOptions o;
    o.bucket_bytes = 64;
    auto ddp =
        nn::DataParallel::Create(m->named_parameters(), GroupHandle::Fixed(&comm), o).value();
    try {
      m->forward(::torch::ones({2, 4})).sum().backward();
      ADD_FAILURE() << "backward did not raise";
    } catch (const c10::Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("bucket mismatch: position 0"), std::string::npos) << what;
      EXPECT_NE(what.find("'b.bias' on dp rank 0 but 'a.bias' on dp rank 1"), std::string::npos)
          << what;
    }
  });
}

TEST(DataParallelFailure, AFailedReductionIsAbandonedWholeAndTrainingGoesOnOnANewGroup) {
  ::torch::set_num_threads(1);
  const int dp = 2;
  std::vector<MLP> models = Models(dp + 1);
  MLP ref = models.back();
  {
    ::torch::optim::SGD opt(ref->parameters(), 0.1);
    for (int s : {0, 2}) {  // step 1 is abandoned
      auto [x, y] = Batch(s);
      opt.zero_grad();
      ::torch::mse_loss(ref->forward(x), y).backward();
      opt.step();
    }
  }
  testing::FakeGroup first(dp, testing::FakeOrdering::kMatchPosted, "dp");
  testing::FakeGroup second(dp, testing::FakeOrdering::kMatchPosted, "dp-rebuilt");
  std::vector<std::unique_ptr<Communicator>> a, b;
  for (int r = 0; r < dp; ++r) {
    a.push_back(first.Comm(r));
    b.push_back(second.Comm(r));
  }
  std::vector<std::thread> threads;
  std::vector<std::vector<Tensor>> got(dp);
  for (int rank = 0; rank < dp; ++rank) {
    threads.emplace_back([&, rank] {
      MLP m = models[static_cast<size_t>(rank)];
      auto ddp = nn::DataParallel::Create(m->named_parameters(), GroupHandle::Fixed(a[rank].get()))
                     .value();
      ::torch::optim::SGD opt(m->parameters(), 0.1);
      auto train = [&](int s) {
        auto [x, y] = Batch(s);
        ddp->ZeroGrad();
        ::torch::mse_loss(m->forward(Part(x, rank, dp)), Part(y, rank, dp)).backward();
        opt.step();
      };
      train(0);
      std::vector<Tensor> before;
      for (const Tensor& p : m->parameters()) before.push_back(p.detach().clone());
      ASSERT_TRUE(a[rank]->Abort().ok());  // the group breaks under step 1
      auto [x, y] = Batch(1);
      bool raised = false;
      try {
        ::torch::mse_loss(m->forward(Part(x, rank, dp)), Part(y, rank, dp)).backward();
      } catch (const c10::Error& e) {
        raised = true;
      }
      EXPECT_TRUE(raised);
      // Abandoned: nothing stepped, and the failure is remembered until ZeroGrad.
      auto params = m->parameters();
      for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(params[i].equal(before[i]));
      absl::Status s = ddp->FinishGradSync();
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
      EXPECT_NE(s.message().find("abandon the step"), absl::string_view::npos) << s;
      ASSERT_TRUE(ddp->Rebuild(GroupHandle::Fixed(b[rank].get())).ok());
      train(2);
      for (const Tensor& p : m->parameters()) got[rank].push_back(p.detach());
    });
  }
  for (auto& t : threads) t.join();
  std::vector<Tensor> want = ref->parameters();
  for (int r = 0; r < dp; ++r) {
    ASSERT_EQ(got[r].size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) EXPECT_LE(RelDiff(got[r][i], want[i]), 1e-12);
  }
}

}  // namespace
}  // namespace strata
