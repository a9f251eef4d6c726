// strata::nn::DataParallel: the flat gradient buffers, their layout, the
// post-accumulate-grad hooks and the end-of-backward callback (see the
// header). The layout rules are those of python/strata/_dp_layout.py.
#include "strata/torch/data_parallel.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "internal/tensor_views.h"
#include "strata/base/status.h"

#if STRATA_TORCH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace strata::nn {

namespace {

struct Entry {
  int index = 0;
  std::string name;
  ::torch::Tensor param;
  ::torch::ScalarType dtype = ::torch::kFloat32;
  std::vector<int64_t> shape;
  int64_t numel = 0;
};

struct Bucket {
  int index = 0;
  ::torch::ScalarType dtype = ::torch::kFloat32;
  int64_t start = 0;
  int64_t length = 0;
  std::vector<int> entries;
};

// Buckets of entries laid out in `order`: per dtype, a bucket closes once it
// holds bucket_bytes; buckets are numbered in the order they close.
struct Layout {
  std::vector<int> order;
  std::vector<Bucket> buckets;
  std::vector<::torch::ScalarType> dtypes;  // in order of first appearance
  std::map<::torch::ScalarType, int64_t> sizes;
  std::vector<int64_t> offset;  // by entry index
  std::vector<int> bucket_of;   // by entry index
};

Layout MakeLayout(const std::vector<Entry>& entries, std::vector<int> order, int64_t bucket_bytes) {
  Layout lay;
  lay.order = std::move(order);
  lay.offset.assign(entries.size(), 0);
  lay.bucket_of.assign(entries.size(), 0);
  std::map<::torch::ScalarType, std::pair<std::vector<int>, int64_t>> open;
  auto close = [&](::torch::ScalarType dtype, const std::vector<int>& members) {
    Bucket b;
    b.index = static_cast<int>(lay.buckets.size());
    b.dtype = dtype;
    b.start = lay.sizes[dtype];
    int64_t offset = b.start;
    for (int i : members) {
      lay.offset[static_cast<size_t>(i)] = offset;
      lay.bucket_of[static_cast<size_t>(i)] = b.index;
      offset += entries[static_cast<size_t>(i)].numel;
    }
    b.length = std::max<int64_t>(offset - b.start, 1);
    b.entries = members;
    lay.sizes[dtype] = b.start + b.length;
    lay.buckets.push_back(std::move(b));
  };
  for (int i : lay.order) {
    const Entry& e = entries[static_cast<size_t>(i)];
    if (std::find(lay.dtypes.begin(), lay.dtypes.end(), e.dtype) == lay.dtypes.end()) {
      lay.dtypes.push_back(e.dtype);
    }
    auto& cur = open[e.dtype];
    cur.first.push_back(i);
    cur.second += e.numel * static_cast<int64_t>(::c10::elementSize(e.dtype));
    if (cur.second >= bucket_bytes) {
      close(e.dtype, cur.first);
      open.erase(e.dtype);
    }
  }
  for (::torch::ScalarType d : lay.dtypes) {
    auto it = open.find(d);
    if (it != open.end()) close(d, it->second.first);
  }
  return lay;
}

// FNV-1a: the same on every process (absl::Hash is seeded per process).
int64_t Digest(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return static_cast<int64_t>(h >> 2);
}

std::string Describe(const std::vector<Entry>& entries, const Layout& lay,
                     const DataParallelOptions& o) {
  std::string s = absl::StrCat(o.bucket_bytes, "/", static_cast<int>(o.reduce_op), "/",
                               o.find_unused_parameters, ";");
  for (const Bucket& b : lay.buckets) {
    absl::StrAppend(&s, static_cast<int>(b.dtype), ":", b.start, ":", b.length, "[");
    for (int i : b.entries) {
      absl::StrAppend(&s, i, "(", absl::StrJoin(entries[static_cast<size_t>(i)].shape, ","), ")");
    }
    absl::StrAppend(&s, "]");
  }
  return s;
}

absl::StatusOr<DataType> StrataType(::torch::ScalarType t) {
  switch (t) {
    case ::torch::kFloat32:
      return DataType::kFloat32;
    case ::torch::kFloat64:
      return DataType::kFloat64;
    case ::torch::kFloat16:
      return DataType::kFloat16;
    case ::torch::kBFloat16:
      return DataType::kBFloat16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("DataParallel: parameters must be float32, float64, float16 or "
                       "bfloat16, got ",
                       ::c10::toString(t)));
  }
}

