#include "fake_communicator.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "parallel/tensor_parallel/internal/convert.h"
#include "strata/base/status.h"

namespace strata::testing {

namespace {

enum class Kind {
  kP2P,
  kAllReduce,
  kBroadcast,
  kReduce,
  kAllGather,
  kReduceScatter,
  kAllToAll,
  kBarrier,
  kSplit,
};

const char* KindName(Kind k) {
  switch (k) {
    case Kind::kP2P:
      return "p2p";
    case Kind::kAllReduce:
      return "allreduce";
    case Kind::kBroadcast:
      return "broadcast";
    case Kind::kReduce:
      return "reduce";
    case Kind::kAllGather:
      return "allgather";
    case Kind::kReduceScatter:
      return "reduce_scatter";
    case Kind::kAllToAll:
      return "all_to_all";
    case Kind::kBarrier:
      return "barrier";
    case Kind::kSplit:
      return "split";
  }
  return "?";
}

struct Op {
  int rank = 0;
  int peer = 0;  // p2p: the peer; broadcast, reduce: the root
  bool send = false;
  Kind kind = Kind::kP2P;
  ReduceOp reduce = ReduceOp::kSum;
  const void* src = nullptr;
  void* dst = nullptr;
  size_t count = 0;      // p2p: elements; collectives: elements of the send buffer
  size_t out_count = 0;  // elements of the receive buffer
  DataType dtype = DataType::kFloat32;
  // All-to-all: elements to and from each rank.
  std::vector<size_t> send_counts, recv_counts;
  // Split: this rank's color and key; what it gets.
  int color = -1;
  int key = 0;
  std::shared_ptr<FakeGroup::State> child;
  int child_rank = -1;
  // Takes part in kInOrder's issue order (not split, which blocks).
  bool ordered = true;
  std::string description;  // Communicator's: "allreduce(sum, 4 x fp32) on group tp (...)"
  absl::Time deadline = absl::InfiniteFuture();
  absl::Duration timeout = absl::InfiniteDuration();
  std::shared_ptr<observe::OpTrace> trace;
  bool done = false;
  absl::Status status;
};

size_t Bytes(size_t count, DataType t) { return count * DataTypeSize(t); }

// Element i of a buffer as a double, and back: the fake reduces in double
// and rounds once, whatever the dtype.
double Load(const void* p, DataType t, size_t i) {
  switch (t) {
    case DataType::kFloat32:
      return static_cast<const float*>(p)[i];
    case DataType::kFloat64:
      return static_cast<const double*>(p)[i];
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return tp_internal::HalfBitsToFloat(static_cast<const uint16_t*>(p)[i], t);
    case DataType::kInt8:
      return static_cast<const int8_t*>(p)[i];
    case DataType::kUInt8:
      return static_cast<const uint8_t*>(p)[i];
    case DataType::kInt16:
      return static_cast<const int16_t*>(p)[i];
    case DataType::kInt32:
      return static_cast<const int32_t*>(p)[i];
    case DataType::kInt64:
      return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    case DataType::kBool:
      return static_cast<const uint8_t*>(p)[i];
  }
  return 0;
}

void Store(void* p, DataType t, size_t i, double v) {
  switch (t) {
    case DataType::kFloat32:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      return;
    case DataType::kFloat64:
      static_cast<double*>(p)[i] = v;
      return;
    case DataType::kFloat16:
    case DataType::kBFloat16:
      static_cast<uint16_t*>(p)[i] = tp_internal::FloatToHalfBits(static_cast<float>(v), t);
      return;
    case DataType::kInt8:
      static_cast<int8_t*>(p)[i] = static_cast<int8_t>(v);
      return;
    case DataType::kUInt8:
      static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v);
      return;
    case DataType::kInt16:
      static_cast<int16_t*>(p)[i] = static_cast<int16_t>(v);
      return;
    case DataType::kInt32:
      static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
      return;
    case DataType::kInt64:
      static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v);
      return;
    case DataType::kBool:
      static_cast<uint8_t*>(p)[i] = v != 0;
      return;
  }
}

