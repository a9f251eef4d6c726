// strata::torch modules on ranks-as-threads (FakeGroup) against unsharded
// torch references computed here: same seed -> shards of the reference's
// initial weights; forward output and every gradient equal the
// reference's (fp32: relative error <= 1e-5).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <thread>

#include "fake_communicator.h"
#include "strata/torch/tensor_parallel.h"

namespace strata {
namespace {

using ::torch::Tensor;

double RelErr(const Tensor& got, const Tensor& want) {
  const double scale = want.abs().max().item<double>();
  const double diff =
      (got.to(::torch::kFloat64) - want.to(::torch::kFloat64)).abs().max().item<double>();
  return scale == 0 ? diff : diff / scale;
}

void RunRanks(int size, const std::function<void(int, Communicator&)>& fn) {
  testing::FakeGroup group(size, testing::FakeOrdering::kMatchPosted, "tp");
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < size; ++r) comms.push_back(group.Comm(r));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) threads.emplace_back([&, r] { fn(r, *comms[r]); });
  for (auto& t : threads) t.join();
}

class TorchAdapterTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { ::torch::set_num_threads(1); }
};

// torch.nn.Linear(in, out) after torch.manual_seed(seed): weight then bias
// from U(-1/sqrt(in), 1/sqrt(in)).
::torch::nn::Linear ReferenceLinear(int64_t in, int64_t out, uint64_t seed) {
  ::torch::nn::Linear l(in, out);
  ::at::Generator gen = ::at::make_generator<::at::CPUGeneratorImpl>(seed);
  ::torch::NoGradGuard no_grad;
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  l->weight.uniform_(-bound, bound, gen);
  l->bias.uniform_(-bound, bound, gen);
  return l;
}

TEST_P(TorchAdapterTest, ParallelMLPMatchesUnshardedMLP) {
  const int tp = GetParam();
  const int64_t tokens = 8, hidden = 8, ffn = 16;
  const uint64_t seed = 7;
  ::torch::manual_seed(3);
  const Tensor x = ::torch::randn({tokens, hidden});
  ::torch::nn::Linear fc1 = ReferenceLinear(hidden, ffn, seed);
  ::torch::nn::Linear fc2 = ReferenceLinear(ffn, hidden, seed + 1);
  Tensor xr = x.clone().requires_grad_();
  Tensor y = fc2->forward(::torch::gelu(fc1->forward(xr)));
  y.pow(2).sum().backward();

  RunRanks(tp, [&](int rank, Communicator& comm) {
    nn::ParallelMLP mlp(nn::ParallelMLPOptions{hidden, ffn}, GroupHandle::Fixed(&comm),
                        nn::InitOptions{seed});
    const int64_t f_l = ffn / tp;
    // Initial weights are the shards of the unsharded layers'.
    EXPECT_TRUE(mlp->fc1->weight.equal(fc1->weight.narrow(0, rank * f_l, f_l)));
    EXPECT_TRUE(mlp->fc2->weight.equal(fc2->weight.narrow(1, rank * f_l, f_l)));
    Tensor xs = x.clone().requires_grad_();
    Tensor ys = mlp->forward(xs);
    ys.pow(2).sum().backward();
    EXPECT_LE(RelErr(ys, y), 1e-5);
    EXPECT_LE(RelErr(xs.grad(), xr.grad()), 1e-5);
    EXPECT_LE(RelErr(mlp->fc1->weight.grad(), fc1->weight.grad().narrow(0, rank * f_l, f_l)), 1e-5);
    EXPECT_LE(RelErr(mlp->fc1->bias.grad(), fc1->bias.grad().narrow(0, rank * f_l, f_l)), 1e-5);
    EXPECT_LE(RelErr(mlp->fc2->weight.grad(), fc2->weight.grad().narrow(1, rank * f_l, f_l)), 1e-5);
    EXPECT_LE(RelErr(mlp->fc2->bias.grad(), fc2->bias.grad()), 1e-5);
  });
}

