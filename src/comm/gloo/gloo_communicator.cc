// Collectives and point-to-point operations of the Gloo backend. Structure
// and fault handling (root creation, Split, Shrink, Abort, Revoke) are in
// gloo_structure.cc.
#include "comm/gloo/gloo_communicator.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "comm/common/pending_op.h"
#include "comm/half_reduce.h"
#include "comm/reduce.h"
#include "strata/base/status.h"

namespace strata::gloo {
namespace {

// Slots of user point-to-point messages (messages on one slot between two
// ranks match in the order they were posted): each message's first part,
// and its rest in chunks on a slot of the message's own, numbered by the
// count of messages between the two ranks.
constexpr uint32_t kFirstSlot = 1;
constexpr uint32_t kChunkSlotBase = 2;  // + the message's number modulo kChunkSlots
constexpr uint32_t kChunkSlots = uint32_t{1} << 30;
// The first part is the byte count (8 bytes) and up to kInline bytes of
// the payload, copied together so that a small message is one Gloo
// transfer; the rest goes in chunks whose bounds depend on the offset only.
// The receiver posts a receive of the first part's full size and one of
// each chunk's full size for every chunk its buffer holds, at once, so a
// message of the expected size needs no round trip at any size, and no
// sender can send more into a receive than it holds (Gloo would assert).
constexpr size_t kHeader = sizeof(uint64_t);
constexpr size_t kInline = size_t{64} << 10;
// Chunk 0 runs from kInline to 1 MiB; the chunks after it double in size
// up to kMaxChunk, then stay at kMaxChunk: [1, 2), [2, 4), [4, 8), [8, 12),
// [12, 16) MiB and so on. Each Gloo transfer costs a rendezvous and a
// completion, so fewer, larger chunks pay at large sizes; a power of two
// fills every receive it needs, and any other size stages only its last
// chunk (at most kMaxChunk).
constexpr size_t kFirstChunkEnd = size_t{1} << 20;
constexpr size_t kMaxChunk = size_t{4} << 20;
constexpr int kDoublings = 2;  // log2(kMaxChunk / kFirstChunkEnd)
static_assert((kFirstChunkEnd << kDoublings) == kMaxChunk);
// Where the doubling stops: chunk kDoublings + 1 ends at 8 MiB.
constexpr size_t kDoubledEnd = kFirstChunkEnd << (kDoublings + 1);

size_t ChunkEnd(size_t i) {
  if (i <= kDoublings + 1) return kFirstChunkEnd << i;
  return kDoubledEnd + (i - kDoublings - 1) * kMaxChunk;
}
size_t ChunkStart(size_t i) { return i == 0 ? kInline : ChunkEnd(i - 1); }
// How many chunks a message of `bytes` has after its first part.
size_t Chunks(size_t bytes) {
  if (bytes <= kInline) return 0;
  if (bytes > kDoubledEnd) return kDoublings + 3 + (bytes - kDoubledEnd - 1) / kMaxChunk;
  size_t i = 0;
  while (ChunkEnd(i) < bytes) ++i;
  return i + 1;
}

bool CanMove(DataType) { return true; }
bool CanReduce(DataType t) { return t != DataType::kBool; }

size_t Bytes(size_t count, DataType t) { return count * DataTypeSize(t); }

int64_t Millis(absl::Duration d) {
  return std::max<int64_t>(1, absl::ToInt64Milliseconds(absl::Ceil(d, absl::Milliseconds(1))));
}

gloo_plugin::ReduceFn ReduceFnFor(DataType dtype, ReduceOp op) {
  return [dtype, op](void* out, const void* a, const void* b, size_t n) {
    comm_internal::ReduceInto(dtype, op, out, a, b, n);
  };
}

// Gloo wants a pointer even for empty buffers.
void* NonNull(void* p) {
  static char dummy;
  return p != nullptr ? p : &dummy;
}

// The state of one point-to-point operation, shared by its run (posting),
// its finish (waiting), Abort and the queue. The finish waits for its
// transfers in a fixed sequence and counts those done, so that a finish
// suspended on a waiting thread (GlooQueue) resumes where it stopped.
struct Transfer {
  std::mutex mu;
  bool interrupted = false;
  bool suspend_asked = false;
  gloo_plugin::Pending* waiting = nullptr;                       // the wait in progress
  std::unique_ptr<gloo_plugin::Pending> first_op;                // the first part
  std::vector<std::unique_ptr<gloo_plugin::Pending>> chunk_ops;  // the rest, in order
  uint32_t chunk_slot = 0;
  // Finish state (only the thread running the finish touches these).
  size_t waited = 0;          // transfers of the sequence waited for
  bool drain_posted = false;  // receives of chunks beyond the buffer
  // The first part: the byte count, then up to kInline bytes of the
  // payload (a receive has room for kInline, a send only what it sends).
  std::unique_ptr<char[]> first;
  // Where the last chunk lands when the receive buffer holds less than a
  // whole one there.
  std::unique_ptr<char[]> last_staging;
  std::unique_ptr<char[]> drain;  // chunks beyond the receive buffer land here