bool CanMove(DataType) { return true; }
bool CanReduce(DataType t) { return t != DataType::kBool; }
const CommCapabilities kCapabilities{&CanMove, &CanReduce};

double Combine(ReduceOp op, double a, double b) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return a + b;
    case ReduceOp::kProd:
      return a * b;
    case ReduceOp::kMin:
      return std::min(a, b);
    case ReduceOp::kMax:
      return std::max(a, b);
  }
  return a;
}

// One rank's view of the group's health, with the real backends' words
// (comm/common/health.cc, which the fake cannot link from the shared
// library).
struct Health {
  enum class State { kHealthy, kFailed, kAborted };
  State state = State::kHealthy;
  absl::Status failure;
};

}  // namespace

struct FakeGroup::State {
  State(int n, FakeOrdering o, MemoryKind m)
      : size(n), ordering(o), memory(m), issued(n), health(n), collectives_issued(n, 0) {}

  const int size;
  const FakeOrdering ordering;
  const MemoryKind memory;
  // std::mutex rather than absl::Mutex: the system abseil is not built for
  // ThreadSanitizer, which then cannot see its locking.
  mutable std::mutex mu;
  std::condition_variable changed;
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<Op>>> sends;
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<Op>>> recvs;
  std::vector<std::deque<std::shared_ptr<Op>>> issued;
  bool revoked = false;
  int revoked_by = -1;
  std::vector<Health> health;
  int64_t matched = 0;
  // Sends and receives posted, by the stream they were ordered on.
  std::map<void*, int64_t> p2p_by_stream;
  // Collectives by sequence number; part r is rank r's operation (null
  // until that rank starts it).
  std::vector<int64_t> collectives_issued;
  std::map<int64_t, std::vector<std::shared_ptr<Op>>> collectives;
  // Shrinks: the survivors meet under their list's hash and attempt
  // (Communicator::ShrinkPlan).
  struct Meeting {
    std::shared_ptr<State> child;
    int arrived = 0;
    int left = 0;
  };
  std::map<std::pair<uint64_t, int>, Meeting> meetings;

  void Finish(const std::shared_ptr<Op>& op, absl::Status status) {
    op->done = true;
    op->status = std::move(status);
    if (op->trace != nullptr) op->trace->Completed(op->status);
    changed.notify_all();
    if (op->ordered) {
      auto& q = issued[op->rank];
      auto it = std::find(q.begin(), q.end(), op);
      if (it != q.end()) q.erase(it);
    }
  }

