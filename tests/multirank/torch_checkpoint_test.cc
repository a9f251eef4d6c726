// strata::torch checkpoints across real ranks (mpirun, 4 ranks): the
// strata::nn tensor-parallel layers and their Adam state saved at tp = 2 x
// dp = 2 (whole tensors and tp shards written once across their replicas),
// loaded collectively at tp = 1 and tp = 4. The reference is the global
// tensors assembled from every rank's shards, which each rank also writes
// with torch::save before the checkpoint.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "harness.h"
#include "strata/torch/checkpoint.h"

namespace strata::testing {
namespace {

using ::strata::nn::InitOptions;
using ::strata::nn::LoadModuleState;
using ::strata::nn::ModuleState;
using ::strata::nn::ParallelMLPOptions;
using ::strata::nn::SaveModuleStateSync;
using ::torch::Tensor;

constexpr int64_t kHidden = 8, kFfn = 16, kVocab = 16;

struct TpNetImpl : ::torch::nn::Module {
  TpNetImpl(Communicator& comm, uint64_t seed) {
    const GroupHandle tp = GroupHandle::Fixed(&comm);
    emb = register_module("emb", nn::VocabParallelEmbedding(EmbeddingOptions{kVocab, kHidden}, tp,
                                                            InitOptions{seed}));
    ParallelMLPOptions mo;
    mo.hidden = kHidden;
    mo.ffn_hidden = kFfn;
    mlp = register_module("mlp", nn::ParallelMLP(mo, tp, InitOptions{seed}));
    norm =
        register_module("norm", ::torch::nn::LayerNorm(::torch::nn::LayerNormOptions({kHidden})));
  }
  nn::VocabParallelEmbedding emb{nullptr};
  nn::ParallelMLP mlp{nullptr};
  ::torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(TpNet);

// The dim each parameter is split along by tp; -1: whole.
int SplitDim(const std::string& key) {
  static const std::map<std::string, int> dims = {
      {"emb.weight", 0},    {"mlp.fc1.weight", 0}, {"mlp.fc1.bias", 0}, {"mlp.fc2.weight", 1},
      {"mlp.fc2.bias", -1}, {"norm.weight", -1},   {"norm.bias", -1}};
  return dims.at(key);
}

std::string SharedDirectory(Communicator& comm) {
  char path[256] = {};
  if (comm.rank() == 0) {
    const char* base = getenv("TEST_TMPDIR");
    std::string tmpl = std::string(base != nullptr ? base : "/tmp") + "/strata-torch-mr-XXXXXX";
    std::strncpy(path, tmpl.c_str(), sizeof(path) - 1);
    if (mkdtemp(path) == nullptr) path[0] = '\0';
  }
  auto w = comm.Broadcast(Buffer{path, sizeof(path), DataType::kUInt8}, 0);
  if (!w.ok() || !(*w)->Wait(absl::Now() + absl::Seconds(60)).ok()) return "";
  return path;
}

class TorchCheckpointMpiTest : public MultiRankTest {};

TEST_F(TorchCheckpointMpiTest, SavedAtTp2Dp2LoadsAtTp1AndTp4) {
  ASSERT_EQ(size(), 4) << "run on 4 ranks";
  const std::string dir = SharedDirectory(world());
  ASSERT_FALSE(dir.empty());
  const int tp_rank = rank() % 2, dp_rank = rank() / 2;
  std::vector<std::string> keys;
  {
    STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Communicator> tp,
                                world().Split(dp_rank, tp_rank, CommOptions{}));
    TpNet net(*tp, 11);
    ::torch::optim::Adam adam(net->parameters(), ::torch::optim::AdamOptions(0.1));
    for (int s = 0; s < 2; ++s) {
      for (auto& p : net->named_parameters()) {
        p.value().mutable_grad() = (p.value().detach() * 0.5 + 0.25 * (s + 1)).sin();
      }
      adam.step();
    }
    // The reference: this rank's values (dp replicas hold the same).
    std::vector<Tensor> mine;
    for (auto& p : net->named_parameters()) {
      keys.push_back(p.key());
      const auto& st = static_cast<::torch::optim::AdamParamState&>(
          *adam.state().at(p.value().unsafeGetTensorImpl()));
      mine.push_back(p.value().detach().clone());
      mine.push_back(st.exp_avg().clone());
      mine.push_back(st.exp_avg_sq().clone());
    }
    ::torch::save(mine, dir + "/ref-" + std::to_string(rank()) + ".pt");

    ModuleState st;
    st.module = net.get();
    st.optimizer = &adam;
    st.shard_replica = {dp_rank, 2};
    st.whole_replica = {rank(), 4};
    CheckpointOptions co;
    co.directory = dir + "/ckpt";
    co.split_from = GroupHandle::Fixed(&world());
    co.commit_timeout = absl::Seconds(120);
    STRATA_ASSERT_OK(SaveModuleStateSync(co, 9, st));
  }
  // The global tensors, from tp ranks 0 and 1 (world ranks 0 and 1).
  std::vector<Tensor> r0, r1;
  ::torch::load(r0, dir + "/ref-0.pt");
  ::torch::load(r1, dir + "/ref-1.pt");
  std::map<std::string, std::vector<Tensor>> global;  // key -> {param, exp_avg, exp_avg_sq}
  for (size_t i = 0; i < keys.size(); ++i) {
    const int dim = SplitDim(keys[i]);
    for (size_t j = 0; j < 3; ++j) {
      const Tensor& a = r0[3 * i + j];
      global[keys[i]].push_back(dim < 0 ? a : ::torch::cat({a, r1[3 * i + j]}, dim));
    }
  }