Buffer BufferOf(const ::torch::Tensor& t) {
  return Buffer{t.data_ptr(), static_cast<size_t>(t.numel()), StrataType(t.scalar_type()).value()};
}

std::string Names(const std::vector<const Entry*>& es, size_t limit = 8) {
  std::vector<std::string> out;
  for (size_t i = 0; i < es.size() && i < limit; ++i) out.push_back("'" + es[i]->name + "'");
  std::string s = absl::StrJoin(out, ", ");
  if (es.size() > limit) absl::StrAppend(&s, " and ", es.size() - limit, " more");
  return s;
}

}  // namespace

struct DataParallel::State {
  // The group, and its communicator as resolved at the start of the current
  // backward pass (or FinishGradSync, Create, Rebuild): after a World
  // rebuild, the new generation's.
  GroupHandle handle;
  Communicator* group = nullptr;
  DataParallelOptions opts;
  std::vector<Entry> entries;
  Layout layout;
  std::map<::torch::ScalarType, ::torch::Tensor> grad;
  std::vector<::torch::Tensor> views;
  ::torch::Device device{::torch::kCPU};
  bool final = false;
  std::vector<int> seen;
  std::vector<bool> was_seen;
  bool user_sync = true;
  bool backward_sync = true;
  bool in_backward = false;
  std::vector<bool> ready;
  std::vector<int> pending;
  size_t next_launch = 0;
  std::map<int, std::unique_ptr<Work>> works;
  std::string failed;
  bool reduced = false;
  bool fresh = false;
  std::vector<DataParallelEvent> events;
#if STRATA_TORCH_CUDA
  std::optional<c10::cuda::CUDAStream> side;
#endif

  absl::Status ResolveGroup() {
    absl::StatusOr<Communicator*> c = handle.Resolve();
    if (!c.ok()) return ::strata::internal::Annotate(c.status(), "DataParallel");
    group = *c;
    return absl::OkStatus();
  }

  void Event(DataParallelEvent::Kind kind, int64_t index = -1, std::string name = {}) {
    if (opts.record_events) events.push_back({kind, index, std::move(name)});
  }

  OpOptions Op() const {
    OpOptions o;
    o.timeout = opts.timeout;
#if STRATA_TORCH_CUDA
    if (side.has_value()) o.stream = side->stream();
#endif
    return o;
  }

  // The side stream waits for the work queued on the current stream so far
  // (the gradients' producer).
  void OrderAfterProducer() {
#if STRATA_TORCH_CUDA
    if (!side.has_value()) return;
    c10::cuda::CUDAGuard guard(device.index());
    cudaEvent_t ev;
    TORCH_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess,
                "DataParallel: cudaEventCreate failed");
    cudaEventRecord(ev, c10::cuda::getCurrentCUDAStream(device.index()).stream());
    cudaStreamWaitEvent(side->stream(), ev, 0);
    cudaEventDestroy(ev);  // released once recorded work completes
#endif
  }

  // The current stream waits for everything issued on the side stream.
  void Join() {
#if STRATA_TORCH_CUDA
    if (!side.has_value()) return;
    c10::cuda::CUDAGuard guard(device.index());
    cudaEvent_t ev;
    TORCH_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) == cudaSuccess,
                "DataParallel: cudaEventCreate failed");
    cudaEventRecord(ev, side->stream());
    cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(device.index()).stream(), ev, 0);
    cudaEventDestroy(ev);
