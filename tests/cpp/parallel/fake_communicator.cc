#include "fake_communicator.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "parallel/tensor_parallel/internal/convert.h"

namespace strata::testing {

namespace {

enum class Kind { kP2P, kAllReduce, kAllGather, kReduceScatter, kBroadcast, kBarrier };

const char* KindName(Kind k) {
  switch (k) {
    case Kind::kP2P:
      return "p2p";
    case Kind::kAllReduce:
      return "allreduce";
    case Kind::kAllGather:
      return "allgather";
    case Kind::kReduceScatter:
      return "reduce_scatter";
    case Kind::kBroadcast:
      return "broadcast";
    case Kind::kBarrier:
      return "barrier";
  }
  return "?";
}

struct Op {
  int rank = 0;
  int peer = 0;  // p2p: the peer; broadcast: the root
  bool send = false;
  Kind kind = Kind::kP2P;
  ReduceOp reduce = ReduceOp::kSum;
  const void* src = nullptr;
  void* dst = nullptr;
  size_t count = 0;  // p2p: elements; collectives: elements of the send buffer
  DataType dtype = DataType::kFloat32;
  bool done = false;
  absl::Status status;

  std::string Describe(const std::string& group) const {
    if (kind != Kind::kP2P) {
      return absl::StrCat(KindName(kind), "(", ReduceOpName(reduce), ", ", count, " x ",
                          DataTypeName(dtype), ") on fake group ", group, " (rank ", rank, ")");
    }
    return absl::StrCat(send ? "send(" : "recv(", count, " x ", DataTypeName(dtype),
                        send ? ") to rank " : ") from rank ", peer, " on fake group ", group,
                        " (rank ", rank, ")");
  }
};

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
    case DataType::kInt32:
      return static_cast<const int32_t*>(p)[i];
    case DataType::kInt64:
      return static_cast<double>(static_cast<const int64_t*>(p)[i]);
    default:
      return 0;
  }
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
    case DataType::kInt32:
      static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
      return;
    case DataType::kInt64:
      static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v);
      return;
    default:
      return;
  }
}

bool Reducible(DataType t) {
  return t == DataType::kFloat32 || t == DataType::kFloat64 || t == DataType::kFloat16 ||
         t == DataType::kBFloat16 || t == DataType::kInt32 || t == DataType::kInt64;
}

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

}  // namespace

struct FakeGroup::State {
  State(int n, FakeOrdering o, std::string g, MemoryKind m)
      : size(n),
        ordering(o),
        name(std::move(g)),
        memory(m),
        issued(n),
        aborted(n, false),
        collectives_issued(n, 0) {}

  const int size;
  const FakeOrdering ordering;
  const std::string name;
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
  std::vector<bool> aborted;
  int64_t matched = 0;
  // Sends and receives posted, by the stream they were ordered on.
  std::map<void*, int64_t> p2p_by_stream;
  // Collectives by sequence number; part r is rank r's operation (null
  // until that rank starts it).
  std::vector<int64_t> collectives_issued;
  std::map<int64_t, std::vector<std::shared_ptr<Op>>> collectives;

  void Finish(const std::shared_ptr<Op>& op, absl::Status status) {
    op->done = true;
    op->status = std::move(status);
    changed.notify_all();
    auto& q = issued[op->rank];
    q.erase(std::find(q.begin(), q.end(), op));
  }

