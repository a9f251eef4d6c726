// Structure and fault handling of the Gloo backend: connecting through the
// store, the root communicator, Split, Shrink, Abort, Revoke and AsyncError
// (see gloo_communicator.h for the design).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "comm/gloo/gloo_communicator.h"
#include "strata/base/status.h"

namespace strata::gloo {
namespace {

gloo_plugin::Error ToError(const absl::Status& s) {
  if (s.ok()) return {};
  return {static_cast<int>(s.code()), std::string(s.message())};
}

// How long one blocking store wait lasts before `cancelled` is asked again.
// A key that appears ends the wait at once, so this adds no latency; it
// bounds how long an abort takes to end the wait.
constexpr absl::Duration kCancelCheck = absl::Milliseconds(50);

// Waits for `key` until `deadline`; with `cancelled` set, in blocking waits
// of at most kCancelCheck, and ends with Aborted as soon as `cancelled`
// returns true.
absl::StatusOr<std::string> GetUnlessCancelled(Store& store, const std::string& key,
                                               absl::Time deadline,
                                               const std::function<bool()>& cancelled) {
  if (!cancelled) return store.Get(key, deadline);
  while (true) {
    if (cancelled()) {
      return absl::AbortedError(
          absl::StrCat("waiting for '", key, "': the communicator was aborted meanwhile"));
    }
    const absl::Time until = std::min(deadline, absl::Now() + kCancelCheck);
    absl::StatusOr<std::string> v = store.Get(key, until);
    const bool absent = !v.ok() && (v.status().code() == absl::StatusCode::kDeadlineExceeded ||
                                    v.status().code() == absl::StatusCode::kNotFound);
    if (!absent || until >= deadline) return v;
  }
}

// The store as the plugin's rendezvous: keys under `prefix`, every wait
// bounded by `deadline`; `cancelled` (when set) ends the plugin's waits and
// the store's.
class StoreRendezvous final : public gloo_plugin::Rendezvous {
 public:
  StoreRendezvous(Store& store, std::string prefix, absl::Time deadline,
                  std::function<bool()> cancelled)
      : store_(store),
        prefix_(std::move(prefix)),
        deadline_(deadline),
        cancelled_(std::move(cancelled)) {}
  gloo_plugin::Error Set(const std::string& key, const std::string& value) override {
    return ToError(store_.Set(absl::StrCat(prefix_, key), value, deadline_));
  }
  gloo_plugin::Error Get(const std::string& key, std::string* value) override {
    absl::StatusOr<std::string> v =
        GetUnlessCancelled(store_, absl::StrCat(prefix_, key), deadline_, cancelled_);
    if (!v.ok()) return ToError(v.status());
    *value = *std::move(v);
    return {};
  }
  bool Cancelled() override { return cancelled_ && cancelled_(); }

