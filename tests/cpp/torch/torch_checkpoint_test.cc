// Checkpoints of torch::nn modules and Adam/AdamW through strata::torch:
// exact round trips of parameters, buffers and optimizer state, strict and
// lenient key matching, shape and dtype mismatches, and tensor-parallel
// layers saved at tp = 2 (two threads committing together over an
// in-process communicator) and loaded at tp = 1 and tp = 4.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "fake_communicator.h"  // tests/cpp/checkpoint: the commit agreement in one process
#include "strata/torch/checkpoint.h"

namespace strata::nn {
namespace {

using ::torch::Tensor;

class ScratchDir {
 public:
  ScratchDir() {
    const char* base = getenv("TEST_TMPDIR");
    std::string tmpl = std::string(base != nullptr ? base : "/tmp") + "/strata-torch-ckpt-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    path_ = mkdtemp(buf.data());
  }
  ~ScratchDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Parameters and buffers of every dtype the issue names, plus a BatchNorm
// (running stats and an int64 counter as buffers).
struct NetImpl : ::torch::nn::Module {
  explicit NetImpl(int64_t in = 6, ::torch::ScalarType half = ::torch::kFloat16) {
    fc = register_module("fc", ::torch::nn::Linear(in, 5));
    bn = register_module("bn", ::torch::nn::BatchNorm1d(5));
    w_bf16 = register_parameter("w_bf16", ::torch::randn({3, 4}).to(::torch::kBFloat16));
    w_fp16 = register_parameter("w_fp16", ::torch::randn({7}).to(half));
    ids = register_parameter("ids", ::torch::randint(-1000, 1000, {2, 3}, ::torch::kInt64),
                             /*requires_grad=*/false);
    b_bf16 = register_buffer("b_bf16", ::torch::randn({5}).to(::torch::kBFloat16));
    b_fp16 = register_buffer("b_fp16", ::torch::randn({2, 2}).to(::torch::kFloat16));
    b_i64 = register_buffer("b_i64", ::torch::randint(0, 1 << 30, {4}, ::torch::kInt64));
    b_bool = register_buffer("b_bool", ::torch::randint(0, 2, {3}).to(::torch::kBool));
  }
  ::torch::nn::Linear fc{nullptr};
  ::torch::nn::BatchNorm1d bn{nullptr};
  Tensor w_bf16, w_fp16, ids, b_bf16, b_fp16, b_i64, b_bool;
};
TORCH_MODULE(Net);

void ExpectSameTensors(::torch::nn::Module& a, ::torch::nn::Module& b) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& p : pa) {
    EXPECT_TRUE(::torch::equal(p.value(), pb[p.key()])) << p.key();
    EXPECT_EQ(p.value().scalar_type(), pb[p.key()].scalar_type()) << p.key();
  }
  auto ba = a.named_buffers(), bb = b.named_buffers();
  ASSERT_EQ(ba.size(), bb.size());
  for (const auto& x : ba) EXPECT_TRUE(::torch::equal(x.value(), bb[x.key()])) << x.key();
}

CheckpointOptions SaveOpts(const std::string& dir) {
  CheckpointOptions o;
  o.directory = dir;
  o.commit_timeout = absl::Seconds(60);
  return o;
}

LoadOptions LoadOpts(const std::string& dir) {
  LoadOptions o;
  o.directory = dir;
  o.timeout = absl::Seconds(60);
  return o;
}

TEST(TorchCheckpoint, RoundTripParametersAndBuffersOfEveryDtype) {
  ScratchDir dir;
  ::torch::manual_seed(1);
  Net saved;
  saved->bn->train();
  saved->bn->forward(::torch::randn({8, 5}));  // running stats and the counter move
  ModuleState st;
  st.module = saved.get();
  ASSERT_TRUE(SaveModuleStateSync(SaveOpts(dir.path()), 3, st).ok());

  ::torch::manual_seed(2);
  Net loaded;
  ASSERT_FALSE(::torch::equal(saved->fc->weight, loaded->fc->weight));
  ModuleState lt;
  lt.module = loaded.get();
  absl::StatusOr<LoadReport> r = LoadModuleState(LoadOpts(dir.path()), lt);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->step, 3);
  EXPECT_GT(r->bytes_verified, 0u);
  ExpectSameTensors(*saved, *loaded);
  EXPECT_EQ(loaded->bn->num_batches_tracked.item<int64_t>(), 1);
}

TEST(TorchCheckpoint, NonContiguousTensorsAreSavedByValue) {
  ScratchDir dir;
  ::torch::manual_seed(3);
  Net saved;
  {
    ::torch::NoGradGuard g;
    // A transposed view as the parameter: its values, not its storage order.
    saved->w_bf16.set_(::torch::randn({4, 3}).to(::torch::kBFloat16).t());
  }
  ASSERT_FALSE(saved->w_bf16.is_contiguous());
  ModuleState st;
  st.module = saved.get();
  ASSERT_TRUE(SaveModuleStateSync(SaveOpts(dir.path()), 1, st).ok());
  Net loaded;
  ModuleState lt;
  lt.module = loaded.get();
  ASSERT_TRUE(LoadModuleState(LoadOpts(dir.path()), lt).ok());
  ExpectSameTensors(*saved, *loaded);
}