#endif
  }

  void ResetPass() {
    ready.assign(entries.size(), false);
    pending.clear();
    for (const Bucket& b : layout.buckets) pending.push_back(static_cast<int>(b.entries.size()));
    next_launch = 0;
    works.clear();
  }

  // Buffers for `layout`, gradients copied from the current views.
  void Alloc() {
    ::torch::NoGradGuard no_grad;
    std::map<::torch::ScalarType, ::torch::Tensor> fresh_grad;
    for (const auto& [dtype, n] : layout.sizes) {
      fresh_grad[dtype] = ::torch::zeros({n}, ::torch::TensorOptions().dtype(dtype).device(device));
    }
    views.resize(entries.size());
    for (Entry& e : entries) {
      const int64_t off = layout.offset[static_cast<size_t>(e.index)];
      ::torch::Tensor view = fresh_grad[e.dtype].narrow(0, off, e.numel).view(e.shape);
      ::torch::Tensor& g = e.param.mutable_grad();
      if (g.defined()) view.copy_(g);
      g = view;
      views[static_cast<size_t>(e.index)] = view;
    }
    grad = std::move(fresh_grad);
    reduced = fresh = false;
  }

  // grad() is the buffer's view again (one copy when it was replaced; an
  // undefined gradient counts as zero).
  void Adopt(Entry& e) {
    ::torch::Tensor& view = views[static_cast<size_t>(e.index)];
    ::torch::Tensor& g = e.param.mutable_grad();
    if (g.defined() && g.is_same(view)) return;
    ::torch::NoGradGuard no_grad;
    if (!g.defined()) {
      view.zero_();
    } else if (g.data_ptr() != view.data_ptr() || g.strides() != view.strides()) {
      view.copy_(g);
    }
    g = view;
  }

  absl::Status Launch(const Bucket& b) {
    ::torch::Tensor flat = grad[b.dtype].narrow(0, b.start, b.length);
    Buffer buf = BufferOf(flat);
    OrderAfterProducer();
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Work> w,
                            group->AllReduce(buf, buf, opts.reduce_op, Op()));
    works[b.index] = std::move(w);
    Event(DataParallelEvent::Kind::kLaunch, b.index);
    return absl::OkStatus();
  }

  absl::Status LaunchReady() {
    while (next_launch < layout.buckets.size() && pending[next_launch] == 0) {
      STRATA_RETURN_IF_ERROR(Launch(layout.buckets[next_launch]));
      ++next_launch;
    }
    return absl::OkStatus();
  }

  absl::Status LaunchRest() {
    for (Entry& e : entries) {
      if (!ready[static_cast<size_t>(e.index)]) Adopt(e);
    }
    for (; next_launch < layout.buckets.size(); ++next_launch) {
      STRATA_RETURN_IF_ERROR(Launch(layout.buckets[next_launch]));
    }
    return absl::OkStatus();
  }

  void Drain() {
    for (auto& [k, w] : works) (void)w->Wait(absl::InfiniteFuture());
    Join();
    in_backward = false;
    ResetPass();
  }

  absl::Status Finish() {
    if (!failed.empty()) {
      Drain();
      return absl::FailedPreconditionError(
          absl::StrCat("DataParallel: the gradient reduction of a step failed (", failed,
                       "); abandon the step with ZeroGrad() (or Rebuild() on a new group) first"));
    }
    if (reduced && !fresh && works.empty()) return absl::OkStatus();
    if (!final) STRATA_RETURN_IF_ERROR(FinalizeLayout(false));
    absl::Status first = LaunchRest();
    for (auto& [k, w] : works) {
      absl::Status s = w->Wait(absl::InfiniteFuture());
      if (s.ok()) {
        Event(DataParallelEvent::Kind::kDone, k);
      } else if (first.ok()) {
        first = s;
      }
    }
    Join();
    ResetPass();
    if (!first.ok()) {
      failed = std::string(first.message());
      return first;
    }
    reduced = true;
    fresh = false;
    return absl::OkStatus();
  }

  // Small control collectives (digests, flags, orders) on int64 values: in
  // host memory, or through a device copy for a CUDA communicator.
  ::torch::Tensor Stage(std::vector<int64_t>& v) const {
    ::torch::Tensor t =
        ::torch::from_blob(v.data(), {static_cast<int64_t>(v.size())}, ::torch::kInt64);
    return group->memory() == MemoryKind::kCuda ? t.to(device) : t;
  }
  static void Unstage(const ::torch::Tensor& t, std::vector<int64_t>& v) {
    if (!t.is_cuda()) return;
    ::torch::Tensor h = t.cpu();  // waits for the stream
    std::copy(h.data_ptr<int64_t>(), h.data_ptr<int64_t>() + v.size(), v.begin());
  }
  OpOptions ControlOp(const ::torch::Tensor& t) const {
    OpOptions o;
    o.timeout = opts.timeout;
    o.stream = internal::StreamOf(t);
    return o;
  }
  static Buffer Int64Buffer(const ::torch::Tensor& t) {
    return Buffer{t.data_ptr(), static_cast<size_t>(t.numel()), DataType::kInt64};
  }

  absl::Status Agree(std::vector<int64_t>& values, ReduceOp op) {
    ::torch::Tensor t = Stage(values);
    Buffer b = Int64Buffer(t);
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Work> w, group->AllReduce(b, b, op, ControlOp(t)));
    STRATA_RETURN_IF_ERROR(w->Wait(absl::InfiniteFuture()));
    Unstage(t, values);
    return absl::OkStatus();
  }

  absl::Status Bcast(std::vector<int64_t>& values) {
    ::torch::Tensor t = Stage(values);
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Work> w,
                            group->Broadcast(Int64Buffer(t), 0, ControlOp(t)));
    STRATA_RETURN_IF_ERROR(w->Wait(absl::InfiniteFuture()));
    Unstage(t, values);
    return absl::OkStatus();
  }

  absl::Status Gather(std::vector<int64_t> mine, std::vector<int64_t>& every) {
    every.assign(mine.size() * static_cast<size_t>(group->size()), 0);
    ::torch::Tensor in = Stage(mine), out = Stage(every);
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Work> w,
                            group->AllGather(Int64Buffer(in), Int64Buffer(out), ControlOp(out)));
    STRATA_RETURN_IF_ERROR(w->Wait(absl::InfiniteFuture()));
    Unstage(out, every);
    return absl::OkStatus();
  }

  // Collective: the layout of the first backward's order, the same on every
  // rank; the unused parameters of a first backward that reduces.
  absl::Status FinalizeLayout(bool check_unused) {
    const size_t n = entries.size();
    std::vector<int> order = seen;
    for (int i = static_cast<int>(n) - 1; i >= 0; --i) {
      if (!was_seen[static_cast<size_t>(i)]) order.push_back(i);
    }
    const bool unused_here = check_unused && !opts.find_unused_parameters && seen.size() < n;
    Layout lay = MakeLayout(entries, order, opts.bucket_bytes);
    const int64_t d = Digest(Describe(entries, lay, opts));
    std::vector<int64_t> t = {d, -d, unused_here ? 1 : 0};
    STRATA_RETURN_IF_ERROR(Agree(t, ReduceOp::kMax));
    if (opts.find_unused_parameters) {
      // The graph may depend on the data: every rank takes rank 0's order.
      std::vector<int64_t> o(order.begin(), order.end());
      STRATA_RETURN_IF_ERROR(Bcast(o));
      std::vector<int> got(o.begin(), o.end());
      if (got != order) lay = MakeLayout(entries, got, opts.bucket_bytes);
    } else if (t[0] != -t[1]) {
      return ExplainMismatch(order);
    }
    if (t[2] != 0) {
      std::vector<int64_t> flags(n), every;
      for (size_t i = 0; i < n; ++i) flags[i] = was_seen[i] ? 1 : 0;
      STRATA_RETURN_IF_ERROR(Gather(flags, every));
      std::vector<std::string> parts;
      for (int r = 0; r < group->size(); ++r) {
        std::vector<const Entry*> unused;
        for (size_t i = 0; i < n; ++i) {
          if (every[static_cast<size_t>(r) * n + i] == 0) unused.push_back(&entries[i]);
        }
        if (!unused.empty()) parts.push_back(absl::StrCat("dp rank ", r, ": ", Names(unused)));
      }
      seen.clear();
      was_seen.assign(n, false);
      return UnusedError(absl::StrJoin(parts, "; "));
    }
    SetLayout(std::move(lay));
    final = true;
    Event(DataParallelEvent::Kind::kLayout, static_cast<int64_t>(layout.buckets.size()));
    return absl::OkStatus();
  }

  absl::Status UnusedError(const std::string& which) const {
    return absl::InvalidArgumentError(absl::StrCat(
        "DataParallel: unused parameters: parameters received no gradient in a backward pass "
        "that reduces gradients over group '",
        group->name(), "' (", which,
        "). Every parameter that requires grad must take part in the loss; set "
        "DataParallelOptions::find_unused_parameters (their gradients are then reduced as the "
        "buffers hold them: zero after ZeroGrad()), or freeze them (requires_grad_(false)) "
        "before Create"));
  }

  absl::Status ExplainMismatch(const std::vector<int>& order) {
    const size_t n = entries.size();
    std::vector<int64_t> mine(order.begin(), order.end()), every;
    mine.push_back(opts.bucket_bytes);
    mine.push_back(static_cast<int64_t>(opts.reduce_op));
    mine.push_back(opts.find_unused_parameters ? 1 : 0);
    STRATA_RETURN_IF_ERROR(Gather(mine, every));
    const size_t w = mine.size();
    for (int r = 1; r < group->size(); ++r) {
      const int64_t* row = &every[static_cast<size_t>(r) * w];
      const int64_t* ref = &every[0];
      if (!std::equal(row + n, row + w, ref + n)) {
        return absl::InvalidArgumentError(
            absl::StrCat("DataParallel: bucket mismatch: dp rank ", r, " of group '", group->name(),
                         "' was created with other options than dp rank 0 (bucket_bytes ", row[n],
                         " vs ", ref[n], ", reduce_op or find_unused_parameters)"));
      }
      for (size_t k = 0; k < n; ++k) {
        if (row[k] != ref[k]) {
          return absl::InvalidArgumentError(absl::StrCat(
              "DataParallel: bucket mismatch: position ", k,
              " of the order gradients became ready in the first backward is '",
              entries[static_cast<size_t>(ref[k])].name, "' on dp rank 0 but '",
              entries[static_cast<size_t>(row[k])].name, "' on dp rank ", r, " of group '",
              group->name(),
              "'. Ranks must run the same model the same way; when the graph depends on the "
              "data, set find_unused_parameters (rank 0's order is then used)"));
        }
      }
    }
    return absl::InvalidArgumentError(
        absl::StrCat("DataParallel: bucket mismatch: the ranks of group '", group->name(),
                     "' computed different gradient buckets"));
  }

  void SetLayout(Layout lay) {
    Drain();
    layout = std::move(lay);
    Alloc();
    ResetPass();
  }

  // One hook: called after autograd accumulated entry `index`'s gradient.
  void OnGrad(int index, const std::shared_ptr<State>& self);
  void BackwardDone();
};