  // Completes every pair that can complete.
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
          absl::Status st;
          if (s->count != r->count || s->dtype != r->dtype) {
            st = absl::InvalidArgumentError(absl::StrCat("mismatched transfer: ", s->Describe(name),
                                                         " met ", r->Describe(name)));
          } else if (s->count > 0) {
            std::memcpy(r->dst, s->src, s->count * DataTypeSize(s->dtype));
          }
          Finish(s, st);
          Finish(r, st);
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
      if (ordering == FakeOrdering::kInOrder && !p->done && issued[p->rank].front() != p) {
        return false;
      }
    }
    return true;
  }

  // Runs a collective every rank has started, in double, and completes it.
  void Execute(int64_t seq, const std::vector<std::shared_ptr<Op>>& parts) {
    const Op& first = *parts[0];
    absl::Status st;
    for (const auto& p : parts) {
      if (p->kind != first.kind || p->dtype != first.dtype || p->count != first.count ||
          p->reduce != first.reduce || p->peer != first.peer) {
        st = absl::InvalidArgumentError(absl::StrCat("mismatched collective #", seq, ": ",
                                                     first.Describe(name), " met ",
                                                     p->Describe(name)));
      }
    }
    if (st.ok()) {
      const size_t n = first.count;
      const DataType t = first.dtype;
      std::vector<double> result;
      switch (first.kind) {
        case Kind::kAllReduce:
        case Kind::kReduceScatter:
          result.assign(n, 0.0);
          for (size_t i = 0; i < n; ++i) {
            double v = Load(parts[0]->src, t, i);
            for (int r = 1; r < size; ++r) v = Combine(first.reduce, v, Load(parts[r]->src, t, i));
            result[i] = first.reduce == ReduceOp::kAvg ? v / size : v;
          }
          break;
        case Kind::kAllGather:
          for (int r = 0; r < size; ++r) {
            for (size_t i = 0; i < n; ++i) result.push_back(Load(parts[r]->src, t, i));
          }
          break;
        case Kind::kBroadcast:
          for (size_t i = 0; i < n; ++i) result.push_back(Load(parts[first.peer]->src, t, i));
          break;
        default:
          break;
      }
      // Written after every input was read, so in-place operations work.
      for (int r = 0; r < size; ++r) {
        Op& p = *parts[r];
        if (p.done || first.kind == Kind::kBarrier) continue;
        const size_t block = first.kind == Kind::kReduceScatter ? n / size : 0;
        const size_t out = first.kind == Kind::kReduceScatter ? block : result.size();
        for (size_t i = 0; i < out; ++i) Store(p.dst, t, i, result[r * block + i]);
      }
    }
    for (const auto& p : parts) {
      if (!p->done) Finish(p, st);
    }
  }

  void FailPending(int only_rank, const absl::Status& status) {
    for (auto* table : {&sends, &recvs}) {
      for (auto& [channel, q] : *table) {
        for (auto it = q.begin(); it != q.end();) {
          if (only_rank >= 0 && (*it)->rank != only_rank) {
            ++it;
            continue;
          }
          Finish(*it, status);
          it = q.erase(it);
        }
      }
    }
    for (auto& [seq, parts] : collectives) {
      for (auto& p : parts) {
        if (p != nullptr && !p->done && (only_rank < 0 || p->rank == only_rank)) Finish(p, status);
      }
    }
    Progress();
  }
};

namespace {

class FakeWork : public Work {
 public:
  FakeWork(std::shared_ptr<FakeGroup::State> state, std::shared_ptr<Op> op)
      : state_(std::move(state)), op_(std::move(op)) {}

  absl::Status Wait(absl::Time deadline) override {
    std::unique_lock<std::mutex> lock(state_->mu);
    Op* op = op_.get();
    auto done = [op] { return op->done; };
    if (deadline == absl::InfiniteFuture()) {
      state_->changed.wait(lock, done);
    } else if (!state_->changed.wait_until(lock, absl::ToChronoTime(deadline), done)) {
      return absl::DeadlineExceededError(
          absl::StrCat(op->Describe(state_->name), ": deadline passed"));
    }
    return op->status;
  }

  absl::StatusOr<bool> Test() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!op_->done) return false;
    if (!op_->status.ok()) return op_->status;
    return true;
  }

  std::string Describe() const override { return op_->Describe(state_->name); }

 private:
  std::shared_ptr<FakeGroup::State> state_;
  std::shared_ptr<Op> op_;
};

class FakeComm : public Communicator {
 public:
  FakeComm(std::shared_ptr<FakeGroup::State> state, int rank)
      : state_(std::move(state)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return state_->size; }
  const std::string& name() const override { return state_->name; }
  int world_rank() const override { return rank_; }
  absl::string_view backend() const override { return "fake"; }
  MemoryKind memory() const override { return state_->memory; }
  bool progresses_independently() const override {
    return state_->ordering == FakeOrdering::kMatchPosted;
  }

