// The tensor-parallel C++ kernels over the MPI backend, on real ranks: tp
// groups split from the job (tp = the whole job, and tp = 2 with the rest
// data-parallel), the linear layers in the option combinations that
// exercise every collective, fp32 and bf16, plus the vocab-parallel
// embedding and cross-entropy, each against references in double computed
// on every rank.
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "harness.h"
#include "strata/parallel/tensor_parallel/embedding.h"
#include "strata/parallel/tensor_parallel/linear.h"
#include "tp_test_util.h"

namespace strata::testing {
namespace {

class TpKernelsTest : public MultiRankTest, public ::testing::WithParamInterface<int> {
 protected:
  // tp = the whole job (param 0) or 2 (param 2, when the job is even).
  std::unique_ptr<Communicator> TpGroup() {
    const int tp = GetParam() == 0 ? size() : GetParam();
    if (size() % tp != 0) return nullptr;
    CommOptions o;
    o.name = "tp";
    auto split = world().Split(rank() / tp, rank(), o);
    EXPECT_TRUE(split.ok()) << split.status();
    return split.ok() ? std::move(split).value() : nullptr;
  }
};

struct LinearCase {
  bool column;
  bool gather_output;
  bool input_is_parallel;
  bool sequence_parallel;
  DataType dtype;
};

TEST_P(TpKernelsTest, LinearLayersMatchTheUnshardedLayer) {
  std::unique_ptr<Communicator> group = TpGroup();
  if (group == nullptr) GTEST_SKIP() << "job size not divisible";
  const int tp = group->size(), r = group->rank();
  const int64_t rows = 16, in = 24, out = 32;
  for (DataType dtype : {DataType::kFloat32, DataType::kBFloat16}) {
    for (LinearCase c :
         {LinearCase{true, false, false, false, dtype}, LinearCase{true, true, false, false, dtype},
          LinearCase{true, false, false, true, dtype},
          LinearCase{false, false, false, false, dtype},
          LinearCase{false, false, true, false, dtype},
          LinearCase{false, false, true, true, dtype}}) {
      SCOPED_TRACE(absl::StrCat(c.column ? "column" : "row", " gather=", c.gather_output,
                                " parallel_in=", c.input_is_parallel, " sp=", c.sequence_parallel,
                                " ", DataTypeName(dtype), " tp=", tp));
      const double tol = dtype == DataType::kFloat32 ? 1e-5 : 1e-2;
      const HostMatrix x = HostMatrix::Random(rows, in, dtype, 1);
      const HostMatrix w = HostMatrix::Random(out, in, dtype, 2);
      const HostMatrix b = HostMatrix::Random(1, out, dtype, 3);
      const HostMatrix dy = HostMatrix::Random(rows, out, dtype, 4);
      const Dense X = x.ToDense(), W = w.ToDense(), Bv = b.ToDense(), DY = dy.ToDense();
      Dense Y = MatmulNT(X, W);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t o = 0; o < out; ++o) Y.at(i, o) += Bv.at(0, o);
      const Dense DX = MatmulNT(DY, W.Transposed());
      const Dense DW = MatmulNT(DY.Transposed(), X.Transposed());

      LinearOptions o;
      o.in_features = in;
      o.out_features = out;
      o.dtype = dtype;
      o.gather_output = c.gather_output;
      o.input_is_parallel = c.input_is_parallel;
      o.sequence_parallel = c.sequence_parallel;
      const int64_t rl = rows / tp;
      Dense x_in, w_l, b_l, y_want, dy_in, dx_want, dw_want;
      std::unique_ptr<ColumnParallelLinear> col;
      std::unique_ptr<RowParallelLinear> row;
      if (c.column) {
        const int64_t ol = out / tp;
        STRATA_ASSERT_OK_AND_ASSIGN(
            col, ColumnParallelLinear::Create(o, GroupHandle::Fixed(group.get())));
        x_in = c.sequence_parallel ? X.Rows(r * rl, rl) : X;
        w_l = W.Rows(r * ol, ol);
        b_l = Bv.Cols(r * ol, ol);
        y_want = c.gather_output ? Y : Y.Cols(r * ol, ol);
        dy_in = c.gather_output ? DY : DY.Cols(r * ol, ol);
        dx_want = c.sequence_parallel ? DX.Rows(r * rl, rl) : DX;
        dw_want = DW.Rows(r * ol, ol);
      } else {
        const int64_t il = in / tp;
        STRATA_ASSERT_OK_AND_ASSIGN(row,
                                    RowParallelLinear::Create(o, GroupHandle::Fixed(group.get())));
        x_in = c.input_is_parallel ? X.Cols(r * il, il) : X;
        w_l = W.Cols(r * il, il);
        b_l = Bv;
        y_want = c.sequence_parallel ? Y.Rows(r * rl, rl) : Y;
        dy_in = c.sequence_parallel ? DY.Rows(r * rl, rl) : DY;
        dx_want = c.input_is_parallel ? DX.Cols(r * il, il) : DX;
        dw_want = DW.Cols(r * il, il);
      }
      HostMatrix xi = HostMatrix::FromDense(x_in, dtype), wi = HostMatrix::FromDense(w_l, dtype),
                 bi = HostMatrix::FromDense(b_l, dtype), dyi = HostMatrix::FromDense(dy_in, dtype);
      HostMatrix y(y_want.rows, y_want.cols, dtype), dx(x_in.rows, x_in.cols, dtype);
      std::vector<float> dw(w_l.rows * w_l.cols, 0.0f);
      LinearForward f{xi.cref(), wi.cref(), bi.bytes.data(), y.ref()};
      LinearBackward bw{dyi.cref(), xi.cref(), wi.cref(), dx.ref(), dw.data(), nullptr};
      STRATA_ASSERT_OK(col ? col->Forward(f) : row->Forward(f));
      STRATA_ASSERT_OK(col ? col->Backward(bw) : row->Backward(bw));
      EXPECT_LE(RelErr(y.ToDense(), y_want), tol) << "output";
      EXPECT_LE(RelErr(dx.ToDense(), dx_want), tol) << "grad_input";
      EXPECT_LE(RelErr(FromFloats(dw, w_l.rows, w_l.cols), dw_want), tol) << "weight grad";
    }
  }
}

TEST_P(TpKernelsTest, VocabParallelEmbeddingAndCrossEntropy) {
  std::unique_ptr<Communicator> group = TpGroup();
  if (group == nullptr) GTEST_SKIP() << "job size not divisible";
  const int tp = group->size(), r = group->rank();
  const int64_t vocab = 8 * tp, dim = 4, tokens = 2 * tp;
  std::vector<int64_t> ids(tokens), target(tokens);
  for (int64_t i = 0; i < tokens; ++i) {
    ids[i] = (i * 5 + 3) % vocab;
    target[i] = i == 1 ? -100 : (i * 7 + 1) % vocab;
  }
  const HostMatrix table = HostMatrix::Random(vocab, dim, DataType::kFloat32, 5);
  const Dense T = table.ToDense();
  EmbeddingOptions eo;
  eo.num_embeddings = vocab;
  eo.embedding_dim = dim;
  eo.sequence_parallel = true;
  STRATA_ASSERT_OK_AND_ASSIGN(auto emb,
                              VocabParallelEmbedding::Create(eo, GroupHandle::Fixed(group.get())));
  const int64_t vl = vocab / tp, tl = tokens / tp;
  HostMatrix wl = HostMatrix::FromDense(T.Rows(r * vl, vl), DataType::kFloat32);
  HostMatrix y(tl, dim, DataType::kFloat32);
  STRATA_ASSERT_OK(emb->Forward({ids.data(), tokens, wl.cref(), y.ref()}));
  Dense want(tl, dim);
  for (int64_t i = 0; i < tl; ++i)
    for (int64_t c = 0; c < dim; ++c) want.at(i, c) = T.at(ids[r * tl + i], c);
  EXPECT_LE(RelErr(y.ToDense(), want), 1e-6);

  const HostMatrix logits = HostMatrix::Random(tokens, vocab, DataType::kFloat32, 6);
  const Dense Z = logits.ToDense();
  CrossEntropyOptions co;
  co.vocab_size = vocab;
  co.label_smoothing = 0.1;
  STRATA_ASSERT_OK_AND_ASSIGN(
      auto ce, VocabParallelCrossEntropy::Create(co, GroupHandle::Fixed(group.get())));
  HostMatrix zl = HostMatrix::FromDense(Z.Cols(r * vl, vl), DataType::kFloat32);
  std::vector<float> loss(tokens), lse(tokens);
  STRATA_ASSERT_OK(ce->Forward({zl.cref(), target.data(), loss.data(), lse.data()}));
  for (int64_t i = 0; i < tokens; ++i) {
    double m = -1e300, s = 0, sum = 0;
    for (int64_t j = 0; j < vocab; ++j) m = std::max(m, Z.at(i, j));
    for (int64_t j = 0; j < vocab; ++j) {
      s += std::exp(Z.at(i, j) - m);
      sum += Z.at(i, j);
    }
    const double lse_want = m + std::log(s);
    const double want_loss =
        target[i] == -100 ? 0.0 : lse_want - 0.9 * Z.at(i, target[i]) - 0.1 * sum / vocab;
    EXPECT_NEAR(loss[i], want_loss, 1e-5 * std::max(1.0, std::abs(want_loss))) << "token " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Groups, TpKernelsTest, ::testing::Values(0, 2),
                         [](const auto& i) { return i.param == 0 ? "tp_all" : "tp2"; });

}  // namespace
}  // namespace strata::testing