  // OK while rank `rank` may issue operations; else the error a new one
  // fails with, as the real backends word it.
  absl::Status CheckUsable(int rank, const std::string& what) const {
    const Health& h = health[rank];
    if (h.state == Health::State::kAborted) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, ": the communicator was aborted; shrink it or build a new one"));
    }
    if (revoked) {
      return absl::AbortedError(absl::StrCat(what,
                                             ": the communicator was revoked (revoked by rank ",
                                             revoked_by, "); shrink it or build a new one"));
    }
    if (h.state == Health::State::kFailed) {
      return absl::FailedPreconditionError(absl::StrCat(
          what, ": the communicator failed earlier and cannot be used (", h.failure.message(),
          "); revoke or abort it, then shrink it or build a new one"));
    }
    return absl::OkStatus();
  }

  // Fails `op`, past its own deadline, and rank's communicator with it.
  void TimeOut(const std::shared_ptr<Op>& op) {
    const absl::Status late = absl::DeadlineExceededError(absl::StrCat(
        op->description, ": the operation's timeout of ", absl::FormatDuration(op->timeout),
        " passed (a peer may have failed or stopped issuing operations)"));
    Health& h = health[op->rank];
    if (h.state == Health::State::kHealthy) {
      h.state = Health::State::kFailed;
      h.failure = late;
    }
    for (auto* table : {&sends, &recvs}) {
      for (auto& [channel, q] : *table) {
        auto it = std::find(q.begin(), q.end(), op);
        if (it != q.end()) q.erase(it);
      }
    }
    Finish(op, late);
    Progress();
  }

  // The status a receive of `r` ends with when it meets the send `s`.
  static absl::Status Transfer(const Op& s, const Op& r) {
    if (s.dtype != r.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(r.description, ": the sender sent ",
                                                     DataTypeName(s.dtype), ", the buffer is ",
                                                     DataTypeName(r.dtype)));
    }
    if (s.count > r.count) {
      return absl::InvalidArgumentError(
          absl::StrCat(r.description, ": the sender sent a message of ", s.count, " x ",
                       DataTypeName(s.dtype), ", larger than the buffer (", r.count, ")"));
    }
    if (s.count < r.count) {
      return absl::InvalidArgumentError(absl::StrCat(r.description, ": received ", s.count, " x ",
                                                     DataTypeName(s.dtype), ", expected ", r.count,
                                                     " (the sender sent a different count)"));
    }
    if (s.count > 0) std::memcpy(r.dst, s.src, Bytes(s.count, s.dtype));
    return absl::OkStatus();
  }

  // Completes every pair and collective that can complete.
  void Progress() {
    for (bool changed = true; changed;) {
      changed = false;
      for (auto& [channel, out] : sends) {
        auto& in = recvs[channel];
        while (!out.empty() && !in.empty()) {
          std::shared_ptr<Op> s = out.front(), r = in.front();
          if (ordering == FakeOrdering::kInOrder &&
              (issued[s->rank].front() != s || issued[r->rank].front() != r)) {
            break;
          }
          out.pop_front();
          in.pop_front();
          const absl::Status got = Transfer(*s, *r);
          // A short message is the receiver's error only, as in MPI.
          Finish(s, s->dtype != r->dtype ? got : absl::OkStatus());
          Finish(r, got);
          ++matched;
          changed = true;
        }
      }
      for (auto it = collectives.begin(); it != collectives.end();) {
        if (Ready(it->second)) {
          Execute(it->first, it->second);
          it = collectives.erase(it);
          changed = true;
        } else {
          ++it;
        }
      }
    }
  }

  bool Ready(const std::vector<std::shared_ptr<Op>>& parts) const {
    for (const auto& p : parts) {
      if (p == nullptr) return false;
      if (ordering == FakeOrdering::kInOrder && p->ordered && !p->done &&
          issued[p->rank].front() != p) {
        return false;
      }
    }
    return true;
  }

  static std::string Mismatch(int64_t seq, const Op& a, const Op& b) {
    return absl::StrCat("mismatched collective #", seq, ": ", a.description, " met ",
                        b.description);
  }

  // The error of a collective whose parts disagree, or OK.
  absl::Status Agree(int64_t seq, const std::vector<std::shared_ptr<Op>>& parts) const {
    const Op& first = *parts[0];
    for (const auto& p : parts) {
      const bool counts =
          first.kind == Kind::kAllToAll || first.kind == Kind::kSplit || (p->count == first.count);
      if (p->kind != first.kind || p->dtype != first.dtype || !counts ||
          p->reduce != first.reduce || p->peer != first.peer) {
        return absl::InvalidArgumentError(Mismatch(seq, first, *p));
      }
    }
    if (first.kind != Kind::kAllToAll) return absl::OkStatus();
    for (int s = 0; s < size; ++s) {
      for (int r = 0; r < size; ++r) {
        const size_t sent = parts[s]->send_counts[r], expected = parts[r]->recv_counts[s];
        if (sent != expected) {
          return absl::InvalidArgumentError(
              absl::StrCat(Mismatch(seq, *parts[s], *parts[r]), ": rank ", s, " sends ", sent,
                           " elements to rank ", r, ", which expects ", expected));
        }
      }
    }
    return absl::OkStatus();
  }

  // Runs a collective every rank has started, and completes it. Every
  // input is read before any output is written, so in-place forms work.
  void Execute(int64_t seq, const std::vector<std::shared_ptr<Op>>& parts) {
    const absl::Status agreed = Agree(seq, parts);
    if (agreed.ok()) Compute(parts);
    for (const auto& p : parts) {
      if (!p->done) Finish(p, agreed);
    }
  }

  void Compute(const std::vector<std::shared_ptr<Op>>& parts) {
    const Op& first = *parts[0];
    const size_t n = first.count;
    const DataType t = first.dtype;
    const size_t elem = DataTypeSize(t);
    auto reduced = [&](size_t from, size_t count) {
      std::vector<double> out(count);
      for (size_t i = 0; i < count; ++i) {
        double v = Load(parts[0]->src, t, from + i);
        for (int r = 1; r < size; ++r)
          v = Combine(first.reduce, v, Load(parts[r]->src, t, from + i));
        out[i] = first.reduce == ReduceOp::kAvg ? v / size : v;
      }
      return out;
    };
    switch (first.kind) {
      case Kind::kAllReduce: {
        const std::vector<double> result = reduced(0, n);
        for (const auto& p : parts) {
          if (p->done) continue;
          for (size_t i = 0; i < n; ++i) Store(p->dst, t, i, result[i]);
        }
        return;
      }
      case Kind::kReduce: {
        const std::vector<double> result = reduced(0, n);
        Op& root = *parts[first.peer];
        if (!root.done) {
          for (size_t i = 0; i < n; ++i) Store(root.dst, t, i, result[i]);
        }
        return;
      }
      case Kind::kReduceScatter: {
        const size_t block = n / static_cast<size_t>(size);
        std::vector<std::vector<double>> blocks;
        for (int r = 0; r < size; ++r) blocks.push_back(reduced(r * block, block));
        for (int r = 0; r < size; ++r) {
          if (parts[r]->done) continue;
          for (size_t i = 0; i < block; ++i) Store(parts[r]->dst, t, i, blocks[r][i]);
        }
        return;
      }
      case Kind::kBroadcast: {
        const Op& root = *parts[first.peer];
        const std::vector<char> data(static_cast<const char*>(root.src),
                                     static_cast<const char*>(root.src) + n * elem);
        for (const auto& p : parts) {
          if (!p->done && n > 0) std::memcpy(p->dst, data.data(), data.size());
        }
        return;
      }
      case Kind::kAllGather: {
        std::vector<char> data;
        for (const auto& p : parts) {
          const char* s = static_cast<const char*>(p->src);
          data.insert(data.end(), s, s + n * elem);
        }
        for (const auto& p : parts) {
          if (!p->done && !data.empty()) std::memcpy(p->dst, data.data(), data.size());
        }
        return;
      }
      case Kind::kAllToAll: {
        // out[r] = block r of every sender, in sender order.
        std::vector<std::vector<char>> out(size);
        for (int r = 0; r < size; ++r) {
          for (int s = 0; s < size; ++s) {
            const char* base = static_cast<const char*>(parts[s]->src);
            size_t offset = 0;
            for (int k = 0; k < r; ++k) offset += parts[s]->send_counts[k];
            const char* from = base + offset * elem;
            out[r].insert(out[r].end(), from, from + parts[s]->send_counts[r] * elem);
          }
        }
        for (int r = 0; r < size; ++r) {
          if (!parts[r]->done && !out[r].empty()) {
            std::memcpy(parts[r]->dst, out[r].data(), out[r].size());
          }
        }
        return;
      }
      case Kind::kSplit: {
        // Ranks of one color, ordered by (key, rank), form a group.
        std::map<int, std::vector<std::pair<int, int>>> colors;  // color -> (key, rank)
        for (const auto& p : parts) {
          if (p->color >= 0) colors[p->color].emplace_back(p->key, p->rank);
        }
        for (auto& [color, members] : colors) {
          std::sort(members.begin(), members.end());
          auto child = std::make_shared<State>(static_cast<int>(members.size()), ordering, memory);
          for (size_t i = 0; i < members.size(); ++i) {
            parts[members[i].second]->child = child;
            parts[members[i].second]->child_rank = static_cast<int>(i);
          }
        }
        return;
      }
      case Kind::kBarrier:
      case Kind::kP2P:
        return;
    }
  }

  // Fails the pending operations of `only_rank` (every rank: -1).
  void FailPending(int only_rank, const absl::Status& status) {
    auto fail = [&](const std::shared_ptr<Op>& op) {
      Finish(op,
             absl::Status(status.code(), absl::StrCat(op->description, ": ", status.message())));
    };
    for (auto* table : {&sends, &recvs}) {
      for (auto& [channel, q] : *table) {
        for (auto it = q.begin(); it != q.end();) {
          if (only_rank >= 0 && (*it)->rank != only_rank) {
            ++it;
            continue;
          }
          fail(*it);
          it = q.erase(it);
        }
      }
    }
    for (auto& [seq, parts] : collectives) {
      for (auto& p : parts) {
        if (p != nullptr && !p->done && (only_rank < 0 || p->rank == only_rank)) fail(p);
      }
    }
    Progress();
  }
};