namespace {

class Hook : public ::torch::autograd::PostAccumulateGradHook {
 public:
  Hook(std::weak_ptr<DataParallel::State> state, int index)
      : state_(std::move(state)), index_(index) {}
  void operator()(const ::torch::autograd::Variable&) override {
    if (std::shared_ptr<DataParallel::State> s = state_.lock()) s->OnGrad(index_, s);
  }

 private:
  std::weak_ptr<DataParallel::State> state_;
  int index_;
};

void Throw(const absl::Status& s) { TORCH_CHECK(s.ok(), std::string(s.message())); }

}  // namespace

void DataParallel::State::OnGrad(int index, const std::shared_ptr<State>& self) {
  // The first gradient of a backward pass: the group of this pass.
  if (!in_backward) Throw(ResolveGroup());
  Entry& e = entries[static_cast<size_t>(index)];
  Adopt(e);
  fresh = true;
  if (!in_backward) {
    in_backward = true;
    backward_sync = user_sync;
    std::weak_ptr<State> weak = self;
    ::torch::autograd::Engine::get_default_engine().queue_callback([weak] {
      if (std::shared_ptr<State> s = weak.lock()) s->BackwardDone();
    });
  }
  Event(DataParallelEvent::Kind::kReady, -1, e.name);
  if (!final) {
    if (!was_seen[static_cast<size_t>(index)]) {
      was_seen[static_cast<size_t>(index)] = true;
      seen.push_back(index);
    }
    ready[static_cast<size_t>(index)] = true;
    return;
  }
  const int b = layout.bucket_of[static_cast<size_t>(index)];
  if (ready[static_cast<size_t>(index)]) {
    TORCH_CHECK(!(backward_sync && static_cast<size_t>(b) < next_launch),
                "DataParallel: ", "parameter '", e.name,
                "' received a second gradient in one backward pass after its bucket's "
                "reduction had started");
    return;
  }
  ready[static_cast<size_t>(index)] = true;
  if (!backward_sync) return;
  if (--pending[static_cast<size_t>(b)] == 0) {
    absl::Status s = LaunchReady();
    if (!s.ok()) {
      failed = std::string(s.message());
      Drain();
      Throw(s);
    }
  }
}