struct MlpImpl : ::torch::nn::Module {
  MlpImpl() {
    a = register_module("a", ::torch::nn::Linear(4, 8));
    b = register_module("b", ::torch::nn::Linear(8, 2));
  }
  Tensor forward(const Tensor& x) { return b(::torch::tanh(a(x))); }
  ::torch::nn::Linear a{nullptr}, b{nullptr};
};
TORCH_MODULE(Mlp);

template <typename Opt, typename OptOptions, typename ParamState>
void AdamRoundTrip(const OptOptions& options) {
  ScratchDir dir;
  ::torch::manual_seed(4);
  Mlp model;
  Opt opt(model->parameters(), options);
  const Tensor x = ::torch::randn({16, 4}), y = ::torch::randn({16, 2});
  auto step = [&](Mlp& m, Opt& o) {
    o.zero_grad();
    ::torch::mse_loss(m->forward(x), y).backward();
    o.step();
  };
  step(model, opt);
  step(model, opt);

  auto ckpt = Checkpointer::Create(SaveOpts(dir.path()));
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ModuleState st;
  st.module = model.get();
  st.optimizer = &opt;
  TrainingState plain;
  plain.optimizer_step = 2;
  ASSERT_TRUE(SaveModuleState(**ckpt, 2, st, plain).ok());
  // The values at the time of the save are the ones saved.
  Mlp reference;
  for (const auto& p : model->named_parameters()) {
    ::torch::NoGradGuard g;
    reference->named_parameters()[p.key()].copy_(p.value());
  }
  step(model, opt);
  ASSERT_TRUE((*ckpt)->Wait(absl::Now() + absl::Seconds(60)).ok());

  // A fresh model and an optimizer that has not stepped: its state is
  // created from the checkpoint, by parameter name.
  ::torch::manual_seed(5);
  Mlp loaded;
  Opt lopt(loaded->parameters(), options);
  ModuleState lt;
  lt.module = loaded.get();
  lt.optimizer = &lopt;
  absl::StatusOr<LoadReport> r = LoadModuleState(LoadOpts(dir.path()), lt);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectSameTensors(*reference, *loaded);
  // Replay the step taken after the save on the loaded pair: it must land
  // exactly where the original did.
  step(loaded, lopt);
  ExpectSameTensors(*model, *loaded);
  auto lp = loaded->named_parameters();
  for (const auto& p : model->named_parameters()) {
    const auto& a =
        static_cast<const ParamState&>(*opt.state().at(p.value().unsafeGetTensorImpl()));
    const auto& b =
        static_cast<const ParamState&>(*lopt.state().at(lp[p.key()].unsafeGetTensorImpl()));
    EXPECT_EQ(a.step(), b.step()) << p.key();
    EXPECT_TRUE(::torch::equal(a.exp_avg(), b.exp_avg())) << p.key();
    EXPECT_TRUE(::torch::equal(a.exp_avg_sq(), b.exp_avg_sq())) << p.key();
    EXPECT_EQ(a.max_exp_avg_sq().defined(), b.max_exp_avg_sq().defined()) << p.key();
    if (a.max_exp_avg_sq().defined()) {
      EXPECT_TRUE(::torch::equal(a.max_exp_avg_sq(), b.max_exp_avg_sq())) << p.key();
    }
  }

  // Loading into an optimizer that has state overwrites it in place.
  ASSERT_TRUE(LoadModuleState(LoadOpts(dir.path()), lt).ok());
  ExpectSameTensors(*reference, *loaded);
  auto ck = CheckpointReader::Open(LoadOpts(dir.path()));
  ASSERT_TRUE(ck.ok());
  EXPECT_EQ((*ck)->state().optimizer_step, 2);
  EXPECT_NE((*ck)->manifest().FindTensor("optimizer.a.weight.exp_avg"), nullptr);
  EXPECT_NE((*ck)->manifest().FindTensor("optimizer.b.bias.step"), nullptr);
}

TEST(TorchCheckpoint, AdamStateRoundTripByName) {
  AdamRoundTrip<::torch::optim::Adam, ::torch::optim::AdamOptions, ::torch::optim::AdamParamState>(
      ::torch::optim::AdamOptions(1e-2));
}

TEST(TorchCheckpoint, AdamWAmsgradStateRoundTripByName) {
  AdamRoundTrip<::torch::optim::AdamW, ::torch::optim::AdamWOptions,
                ::torch::optim::AdamWParamState>(::torch::optim::AdamWOptions(1e-2).amsgrad(true));
}