 private:
  Store& store_;
  const std::string prefix_;
  const absl::Time deadline_;
  const std::function<bool()> cancelled_;
};

// The device for `options` (an event-loop thread and an address), shared
// by every root this process makes with the same plugin, interface and host
// name while one of them lives. A regroup that takes in joiners makes a new
// root; a device of its own would start a thread, and destroying the old
// root's would wait for its loop to stop (up to 10 ms), on the path of the
// regroup.
absl::Status SharedDevice(GlooRuntime& runtime, const gloo_plugin::DeviceOptions& options,
                          const std::string& what) {
  // The plugin by its table: each load has an object of its own, one table.
  using Key = std::tuple<const gloo_plugin::Api*, std::string, std::string>;
  static std::mutex mu;
  static auto* devices = new std::map<Key, std::weak_ptr<gloo_plugin::Device>>();
  std::lock_guard<std::mutex> lock(mu);
  std::weak_ptr<gloo_plugin::Device>& slot =
      (*devices)[Key{&runtime.plugin->api(), options.iface, options.hostname}];
  runtime.device = slot.lock();
  if (runtime.device != nullptr) return absl::OkStatus();
  STRATA_RETURN_IF_ERROR(
      FromPlugin(runtime.plugin->api().create_device(options, &runtime.device), what));
  slot = runtime.device;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<gloo_plugin::Context>> ConnectContext(
    const GlooRuntime& runtime, const std::string& uid, int rank, int size, absl::Time deadline,
    const std::function<bool()>& cancelled) {
  StoreRendezvous rv(*runtime.store, absl::StrCat(uid, "/m/"), deadline, cancelled);
  gloo_plugin::ConnectOptions options;
  options.rank = rank;
  options.size = size;
  options.timeout_ms = std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - absl::Now()));
  std::unique_ptr<gloo_plugin::Context> context;
  gloo_plugin::Error e = runtime.plugin->api().connect(runtime.device, options, rv, &context);
  if (!e.ok()) {
    absl::Status s =
        FromPlugin(e, absl::StrCat("connecting ", size, " ranks (this is rank ", rank, ") through ",
                                   runtime.store->Describe(), " under '", uid, "'"));
    if (e.peer >= 0) s.SetPayload(kUnreachablePayload, absl::Cord(absl::StrCat(e.peer)));
    return s;
  }
  return context;
}

namespace {

// A child's connect names the peer it gave up on in the child's ranks; its
// caller names it in the parent's (kUnreachablePayload).
absl::Status InParentRanks(absl::Status s, const std::function<int(int)>& parent_rank) {
  auto peer = s.GetPayload(kUnreachablePayload);
  int child = -1;
  if (peer.has_value() && absl::SimpleAtoi(std::string(*peer), &child) && child >= 0) {
    s.SetPayload(kUnreachablePayload, absl::Cord(absl::StrCat(parent_rank(child))));
  }
  return s;
}

}  // namespace

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::CreateRoot(
    const RootOptions& options, std::shared_ptr<Store> store, int rank, int size) {
  const absl::Time deadline = absl::Now() + options.comm.timeout;
  const std::string what = absl::StrCat("creating the gloo root communicator '", options.comm.name,
                                        "' (rank ", rank, " of ", size, ")");
  if (store == nullptr) {
    if (size != 1) {
      return absl::FailedPreconditionError(absl::StrCat(
          what,
          ": the gloo backend needs a store to bootstrap through (RootOptions::store, or "
          "STRATA_STORE=file:/shared/dir; strata.init() passes torchrun's)"));
    }
    store = MakeMemoryStore();  // a world of one meets only itself
  }
  auto runtime = std::make_shared<GlooRuntime>();
  runtime->world_rank = rank;
  runtime->store = store;
  absl::StatusOr<std::shared_ptr<GlooPlugin>> plugin = LoadGlooPlugin(options.gloo.plugin_path);
  if (!plugin.ok()) return internal::Annotate(plugin.status(), what);
  runtime->plugin = *std::move(plugin);
  gloo_plugin::DeviceOptions device;
  device.iface = options.gloo.iface;
  if (device.iface.empty()) {
    if (const char* env = std::getenv("GLOO_SOCKET_IFNAME"); env != nullptr) device.iface = env;
  }
  device.hostname = options.gloo.hostname;
  STRATA_RETURN_IF_ERROR(SharedDevice(*runtime, device, what));
  // The k-th root of every rank: a counter per rank in the store.
  absl::StatusOr<int64_t> generation = store->Add(absl::StrCat("strata/roots/", rank), 1, deadline);
  if (!generation.ok()) return internal::Annotate(generation.status(), what);
  const std::string uid = absl::StrCat("strata/root", *generation);
  absl::StatusOr<std::unique_ptr<gloo_plugin::Context>> context =
      ConnectContext(*runtime, uid, rank, size, deadline, options.cancelled);
  if (!context.ok()) return internal::Annotate(context.status(), what);
  return std::make_unique<GlooCommunicator>(std::move(runtime), std::move(context).value(),
                                            options.comm, uid);
}

GlooCommunicator::GlooCommunicator(std::shared_ptr<GlooRuntime> runtime,
                                   std::unique_ptr<gloo_plugin::Context> context,
                                   const CommOptions& options, std::string uid)
    : Communicator(options, Membership{context->rank(), context->size(), runtime->world_rank},
                   GlooCapabilities()),
      runtime_(std::move(runtime)),
      context_(std::move(context)),
      uid_(std::move(uid)),
      health_(where()),
      sent_to_(context_->size(), 0),
      received_from_(context_->size(), 0),
      queue_(std::make_shared<GlooQueue>(&health_,
                                         [this](const absl::Status& s) { return OnError(s); })) {}

GlooCommunicator::~GlooCommunicator() {
  // An operation blocked in Gloo returns once the connections close.
  if (queue_->busy()) CloseConnections();
  queue_->Stop(absl::AbortedError("the communicator was destroyed"));
  std::lock_guard<std::mutex> lock(closer_mu_);
  if (closer_.joinable()) closer_.join();
}

void GlooCommunicator::CloseConnections() {
  if (closed_.exchange(true)) return;
  // On a thread of its own: Gloo's TCP transport closes its pairs one by
  // one, each waiting for its event loop's next turn (up to 10 ms), which
  // made an Abort of a group of 4 cost 15-30 ms and a recovery's abort of
  // every group several times that. The pending operations failed before
  // (queue_->FailAll); what waits in Gloo returns once its pair closes.
  std::lock_guard<std::mutex> lock(closer_mu_);
  closer_ = std::thread([context = context_.get()] { context->CloseConnections(); });
}

absl::Status GlooCommunicator::OnError(const absl::Status& status) {
  // Already broken (aborted, revoked, failed): nothing more to learn.
  if (!health_.healthy()) return status;
  // This rank closed the connections (the communicator is being destroyed
  // with an operation in Gloo): the operation was aborted, not lost.
  if (closed_.load() && (status.code() == absl::StatusCode::kUnavailable ||
                         status.code() == absl::StatusCode::kAborted)) {
    return absl::AbortedError(
        absl::StrCat(status.message(), " (the communicator was destroyed by this rank)"));
  }
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
      return status;  // a mismatched message; the communicator is fine
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kAborted: {
      // Connections closed under us: a peer revoked the communicator (the
      // flag is in the store), aborted, or is gone. The flag is read with
      // a deadline in the past: one look, no waiting.
      absl::StatusOr<std::string> flag =
          runtime_->store->Get(absl::StrCat(uid_, "/revoked"), absl::InfinitePast());
      if (flag.ok()) {
        absl::Status revoked = absl::AbortedError(
            absl::StrCat(status.message(), " (the communicator was revoked by rank ", *flag, ")"));
        health_.SetRevoked(revoked);
        CloseConnections();
        return revoked;
      }
      absl::Status lost = status;
      if (status.code() == absl::StatusCode::kUnavailable) {
        lost.SetPayload(kRankFailurePayload, absl::Cord(""));  // which rank: unknown
      }
      health_.SetFailed(lost);
      // Close ours too, so that peers blocked on this rank fail now rather
      // than at their timeouts.
      CloseConnections();
      return lost;
    }
    default:
      health_.SetFailed(status);
      return status;
  }
}

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Connect(
    const std::string& uid, int rank, int size, const CommOptions& options,
    const std::function<bool()>& cancelled) {
  const absl::Time deadline = absl::Now() + options.timeout;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<gloo_plugin::Context> context,
                          ConnectContext(*runtime_, uid, rank, size, deadline, cancelled));
  return std::make_unique<GlooCommunicator>(runtime_, std::move(context), options, uid);
}