void DataParallel::State::BackwardDone() {
  in_backward = false;
  Event(DataParallelEvent::Kind::kBackwardEnd);
  std::vector<const Entry*> unused;
  for (const Entry& e : entries) {
    if (!ready[static_cast<size_t>(e.index)]) unused.push_back(&e);
  }
  const bool sync = backward_sync;
  if (!final) {
    absl::Status s = FinalizeLayout(sync);
    if (!s.ok()) {
      ResetPass();
      Throw(s);
    }
  }
  if (!sync) {
    ready.assign(entries.size(), false);
    return;
  }
  absl::Status s = Finish();
  ready.assign(entries.size(), false);
  Throw(s);
  if (!unused.empty() && !opts.find_unused_parameters) {
    Throw(UnusedError(absl::StrCat("dp rank ", group->rank(), ": ", Names(unused))));
  }
}

// ---- DataParallel ----------------------------------------------------------------

DataParallel::DataParallel(std::shared_ptr<State> state) : state_(std::move(state)) {}

DataParallel::~DataParallel() {
  if (!state_) return;
  state_->Drain();
  for (Entry& e : state_->entries) {
    ::torch::autograd::impl::set_post_acc_grad_hooks(e.param, nullptr);
  }
}

absl::StatusOr<std::unique_ptr<DataParallel>> DataParallel::Create(
    const ::torch::OrderedDict<std::string, ::torch::Tensor>& named_parameters,
    const GroupHandle& group, const DataParallelOptions& options) {
  std::vector<std::pair<std::string, ::torch::Tensor>> v;
  for (const auto& item : named_parameters) v.emplace_back(item.key(), item.value());
  return Create(v, group, options);
}

