// Checkpoints of torch::nn modules and Adam/AdamW optimizers over the
// strata checkpoint layer (see strata/torch/checkpoint.h).
#include "strata/torch/checkpoint.h"

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "internal/tensor_views.h"
#include "strata/base/status.h"

namespace strata::nn {

namespace {

using ::torch::Tensor;

absl::StatusOr<DataType> StrataType(const Tensor& t, const std::string& key) {
  switch (t.scalar_type()) {
    case ::torch::kFloat32:
      return DataType::kFloat32;
    case ::torch::kFloat64:
      return DataType::kFloat64;
    case ::torch::kFloat16:
      return DataType::kFloat16;
    case ::torch::kBFloat16:
      return DataType::kBFloat16;
    case ::torch::kInt8:
      return DataType::kInt8;
    case ::torch::kUInt8:
      return DataType::kUInt8;
    case ::torch::kInt32:
      return DataType::kInt32;
    case ::torch::kInt64:
      return DataType::kInt64;
    case ::torch::kInt16:
      return DataType::kInt16;
    case ::torch::kBool:
      return DataType::kBool;
    default:
      return absl::InvalidArgumentError(absl::StrCat("checkpoint: tensor '", key, "' has dtype ",
                                                     std::string(c10::toString(t.scalar_type())),
                                                     ", which strata checkpoints cannot store"));
  }
}

// One tensor of the module or optimizer and its box in the global tensor
// (null: whole).
struct Entry {
  std::string key;
  Tensor tensor;
  const ParameterShard* box = nullptr;
};

absl::StatusOr<ShardedTensor> ShardOf(const Entry& e, const ModuleState& state) {
  ShardedTensor s;
  s.key = e.key;
  STRATA_ASSIGN_OR_RETURN(s.dtype, StrataType(e.tensor, e.key));
  s.local_shape.assign(e.tensor.sizes().begin(), e.tensor.sizes().end());
  if (e.box != nullptr) {
    if (e.box->global_shape.size() != s.local_shape.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint: tensor '", e.key, "' has ", s.local_shape.size(),
          " dimensions but its tensor-parallel shard has ", e.box->global_shape.size()));
    }
    s.global_shape = e.box->global_shape;
    s.global_offset = e.box->global_offset;
    s.replica = state.shard_replica;
  } else {
    s.global_shape = s.local_shape;
    s.global_offset.assign(s.local_shape.size(), 0);
    s.replica = state.whole_replica;
  }
  STRATA_RETURN_IF_ERROR(ValidateShard(s));
  return s;
}

// The module's parameters and buffers, with the boxes of the sharded ones.
std::vector<Entry> ModuleEntries(const ModuleState& state,
                                 std::map<const void*, std::string>* param_names,
                                 std::map<std::string, const ParameterShard*>* boxes) {
  auto add_boxes = [&](const ::torch::nn::Module& m, const std::string& prefix) {
    const auto* sharded = dynamic_cast<const ShardedParameters*>(&m);
    if (sharded == nullptr) return;
    for (const auto& [name, box] : sharded->parameter_shards()) (*boxes)[prefix + name] = &box;
  };
  // The module itself apart: named_modules() would need it in a shared_ptr.
  add_boxes(*state.module, "");
  for (const auto& item : state.module->named_modules("", /*include_self=*/false)) {
    add_boxes(*item.value(), item.key() + ".");
  }
  std::vector<Entry> out;
  for (const auto& p : state.module->named_parameters()) {
    auto it = boxes->find(p.key());
    (*param_names)[p.value().unsafeGetTensorImpl()] = p.key();
    out.push_back(
        {state.module_prefix + p.key(), p.value(), it == boxes->end() ? nullptr : it->second});
  }
  for (const auto& b : state.module->named_buffers()) {
    out.push_back({state.module_prefix + b.key(), b.value(), nullptr});
  }
  return out;
}

// The state slots of Adam and AdamW (their ParamState classes are distinct
// types with the same fields).
struct AdamSlots {
  Tensor* exp_avg;
  Tensor* exp_avg_sq;
  Tensor* max_exp_avg_sq;
  int64_t* step;
};

template <typename S>
AdamSlots SlotsOf(::torch::optim::OptimizerParamState& st) {
  auto& s = static_cast<S&>(st);
  return {&s.exp_avg(), &s.exp_avg_sq(), &s.max_exp_avg_sq(), &s.step()};
}