absl::StatusOr<std::unique_ptr<Communicator>> GlooCommunicator::DoSplit(
    int color, int key, const CommOptions& options, const ResolvedOptions& resolved) {
  const absl::Time deadline = resolved.deadline;
  const std::string& what = resolved.description;
  int seq;
  const uint64_t aborts = aborts_.load();
  {
    std::lock_guard<std::mutex> lock(issue_mu_);
    STRATA_RETURN_IF_ERROR(health_.CheckUsable(what));
    seq = split_seq_++;
  }
  // Every rank's (color, key), through the parent.
  const int n = size();
  int32_t mine[2] = {color < 0 ? -1 : color, key};
  std::vector<int32_t> all(2 * static_cast<size_t>(n));
  // Part of the split, not an operation of its own: the hook, unrecorded.
  ResolvedOptions gather;
  gather.deadline = deadline;
  gather.timeout = resolved.timeout;
  gather.description = absl::StrCat(what, ": gathering colors and keys");
  absl::StatusOr<std::unique_ptr<Work>> work = DoAllGather(
      ConstBuffer(mine, 2, DataType::kInt32), Buffer::Of(all.data(), all.size()), gather);
  if (!work.ok()) return internal::Annotate(work.status(), what);
  STRATA_RETURN_IF_ERROR_CTX((*work)->Wait(deadline), what);
  if (color < 0) return std::unique_ptr<Communicator>();
  std::vector<std::pair<int32_t, int>> members;  // (key, parent rank)
  for (int r = 0; r < n; ++r) {
    if (all[2 * static_cast<size_t>(r)] == color) members.emplace_back(all[2 * r + 1], r);
  }
  std::sort(members.begin(), members.end());
  const int new_rank = static_cast<int>(
      std::find_if(members.begin(), members.end(),
                   [&](const std::pair<int32_t, int>& m) { return m.second == rank(); }) -
      members.begin());
  const std::string uid = absl::StrCat(uid_, "/s", seq, "c", color);
  // A member that dies before or after the rendezvous leaves the others
  // waiting for it in the store or in Gloo's connect: an abort of this
  // communicator meanwhile (the elastic layer's alarm during a World
  // rebuild) ends either wait at once.
  absl::StatusOr<std::unique_ptr<GlooCommunicator>> child =
      Connect(uid, new_rank, static_cast<int>(members.size()), options,
              [this, aborts] { return aborts_.load() != aborts; });
  if (!child.ok()) {
    return internal::Annotate(
        InParentRanks(
            child.status(),
            [&](int c) { return c < static_cast<int>(members.size()) ? members[c].second : -1; }),
        what);
  }
  return std::unique_ptr<Communicator>(std::move(child).value());
}