TEST_P(TorchAdapterTest, SequenceParallelColumnLinearGathersThreeDimensionalInput) {
  const int tp = GetParam();
  const int64_t seq = 8, batch = 2, in = 4, out = 8;
  ::torch::manual_seed(5);
  const Tensor x = ::torch::randn({seq, batch, in});
  ::torch::nn::Linear ref = ReferenceLinear(in, out, 11);
  Tensor xr = x.clone().requires_grad_();
  Tensor y = ref->forward(xr);
  y.sum().backward();
  RunRanks(tp, [&](int rank, Communicator& comm) {
    LinearOptions o;
    o.in_features = in;
    o.out_features = out;
    o.sequence_parallel = true;
    nn::ColumnParallelLinear layer(o, GroupHandle::Fixed(&comm), nn::InitOptions{11});
    const int64_t s_l = seq / tp, o_l = out / tp;
    Tensor xs = x.narrow(0, rank * s_l, s_l).clone().requires_grad_();
    Tensor ys = layer->forward(xs);
    ASSERT_EQ(ys.sizes(), (std::vector<int64_t>{seq, batch, o_l}));
    ys.sum().backward();
    EXPECT_LE(RelErr(ys, y.narrow(2, rank * o_l, o_l)), 1e-5);
    EXPECT_LE(RelErr(xs.grad(), xr.grad().narrow(0, rank * s_l, s_l)), 1e-5);
    EXPECT_LE(RelErr(layer->weight.grad(), ref->weight.grad().narrow(0, rank * o_l, o_l)), 1e-5);
  });
}

TEST_P(TorchAdapterTest, EmbeddingAndCrossEntropyMatchTorch) {
  const int tp = GetParam();
  const int64_t vocab = 16, dim = 4, tokens = 6;
  const Tensor ids = ::torch::tensor({0, 15, 4, 4, 9, 2}, ::torch::kInt64);
  Tensor target = ::torch::tensor({3, -100, 15, 0, 8, 8}, ::torch::kInt64);
  // Reference: torch.nn.Embedding drawn N(0, 1) from the seeded generator,
  // a fixed projection to the vocabulary, F.cross_entropy.
  ::at::Generator gen = ::at::make_generator<::at::CPUGeneratorImpl>(21);
  Tensor table = ::torch::empty({vocab, dim}).normal_(0, 1, gen).requires_grad_();
  ::torch::manual_seed(9);
  const Tensor proj = ::torch::randn({dim, vocab});
  Tensor logits_ref = (::torch::embedding(table, ids).matmul(proj)).detach().requires_grad_();
  Tensor loss_ref =
      ::torch::nn::functional::cross_entropy(logits_ref, target,
                                             ::torch::nn::functional::CrossEntropyFuncOptions()
                                                 .reduction(::torch::kNone)
                                                 .label_smoothing(0.1));
  loss_ref.sum().backward();
  Tensor emb_out_ref = ::torch::embedding(table, ids);
  emb_out_ref.pow(2).sum().backward();

  RunRanks(tp, [&](int rank, Communicator& comm) {
    const int64_t v_l = vocab / tp;
    EmbeddingOptions eo;
    eo.num_embeddings = vocab;
    eo.embedding_dim = dim;
    nn::VocabParallelEmbedding emb(eo, GroupHandle::Fixed(&comm), nn::InitOptions{21});
    EXPECT_TRUE(emb->weight.equal(table.detach().narrow(0, rank * v_l, v_l)));
    Tensor out = emb->forward(ids);
    EXPECT_LE(RelErr(out, emb_out_ref), 1e-6);
    out.pow(2).sum().backward();
    EXPECT_LE(RelErr(emb->weight.grad(), table.grad().narrow(0, rank * v_l, v_l)), 1e-5);

    CrossEntropyOptions co;
    co.vocab_size = vocab;
    co.label_smoothing = 0.1;
    nn::VocabParallelCrossEntropyLoss xent(co, GroupHandle::Fixed(&comm));
    Tensor logits = logits_ref.detach().narrow(1, rank * v_l, v_l).clone().requires_grad_();
    Tensor loss = xent->forward(logits, target);
    EXPECT_LE(RelErr(loss, loss_ref), 1e-5);
    loss.sum().backward();
    EXPECT_LE(RelErr(logits.grad(), logits_ref.grad().narrow(1, rank * v_l, v_l)), 1e-5);
  });
}

INSTANTIATE_TEST_SUITE_P(Tp, TorchAdapterTest, ::testing::Values(1, 2, 4));

TEST(TorchAdapterErrors, InvalidOptionsThrowTheStatusMessage) {
  testing::FakeGroup group(2, testing::FakeOrdering::kMatchPosted, "tp");
  auto comm = group.Comm(0);
  LinearOptions o;
  o.in_features = 4;
  o.out_features = 3;
  try {
    nn::ColumnParallelLinear layer(o, GroupHandle::Fixed(comm.get()));
    FAIL() << "no exception";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("out_features 3 is not divisible by the size 2"),
              std::string::npos)
        << e.what();
  }
  o.out_features = 4;
  nn::ColumnParallelLinear layer(o, GroupHandle::Fixed(comm.get()));
  EXPECT_THROW(layer->forward(::torch::zeros({2, 5})), c10::Error);  // wrong features
  EXPECT_THROW(layer->forward(::torch::zeros({2, 4}, ::torch::kInt32)), c10::Error);  // dtype
}

}  // namespace
}  // namespace strata