// Strict by default: a module tensor the checkpoint lacks, or a saved tensor
// the module lacks, is an error naming the key; nothing is changed.
struct ExtraImpl : ::torch::nn::Module {
  ExtraImpl() {
    a = register_module("a", ::torch::nn::Linear(4, 8));
    b = register_module("b", ::torch::nn::Linear(8, 2));
    extra = register_parameter("extra", ::torch::ones({3}));
  }
  ::torch::nn::Linear a{nullptr}, b{nullptr};
  Tensor extra;
};
TORCH_MODULE(Extra);

TEST(TorchCheckpoint, StrictErrorsNameTheKey) {
  ScratchDir dir;
  Mlp model;
  ModuleState st;
  st.module = model.get();
  ASSERT_TRUE(SaveModuleStateSync(SaveOpts(dir.path()), 1, st).ok());

  Extra extra;
  const Tensor before = extra->a->weight.clone();
  ModuleState et;
  et.module = extra.get();
  absl::StatusOr<LoadReport> r = LoadModuleState(LoadOpts(dir.path()), et);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_NE(r.status().message().find("model.extra"), absl::string_view::npos) << r.status();
  EXPECT_TRUE(::torch::equal(extra->a->weight, before));

  // Saved with the extra tensor, loaded without it: unexpected.
  ScratchDir dir2;
  ASSERT_TRUE(SaveModuleStateSync(SaveOpts(dir2.path()), 1, et).ok());
  r = LoadModuleState(LoadOpts(dir2.path()), st);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("model.extra"), absl::string_view::npos) << r.status();

  // Lenient: both listed, the rest loaded.
  LoadOptions lenient = LoadOpts(dir.path());
  lenient.matching = KeyMatching::kLenient;
  r = LoadModuleState(lenient, et);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->missing, std::vector<std::string>{"model.extra"});
  EXPECT_TRUE(::torch::equal(extra->a->weight, model->a->weight));
  EXPECT_TRUE(::torch::equal(extra->extra, ::torch::ones({3})));

  // Optimizer state present in the optimizer but absent from a checkpoint
  // saved without one.
  ::torch::optim::Adam opt(model->parameters(), ::torch::optim::AdamOptions(1e-3));
  for (auto& p : model->parameters()) p.mutable_grad() = ::torch::ones_like(p);
  opt.step();
  st.optimizer = &opt;
  r = LoadModuleState(LoadOpts(dir.path()), st);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_NE(r.status().message().find("optimizer.a."), absl::string_view::npos) << r.status();
}

TEST(TorchCheckpoint, ShapeAndDtypeMismatchNameTheKey) {
  ScratchDir dir;
  Net saved(6);
  ModuleState st;
  st.module = saved.get();
  ASSERT_TRUE(SaveModuleStateSync(SaveOpts(dir.path()), 1, st).ok());

  Net wider(7);  // fc.weight [5, 7] against the saved [5, 6]
  const Tensor before = wider->w_fp16.clone();
  ModuleState wt;
  wt.module = wider.get();
  absl::StatusOr<LoadReport> r = LoadModuleState(LoadOpts(dir.path()), wt);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("model.fc.weight"), absl::string_view::npos) << r.status();
  EXPECT_TRUE(::torch::equal(wider->w_fp16, before));  // nothing loaded

  Net other(6, ::torch::kFloat32);  // w_fp16 as float32
  ModuleState ot;
  ot.module = other.get();
  r = LoadModuleState(LoadOpts(dir.path()), ot);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("model.w_fp16"), absl::string_view::npos) << r.status();
}

TEST(TorchCheckpoint, BadInputsAreRefused) {
  ScratchDir dir;
  Mlp model;
  ModuleState st;
  EXPECT_EQ(BuildModuleSaveRequest(st, 1).status().code(), absl::StatusCode::kInvalidArgument);
  st.module = model.get();
  ::torch::optim::SGD sgd(model->parameters(), ::torch::optim::SGDOptions(0.1));
  st.optimizer = &sgd;
  absl::Status s = SaveModuleStateSync(SaveOpts(dir.path()), 1, st);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("Adam"), absl::string_view::npos) << s;

  // An optimizer over a tensor that is not a parameter of the module.
  Tensor stray = ::torch::zeros({2}, ::torch::requires_grad());
  ::torch::optim::Adam adam(std::vector<Tensor>{stray}, ::torch::optim::AdamOptions(0.1));
  st.optimizer = &adam;
  s = BuildModuleSaveRequest(st, 1).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("not a parameter of the module"), absl::string_view::npos) << s;

  // A dtype strata cannot store, named with its key.
  struct C : ::torch::nn::Module {
    C() { register_buffer("z", ::torch::zeros({2}, ::torch::kComplexFloat)); }
  } c;
  ModuleState ct;
  ct.module = &c;
  s = BuildModuleSaveRequest(ct, 1).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("model.z"), absl::string_view::npos) << s;
}

}  // namespace
}  // namespace strata::nn