absl::StatusOr<std::unique_ptr<Communicator>> GlooCommunicator::DoShrink(
    const ShrinkPlan& plan, const CommOptions& options, const ResolvedOptions& resolved) {
  const std::string& what = resolved.description;
  const std::vector<int>& survivors = plan.survivors;
  const int m = static_cast<int>(survivors.size());
  const int me = plan.new_rank;
  const absl::Time deadline = resolved.deadline;
  // Named alike by every survivor (the excluded ranks' count of shrinks
  // may differ).
  const std::string uid =
      absl::StrCat(uid_, "/k", absl::Hex(plan.survivors_hash), "-", plan.attempt);
  // Survivors compare their lists with a neighbour's: O(1) store operations
  // each, and every disagreement is seen by some survivor.
  Store& store = *runtime_->store;
  const std::string hash = absl::StrCat(plan.survivors_hash);
  // A survivor that dies during the shrink never writes its keys: an
  // Abort() of this communicator meanwhile (the caller learnt of it) ends
  // the waits at once instead of at the deadline.
  const uint64_t aborts = aborts_.load();
  const std::function<bool()> cancelled = [this, aborts] { return aborts_.load() != aborts; };
  STRATA_RETURN_IF_ERROR_CTX(store.Set(absl::StrCat(uid, "/h/", rank()), hash, deadline), what);
  const int next = survivors[static_cast<size_t>((me + 1) % m)];
  absl::StatusOr<std::string> theirs =
      GetUnlessCancelled(store, absl::StrCat(uid, "/h/", next), deadline, cancelled);
  if (!theirs.ok()) {
    return internal::Annotate(
        theirs.status(), absl::StrCat(what, ": survivor rank ", next,
                                      " did not join (is it alive, and does it exclude the same "
                                      "ranks?)"));
  }
  if (*theirs != hash) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": survivor rank ", next,
        " passed a different list of excluded ranks (every survivor must pass the same list)"));
  }
  absl::StatusOr<std::unique_ptr<GlooCommunicator>> child = Connect(uid, me, m, options, cancelled);
  if (!child.ok()) {
    return internal::Annotate(
        InParentRanks(child.status(), [&](int c) { return c < m ? survivors[c] : -1; }), what);
  }
  return std::unique_ptr<Communicator>(std::move(child).value());
}

absl::Status GlooCommunicator::DoAbort() {
  // Aborted first: interrupting the running operation makes it fail, and
  // OnError must not take that failure for a revoke. Then the pending
  // operations, so that they fail with this message rather than with the
  // closed connections'.
  aborts_.fetch_add(1);
  health_.SetAborted();
  queue_->FailAll(absl::AbortedError("the communicator was aborted by this rank"));
  CloseConnections();
  return absl::OkStatus();
}

absl::Status GlooCommunicator::DoRevoke() {
  const absl::Time deadline = absl::Now() + timeout();
  STRATA_RETURN_IF_ERROR_CTX(
      runtime_->store->Set(absl::StrCat(uid_, "/revoked"), absl::StrCat(rank()), deadline),
      "revoke on ", health_.where());
  queue_->FailAll(absl::AbortedError("the communicator was revoked by this rank"));
  health_.SetRevoked(absl::AbortedError(absl::StrCat(health_.where(), ": revoked by this rank")));
  CloseConnections();
  return absl::OkStatus();
}

absl::Status GlooCommunicator::DoAsyncError() { return health_.Health(); }

}  // namespace strata::gloo
