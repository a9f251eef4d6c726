// VocabParallelEmbedding and VocabParallelCrossEntropy on ranks-as-threads
// against plain references in double (tp 1, 2, 4; fp32 and bf16; with and
// without sequence parallelism, ignore_index and label smoothing), and
// every user error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "strata/parallel/tensor_parallel/embedding.h"
#include "tp_test_util.h"

namespace strata {
namespace {

using testing::Dense;
using ::testing::HasSubstr;
using testing::HostMatrix;
using testing::RelErr;

double Tol(DataType t) { return t == DataType::kFloat32 ? 1e-5 : 1e-2; }

class EmbeddingTest : public ::testing::TestWithParam<std::tuple<int, DataType, bool>> {};

TEST_P(EmbeddingTest, MatchesLookupAndScatterAdd) {
  const auto [tp, dtype, sp] = GetParam();
  const int64_t vocab = 16, dim = 6, tokens = 8;
  const HostMatrix table = HostMatrix::Random(vocab, dim, dtype, 11);
  const HostMatrix dy = HostMatrix::Random(tokens, dim, dtype, 12);
  const std::vector<int64_t> ids = {0, 15, 3, 3, 8, 12, 7, 1};  // every rank's range, a repeat
  const Dense T = table.ToDense(), DY = dy.ToDense();
  Dense Y(tokens, dim), DW(vocab, dim);
  for (int64_t i = 0; i < tokens; ++i)
    for (int64_t c = 0; c < dim; ++c) {
      Y.at(i, c) = T.at(ids[i], c);
      DW.at(ids[i], c) += DY.at(i, c);
    }
  testing::RunRanks(tp, [&](int rank, Communicator& comm) {
    EmbeddingOptions o;
    o.num_embeddings = vocab;
    o.embedding_dim = dim;
    o.dtype = dtype;
    o.sequence_parallel = sp;
    auto emb = VocabParallelEmbedding::Create(o, GroupHandle::Fixed(&comm));
    ASSERT_TRUE(emb.ok()) << emb.status();
    const int64_t v_l = vocab / tp, rows = sp ? tokens / tp : tokens;
    EXPECT_EQ((*emb)->vocab_start(), rank * v_l);
    EXPECT_EQ((*emb)->vocab_end(), (rank + 1) * v_l);
    HostMatrix w = HostMatrix::FromDense(T.Rows(rank * v_l, v_l), dtype);
    HostMatrix y(rows, dim, dtype);
    absl::Status s = (*emb)->Forward({ids.data(), tokens, w.cref(), y.ref()});
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_LE(RelErr(y.ToDense(), sp ? Y.Rows(rank * rows, rows) : Y), Tol(dtype));
    HostMatrix g = HostMatrix::FromDense(sp ? DY.Rows(rank * rows, rows) : DY, dtype);
    std::vector<float> acc(v_l * dim, 1.0f);
    s = (*emb)->Backward({ids.data(), tokens, g.cref(), acc.data()});
    ASSERT_TRUE(s.ok()) << s;
    Dense want = DW.Rows(rank * v_l, v_l);
    for (double& v : want.v) v += 1.0;
    EXPECT_LE(RelErr(testing::FromFloats(acc, v_l, dim), want), Tol(dtype));
  });
}

INSTANTIATE_TEST_SUITE_P(All, EmbeddingTest,
                         ::testing::Combine(::testing::Values(1, 2, 4),
                                            ::testing::Values(DataType::kFloat32,
                                                              DataType::kBFloat16),
                                            ::testing::Bool()),
                         [](const auto& i) {
                           return absl::StrCat("tp", std::get<0>(i.param), "_",
                                               DataTypeName(std::get<1>(i.param)),
                                               std::get<2>(i.param) ? "_sp" : "");
                         });

class CrossEntropyTest
    : public ::testing::TestWithParam<std::tuple<int, DataType, double, int64_t>> {};

TEST_P(CrossEntropyTest, MatchesSoftmaxDefinition) {
  const auto [tp, dtype, smoothing, ignore] = GetParam();
  const int64_t vocab = 12, tokens = 6;
  HostMatrix logits_all = HostMatrix::Random(tokens, vocab, dtype, 21);
  {  // Larger logits, so the max subtraction matters.
    Dense d = logits_all.ToDense();
    for (double& v : d.v) v *= 8;
    logits_all = HostMatrix::FromDense(d, dtype);
  }
  const std::vector<int64_t> target = {0, 11, ignore, 5, 6, 2};
  const std::vector<float> grad_loss = {1.0f, 0.5f, 2.0f, -1.0f, 0.25f, 3.0f};
  // The definition: p = softmax(z); loss = -(1 - e) log p_t - e / V sum_j log p_j.
  const Dense Z = logits_all.ToDense();
  std::vector<double> loss(tokens, 0.0);
  Dense DZ(tokens, vocab);
  for (int64_t r = 0; r < tokens; ++r) {
    if (target[r] == ignore) continue;
    double m = -1e300, s = 0;
    for (int64_t j = 0; j < vocab; ++j) m = std::max(m, Z.at(r, j));
    for (int64_t j = 0; j < vocab; ++j) s += std::exp(Z.at(r, j) - m);
    double mean_logp = 0;
    for (int64_t j = 0; j < vocab; ++j) mean_logp += (Z.at(r, j) - m - std::log(s)) / vocab;
    loss[r] = -(1 - smoothing) * (Z.at(r, target[r]) - m - std::log(s)) - smoothing * mean_logp;
    for (int64_t j = 0; j < vocab; ++j) {
      const double p = std::exp(Z.at(r, j) - m) / s;
      const double onehot = j == target[r] ? 1.0 : 0.0;
      DZ.at(r, j) = grad_loss[r] * (p - (1 - smoothing) * onehot - smoothing / vocab);
    }
  }
  testing::RunRanks(tp, [&](int rank, Communicator& comm) {
    CrossEntropyOptions o;
    o.vocab_size = vocab;
    o.dtype = dtype;
    o.ignore_index = ignore;
    o.label_smoothing = smoothing;
    auto ce = VocabParallelCrossEntropy::Create(o, GroupHandle::Fixed(&comm));
    ASSERT_TRUE(ce.ok()) << ce.status();
    const int64_t v_l = vocab / tp;
    HostMatrix z = HostMatrix::FromDense(Z.Cols(rank * v_l, v_l), dtype);
    std::vector<float> got(tokens), lse(tokens);
    absl::Status s = (*ce)->Forward({z.cref(), target.data(), got.data(), lse.data()});
    ASSERT_TRUE(s.ok()) << s;
    Dense want_loss(1, tokens), got_loss(1, tokens);
    for (int64_t r = 0; r < tokens; ++r) {
      want_loss.v[r] = loss[r];
      got_loss.v[r] = got[r];
    }
    // The loss is computed in fp32 whatever the logits' dtype.
    EXPECT_LE(RelErr(got_loss, want_loss), 1e-5) << "rank " << rank;
    HostMatrix dz(tokens, v_l, dtype);
    s = (*ce)->Backward({z.cref(), target.data(), lse.data(), grad_loss.data(), dz.ref()});
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_LE(RelErr(dz.ToDense(), DZ.Cols(rank * v_l, v_l)), Tol(dtype)) << "rank " << rank;
  });
}

INSTANTIATE_TEST_SUITE_P(
    All, CrossEntropyTest,
    ::testing::Combine(::testing::Values(1, 2, 4),
                       ::testing::Values(DataType::kFloat32, DataType::kBFloat16),
                       ::testing::Values(0.0, 0.1), ::testing::Values(int64_t{-100}, int64_t{3})),
    [](const auto& i) {
      return absl::StrCat("tp", std::get<0>(i.param), "_", DataTypeName(std::get<1>(i.param)),
                          std::get<2>(i.param) > 0 ? "_smoothing" : "",
                          std::get<3>(i.param) >= 0 ? "_ignore3" : "");
    });

// ---- errors -------------------------------------------------------------

void ExpectCode(const absl::Status& s, absl::StatusCode code, const std::string& needle) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(needle));
}