  for (int tp_size : {1, 4}) {
    SCOPED_TRACE("tp " + std::to_string(tp_size));
    const int color = tp_size == 1 ? rank() : 0;
    STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Communicator> tp,
                                world().Split(color, rank(), CommOptions{}));
    const int r = tp->rank();
    TpNet net(*tp, 12);
    ::torch::optim::Adam adam(net->parameters(), ::torch::optim::AdamOptions(0.1));
    ModuleState st;
    st.module = net.get();
    st.optimizer = &adam;
    LoadOptions lo;
    lo.directory = dir + "/ckpt";
    lo.group = GroupHandle::Fixed(&world());
    lo.timeout = absl::Seconds(120);
    STRATA_ASSERT_OK_AND_ASSIGN(LoadReport report, LoadModuleState(lo, st));
    EXPECT_EQ(report.step, 9);
    for (auto& p : net->named_parameters()) {
      const int dim = SplitDim(p.key());
      auto box = [&](const Tensor& g) {
        if (dim < 0) return g;
        const int64_t n = g.size(dim) / tp_size;
        return g.narrow(dim, n * r, n);
      };
      const auto& s = static_cast<::torch::optim::AdamParamState&>(
          *adam.state().at(p.value().unsafeGetTensorImpl()));
      const auto& g = global.at(p.key());
      EXPECT_TRUE(::torch::equal(p.value(), box(g[0]))) << p.key();
      EXPECT_TRUE(::torch::equal(s.exp_avg(), box(g[1]))) << p.key();
      EXPECT_TRUE(::torch::equal(s.exp_avg_sq(), box(g[2]))) << p.key();
      EXPECT_EQ(s.step(), 2) << p.key();
    }
  }
  auto w = world().Barrier();
  ASSERT_TRUE(w.ok());
  STRATA_ASSERT_OK((*w)->Wait(Deadline()));
  if (rank() == 0) std::filesystem::remove_all(dir);
}

// One rank cannot load (a buffer dtype strata does not store): it gets the
// error naming the key, and the others fail promptly naming that rank
// instead of waiting for their deadline.
TEST_F(TorchCheckpointMpiTest, ARankThatCannotLoadFailsEveryRank) {
  ASSERT_EQ(size(), 4) << "run on 4 ranks";
  const std::string dir = SharedDirectory(world());
  ASSERT_FALSE(dir.empty());
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Communicator> tp,
                              world().Split(0, rank(), CommOptions{}));
  TpNet net(*tp, 3);
  ModuleState st;
  st.module = net.get();
  st.whole_replica = {rank(), 4};
  CheckpointOptions co;
  co.directory = dir + "/ckpt";
  co.split_from = GroupHandle::Fixed(&world());
  co.commit_timeout = absl::Seconds(120);
  STRATA_ASSERT_OK(SaveModuleStateSync(co, 1, st));

  if (rank() == 1) net->register_buffer("z", ::torch::zeros({2}, ::torch::kComplexFloat));
  LoadOptions lo;
  lo.directory = dir + "/ckpt";
  lo.group = GroupHandle::Fixed(&world());
  lo.timeout = absl::Seconds(120);
  absl::StatusOr<LoadReport> r = LoadModuleState(lo, st);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  if (rank() == 1) {
    EXPECT_NE(r.status().message().find("'model.z'"), absl::string_view::npos) << r.status();
  } else {
    EXPECT_NE(r.status().message().find("rank 1"), absl::string_view::npos) << r.status();
    EXPECT_NE(r.status().message().find("model.z"), absl::string_view::npos) << r.status();
  }
  auto w = world().Barrier();
  ASSERT_TRUE(w.ok());
  STRATA_ASSERT_OK((*w)->Wait(Deadline()));
  if (rank() == 0) std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace strata::testing