  absl::StatusOr<std::unique_ptr<Work>> AllReduce(ConstBuffer send, Buffer recv, ReduceOp op,
                                                  const OpOptions&) override {
    if (send.count != recv.count || send.dtype != recv.dtype) {
      return Mismatch("allreduce", send, recv);
    }
    return Collective(Kind::kAllReduce, op, send, recv.data, 0);
  }
  absl::StatusOr<std::unique_ptr<Work>> Broadcast(Buffer buffer, int root,
                                                  const OpOptions&) override {
    if (root < 0 || root >= state_->size) {
      return absl::InvalidArgumentError(
          absl::StrCat("broadcast root ", root, " is not a rank of fake group ", state_->name));
    }
    return Collective(Kind::kBroadcast, ReduceOp::kSum, buffer, buffer.data, root);
  }
  absl::StatusOr<std::unique_ptr<Work>> Reduce(ConstBuffer, Buffer, ReduceOp, int,
                                               const OpOptions&) override {
    return Unsupported("Reduce");
  }
  absl::StatusOr<std::unique_ptr<Work>> AllGather(ConstBuffer send, Buffer recv,
                                                  const OpOptions&) override {
    if (recv.count != send.count * state_->size || send.dtype != recv.dtype) {
      return Mismatch("allgather", send, recv);
    }
    return Collective(Kind::kAllGather, ReduceOp::kSum, send, recv.data, 0);
  }
  absl::StatusOr<std::unique_ptr<Work>> ReduceScatter(ConstBuffer send, Buffer recv, ReduceOp op,
                                                      const OpOptions&) override {
    if (send.count != recv.count * state_->size || send.dtype != recv.dtype) {
      return Mismatch("reduce_scatter", send, recv);
    }
    return Collective(Kind::kReduceScatter, op, send, recv.data, 0);
  }
  absl::StatusOr<std::unique_ptr<Work>> AllToAll(ConstBuffer, Buffer, const OpOptions&) override {
    return Unsupported("AllToAll");
  }
  absl::StatusOr<std::unique_ptr<Work>> AllToAllV(ConstBuffer, Buffer, const AllToAllCounts&,
                                                  const OpOptions&) override {
    return Unsupported("AllToAllV");
  }
  absl::StatusOr<std::unique_ptr<Work>> Barrier(const OpOptions&) override {
    return Collective(Kind::kBarrier, ReduceOp::kSum, ConstBuffer(nullptr, 0, DataType::kUInt8),
                      nullptr, 0);
  }