TEST(EmbeddingErrors, CreateAndCall) {
  testing::FakeGroup group(2, testing::FakeOrdering::kMatchPosted, "tp");
  auto comm = group.Comm(0);
  EmbeddingOptions o;
  o.num_embeddings = 7;
  o.embedding_dim = 4;
  ExpectCode(VocabParallelEmbedding::Create(o, GroupHandle::Fixed(comm.get())).status(),
             absl::StatusCode::kInvalidArgument,
             "num_embeddings 7 is not divisible by the size 2 of group tp");
  o.num_embeddings = 8;
  o.embedding_dim = 0;
  ExpectCode(VocabParallelEmbedding::Create(o, GroupHandle::Fixed(comm.get())).status(),
             absl::StatusCode::kInvalidArgument, "embedding_dim 0");
  o.embedding_dim = 4;
  o.dtype = DataType::kInt64;
  ExpectCode(VocabParallelEmbedding::Create(o, GroupHandle::Fixed(comm.get())).status(),
             absl::StatusCode::kInvalidArgument, "dtype int64");
  o.dtype = DataType::kFloat32;
  o.memory = MemoryKind::kCuda;
  ExpectCode(VocabParallelEmbedding::Create(o, GroupHandle::Fixed(comm.get())).status(),
             absl::StatusCode::kUnimplemented, "host memory only");
  o.memory = MemoryKind::kHost;
  o.timeout = absl::ZeroDuration();
  ExpectCode(VocabParallelEmbedding::Create(o, GroupHandle::Fixed(comm.get())).status(),
             absl::StatusCode::kInvalidArgument, "timeout");
  o.timeout = absl::Seconds(5);
  o.sequence_parallel = true;
  auto emb = VocabParallelEmbedding::Create(o, GroupHandle::Fixed(comm.get()));
  ASSERT_TRUE(emb.ok());
  HostMatrix w(4, 4, DataType::kFloat32), y(2, 4, DataType::kFloat32);
  std::vector<int64_t> bad = {1, 8, 2, 3};
  ExpectCode((*emb)->Forward({bad.data(), 4, w.cref(), y.ref()}),
             absl::StatusCode::kInvalidArgument, "id 8 at position 1 is outside the vocabulary");
  std::vector<int64_t> odd = {1, 2, 3};
  ExpectCode((*emb)->Forward({odd.data(), 3, w.cref(), y.ref()}),
             absl::StatusCode::kInvalidArgument, "3 tokens are not divisible by the size 2");
  std::vector<int64_t> ids = {1, 2, 3, 4};
  HostMatrix big(4, 4, DataType::kFloat32);
  ExpectCode((*emb)->Forward({ids.data(), 4, w.cref(), big.ref()}),
             absl::StatusCode::kInvalidArgument, "output is [4, 4] fp32, expected [2, 4] fp32");
  ExpectCode((*emb)->Backward({ids.data(), 4, y.cref(), nullptr}),
             absl::StatusCode::kInvalidArgument, "weight_main_grad is null");
  ExpectCode((*emb)->Forward({nullptr, 4, w.cref(), y.ref()}), absl::StatusCode::kInvalidArgument,
             "4 ids without data");
}

