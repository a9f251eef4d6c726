// Every error a user can cause with the tensor-parallel linear layers:
// invalid options and sizes at creation, wrong views at each call, and a
// collective that cannot complete before its deadline.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <thread>

#include "strata/parallel/tensor_parallel/linear.h"
#include "tp_test_util.h"

namespace strata {
namespace {

using ::testing::HasSubstr;
using testing::HostMatrix;

LinearOptions Base() {
  LinearOptions o;
  o.in_features = 8;
  o.out_features = 8;
  o.timeout = absl::Seconds(10);
  return o;
}

// The status of creating a layer of the given kind on rank 0 of a group of
// `size` (creation does not communicate).
absl::Status CreateStatus(bool column, const LinearOptions& o, int size = 2,
                          MemoryKind memory = MemoryKind::kHost) {
  testing::FakeGroup group(size, testing::FakeOrdering::kMatchPosted, "tp", memory);
  std::unique_ptr<Communicator> comm = group.Comm(0);
  if (column) return ColumnParallelLinear::Create(o, GroupHandle::Fixed(comm.get())).status();
  return RowParallelLinear::Create(o, GroupHandle::Fixed(comm.get())).status();
}

void ExpectInvalid(const absl::Status& s, const std::string& needle) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(needle));
}

TEST(LinearCreate, RejectsBadSizesAndDtypes) {
  for (bool column : {true, false}) {
    LinearOptions o = Base();
    o.in_features = 0;
    ExpectInvalid(CreateStatus(column, o), "in_features 0");
    o = Base();
    o.out_features = -3;
    ExpectInvalid(CreateStatus(column, o), "out_features -3");
    o = Base();
    o.dtype = DataType::kInt32;
    ExpectInvalid(CreateStatus(column, o), "dtype int32");
    o = Base();
    o.timeout = absl::ZeroDuration();
    ExpectInvalid(CreateStatus(column, o), "timeout 0");
  }
}

TEST(LinearCreate, RejectsIndivisibleFeatures) {
  LinearOptions o = Base();
  o.out_features = 10;
  ExpectInvalid(CreateStatus(true, o, 4), "out_features 10 is not divisible by the size 4");
  o = Base();
  o.in_features = 6;
  ExpectInvalid(CreateStatus(false, o, 4), "in_features 6 is not divisible by the size 4");
}

TEST(LinearCreate, RejectsInvalidOptionCombinations) {
  LinearOptions o = Base();
  o.sequence_parallel = true;
  ExpectInvalid(CreateStatus(false, o), "sequence_parallel needs input_is_parallel");
  o = Base();
  o.gather_output = true;
  o.sequence_parallel = true;
  ExpectInvalid(CreateStatus(true, o), "gather_output cannot be combined with sequence_parallel");
  o = Base();
  o.input_is_parallel = true;
  ExpectInvalid(CreateStatus(true, o), "input_is_parallel is a RowParallelLinear option");
  o = Base();
  o.gather_output = true;
  ExpectInvalid(CreateStatus(false, o), "gather_output is a ColumnParallelLinear option");
}

TEST(LinearCreate, RejectsMemoryOfAnotherKindThanTheGroup) {
  LinearOptions o = Base();
  o.memory = MemoryKind::kCuda;
  ExpectInvalid(CreateStatus(true, o, 2, MemoryKind::kHost),
                "tensors are in CUDA memory but group tp (fake) communicates host memory");
  o.memory = MemoryKind::kHost;
  ExpectInvalid(CreateStatus(false, o, 2, MemoryKind::kCuda),
                "tensors are in host memory but group tp (fake) communicates CUDA memory");
}

TEST(LinearCreate, CudaMemoryWithoutADeviceIsUnimplemented) {
  LinearOptions o = Base();
  o.memory = MemoryKind::kCuda;
  absl::Status s = CreateStatus(true, o, 1);
  if (s.ok()) GTEST_SKIP() << "a CUDA device is visible";
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("CUDA"));
}

// One-rank layers for the per-call checks.
class LinearCallTest : public ::testing::Test {
 protected:
  void SetUp() override { comm_ = group_.Comm(0); }
  testing::FakeGroup group_{1, testing::FakeOrdering::kMatchPosted, "tp"};
  std::unique_ptr<Communicator> comm_;
};

TEST_F(LinearCallTest, ShapesRejectRowsThatSequenceParallelismCannotSplit) {
  testing::FakeGroup group(2, testing::FakeOrdering::kMatchPosted, "tp");
  auto comm = group.Comm(0);
  LinearOptions o = Base();
  o.input_is_parallel = true;
  o.sequence_parallel = true;
  auto row = RowParallelLinear::Create(o, GroupHandle::Fixed(comm.get()));
  ASSERT_TRUE(row.ok());
  ExpectInvalid((*row)->Shapes(7).status(),
                "7 input rows (tokens) are not divisible by the size 2");
  ExpectInvalid((*row)->Shapes(-1).status(), "-1 input rows");
  EXPECT_EQ((*row)->Shapes(8)->output_rows, 4);
  EXPECT_EQ((*row)->local_in_features(), 4);
}