// A parameter of the optimizer: its name in the module, and its state
// (null before the optimizer's first step on it).
struct OptimizerParam {
  std::string name;
  Tensor param;
  ::torch::optim::OptimizerParamState* state = nullptr;
};

class OptimizerView {
 public:
  static absl::StatusOr<OptimizerView> Of(::torch::optim::Optimizer* opt,
                                          const std::map<const void*, std::string>& names) {
    OptimizerView v;
    v.opt_ = opt;
    if (dynamic_cast<::torch::optim::Adam*>(opt) != nullptr) {
      v.adamw_ = false;
    } else if (dynamic_cast<::torch::optim::AdamW*>(opt) != nullptr) {
      v.adamw_ = true;
    } else {
      return absl::InvalidArgumentError(
          "checkpoint: only torch::optim::Adam and torch::optim::AdamW optimizers are supported");
    }
    const auto& groups = opt->param_groups();
    for (size_t g = 0; g < groups.size(); ++g) {
      const auto& params = groups[g].params();
      for (size_t i = 0; i < params.size(); ++i) {
        void* impl = params[i].unsafeGetTensorImpl();
        auto name = names.find(impl);
        if (name == names.end()) {
          return absl::InvalidArgumentError(absl::StrCat("checkpoint: parameter ", i,
                                                         " of the optimizer's param group ", g,
                                                         " is not a parameter of the module"));
        }
        auto st = opt->state().find(impl);
        v.params_.push_back(
            {name->second, params[i], st == opt->state().end() ? nullptr : st->second.get()});
      }
    }
    return v;
  }

  const std::vector<OptimizerParam>& params() const { return params_; }

  AdamSlots Slots(::torch::optim::OptimizerParamState& st) const {
    return adamw_ ? SlotsOf<::torch::optim::AdamWParamState>(st)
                  : SlotsOf<::torch::optim::AdamParamState>(st);
  }

  // Gives `param` a fresh state and returns its slots.
  AdamSlots Create(const Tensor& param) {
    std::unique_ptr<::torch::optim::OptimizerParamState> st;
    if (adamw_) {
      st = std::make_unique<::torch::optim::AdamWParamState>();
    } else {
      st = std::make_unique<::torch::optim::AdamParamState>();
    }
    auto* raw = st.get();
    opt_->state()[param.unsafeGetTensorImpl()] = std::move(st);
    return Slots(*raw);
  }

 private:
  ::torch::optim::Optimizer* opt_ = nullptr;
  bool adamw_ = false;
  std::vector<OptimizerParam> params_;
};

absl::Status CheckState(const ModuleState& state) {
  if (state.version != ModuleState::kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint: ModuleState version ",
                                                   state.version, " is not supported (expected ",
                                                   ModuleState::kVersion, ")"));
  }
  if (state.module == nullptr) {
    return absl::InvalidArgumentError("checkpoint: ModuleState.module is null");
  }
  return absl::OkStatus();
}

// Every tensor to save or load, in a stable order: the module's, then each
// optimizer parameter's states (those it has).
struct Collected {
  std::vector<Entry> entries;
  std::map<const void*, std::string> param_names;
  std::map<std::string, const ParameterShard*> boxes;
};

absl::Status CheckStateShape(const std::string& key, const Tensor& t, const Tensor& param) {
  if (t.sizes() != param.sizes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint: optimizer state '", key, "' has shape [", absl::StrJoin(t.sizes(), ", "),
        "] but its parameter has shape [", absl::StrJoin(param.sizes(), ", "), "]"));
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

absl::StatusOr<ModuleSaveRequest> BuildRequest(const ModuleState& state, int64_t step) {
  STRATA_RETURN_IF_ERROR(CheckState(state));
  Collected c;
  c.entries = ModuleEntries(state, &c.param_names, &c.boxes);
  if (state.optimizer != nullptr) {
    STRATA_ASSIGN_OR_RETURN(OptimizerView view, OptimizerView::Of(state.optimizer, c.param_names));
    for (const OptimizerParam& p : view.params()) {
      if (p.state == nullptr) continue;
      AdamSlots s = view.Slots(*p.state);
      auto box = c.boxes.find(p.name);
      const ParameterShard* b = box == c.boxes.end() ? nullptr : box->second;
      const std::string base = state.optimizer_prefix + p.name;
      for (auto [slot, suffix] :
           {std::pair{s.exp_avg, ".exp_avg"}, std::pair{s.exp_avg_sq, ".exp_avg_sq"},
            std::pair{s.max_exp_avg_sq, ".max_exp_avg_sq"}}) {
        if (!slot->defined()) continue;
        STRATA_RETURN_IF_ERROR(CheckStateShape(base + suffix, *slot, p.param));
        c.entries.push_back({base + suffix, *slot, b});
      }
      c.entries.push_back({base + ".step", ::torch::tensor(*s.step, ::torch::kInt64), nullptr});
    }
  }
  ModuleSaveRequest out;
  out.request.step = step;
  for (const Entry& e : c.entries) {
    STRATA_ASSIGN_OR_RETURN(ShardedTensor shard, ShardOf(e, state));
    Tensor t = e.tensor.detach();
    if (!t.is_cpu() && !t.is_cuda()) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint: tensor '", e.key, "' is on ",
                                                     t.device().str(),
                                                     "; only CPU and CUDA tensors are saved"));
    }
    if (!t.is_contiguous()) t = t.contiguous();
    TensorData d;
    d.shard = std::move(shard);
    d.data = t.data_ptr();
    d.memory = t.is_cuda() ? MemoryKind::kCuda : MemoryKind::kHost;
    if (t.is_cuda() && out.request.cuda_stream == nullptr) {
      out.request.cuda_stream = internal::StreamOf(t);
    }
    out.request.tensors.push_back(std::move(d));
    out.keep_alive.push_back(std::move(t));
  }
  return out;
}

