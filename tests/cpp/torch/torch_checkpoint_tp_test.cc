// Checkpoints of the strata::nn tensor-parallel layers (and Adam state
// sharded like them) saved at tp = 2 and loaded at tp = 1, 2 and 4. Each
// "rank" is a thread; the checkpoint's commit agreement and the collective
// load run over the in-process communicator of the checkpoint tests, the
// modules over another (building them communicates nothing). The reference
// is the global tensors assembled in the test from the tp = 2 shards.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fake_communicator.h"  // tests/cpp/checkpoint
#include "strata/torch/checkpoint.h"

namespace strata::nn {
namespace {

using testing_util::FakeHub;
using ::torch::Tensor;

constexpr int64_t kHidden = 8, kFfn = 16, kVocab = 16;

// An embedding, a column- then row-parallel linear and a whole LayerNorm.
struct TpNetImpl : ::torch::nn::Module {
  TpNetImpl(Communicator& comm, uint64_t seed) {
    const GroupHandle tp = GroupHandle::Fixed(&comm);
    emb = register_module(
        "emb", VocabParallelEmbedding(EmbeddingOptions{kVocab, kHidden}, tp, InitOptions{seed}));
    ParallelMLPOptions mo;
    mo.hidden = kHidden;
    mo.ffn_hidden = kFfn;
    mlp = register_module("mlp", ParallelMLP(mo, tp, InitOptions{seed}));
    norm =
        register_module("norm", ::torch::nn::LayerNorm(::torch::nn::LayerNormOptions({kHidden})));
  }
  VocabParallelEmbedding emb{nullptr};
  ParallelMLP mlp{nullptr};
  ::torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(TpNet);

// How each parameter of TpNet is split by tp: the dim, or -1 for whole.
const std::map<std::string, int>& SplitDims() {
  static const auto* dims = new std::map<std::string, int>{
      {"emb.weight", 0},    {"mlp.fc1.weight", 0}, {"mlp.fc1.bias", 0}, {"mlp.fc2.weight", 1},
      {"mlp.fc2.bias", -1}, {"norm.weight", -1},   {"norm.bias", -1}};
  return *dims;
}

// Runs fn(rank) on `n` threads.
void OnRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

struct Saved {
  std::map<std::string, Tensor> params, exp_avg, exp_avg_sq;  // global, assembled
  int64_t step = 0;
};

class ScratchDir {
 public:
  ScratchDir() {
    const char* base = getenv("TEST_TMPDIR");
    std::string tmpl = std::string(base != nullptr ? base : "/tmp") + "/strata-torch-tp-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    path_ = mkdtemp(buf.data());
  }
  ~ScratchDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

Tensor Assemble(const std::vector<Tensor>& shards, int dim) {
  return dim < 0 ? shards[0] : ::torch::cat(shards, dim);
}

// Two ranks at tp = 2 (dp = 1): perturb the parameters (so the test does
// not pass on initialisation alone), take two Adam steps, save.
Saved SaveAtTp2(const std::string& dir) {
  constexpr int kTp = 2;
  auto tp_hub = std::make_shared<FakeHub>(kTp);
  auto ck_hub = std::make_shared<FakeHub>(kTp);
  std::vector<std::map<std::string, Tensor>> params(kTp), m(kTp), v(kTp);
  std::vector<int64_t> steps(kTp);
  std::vector<absl::Status> results(kTp);
  OnRanks(kTp, [&](int rank) {
    std::unique_ptr<Communicator> tp = tp_hub->Endpoint(rank);
    std::unique_ptr<Communicator> ck = ck_hub->Endpoint(rank);
    TpNet net(*tp, 7);
    ::torch::optim::Adam adam(net->parameters(), ::torch::optim::AdamOptions(0.1));
    for (int s = 0; s < 2; ++s) {
      for (auto& p : net->named_parameters()) {
        // A gradient that is a function of the (sharded) value, so the
        // shards of the state are consistent with one global tensor.
        p.value().mutable_grad() = (p.value().detach() * 0.5 + 0.25 * (s + 1)).sin();
      }
      adam.step();
    }
    ModuleState st;
    st.module = net.get();
    st.optimizer = &adam;
    st.whole_replica = {rank, kTp};  // whole tensors: one copy per tp rank
    CheckpointOptions co;
    co.directory = dir;
    co.group = GroupHandle::Fixed(ck.get());
    co.commit_timeout = absl::Seconds(60);
    results[rank] = SaveModuleStateSync(co, 5, st);
    for (auto& p : net->named_parameters()) {
      params[rank][p.key()] = p.value().detach().clone();
      const auto& s = static_cast<::torch::optim::AdamParamState&>(
          *adam.state().at(p.value().unsafeGetTensorImpl()));
      m[rank][p.key()] = s.exp_avg().clone();
      v[rank][p.key()] = s.exp_avg_sq().clone();
      steps[rank] = s.step();
    }
  });
  for (int r = 0; r < kTp; ++r) EXPECT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r];
  Saved out;
  for (const auto& [key, dim] : SplitDims()) {
    out.params[key] = Assemble({params[0][key], params[1][key]}, dim);
    out.exp_avg[key] = Assemble({m[0][key], m[1][key]}, dim);
    out.exp_avg_sq[key] = Assemble({v[0][key], v[1][key]}, dim);
  }
  out.step = steps[0];
  return out;
}

// Loads the checkpoint at `tp` ranks (a fresh model and an Adam that has
// not stepped on each) and checks every rank got its box of the reference.
void LoadAtTp(const std::string& dir, int tp_size, const Saved& ref) {
  auto tp_hub = std::make_shared<FakeHub>(tp_size);
  auto ld_hub = std::make_shared<FakeHub>(tp_size);
  OnRanks(tp_size, [&](int rank) {
    std::unique_ptr<Communicator> tp = tp_hub->Endpoint(rank);
    std::unique_ptr<Communicator> ld = ld_hub->Endpoint(rank);
    TpNet net(*tp, 99);  // another seed: values differ before the load
    ::torch::optim::Adam adam(net->parameters(), ::torch::optim::AdamOptions(0.1));
    ModuleState st;
    st.module = net.get();
    st.optimizer = &adam;
    LoadOptions lo;
    lo.directory = dir;
    lo.group = GroupHandle::Fixed(ld.get());
    lo.timeout = absl::Seconds(60);
    absl::StatusOr<LoadReport> r = LoadModuleState(lo, st);
    ASSERT_TRUE(r.ok()) << "tp " << tp_size << " rank " << rank << ": " << r.status();
    EXPECT_EQ(r->step, 5);
    for (auto& p : net->named_parameters()) {
      const int dim = SplitDims().at(p.key());
      auto mine = [&](const Tensor& global) {
        if (dim < 0) return global;
        const int64_t n = global.size(dim) / tp_size;
        return global.narrow(dim, n * rank, n);
      };
      const std::string where =
          "tp " + std::to_string(tp_size) + " rank " + std::to_string(rank) + " " + p.key();
      EXPECT_TRUE(::torch::equal(p.value(), mine(ref.params.at(p.key())))) << where;
      const auto& s = static_cast<::torch::optim::AdamParamState&>(
          *adam.state().at(p.value().unsafeGetTensorImpl()));
      EXPECT_TRUE(::torch::equal(s.exp_avg(), mine(ref.exp_avg.at(p.key())))) << where;
      EXPECT_TRUE(::torch::equal(s.exp_avg_sq(), mine(ref.exp_avg_sq.at(p.key())))) << where;
      EXPECT_EQ(s.step(), ref.step) << where;
    }
  });
}

TEST(TorchCheckpointTp, SavedAtTp2LoadsAtTp1Tp2Tp4) {
  ScratchDir dir;
  Saved ref = SaveAtTp2(dir.path());
  ASSERT_FALSE(::testing::Test::HasFailure());
  LoadAtTp(dir.path(), 1, ref);
  LoadAtTp(dir.path(), 2, ref);
  LoadAtTp(dir.path(), 4, ref);
}

TEST(TorchCheckpointTp, ShardedParametersDescribeTheirBox) {
  auto hub = std::make_shared<FakeHub>(4);
  std::unique_ptr<Communicator> tp = hub->Endpoint(3);
  TpNet net(*tp, 1);
  const auto& fc1 = net->mlp->fc1->parameter_shards();
  EXPECT_EQ(fc1.at("weight").global_shape, (std::vector<int64_t>{kFfn, kHidden}));
  EXPECT_EQ(fc1.at("weight").global_offset, (std::vector<int64_t>{3 * kFfn / 4, 0}));
  EXPECT_EQ(fc1.at("bias").global_offset, (std::vector<int64_t>{3 * kFfn / 4}));
  const auto& fc2 = net->mlp->fc2->parameter_shards();
  EXPECT_EQ(fc2.at("weight").global_offset, (std::vector<int64_t>{0, 3 * kFfn / 4}));
  EXPECT_EQ(fc2.count("bias"), 0u);  // whole on every rank
  EXPECT_EQ(net->emb->parameter_shards().at("weight").global_offset,
            (std::vector<int64_t>{3 * kVocab / 4, 0}));
}

}  // namespace
}  // namespace strata::nn