TEST(VocabErrors, GroupsOnDeviceMemoryAreRejected) {
  testing::FakeGroup group(2, testing::FakeOrdering::kMatchPosted, "tp", MemoryKind::kCuda);
  auto comm = group.Comm(0);
  EmbeddingOptions e;
  e.num_embeddings = 8;
  e.embedding_dim = 2;
  ExpectCode(VocabParallelEmbedding::Create(e, GroupHandle::Fixed(comm.get())).status(),
             absl::StatusCode::kInvalidArgument, "group tp does not communicate host memory");
  CrossEntropyOptions c;
  c.vocab_size = 8;
  ExpectCode(VocabParallelCrossEntropy::Create(c, GroupHandle::Fixed(comm.get())).status(),
             absl::StatusCode::kInvalidArgument, "group tp does not communicate host memory");
}

TEST(CrossEntropyErrors, CreateAndCall) {
  testing::FakeGroup group(2, testing::FakeOrdering::kMatchPosted, "tp");
  auto comm = group.Comm(0);
  CrossEntropyOptions o;
  o.vocab_size = 9;
  ExpectCode(VocabParallelCrossEntropy::Create(o, GroupHandle::Fixed(comm.get())).status(),
             absl::StatusCode::kInvalidArgument, "vocab_size 9 must be positive and divisible");
  o.vocab_size = 8;
  for (double bad : {1.0, -0.1, std::nan("")}) {
    o.label_smoothing = bad;
    ExpectCode(VocabParallelCrossEntropy::Create(o, GroupHandle::Fixed(comm.get())).status(),
               absl::StatusCode::kInvalidArgument, "is outside [0, 1)");
  }
  o.label_smoothing = 0;
  o.dtype = DataType::kInt8;
  ExpectCode(VocabParallelCrossEntropy::Create(o, GroupHandle::Fixed(comm.get())).status(),
             absl::StatusCode::kInvalidArgument, "dtype int8");
  o.dtype = DataType::kFloat32;
  o.memory = MemoryKind::kCuda;
  ExpectCode(VocabParallelCrossEntropy::Create(o, GroupHandle::Fixed(comm.get())).status(),
             absl::StatusCode::kUnimplemented, "host memory only");
  o.memory = MemoryKind::kHost;
  o.timeout = absl::ZeroDuration();
  ExpectCode(VocabParallelCrossEntropy::Create(o, GroupHandle::Fixed(comm.get())).status(),
             absl::StatusCode::kInvalidArgument, "timeout");
  o.timeout = absl::Seconds(5);
  auto ce = VocabParallelCrossEntropy::Create(o, GroupHandle::Fixed(comm.get()));
  ASSERT_TRUE(ce.ok());
  HostMatrix z(2, 4, DataType::kFloat32), wide(2, 8, DataType::kFloat32);
  std::vector<float> loss(2), lse(2), g(2);
  std::vector<int64_t> bad = {1, 8};
  ExpectCode((*ce)->Forward({z.cref(), bad.data(), loss.data(), lse.data()}),
             absl::StatusCode::kInvalidArgument,
             "target 8 at position 1 is outside the vocabulary");
  std::vector<int64_t> t = {1, 2};
  ExpectCode((*ce)->Forward({wide.cref(), t.data(), loss.data(), lse.data()}),
             absl::StatusCode::kInvalidArgument, "logits is [2, 8] fp32, expected [tokens, 4]");
  ExpectCode((*ce)->Forward({z.cref(), t.data(), nullptr, lse.data()}),
             absl::StatusCode::kInvalidArgument, "loss and log_sum_exp are required");
  ExpectCode((*ce)->Forward({z.cref(), nullptr, loss.data(), lse.data()}),
             absl::StatusCode::kInvalidArgument, "target is null");
  ConstMatrixRef empty(nullptr, 2, 4, DataType::kFloat32);
  ExpectCode((*ce)->Forward({empty, t.data(), loss.data(), lse.data()}),
             absl::StatusCode::kInvalidArgument, "logits has no data");
  HostMatrix short_dz(1, 4, DataType::kFloat32);
  ExpectCode((*ce)->Backward({z.cref(), t.data(), lse.data(), g.data(), short_dz.ref()}),
             absl::StatusCode::kInvalidArgument, "grad_logits has 1 rows, logits 2");
  ExpectCode((*ce)->Backward({z.cref(), t.data(), nullptr, g.data(), z.ref()}),
             absl::StatusCode::kInvalidArgument, "log_sum_exp and grad_loss are required");
}

}  // namespace
}  // namespace strata