  void Interrupt() {
    std::lock_guard<std::mutex> lock(mu);
    interrupted = true;
    if (first_op) first_op->Abort();
    for (auto& op : chunk_ops) {
      if (op) op->Abort();
    }
  }
  // Hands the transfers, all completed, to `retire` (GlooCommunicator::Retire).
  template <typename F>
  void Retire(F&& retire) {
    std::lock_guard<std::mutex> lock(mu);
    retire(std::move(first_op), std::move(chunk_ops));
    chunk_ops.clear();
  }
  // Makes the wait in progress, or the next, return Suspended(). Gloo's
  // abort of a wait does not consume the transfer's completion.
  void Suspend() {
    std::lock_guard<std::mutex> lock(mu);
    suspend_asked = true;
    if (waiting != nullptr) waiting->Abort();
  }
  // Waits for `op`, the next transfer of the sequence, until `deadline`.
  absl::Status AwaitNext(gloo_plugin::Pending* op, absl::Time deadline, absl::string_view what) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (interrupted) return absl::AbortedError(absl::StrCat(what, ": interrupted"));
      if (suspend_asked) {
        suspend_asked = false;
        return Suspended();
      }
      waiting = op;
    }
    const absl::Duration left = deadline - absl::Now();
    gloo_plugin::Error e;
    if (left > absl::ZeroDuration()) e = op->Wait(Millis(left));
    std::lock_guard<std::mutex> lock(mu);
    waiting = nullptr;
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": the operation's timeout passed"));
    }
    if (e.ok()) {
      ++waited;
      return absl::OkStatus();
    }
    if (e.code == gloo_plugin::kAborted && suspend_asked && !interrupted) {
      suspend_asked = false;
      return Suspended();
    }
    return FromPlugin(e, what);
  }
};

// A point-to-point operation between ranks of one host (host copies): one
// message (gloo_plugin::HostTransfer), posted by the run, waited for by the
// finish, which a suspend makes return Suspended() and resumable.
struct HostOp {
  std::mutex mu;
  std::unique_ptr<gloo_plugin::HostTransfer> message;
  bool interrupted = false;  // before the message was posted
  bool suspend_asked = false;

  void Adopt(std::unique_ptr<gloo_plugin::HostTransfer> m) {
    std::lock_guard<std::mutex> lock(mu);
    message = std::move(m);
    if (interrupted) message->Interrupt();
    if (suspend_asked) message->Suspend();
    suspend_asked = false;
  }
  void Interrupt() {
    std::lock_guard<std::mutex> lock(mu);
    interrupted = true;
    if (message) message->Interrupt();
  }
  void Suspend() {
    std::lock_guard<std::mutex> lock(mu);
    if (message) {
      message->Suspend();
    } else {
      suspend_asked = true;
    }
  }
  absl::Status Await(absl::Time deadline, absl::string_view what) {
    gloo_plugin::HostTransfer* m;
    {
      std::lock_guard<std::mutex> lock(mu);
      m = message.get();
    }
    if (m == nullptr) return absl::AbortedError(absl::StrCat(what, ": interrupted"));
    // Past the deadline the message still gets a last look (a millisecond).
    const gloo_plugin::Error e = m->Wait(Millis(deadline - absl::Now()));
    if (!e.ok() && !m->finished()) return Suspended();
    return FromPlugin(e, what);
  }
};

// A receive's error when the sender sent `incoming` bytes into `buffer`.
absl::Status SizeMismatch(absl::string_view what, const Buffer& buffer, uint64_t incoming) {
  const size_t elem = DataTypeSize(buffer.dtype);
  if (incoming > Bytes(buffer.count, buffer.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the sender sent a message of ", incoming / elem, " x ",
                     DataTypeName(buffer.dtype), ", larger than the buffer (", buffer.count, ")"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": received ", incoming / elem, " x ", DataTypeName(buffer.dtype),
                   ", expected ", buffer.count, " (the sender sent a different count)"));
}

}  // namespace