  absl::StatusOr<std::unique_ptr<Work>> Send(ConstBuffer buffer, int peer,
                                             const OpOptions& options) override {
    CountStream(options);
    return Post(/*send=*/true, buffer.data, nullptr, buffer.count, buffer.dtype, peer);
  }
  absl::StatusOr<std::unique_ptr<Work>> Recv(Buffer buffer, int peer,
                                             const OpOptions& options) override {
    CountStream(options);
    return Post(/*send=*/false, nullptr, buffer.data, buffer.count, buffer.dtype, peer);
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int, int, const CommOptions&) override {
    return absl::UnimplementedError("FakeGroup has no Split");
  }
  absl::Status Abort() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->aborted[rank_] = true;
    state_->FailPending(rank_, absl::AbortedError(absl::StrCat(
                                   "rank ", rank_, " aborted fake group ", state_->name)));
    return absl::OkStatus();
  }
  absl::Status Revoke() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->revoked) state_->revoked_by = rank_;
    state_->revoked = true;
    state_->FailPending(
        -1, absl::AbortedError(absl::StrCat("fake group ", state_->name, " was revoked by rank ",
                                            state_->revoked_by)));
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<Communicator>> Shrink(absl::Span<const int>,
                                                       const CommOptions&) override {
    return absl::UnimplementedError("FakeGroup has no Shrink");
  }
  absl::Status AsyncError() override {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->revoked) return absl::AbortedError("fake group revoked");
    if (state_->aborted[rank_]) return absl::AbortedError("fake group aborted on this rank");
    return absl::OkStatus();
  }

 private:
  // Counts a send or receive under the stream it is ordered on.
  void CountStream(const OpOptions& options) {
    std::lock_guard<std::mutex> lock(state_->mu);
    ++state_->p2p_by_stream[options.stream];
  }

  absl::Status Unsupported(const char* op) const {
    return absl::UnimplementedError(absl::StrCat("FakeGroup does not implement ", op));
  }

  absl::Status Mismatch(const char* op, const ConstBuffer& send, const Buffer& recv) const {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": send buffer of ", send.count, " x ", DataTypeName(send.dtype),
                     " and receive buffer of ", recv.count, " x ", DataTypeName(recv.dtype),
                     " do not fit a group of ", state_->size));
  }

  absl::StatusOr<std::unique_ptr<Work>> Collective(Kind kind, ReduceOp reduce, ConstBuffer send,
                                                   void* dst, int root) {
    if (send.count > 0 && (send.data == nullptr || dst == nullptr)) {
      return absl::InvalidArgumentError("null buffer with a nonzero count");
    }
    if (kind != Kind::kBarrier && kind != Kind::kBroadcast && kind != Kind::kAllGather &&
        !Reducible(send.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("fake group cannot reduce ", DataTypeName(send.dtype)));
    }
    auto op = std::make_shared<Op>();
    op->rank = rank_;
    op->peer = root;
    op->kind = kind;
    op->reduce = reduce;
    op->src = send.data;
    op->dst = dst;
    op->count = send.count;
    op->dtype = send.dtype;
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->aborted[rank_]) {
      return absl::FailedPreconditionError("fake group was aborted on this rank");
    }
    if (state_->revoked) {
      op->done = true;
      op->status = absl::AbortedError(
          absl::StrCat("fake group ", state_->name, " was revoked by rank ", state_->revoked_by));
    } else {
      auto& parts = state_->collectives[state_->collectives_issued[rank_]++];
      if (parts.empty()) parts.resize(state_->size);
      parts[rank_] = op;
      state_->issued[rank_].push_back(op);
      state_->Progress();
    }
    return std::unique_ptr<Work>(new FakeWork(state_, op));
  }

  absl::StatusOr<std::unique_ptr<Work>> Post(bool send, const void* src, void* dst, size_t count,
                                             DataType dtype, int peer) {
    if (peer < 0 || peer >= state_->size || peer == rank_) {
      return absl::InvalidArgumentError(
          absl::StrCat("peer ", peer, " is not another rank of fake group ", state_->name));
    }
    if (count > 0 && (send ? src == nullptr : dst == nullptr)) {
      return absl::InvalidArgumentError("null buffer with a nonzero count");
    }
    auto op = std::make_shared<Op>();
    op->rank = rank_;
    op->peer = peer;
    op->send = send;
    op->src = src;
    op->dst = dst;
    op->count = count;
    op->dtype = dtype;
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->aborted[rank_]) {
      return absl::FailedPreconditionError("fake group was aborted on this rank");
    }
    if (state_->revoked) {
      op->done = true;
      op->status = absl::AbortedError(
          absl::StrCat("fake group ", state_->name, " was revoked by rank ", state_->revoked_by));
    } else {
      state_->issued[rank_].push_back(op);
      (send ? state_->sends
            : state_->recvs)[send ? std::make_pair(rank_, peer) : std::make_pair(peer, rank_)]
          .push_back(op);
      state_->Progress();
    }
    return std::unique_ptr<Work>(new FakeWork(state_, op));
  }

  std::shared_ptr<FakeGroup::State> state_;
  const int rank_;
};

}  // namespace

FakeGroup::FakeGroup(int size, FakeOrdering ordering, std::string name, MemoryKind memory)
    : state_(std::make_shared<State>(size, ordering, std::move(name), memory)) {}

FakeGroup::~FakeGroup() = default;

std::unique_ptr<Communicator> FakeGroup::Comm(int rank) {
  return std::make_unique<FakeComm>(state_, rank);
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