namespace {

using State = FakeGroup::State;

class FakeWork : public Work {
 public:
  FakeWork(std::shared_ptr<State> state, std::shared_ptr<Op> op)
      : state_(std::move(state)), op_(std::move(op)) {}

  absl::Status DoWait(absl::Time deadline) override {
    const absl::Time start = absl::Now();
    std::unique_lock<std::mutex> lock(state_->mu);
    while (!op_->done) {
      const absl::Time now = absl::Now();
      if (now >= op_->deadline) {
        state_->TimeOut(op_);
        break;
      }
      if (now >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            op_->description, ": not complete when the wait's deadline passed (waited ",
            absl::FormatDuration(absl::Trunc(now - start, absl::Milliseconds(1))),
            "); the operation is still in flight and may be waited for again"));
      }
      // In slices: either deadline may be infinitely far away.
      const absl::Time until = std::min({deadline, op_->deadline, now + absl::Hours(1)});
      state_->changed.wait_until(lock, absl::ToChronoTime(until));
    }
    return op_->status;
  }

  absl::StatusOr<bool> Test() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!op_->done && absl::Now() >= op_->deadline) state_->TimeOut(op_);
    if (!op_->done) return false;
    if (!op_->status.ok()) return op_->status;
    return true;
  }

  std::string Describe() const override { return op_->description; }

 private:
  std::shared_ptr<State> state_;
  std::shared_ptr<Op> op_;
};