absl::Status FromPlugin(const gloo_plugin::Error& e, absl::string_view description) {
  if (e.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(e.code),
                      absl::StrCat(description, ": ", e.message));
}

const CommCapabilities& GlooCapabilities() {
  static const CommCapabilities caps{&CanMove, &CanReduce};
  return caps;
}

absl::StatusOr<std::unique_ptr<Work>> GlooCommunicator::Start(
    Kind kind, const ResolvedOptions& options, RunFn run,
    std::function<absl::Status(absl::Time)> finish, std::function<void()> interrupt,
    std::function<void()> suspend) {
  std::lock_guard<std::mutex> lock(issue_mu_);
  STRATA_RETURN_IF_ERROR(health_.CheckUsable(options.description));
  auto op = std::make_shared<QueuedOp>();
  op->pending = std::make_shared<comm_internal::PendingOp>(options.description, options.deadline,
                                                           options.trace);
  const uint32_t tag = kind == Kind::kCollective ? next_tag_++ : 0;
  const std::string limit = absl::FormatDuration(options.timeout);
  // A Gloo timeout is the operation's own timeout: say which it was.
  auto name_timeout = [limit](absl::Status s) {
    if (s.code() != absl::StatusCode::kDeadlineExceeded) return s;
    return absl::Status(
        s.code(), absl::StrCat(s.message(), " (the operation's timeout of ", limit, " passed)"));
  };
  comm_internal::PendingOp* pending = op->pending.get();
  op->run = [run = std::move(run), pending, tag, name_timeout](absl::Duration left) {
    return name_timeout(run(Step{tag, Millis(left), pending->description()}));
  };
  if (finish) {
    op->finish = [finish = std::move(finish), name_timeout](absl::Time deadline) {
      return name_timeout(finish(deadline));
    };
  }
  op->interrupt = std::move(interrupt);
  op->suspend = std::move(suspend);
  // Posting a transfer does not block: the caller posts it when the queue
  // is idle.
  return queue_->Submit(std::move(op), /*inline_ok=*/kind == Kind::kPointToPoint);
}