absl::StatusOr<std::unique_ptr<DataParallel>> DataParallel::Create(
    const std::vector<std::pair<std::string, ::torch::Tensor>>& named_parameters,
    const GroupHandle& handle, const DataParallelOptions& options) {
  if (options.version != DataParallelOptions::kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("DataParallelOptions version ", options.version,
                                                   ", this library reads ",
                                                   DataParallelOptions::kVersion));
  }
  if (options.bucket_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("DataParallel: bucket_bytes must be >= 1, got ", options.bucket_bytes));
  }
  if (options.reduce_op != ReduceOp::kAvg && options.reduce_op != ReduceOp::kSum) {
    return absl::InvalidArgumentError(absl::StrCat("DataParallel: reduce_op must be avg or sum, ",
                                                   "got ", ReduceOpName(options.reduce_op)));
  }
  auto st = std::make_shared<State>();
  st->handle = handle;
  STRATA_RETURN_IF_ERROR(st->ResolveGroup());
  Communicator& group = *st->group;
  st->opts = options;
  std::set<const void*> distinct;
  for (const auto& [name, p] : named_parameters) {
    if (!p.defined() || !p.requires_grad()) continue;
    if (!distinct.insert(p.unsafeGetTensorImpl()).second) continue;  // shared: once
    STRATA_RETURN_IF_ERROR(StrataType(p.scalar_type()).status());
    if (!st->entries.empty() && p.device() != st->device) {
      return absl::InvalidArgumentError(absl::StrCat("DataParallel: parameters live on ",
                                                     st->device.str(), " and ", p.device().str(),
                                                     "; one device per rank"));
    }
    if (p.is_cuda() != (group.memory() == MemoryKind::kCuda)) {
      return absl::InvalidArgumentError(
          absl::StrCat("DataParallel: parameter '", name, "' is on ", p.device().str(),
                       " but group '", group.name(), "' (", group.backend(), ") reduces ",
                       group.memory() == MemoryKind::kCuda ? "CUDA" : "host", " memory"));
    }
    st->device = p.device();
    Entry e;
    e.index = static_cast<int>(st->entries.size());
    e.name = name;
    e.param = p;
    e.dtype = p.scalar_type();
    e.shape.assign(p.sizes().begin(), p.sizes().end());
    e.numel = p.numel();
    st->entries.push_back(std::move(e));
  }
  const size_t n = st->entries.size();