class FakeComm final : public Communicator {
 public:
  FakeComm(std::shared_ptr<State> state, int rank, int world_rank, const CommOptions& options)
      : Communicator(options, Membership{rank, state->size, world_rank}, kCapabilities),
        state_(std::move(state)) {}

  absl::string_view backend() const override { return "fake"; }
  MemoryKind memory() const override { return state_->memory; }
  bool progresses_independently() const override {
    return state_->ordering == FakeOrdering::kMatchPosted;
  }

 protected:
  absl::StatusOr<std::unique_ptr<Work>> DoAllReduce(ConstBuffer send, Buffer recv, ReduceOp op,
                                                    const ResolvedOptions& options) override {
    auto o = NewOp(Kind::kAllReduce, send, recv.data, options);
    o->reduce = op;
    o->out_count = recv.count;
    return Collective(std::move(o));
  }
  absl::StatusOr<std::unique_ptr<Work>> DoBroadcast(Buffer buffer, int root,
                                                    const ResolvedOptions& options) override {
    auto o = NewOp(Kind::kBroadcast, buffer, buffer.data, options);
    o->peer = root;
    o->out_count = buffer.count;
    return Collective(std::move(o));
  }
  absl::StatusOr<std::unique_ptr<Work>> DoReduce(ConstBuffer send, Buffer recv, ReduceOp op,
                                                 int root,
                                                 const ResolvedOptions& options) override {
    auto o = NewOp(Kind::kReduce, send, recv.data, options);
    o->reduce = op;
    o->peer = root;
    o->out_count = recv.count;
    return Collective(std::move(o));
  }
  absl::StatusOr<std::unique_ptr<Work>> DoAllGather(ConstBuffer send, Buffer recv,
                                                    const ResolvedOptions& options) override {
    auto o = NewOp(Kind::kAllGather, send, recv.data, options);
    o->out_count = recv.count;
    return Collective(std::move(o));
  }
  absl::StatusOr<std::unique_ptr<Work>> DoReduceScatter(ConstBuffer send, Buffer recv, ReduceOp op,
                                                        const ResolvedOptions& options) override {
    auto o = NewOp(Kind::kReduceScatter, send, recv.data, options);
    o->reduce = op;
    o->out_count = recv.count;
    return Collective(std::move(o));
  }
  absl::StatusOr<std::unique_ptr<Work>> DoAllToAll(ConstBuffer send, Buffer recv,
                                                   const ResolvedOptions& options) override {
    AllToAllCounts counts;
    counts.send_counts.assign(static_cast<size_t>(size()),
                              send.count / static_cast<size_t>(size()));
    counts.recv_counts = counts.send_counts;
    return DoAllToAllV(send, recv, counts, options);
  }
  absl::StatusOr<std::unique_ptr<Work>> DoAllToAllV(ConstBuffer send, Buffer recv,
                                                    const AllToAllCounts& counts,
                                                    const ResolvedOptions& options) override {
    auto o = NewOp(Kind::kAllToAll, send, recv.data, options);
    o->out_count = recv.count;
    o->send_counts = counts.send_counts;
    o->recv_counts = counts.recv_counts;
    return Collective(std::move(o));
  }
  absl::StatusOr<std::unique_ptr<Work>> DoBarrier(const ResolvedOptions& options) override {
    return Collective(NewOp(Kind::kBarrier, ConstBuffer(), nullptr, options));
  }
  absl::StatusOr<std::unique_ptr<Work>> DoSend(ConstBuffer buffer, int peer,
                                               const ResolvedOptions& options) override {
    return Post(true, buffer, nullptr, peer, options);
  }
  absl::StatusOr<std::unique_ptr<Work>> DoRecv(Buffer buffer, int peer,
                                               const ResolvedOptions& options) override {
    return Post(false, buffer, buffer.data, peer, options);
  }