// LibTorch reports its failures as c10::Error; the API here returns Status.
template <typename F>
auto Guarded(const char* what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("checkpoint: LibTorch failed while ", what, ": ", e.what_without_backtrace()));
  }
}

// This rank cannot build its targets, but the load is collective: it takes
// part with one target that fails validation and whose key carries the
// reason, so the other ranks fail at once ("rank <k> could not match its
// targets ...: ...") rather than at their deadline.
void FailCollectiveLoad(const CheckpointReader& reader, const absl::Status& reason) {
  std::string key = absl::StrCat("<rank-local failure: ", reason.message(), ">");
  if (key.size() > kMaxTensorKeyBytes) key.resize(kMaxTensorKeyBytes);
  uint8_t scratch[8] = {};
  TensorTarget poison;
  poison.shard.key = std::move(key);
  poison.shard.global_shape = {1};
  poison.shard.local_shape = {2};  // larger than the tensor: refused
  poison.shard.global_offset = {0};
  poison.data = scratch;
  (void)reader.Load({poison});
}

}  // namespace

absl::StatusOr<ModuleSaveRequest> BuildModuleSaveRequest(const ModuleState& state, int64_t step) {
  return Guarded("collecting the tensors to save", [&] { return BuildRequest(state, step); });
}

absl::Status SaveModuleState(Checkpointer& checkpointer, int64_t step, const ModuleState& state,
                             const TrainingState& plain) {
  absl::StatusOr<ModuleSaveRequest> req = BuildModuleSaveRequest(state, step);
  if (!req.ok()) {
    // The other ranks' save of this step must not wait for this one.
    return checkpointer.Abandon(step, req.status());
  }
  req->request.state = plain;
  // CUDA copies into staging are ordered on the stream; Save returns once
  // they are done, so the keep-alive tensors may go then.
  return checkpointer.Save(req->request);
}

absl::Status SaveModuleStateSync(const CheckpointOptions& options, int64_t step,
                                 const ModuleState& state, const TrainingState& plain) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Checkpointer> ckpt, Checkpointer::Create(options));
  absl::Status saved = SaveModuleState(*ckpt, step, state, plain);
  absl::Status closed = ckpt->Close(absl::Now() + options.commit_timeout);
  return saved.ok() ? closed : saved;
}

