// ColumnParallelLinear and RowParallelLinear on ranks-as-threads: for every
// valid combination of options, group sizes 1, 2 and 4, fp32 and bf16, the
// forward output, input gradient, accumulated fp32 weight gradient and bias
// gradient of each rank equal its slice of the unsharded layer computed
// here in double (fp32: relative error <= 1e-5, bf16: <= 1e-2).
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "strata/parallel/tensor_parallel/linear.h"
#include "tp_test_util.h"

namespace strata {
namespace {

using testing::Dense;
using testing::HostMatrix;
using testing::RelErr;

struct Case {
  bool column = true;
  int tp = 1;
  DataType dtype = DataType::kFloat32;
  bool bias = true;
  bool gather_output = false;
  bool input_is_parallel = false;
  bool sequence_parallel = false;
  bool skip_bias_add = false;
};

std::string Name(const Case& c) {
  return absl::StrCat(c.column ? "Column" : "Row", "_tp", c.tp, "_", DataTypeName(c.dtype),
                      c.bias ? "_bias" : "", c.gather_output ? "_gather" : "",
                      c.input_is_parallel ? "_parallelin" : "", c.sequence_parallel ? "_sp" : "",
                      c.skip_bias_add ? "_skipbias" : "");
}

std::vector<Case> AllCases() {
  std::vector<Case> out;
  for (bool column : {true, false})
    for (int tp : {1, 2, 4})
      for (DataType t : {DataType::kFloat32, DataType::kBFloat16})
        for (int bits = 0; bits < 16; ++bits) {
          Case c{column, tp, t};
          c.bias = bits & 1;
          c.sequence_parallel = bits & 2;
          c.skip_bias_add = bits & 4;
          if (column) {
            c.gather_output = bits & 8;
            if (c.gather_output && c.sequence_parallel) continue;
          } else {
            c.input_is_parallel = bits & 8;
            if (c.sequence_parallel && !c.input_is_parallel) continue;
          }
          out.push_back(c);
        }
  return out;
}

class LinearTest : public ::testing::TestWithParam<Case> {};

TEST_P(LinearTest, MatchesUnshardedLayer) {
  const Case c = GetParam();
  const int64_t rows = 8, in = 12, out = 8;
  const double tol = c.dtype == DataType::kFloat32 ? 1e-5 : 1e-2;
  const HostMatrix x = HostMatrix::Random(rows, in, c.dtype, 1);
  const HostMatrix w = HostMatrix::Random(out, in, c.dtype, 2);
  const HostMatrix b = HostMatrix::Random(1, out, c.dtype, 3);
  const HostMatrix dy = HostMatrix::Random(rows, out, c.dtype, 4);
  // The unsharded layer, in double.
  const Dense X = x.ToDense(), W = w.ToDense(), B = b.ToDense(), DY = dy.ToDense();
  Dense Y = testing::MatmulNT(X, W);
  if (c.bias && !c.skip_bias_add) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) Y.at(r, o) += B.at(0, o);
  }
  const Dense DX = testing::MatmulNT(DY, W.Transposed());
  const Dense DW = testing::MatmulNT(DY.Transposed(), X.Transposed());
  Dense DB(1, out);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) DB.at(0, o) += DY.at(r, o);

  testing::RunRanks(c.tp, [&](int rank, Communicator& comm) {
    LinearOptions o;
    o.in_features = in;
    o.out_features = out;
    o.dtype = c.dtype;
    o.bias = c.bias;
    o.gather_output = c.gather_output;
    o.input_is_parallel = c.input_is_parallel;
    o.sequence_parallel = c.sequence_parallel;
    o.skip_bias_add = c.skip_bias_add;
    o.timeout = absl::Seconds(30);
    const int tp = c.tp;
    const int64_t rows_l = rows / tp;
    // This rank's inputs and the expected results: slices of the above.
    Dense x_in, w_l, b_l, dy_in, y_want, dx_want, dw_want, db_want;
    std::unique_ptr<ColumnParallelLinear> col;
    std::unique_ptr<RowParallelLinear> row;
    if (c.column) {
      const int64_t o_l = out / tp;
      auto made = ColumnParallelLinear::Create(o, GroupHandle::Fixed(&comm));
      ASSERT_TRUE(made.ok()) << made.status();
      col = std::move(made).value();
      x_in = c.sequence_parallel ? X.Rows(rank * rows_l, rows_l) : X;
      w_l = W.Rows(rank * o_l, o_l);
      b_l = B.Cols(rank * o_l, o_l);
      y_want = c.gather_output ? Y : Y.Cols(rank * o_l, o_l);
      dy_in = c.gather_output ? DY : DY.Cols(rank * o_l, o_l);
      dx_want = c.sequence_parallel ? DX.Rows(rank * rows_l, rows_l) : DX;
      dw_want = DW.Rows(rank * o_l, o_l);
      db_want = DB.Cols(rank * o_l, o_l);
    } else {
      const int64_t i_l = in / tp;
      auto made = RowParallelLinear::Create(o, GroupHandle::Fixed(&comm));
      ASSERT_TRUE(made.ok()) << made.status();
      row = std::move(made).value();
      x_in = c.input_is_parallel ? X.Cols(rank * i_l, i_l) : X;
      w_l = W.Cols(rank * i_l, i_l);
      b_l = B;
      y_want = c.sequence_parallel ? Y.Rows(rank * rows_l, rows_l) : Y;
      dy_in = c.sequence_parallel ? DY.Rows(rank * rows_l, rows_l) : DY;
      dx_want = c.input_is_parallel ? DX.Cols(rank * i_l, i_l) : DX;
      dw_want = DW.Cols(rank * i_l, i_l);
      db_want = DB;
    }
    HostMatrix xi = HostMatrix::FromDense(x_in, c.dtype), wi = HostMatrix::FromDense(w_l, c.dtype),
               bi = HostMatrix::FromDense(b_l, c.dtype),
               dyi = HostMatrix::FromDense(dy_in, c.dtype);
    HostMatrix y(y_want.rows, y_want.cols, c.dtype), dx(x_in.rows, x_in.cols, c.dtype);
    // The main gradient starts non-zero: the kernel must add to it.
    std::vector<float> dw_acc(w_l.rows * w_l.cols, 0.5f), db_acc(b_l.cols, 0.25f);

    LinearForward f{xi.cref(), wi.cref(), c.bias ? bi.bytes.data() : nullptr, y.ref()};
    const bool bias_grad = c.bias && !c.skip_bias_add;
    LinearBackward bw{dyi.cref(), xi.cref(),     wi.cref(),
                      dx.ref(),   dw_acc.data(), bias_grad ? db_acc.data() : nullptr};
    absl::Status fs = col ? col->Forward(f) : row->Forward(f);
    ASSERT_TRUE(fs.ok()) << fs;
    absl::Status bs = col ? col->Backward(bw) : row->Backward(bw);
    ASSERT_TRUE(bs.ok()) << bs;

    EXPECT_LE(RelErr(y.ToDense(), y_want), tol) << "output, rank " << rank;
    EXPECT_LE(RelErr(dx.ToDense(), dx_want), tol) << "grad_input, rank " << rank;
    Dense dw_expect = dw_want, db_expect = db_want;
    for (double& v : dw_expect.v) v += 0.5;
    for (double& v : db_expect.v) v += 0.25;
    EXPECT_LE(RelErr(testing::FromFloats(dw_acc, w_l.rows, w_l.cols), dw_expect), tol)
        << "weight main grad, rank " << rank;
    if (bias_grad) {
      EXPECT_LE(RelErr(testing::FromFloats(db_acc, 1, b_l.cols), db_expect), tol)
          << "bias grad, rank " << rank;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(AllOptions, LinearTest, ::testing::ValuesIn(AllCases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return Name(i.param); });

// Skipping grad_input or the weight gradient skips their work and leaves
// the other results right; calling twice accumulates twice.
TEST(LinearPartialBackward, SkipsAndAccumulates) {
  const int64_t rows = 4, in = 4, out = 4;
  const HostMatrix x = HostMatrix::Random(rows, in, DataType::kFloat32, 5);
  const HostMatrix w = HostMatrix::Random(out / 2, in, DataType::kFloat32, 6);
  const HostMatrix dy = HostMatrix::Random(rows, out / 2, DataType::kFloat32, 7);
  const Dense DW = testing::MatmulNT(dy.ToDense().Transposed(), x.ToDense().Transposed());
  testing::RunRanks(2, [&](int rank, Communicator& comm) {
    LinearOptions o;
    o.in_features = in;
    o.out_features = out;
    o.bias = false;
    auto layer = ColumnParallelLinear::Create(o, GroupHandle::Fixed(&comm));
    ASSERT_TRUE(layer.ok());
    std::vector<float> acc(w.rows * w.cols, 0.0f);
    LinearBackward b{dy.cref(), x.cref(), w.cref(), MatrixRef{}, acc.data(), nullptr};
    ASSERT_TRUE((*layer)->Backward(b).ok());
    ASSERT_TRUE((*layer)->Backward(b).ok());
    Dense twice = DW;
    for (double& v : twice.v) v *= 2;
    EXPECT_LE(RelErr(testing::FromFloats(acc, w.rows, w.cols), twice), 1e-5);
  });
}

}  // namespace
}  // namespace strata