  absl::StatusOr<std::unique_ptr<Communicator>> DoSplit(int color, int key,
                                                        const CommOptions& options,
                                                        const ResolvedOptions& resolved) override {
    auto o = NewOp(Kind::kSplit, ConstBuffer(), nullptr, resolved);
    o->color = color < 0 ? -1 : color;
    o->key = key;
    o->ordered = false;
    std::unique_lock<std::mutex> lock(state_->mu);
    STRATA_RETURN_IF_ERROR(state_->CheckUsable(rank(), o->description));
    Join(o);
    while (!o->done) {
      if (absl::Now() >= o->deadline) {
        state_->TimeOut(o);
        break;
      }
      state_->changed.wait_until(lock, absl::ToChronoTime(o->deadline));
    }
    STRATA_RETURN_IF_ERROR(o->status);
    if (o->child == nullptr) return std::unique_ptr<Communicator>();
    return std::unique_ptr<Communicator>(
        std::make_unique<FakeComm>(o->child, o->child_rank, world_rank(), options));
  }

  absl::StatusOr<std::unique_ptr<Communicator>> DoShrink(const ShrinkPlan& plan,
                                                         const CommOptions& options,
                                                         const ResolvedOptions& resolved) override {
    // Works on a revoked or failed communicator too: the survivors meet
    // outside its operations.
    std::unique_lock<std::mutex> lock(state_->mu);
    const uint64_t hash = plan.survivors_hash;
    const int round = plan.attempt;
    State::Meeting& meeting = state_->meetings[{hash, round}];
    const int m = static_cast<int>(plan.survivors.size());
    if (meeting.child == nullptr) {
      meeting.child = std::make_shared<State>(m, state_->ordering, state_->memory);
      meeting.left = m;
    }
    ++meeting.arrived;
    std::shared_ptr<State> child = meeting.child;
    state_->changed.notify_all();
    const bool met = state_->changed.wait_until(lock, absl::ToChronoTime(resolved.deadline), [&] {
      return state_->meetings[{hash, round}].arrived == m;
    });
    State::Meeting& after = state_->meetings[{hash, round}];
    if (--after.left == 0 || !met) state_->meetings.erase({hash, round});
    if (!met) {
      return absl::DeadlineExceededError(absl::StrCat(
          resolved.description, ": the survivors [", absl::StrJoin(plan.survivors, ", "),
          "] did not all join by the deadline (are they alive, and do they exclude the same "
          "ranks?)"));
    }
    return std::unique_ptr<Communicator>(
        std::make_unique<FakeComm>(child, plan.new_rank, world_rank(), options));
  }