absl::StatusOr<std::unique_ptr<Work>> GlooCommunicator::DoAllReduce(
    ConstBuffer send, Buffer recv, ReduceOp op, const ResolvedOptions& options) {
  const int n = size();
  return Start(Kind::kCollective, options, [this, send, recv, op, n](const Step& step) {
    if (recv.count == 0) return absl::OkStatus();
    if (send.data != recv.data) {
      std::memcpy(recv.data, send.data, Bytes(recv.count, recv.dtype));
    }
    STRATA_RETURN_IF_ERROR(
        FromPlugin(context_->AllReduce(recv.data, recv.count, DataTypeSize(recv.dtype),
                                       ReduceFnFor(recv.dtype, op), step.tag, step.timeout_ms),
                   step.description));
    if (op == ReduceOp::kAvg) {
      comm_internal::DivideInPlace(recv.dtype, recv.data, recv.count, n);
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<std::unique_ptr<Work>> GlooCommunicator::DoBroadcast(
    Buffer buffer, int root, const ResolvedOptions& options) {
  return Start(Kind::kCollective, options, [this, buffer, root](const Step& step) {
    if (buffer.count == 0) return absl::OkStatus();
    return FromPlugin(context_->Broadcast(buffer.data, Bytes(buffer.count, buffer.dtype), root,
                                          step.tag, step.timeout_ms),
                      step.description);
  });
}

absl::StatusOr<std::unique_ptr<Work>> GlooCommunicator::DoReduce(ConstBuffer send, Buffer recv,
                                                                 ReduceOp op, int root,
                                                                 const ResolvedOptions& options) {
  const int n = size();
  const bool is_root = rank() == root;
  return Start(Kind::kCollective, options,
               [this, send, recv, op, root, n, is_root](const Step& step) {
                 if (send.count == 0) return absl::OkStatus();
                 // Off the root, `recv` is ignored (the plugin uses scratch).
                 void* out = is_root ? recv.data : nullptr;
                 STRATA_RETURN_IF_ERROR(FromPlugin(
                     context_->Reduce(send.data, out, send.count, DataTypeSize(send.dtype),
                                      ReduceFnFor(send.dtype, op), root, step.tag, step.timeout_ms),
                     step.description));
                 if (op == ReduceOp::kAvg && is_root) {
                   comm_internal::DivideInPlace(recv.dtype, recv.data, recv.count, n);
                 }
                 return absl::OkStatus();
               });
}

absl::StatusOr<std::unique_ptr<Work>> GlooCommunicator::DoAllGather(
    ConstBuffer send, Buffer recv, const ResolvedOptions& options) {
  const size_t block = Bytes(send.count, send.dtype);
  const bool in_place =
      send.data != nullptr && send.data == static_cast<char*>(recv.data) + block * rank();
  return Start(Kind::kCollective, options, [this, send, recv, block, in_place](const Step& step) {
    if (block == 0) return absl::OkStatus();
    return FromPlugin(context_->AllGather(in_place ? nullptr : send.data, recv.data, block,
                                          step.tag, step.timeout_ms),
                      step.description);
  });
}

absl::StatusOr<std::unique_ptr<Work>> GlooCommunicator::DoReduceScatter(
    ConstBuffer send, Buffer recv, ReduceOp op, const ResolvedOptions& options) {
  const int n = size();
  return Start(Kind::kCollective, options, [this, send, recv, op, n](const Step& step) {
    if (recv.count == 0) return absl::OkStatus();
    STRATA_RETURN_IF_ERROR(FromPlugin(
        context_->ReduceScatter(send.data, recv.data, recv.count, DataTypeSize(recv.dtype),
                                ReduceFnFor(recv.dtype, op), step.tag, step.timeout_ms),
        step.description));
    if (op == ReduceOp::kAvg) {
      comm_internal::DivideInPlace(recv.dtype, recv.data, recv.count, n);
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<std::unique_ptr<Work>> GlooCommunicator::DoAllToAll(ConstBuffer send, Buffer recv,
                                                                   const ResolvedOptions& options) {
  const size_t bytes = Bytes(send.count, send.dtype);
  const size_t block = bytes / static_cast<size_t>(size());
  return Start(Kind::kCollective, options, [this, send, recv, bytes, block](const Step& step) {
    if (block == 0) return absl::OkStatus();
    // In place: Gloo needs distinct buffers; send from a copy.
    std::vector<char> staged;
    const void* source = send.data;
    if (send.data == recv.data) {
      staged.assign(static_cast<const char*>(send.data),
                    static_cast<const char*>(send.data) + bytes);
      source = staged.data();
    }
    return FromPlugin(context_->AllToAll(source, recv.data, block, step.tag, step.timeout_ms),
                      step.description);
  });
}

absl::StatusOr<std::unique_ptr<Work>> GlooCommunicator::DoAllToAllV(
    ConstBuffer send, Buffer recv, const AllToAllCounts& counts, const ResolvedOptions& options) {
  std::vector<int64_t> send_counts(counts.send_counts.begin(), counts.send_counts.end());
  std::vector<int64_t> recv_counts(counts.recv_counts.begin(), counts.recv_counts.end());
  return Start(
      Kind::kCollective, options, [this, send, recv, send_counts, recv_counts](const Step& step) {
        std::vector<char> staged;
        const void* source = send.data;
        if (send.data == recv.data && send.count != 0) {
          const char* p = static_cast<const char*>(send.data);
          staged.assign(p, p + Bytes(send.count, send.dtype));
          source = staged.data();
        }
        return FromPlugin(
            context_->AllToAllV(NonNull(const_cast<void*>(source)), send_counts, NonNull(recv.data),
                                recv_counts, DataTypeSize(send.dtype), step.tag, step.timeout_ms),
            step.description);
      });
}

absl::StatusOr<std::unique_ptr<Work>> GlooCommunicator::DoBarrier(const ResolvedOptions& options) {
  return Start(Kind::kCollective, options, [this](const Step& step) {
    return FromPlugin(context_->Barrier(step.tag, step.timeout_ms), step.description);
  });
}

// A send posts the message's first part (its byte count and up to kInline
// bytes of it, copied together) and the chunks of its rest; the completer
// waits for them. The receiver posts a receive for the first part and one
// for every chunk its buffer holds, at once: a message of the size it
// expects needs no round trip. The first part tells it the size: chunks
// sent beyond its buffer are drained, and a mismatch is an error naming
// both counts. When the message is shorter, receives of chunks that never
// come stay posted on that message's slot, which no later message uses
// (until the count of messages between the two ranks wraps at kChunkSlots).
absl::StatusOr<std::unique_ptr<Work>> GlooCommunicator::DoSend(ConstBuffer buffer, int peer,
                                                               const ResolvedOptions& options) {
  if (host_copy()) {
    return StartHost(true, Buffer{const_cast<void*>(buffer.data), buffer.count, buffer.dtype}, peer,
                     options);
  }
  auto t = std::make_shared<Transfer>();
  const uint64_t bytes = Bytes(buffer.count, buffer.dtype);
  const size_t inline_bytes = std::min<size_t>(bytes, kInline);
  t->first.reset(new char[kHeader + inline_bytes]);
  std::memcpy(t->first.get(), &bytes, kHeader);
  if (inline_bytes > 0) std::memcpy(t->first.get() + kHeader, buffer.data, inline_bytes);
  auto result = Start(
      Kind::kPointToPoint, options,
      [this, t, buffer, peer, bytes, inline_bytes](const Step& step) {
        std::lock_guard<std::mutex> lock(t->mu);
        const uint32_t slot = kChunkSlotBase + sent_to_[peer]++ % kChunkSlots;
        STRATA_RETURN_IF_ERROR(FromPlugin(
            context_->Send(t->first.get(), kHeader + inline_bytes, peer, kFirstSlot, &t->first_op),
            step.description));
        const char* data = static_cast<const char*>(buffer.data);
        t->chunk_ops.resize(Chunks(bytes));
        for (size_t i = 0; i < t->chunk_ops.size(); ++i) {
          const size_t offset = ChunkStart(i);
          STRATA_RETURN_IF_ERROR(FromPlugin(
              context_->Send(data + offset, std::min<size_t>(ChunkEnd(i), bytes) - offset, peer,
                             slot, &t->chunk_ops[i]),
              step.description));
        }
        return absl::OkStatus();
      },
      [this, t, what = options.description](absl::Time deadline) {
        // The transfers go out in the order they were posted: waiting for
        // the last one first saves a wake-up per transfer.
        const size_t n = t->chunk_ops.size();
        absl::Status s;
        while (s.ok() && t->waited < n) {
          s = t->AwaitNext(t->chunk_ops[n - 1 - t->waited].get(), deadline, what);
        }
        if (s.ok() && t->waited == n) s = t->AwaitNext(t->first_op.get(), deadline, what);
        if (s.ok()) {
          t->Retire(
              [this](auto first, auto chunks) { Retire(std::move(first), std::move(chunks)); });
        } else if (!IsSuspended(s)) {
          Bury(t);
        }
        return s;
      },
      [t] { t->Interrupt(); }, [t] { t->Suspend(); });
  return result;
}

absl::StatusOr<std::unique_ptr<Work>> GlooCommunicator::DoRecv(Buffer buffer, int peer,
                                                               const ResolvedOptions& options) {
  if (host_copy()) return StartHost(false, buffer, peer, options);
  auto t = std::make_shared<Transfer>();
  t->first.reset(new char[kHeader + kInline]);
  const size_t capacity = Bytes(buffer.count, buffer.dtype);
  const size_t expected_chunks = Chunks(capacity);
  return Start(
      Kind::kPointToPoint, options,
      [this, t, buffer, peer, capacity, expected_chunks](const Step& step) {
        std::lock_guard<std::mutex> lock(t->mu);
        t->chunk_slot = kChunkSlotBase + received_from_[peer]++ % kChunkSlots;
        STRATA_RETURN_IF_ERROR(FromPlugin(
            context_->Recv(t->first.get(), kHeader + kInline, peer, kFirstSlot, &t->first_op),
            step.description));
        char* data = static_cast<char*>(buffer.data);
        t->chunk_ops.resize(expected_chunks);
        for (size_t i = 0; i < expected_chunks; ++i) {
          const size_t offset = ChunkStart(i), room = ChunkEnd(i) - offset;
          char* target = data + offset;
          if (capacity < ChunkEnd(i)) {
            t->last_staging.reset(new char[room]);
            target = t->last_staging.get();
          }
          STRATA_RETURN_IF_ERROR(
              FromPlugin(context_->Recv(target, room, peer, t->chunk_slot, &t->chunk_ops[i]),
                         step.description));
        }
        return absl::OkStatus();
      },
      [this, t, buffer, peer, capacity, expected_chunks,
       what = options.description](absl::Time deadline) -> absl::Status {
        absl::Status s;
        if (t->waited == 0) s = t->AwaitNext(t->first_op.get(), deadline, what);
        if (IsSuspended(s)) return s;
        uint64_t incoming = 0;
        if (s.ok()) std::memcpy(&incoming, t->first.get(), kHeader);
        const size_t sent_chunks = Chunks(incoming);
        if (s.ok() && sent_chunks > expected_chunks && !t->drain_posted) {
          t->drain_posted = true;
          // Receive what the buffer has no room for, so that the sender
          // completes and the next message starts where it should.
          std::lock_guard<std::mutex> lock(t->mu);
          if (t->interrupted) {
            s = absl::AbortedError(absl::StrCat(what, ": interrupted"));
          } else {
            t->drain.reset(new char[kMaxChunk]);
            t->chunk_ops.resize(sent_chunks);
            for (size_t i = expected_chunks; s.ok() && i < sent_chunks; ++i) {
              s = FromPlugin(context_->Recv(t->drain.get(), ChunkEnd(i) - ChunkStart(i), peer,
                                            t->chunk_slot, &t->chunk_ops[i]),
                             what);
            }
          }
        }
        // The last first, as in Send (the first part was the sequence's first).
        while (s.ok() && t->waited <= sent_chunks) {
          s = t->AwaitNext(t->chunk_ops[sent_chunks - t->waited].get(), deadline, what);
        }
        if (IsSuspended(s)) return s;
        if (!s.ok() || sent_chunks < expected_chunks) {
          Bury(t);  // receives still posted
        } else {
          t->Retire(
              [this](auto first, auto chunks) { Retire(std::move(first), std::move(chunks)); });
        }
        if (!s.ok()) return s;
        const size_t held = std::min<size_t>(incoming, capacity);
        if (held > 0) std::memcpy(buffer.data, t->first.get() + kHeader, std::min(held, kInline));
        if (t->last_staging) {
          const size_t last = ChunkStart(expected_chunks - 1);  // where the last chunk starts
          if (held > last) {
            std::memcpy(static_cast<char*>(buffer.data) + last, t->last_staging.get(), held - last);
          }
        }
        if (incoming == capacity) return absl::OkStatus();
        return SizeMismatch(what, buffer, incoming);
      },
      [t] { t->Interrupt(); }, [t] { t->Suspend(); });
}

// Ranks of one host: each message is one HostTransfer, copied once between
// the two buffers by whichever rank finishes it first (gloo_plugin's
// host_p2p.h); nothing is staged or chunked.
absl::StatusOr<std::unique_ptr<Work>> GlooCommunicator::StartHost(bool send, Buffer buffer,
                                                                  int peer,
                                                                  const ResolvedOptions& options) {
  auto t = std::make_shared<HostOp>();
  const size_t bytes = Bytes(buffer.count, buffer.dtype);
  return Start(
      Kind::kPointToPoint, options,
      [this, t, send, buffer, bytes, peer](const Step& step) {
        std::unique_ptr<gloo_plugin::HostTransfer> m;
        void* data = NonNull(buffer.data);
        STRATA_RETURN_IF_ERROR(
            FromPlugin(send ? context_->HostSend(data, bytes, peer, step.timeout_ms, &m)
                            : context_->HostRecv(data, bytes, peer, step.timeout_ms, &m),
                       step.description));
        t->Adopt(std::move(m));
        return absl::OkStatus();
      },
      [t, send, buffer, bytes, what = options.description](absl::Time deadline) {
        STRATA_RETURN_IF_ERROR(t->Await(deadline, what));
        const uint64_t incoming = t->message->sent_bytes();
        if (send || incoming == bytes) return absl::OkStatus();
        return SizeMismatch(what, buffer, incoming);
      },
      [t] { t->Interrupt(); }, [t] { t->Suspend(); });
}

void GlooCommunicator::Retire(std::unique_ptr<gloo_plugin::Pending> first,
                              std::vector<std::unique_ptr<gloo_plugin::Pending>> chunks) {
  std::vector<std::unique_ptr<gloo_plugin::Pending>> old;  // destroyed after the lock
  std::lock_guard<std::mutex> lock(retired_mu_);
  retired_.push_back(std::move(first));
  for (auto& c : chunks) retired_.push_back(std::move(c));
  while (retired_.size() > kRetired) {
    old.push_back(std::move(retired_.front()));
    retired_.pop_front();
  }
}

void GlooCommunicator::Bury(std::shared_ptr<void> transfer) {
  std::lock_guard<std::mutex> lock(graveyard_mu_);
  graveyard_.push_back(std::move(transfer));
}

}  // namespace strata::gloo