namespace {

absl::StatusOr<LoadReport> Load(const LoadOptions& options, const ModuleState& state) {
  STRATA_RETURN_IF_ERROR(CheckState(state));
  // Pending reads: a host staging tensor per target, and what to do with it
  // once every read has succeeded.
  struct Pending {
    ShardedTensor shard;
    Tensor staging;
    std::function<void(const Tensor&)> commit;
  };
  std::vector<Pending> pending;
  auto add = [&](const Entry& e, std::function<void(const Tensor&)> commit) -> absl::Status {
    STRATA_ASSIGN_OR_RETURN(ShardedTensor shard, ShardOf(e, state));
    Tensor staging = ::torch::empty(e.tensor.sizes(), e.tensor.options().device(::torch::kCPU));
    pending.push_back({std::move(shard), std::move(staging), std::move(commit)});
    return absl::OkStatus();
  };
  auto copy_into = [](Tensor dst) {
    return [dst](const Tensor& src) mutable {
      ::torch::NoGradGuard no_grad;
      dst.copy_(src);
    };
  };

  // Open first: it is collective, and the targets of optimizer states an
  // optimizer does not have yet depend on the manifest.
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                          CheckpointReader::Open(options));
  Collected c;
  std::optional<OptimizerView> view;
  auto prepare = [&]() -> absl::Status {
    c.entries = ModuleEntries(state, &c.param_names, &c.boxes);
    for (const Entry& e : c.entries) STRATA_RETURN_IF_ERROR(add(e, copy_into(e.tensor)));

    if (state.optimizer != nullptr) {
      STRATA_ASSIGN_OR_RETURN(view, OptimizerView::Of(state.optimizer, c.param_names));
      for (const OptimizerParam& p : view->params()) {
        auto box = c.boxes.find(p.name);
        const ParameterShard* b = box == c.boxes.end() ? nullptr : box->second;
        const std::string base = state.optimizer_prefix + p.name;
        const Tensor step_like = ::torch::tensor(int64_t{0}, ::torch::kInt64);
        if (p.state != nullptr) {
          AdamSlots s = view->Slots(*p.state);
          for (auto [slot, suffix] :
               {std::pair{s.exp_avg, ".exp_avg"}, std::pair{s.exp_avg_sq, ".exp_avg_sq"},
                std::pair{s.max_exp_avg_sq, ".max_exp_avg_sq"}}) {
            if (!slot->defined()) continue;
            STRATA_RETURN_IF_ERROR(CheckStateShape(base + suffix, *slot, p.param));
            STRATA_RETURN_IF_ERROR(add({base + suffix, *slot, b}, copy_into(*slot)));
          }
          int64_t* step = s.step;
          STRATA_RETURN_IF_ERROR(add({base + ".step", step_like, nullptr},
                                     [step](const Tensor& t) { *step = t.item<int64_t>(); }));
          continue;
        }
        // No state yet (no step taken): created from the checkpoint when it
        // has one for this parameter.
        if (reader->manifest().FindTensor(base + ".exp_avg") == nullptr) continue;
        const bool ams = reader->manifest().FindTensor(base + ".max_exp_avg_sq") != nullptr;
        // The new state's tensors, filled by the commits below in order; the
        // last (the step) installs the state.
        auto fresh = std::make_shared<std::vector<Tensor>>();
        Tensor param = p.param;
        OptimizerView* v = &*view;
        std::vector<std::string> suffixes = {".exp_avg", ".exp_avg_sq"};
        if (ams) suffixes.push_back(".max_exp_avg_sq");
        for (const std::string& suffix : suffixes) {
          STRATA_RETURN_IF_ERROR(
              add({base + suffix, p.param.detach(), b}, [fresh, param](const Tensor& t) {
                fresh->push_back(t.to(param.device()).clone(::torch::MemoryFormat::Preserve));
              }));
        }
        STRATA_RETURN_IF_ERROR(add({base + ".step", step_like, nullptr},
                                   [fresh, param, v, ams, n = suffixes.size()](const Tensor& t) {
                                     // A lenient load that missed one of the states leaves none.
                                     if (fresh->size() != n) return;
                                     AdamSlots s = v->Create(param);
                                     *s.exp_avg = (*fresh)[0];
                                     *s.exp_avg_sq = (*fresh)[1];
                                     if (ams) *s.max_exp_avg_sq = (*fresh)[2];
                                     *s.step = t.item<int64_t>();
                                   }));
      }
    }
    return absl::OkStatus();
  };
  if (absl::Status prepared = prepare(); !prepared.ok()) {
    if (!options.group.empty()) FailCollectiveLoad(*reader, prepared);
    return prepared;
  }

  std::vector<TensorTarget> targets;
  targets.reserve(pending.size());
  for (const Pending& p : pending) targets.push_back({p.shard, p.staging.data_ptr()});
  STRATA_ASSIGN_OR_RETURN(LoadReport report, reader->Load(targets));
  // Lenient loads skip missing targets: those keep their values.
  std::set<std::string> missing(report.missing.begin(), report.missing.end());
  for (const Pending& p : pending) {
    if (missing.count(p.shard.key) == 0) p.commit(p.staging);
  }
  return report;
}

}  // namespace

absl::StatusOr<LoadReport> LoadModuleState(const LoadOptions& options, const ModuleState& state) {
  return Guarded("loading", [&] { return Load(options, state); });
}

}  // namespace strata::nn