TEST_F(LinearCallTest, ForwardRejectsWrongViews) {
  auto layer = ColumnParallelLinear::Create(Base(), GroupHandle::Fixed(comm_.get()));
  ASSERT_TRUE(layer.ok());
  HostMatrix x(4, 8, DataType::kFloat32), w(8, 8, DataType::kFloat32), b(1, 8, DataType::kFloat32),
      y(4, 8, DataType::kFloat32);
  LinearForward ok{x.cref(), w.cref(), b.bytes.data(), y.ref()};
  ASSERT_TRUE((*layer)->Forward(ok).ok());

  LinearForward f = ok;
  HostMatrix wrong_cols(4, 7, DataType::kFloat32);
  f.input = wrong_cols.cref();
  ExpectInvalid((*layer)->Forward(f), "input is [4, 7] fp32, expected [4, 8] fp32");
  f = ok;
  HostMatrix bf16(8, 8, DataType::kBFloat16);
  f.weight = bf16.cref();
  ExpectInvalid((*layer)->Forward(f), "weight is [8, 8] bf16, expected [8, 8] fp32");
  f = ok;
  f.output = MatrixRef{nullptr, 4, 8, DataType::kFloat32};
  ExpectInvalid((*layer)->Forward(f), "output [4, 8] fp32 has no data");
  f = ok;
  f.bias = nullptr;
  ExpectInvalid((*layer)->Forward(f), "has a bias of 8 but none was given");

  LinearOptions nb = Base();
  nb.bias = false;
  auto no_bias = ColumnParallelLinear::Create(nb, GroupHandle::Fixed(comm_.get()));
  ASSERT_TRUE(no_bias.ok());
  ExpectInvalid((*no_bias)->Forward(ok), "a bias was given to a layer created with bias = false");
}

TEST_F(LinearCallTest, BackwardRejectsWrongViewsAndBiasGradients) {
  LinearOptions o = Base();
  o.skip_bias_add = true;
  auto layer = RowParallelLinear::Create(o, GroupHandle::Fixed(comm_.get()));
  ASSERT_TRUE(layer.ok());
  HostMatrix x(4, 8, DataType::kFloat32), w(8, 8, DataType::kFloat32), dy(4, 8, DataType::kFloat32),
      dx(4, 8, DataType::kFloat32);
  std::vector<float> dw(64), db(8);
  LinearBackward ok{dy.cref(), x.cref(), w.cref(), dx.ref(), dw.data(), nullptr};
  ASSERT_TRUE((*layer)->Backward(ok).ok());

  LinearBackward b = ok;
  HostMatrix short_dy(3, 8, DataType::kFloat32);
  b.grad_output = short_dy.cref();
  ExpectInvalid((*layer)->Backward(b), "grad_output is [3, 8] fp32, expected [4, 8] fp32");
  b = ok;
  HostMatrix wide_dx(4, 9, DataType::kFloat32);
  b.grad_input = wide_dx.ref();
  ExpectInvalid((*layer)->Backward(b), "grad_input is [4, 9] fp32, expected [4, 8] fp32");
  b = ok;
  b.bias_grad = db.data();
  ExpectInvalid((*layer)->Backward(b), "skips the bias add (the caller owns the bias gradient)");

  LinearOptions nb = Base();
  nb.bias = false;
  auto no_bias = RowParallelLinear::Create(nb, GroupHandle::Fixed(comm_.get()));
  ASSERT_TRUE(no_bias.ok());
  ExpectInvalid((*no_bias)->Backward(b), "bias_grad was given but the layer has no bias");
}

// A peer that never joins: the collective's deadline passes and the error
// names the layer and the step.
TEST(LinearComm, MissingPeerEndsInDeadlineExceeded) {
  testing::FakeGroup group(2, testing::FakeOrdering::kMatchPosted, "tp");
  auto comm = group.Comm(0);
  LinearOptions o = Base();
  o.input_is_parallel = true;
  o.timeout = absl::Milliseconds(100);
  auto layer = RowParallelLinear::Create(o, GroupHandle::Fixed(comm.get()));
  ASSERT_TRUE(layer.ok());
  HostMatrix x(4, 4, DataType::kFloat32), w(8, 4, DataType::kFloat32), b(1, 8, DataType::kFloat32),
      y(4, 8, DataType::kFloat32);
  absl::Status s = (*layer)->Forward({x.cref(), w.cref(), b.bytes.data(), y.ref()});
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("row-parallel linear forward: all-reduce of output"));
  // Rank 1 joins late, so the fake group's pending collective completes and
  // no thread is left waiting.
  auto late = group.Comm(1);
  auto layer1 = RowParallelLinear::Create(o, GroupHandle::Fixed(late.get()));
  ASSERT_TRUE(layer1.ok());
  EXPECT_TRUE((*layer1)->Forward({x.cref(), w.cref(), b.bytes.data(), y.ref()}).ok());
}

}  // namespace
}  // namespace strata