#if STRATA_TORCH_CUDA
  if (st->device.is_cuda()) st->side = c10::cuda::getStreamFromPool(false, st->device.index());
#endif
  // The same parameters on every rank: one all-reduce of a digest, and an
  // all-gather of the shapes to name the difference when there is one.
  std::string rows;
  for (const Entry& e : st->entries) {
    absl::StrAppend(&rows, static_cast<int>(e.dtype), "(", absl::StrJoin(e.shape, ","), ");");
  }
  const int64_t d = Digest(rows);
  int64_t max_dims = 0;
  for (const Entry& e : st->entries) max_dims = std::max<int64_t>(max_dims, e.shape.size());
  std::vector<int64_t> t = {d, -d, static_cast<int64_t>(n), max_dims};
  STRATA_RETURN_IF_ERROR(st->Agree(t, ReduceOp::kMax));
  if (t[0] != -t[1]) {
    const int64_t count = t[2], dims = t[3], width = 1 + count * (2 + dims);
    std::vector<int64_t> mine(static_cast<size_t>(width), -1), every;
    mine[0] = static_cast<int64_t>(n);
    for (size_t k = 0; k < n; ++k) {
      const Entry& e = st->entries[k];
      int64_t* row = &mine[1 + k * static_cast<size_t>(2 + dims)];
      row[0] = static_cast<int64_t>(e.dtype);
      row[1] = static_cast<int64_t>(e.shape.size());
      for (size_t j = 0; j < e.shape.size(); ++j) row[2 + j] = e.shape[j];
    }
    STRATA_RETURN_IF_ERROR(st->Gather(mine, every));
    auto describe = [&](const int64_t* row) {
      std::vector<int64_t> shape(row + 2, row + 2 + row[1]);
      return absl::StrCat("shape [", absl::StrJoin(shape, ", "), "] ",
                          ::c10::toString(static_cast<::torch::ScalarType>(row[0])));
    };
    const int64_t* ref = &every[0];
    for (int r = 1; r < group.size(); ++r) {
      const int64_t* row = &every[static_cast<size_t>(r * width)];
      if (row[0] != ref[0]) {
        return absl::InvalidArgumentError(
            absl::StrCat("DataParallel: dp rank ", r, " of group '", group.name(), "' has ", row[0],
                         " parameters that require grad, dp rank 0 has ", ref[0]));
      }
      for (int64_t k = 0; k < ref[0]; ++k) {
        const int64_t* a = ref + 1 + k * (2 + dims);
        const int64_t* b = row + 1 + k * (2 + dims);
        if (!std::equal(a, a + 2 + dims, b)) {
          const std::string name =
              static_cast<size_t>(k) < n ? st->entries[static_cast<size_t>(k)].name : "?";
          return absl::InvalidArgumentError(absl::StrCat(
              "DataParallel: parameter ", k, " ('", name, "' on dp rank ", group.rank(), ") has ",
              describe(a), " on dp rank 0 but ", describe(b), " on dp rank ", r, " of group '",
              group.name(), "': every rank must hold the same parameters"));
        }
      }
    }
  }
  if (options.broadcast_parameters && group.size() > 1) {
    ::torch::NoGradGuard no_grad;
    for (Entry& e : st->entries) {
      ::torch::Tensor data = e.param.detach();
      ::torch::Tensor c = data.is_contiguous() ? data : data.contiguous();
      OpOptions o;  // ordered after the parameters' producer, the current stream
      o.timeout = options.timeout;
      o.stream = internal::StreamOf(c);
      STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Work> w, group.Broadcast(BufferOf(c), 0, o));
      STRATA_RETURN_IF_ERROR(w->Wait(absl::InfiniteFuture()));
      if (!c.is_same(data)) data.copy_(c);
    }
  }
  std::vector<int> order;
  for (int i = static_cast<int>(n) - 1; i >= 0; --i) order.push_back(i);
  st->layout = MakeLayout(st->entries, order, options.bucket_bytes);
  st->was_seen.assign(n, false);
  st->Alloc();
  st->ResetPass();
  for (Entry& e : st->entries) {
    ::torch::autograd::impl::set_post_acc_grad_hooks(e.param, std::make_unique<Hook>(st, e.index));
  }
  return std::unique_ptr<DataParallel>(new DataParallel(std::move(st)));
}