  absl::Status DoAbort() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    Health& h = state_->health[rank()];
    if (h.state == Health::State::kAborted) return absl::OkStatus();
    h.state = Health::State::kAborted;
    state_->FailPending(rank(), absl::AbortedError("the communicator was aborted by this rank"));
    return absl::OkStatus();
  }

  absl::Status DoRevoke() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->revoked) state_->revoked_by = rank();
    state_->revoked = true;
    state_->FailPending(-1, absl::AbortedError(absl::StrCat("the communicator was revoked by rank ",
                                                            state_->revoked_by)));
    return absl::OkStatus();
  }

  absl::Status DoAsyncError() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    const Health& h = state_->health[rank()];
    if (h.state == Health::State::kAborted) {
      return absl::AbortedError(absl::StrCat(where(), ": the communicator was aborted"));
    }
    if (state_->revoked) {
      return absl::AbortedError(
          absl::StrCat(where(), ": the communicator was revoked by rank ", state_->revoked_by));
    }
    if (h.state == Health::State::kFailed) return h.failure;
    return absl::OkStatus();
  }

 private:
  std::shared_ptr<Op> NewOp(Kind kind, ConstBuffer send, void* dst,
                            const ResolvedOptions& options) const {
    auto op = std::make_shared<Op>();
    op->rank = rank();
    op->kind = kind;
    op->src = send.data;
    op->dst = dst;
    op->count = send.count;
    op->dtype = send.dtype;
    op->description = options.description;
    op->deadline = options.deadline;
    op->timeout = options.timeout;
    op->trace = options.trace;
    return op;
  }

  // Adds this rank's part of its next collective (lock held).
  void Join(const std::shared_ptr<Op>& op) {
    auto& parts = state_->collectives[state_->collectives_issued[rank()]++];
    if (parts.empty()) parts.resize(state_->size);
    parts[rank()] = op;
    if (op->ordered) state_->issued[rank()].push_back(op);
    if (op->trace != nullptr) op->trace->Started();
    state_->Progress();
  }

  absl::StatusOr<std::unique_ptr<Work>> Collective(std::shared_ptr<Op> op) {
    std::lock_guard<std::mutex> lock(state_->mu);
    STRATA_RETURN_IF_ERROR(state_->CheckUsable(rank(), op->description));
    Join(op);
    return std::unique_ptr<Work>(new FakeWork(state_, op));
  }

  absl::StatusOr<std::unique_ptr<Work>> Post(bool send, ConstBuffer buffer, void* dst, int peer,
                                             const ResolvedOptions& options) {
    auto op = NewOp(Kind::kP2P, buffer, dst, options);
    op->peer = peer;
    op->send = send;
    std::lock_guard<std::mutex> lock(state_->mu);
    STRATA_RETURN_IF_ERROR(state_->CheckUsable(rank(), op->description));
    ++state_->p2p_by_stream[options.stream];
    state_->issued[rank()].push_back(op);
    (send ? state_->sends
          : state_->recvs)[send ? std::make_pair(rank(), peer) : std::make_pair(peer, rank())]
        .push_back(op);
    if (op->trace != nullptr) op->trace->Started();
    state_->Progress();
    return std::unique_ptr<Work>(new FakeWork(state_, op));
  }

  std::shared_ptr<State> state_;
};

}  // namespace

FakeGroup::FakeGroup(int size, FakeOrdering ordering, std::string name, MemoryKind memory)
    : state_(std::make_shared<State>(size, ordering, memory)), name_(std::move(name)) {}

FakeGroup::~FakeGroup() = default;

std::unique_ptr<Communicator> FakeGroup::Comm(int rank) {
  CommOptions options;
  options.name = name_;
  return Comm(rank, options);
}

std::unique_ptr<Communicator> FakeGroup::Comm(int rank, const CommOptions& options) {
  return std::make_unique<FakeComm>(state_, rank, rank, options);
}

int64_t FakeGroup::matched() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->matched;
}

std::map<void*, int64_t> FakeGroup::p2p_by_stream() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->p2p_by_stream;
}

}  // namespace strata::testing