DataParallel::NoSync::NoSync(DataParallel& dp) : dp_(dp), before_(dp.state_->user_sync) {
  dp.state_->user_sync = false;
}

DataParallel::NoSync::~NoSync() { dp_.state_->user_sync = before_; }

void DataParallel::ZeroGrad() {
  State& s = *state_;
  s.Drain();
  ::torch::NoGradGuard no_grad;
  for (auto& [dtype, buf] : s.grad) buf.zero_();
  for (Entry& e : s.entries) e.param.mutable_grad() = s.views[static_cast<size_t>(e.index)];
  s.failed.clear();
  s.reduced = s.fresh = false;
}

absl::Status DataParallel::FinishGradSync() {
  if (!state_->in_backward) STRATA_RETURN_IF_ERROR(state_->ResolveGroup());
  return state_->Finish();
}

absl::Status DataParallel::Rebuild(const GroupHandle& group) {
  State& s = *state_;
  ZeroGrad();
  s.handle = group;
  s.group = nullptr;
  STRATA_RETURN_IF_ERROR(s.ResolveGroup());
  if (s.final && s.group->size() > 1) {
    const int64_t d = Digest(Describe(s.entries, s.layout, s.opts));
    std::vector<int64_t> t = {d, -d};
    STRATA_RETURN_IF_ERROR(s.Agree(t, ReduceOp::kMax));
    if (t[0] != -t[1]) {
      return absl::InvalidArgumentError(
          absl::StrCat("DataParallel: bucket mismatch: after Rebuild the ranks of group '",
                       s.group->name(), "' hold different gradient buckets"));
    }
  }
  return absl::OkStatus();
}

const GroupHandle& DataParallel::group() const { return state_->handle; }

int DataParallel::num_buckets() const { return static_cast<int>(state_->layout.buckets.size()); }

std::vector<std::string> DataParallel::bucket_parameters(int b) const {
  std::vector<std::string> out;
  for (int i : state_->layout.buckets.at(static_cast<size_t>(b)).entries) {
    out.push_back(state_->entries[static_cast<size_t>(i)].name);
  }
  return out;
}

const std::vector<DataParallelEvent>& DataParallel::events() const { return state_->events; }

}  // namespace strata::nn
